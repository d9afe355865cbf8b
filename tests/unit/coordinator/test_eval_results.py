"""eval.jsonl reading: a line torn by a crash mid-write is skipped, and said."""

from __future__ import annotations

import json
import logging

from spotlight.coordinator.evaluation import read_results


def test_read_results_skips_a_torn_line_with_a_warning(tmp_path, caplog):
    good = {"iteration": 5, "eval/strict": 0.5}
    (tmp_path / "eval.jsonl").write_text(json.dumps(good) + "\n\n" + '{"iteration": 10, "eval/str')
    with caplog.at_level(logging.WARNING, logger="spotlight.coordinator"):
        assert read_results(tmp_path) == [good]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "line 3 is not JSON" in warned[0]
    assert read_results(tmp_path / "missing") == []


def test_result_line_names_the_iteration_and_compares_with_the_base_model():
    from spotlight.coordinator.evaluation import result_line

    base = {"iteration": -1, "eval/score": 0.7, "eval/strict": 0.578, "eval/partial": 0.733}
    after = {"iteration": 19, "eval/score": 0.75, "eval/strict": 0.6, "eval/partial": 0.75}
    assert result_line(base) == "held-out panel, base model: strict 0.578 partial 0.733"
    assert result_line(after, base) == (
        "held-out panel after iteration 20: strict 0.600 partial 0.750 (base strict 0.578 partial 0.733)"
    )
    assert result_line(after) == "held-out panel after iteration 20: strict 0.600 partial 0.750"
    # another task: the panel's mean reward
    assert result_line({"iteration": 4, "eval/score": -12.5}, {"iteration": -1, "eval/score": -13.0}) == (
        "held-out panel after iteration 5: score -12.500 (base score -13.000)"
    )


def test_a_resumed_run_compares_with_the_base_model_an_earlier_session_evaluated(tmp_path):
    """Was: after --resume the first held-out line had no "(base …)": only this coordinator's
    results were searched, and the base model had been evaluated before the restart."""
    from spotlight.coordinator.evaluation import base_result, result_line

    base = {"iteration": -1, "eval/strict": 0.578, "eval/partial": 0.733}
    earlier = {"iteration": 9, "eval/strict": 0.6, "eval/partial": 0.74}
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in (base, earlier)) + "\n")
    after = {"iteration": 19, "eval/strict": 0.61, "eval/partial": 0.75}
    assert base_result(tmp_path, []) == base
    assert result_line(after, base_result(tmp_path, [])).endswith("(base strict 0.578 partial 0.733)")
    mine = dict(base, **{"eval/strict": 0.5})  # this coordinator's own result comes first
    assert base_result(tmp_path, [mine]) == mine
    assert base_result(tmp_path / "fresh", []) is None
