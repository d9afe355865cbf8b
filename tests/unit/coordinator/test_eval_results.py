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
