"""Held-out evaluations across a stop and ``--resume`` (docs/evaluation.md; docs/architecture.md
§13): every due evaluation that never finished is run by the resumed coordinator, and the last
iteration's checkpoint is written before the evaluation of the final weights starts. The
coordinator is built, not started: no socket, no Eval Worker process."""

from __future__ import annotations

import json
import logging

import pytest

from spotlight.coordinator import resume
from spotlight.store.checkpoint import latest_checkpoint, load_checkpoint
from tests.factories import toy_coordinator


def test_catch_up_queues_the_base_model_and_each_due_version_without_a_result():
    from spotlight.coordinator.evaluation import CatchUp, catch_up

    got = catch_up(1, 4, 2, recorded=[], written=[], available=[0, 1, 2])
    assert got == CatchUp(evaluate=((-1, 0), (0, 1), (1, 2)))
    # eval.every = 2 of 5 iterations: v2 after iteration 2, v4 after 4, and the last (v5)
    got = catch_up(2, 5, 5, recorded=[-1, 1], written=[-1, 1], available=range(6))
    assert got.evaluate == ((3, 4), (4, 5)) and got.record == () and got.gone == ()


def test_catch_up_records_a_written_result_and_skips_a_deleted_version():
    from spotlight.coordinator.evaluation import CatchUp, catch_up

    # v0's result file was written but never read; v1 was deleted by run.keep_weight_versions
    got = catch_up(1, 4, 3, recorded=[1], written=[-1, 1], available=[2, 3])
    assert got == CatchUp(record=((-1, 0),), evaluate=((2, 3),), gone=((0, 1),))


def test_catch_up_owes_nothing_before_the_first_iteration_or_without_evaluation():
    from spotlight.coordinator.evaluation import CatchUp, catch_up

    assert catch_up(1, 4, 0, recorded=[], written=[], available=[0]) == CatchUp()
    assert catch_up(0, 4, 3, recorded=[], written=[], available=[0, 1, 2, 3]) == CatchUp()
    # a checkpoint past a shortened run (--iterations) owes nothing beyond the run's last iteration
    assert catch_up(1, 2, 3, recorded=[-1, 0, 1], written=[], available=[0, 1, 2, 3]) == CatchUp()


def test_written_iterations_reads_the_result_file_names(tmp_path):
    from spotlight.coordinator.evaluation import written_iterations

    (tmp_path / "eval").mkdir()
    for name in ("iter_0000.json", "iter_0003.json", "iter_0003.png", "first_vs_last.png"):
        (tmp_path / "eval" / name).write_text("{}")
    assert written_iterations(tmp_path) == {-1, 2}
    assert written_iterations(tmp_path / "missing") == set()


class _Evals:
    """The Eval Worker shell, without processes: records what is requested."""

    def __init__(self):
        self.requested: list[tuple[int, int]] = []
        self.queue: list = []
        self.pending_versions: set[int] = set()

    @property
    def busy(self) -> bool:
        return bool(self.requested)

    def request(self, iteration: int, version: int) -> None:
        self.requested.append((iteration, version))

    def poll(self) -> list[dict]:
        return []

    def close(self) -> None:
        pass


CONFIG = {
    "run.iterations": 2,
    "eval.every": 1,
    "eval.prompts_path": "examples/prompts/geneval/train_metadata.jsonl",
    "run.sample_grid_every": 0,
}


def _opened(run_dir, *, resume_run: bool = False, progress=None):
    coord = toy_coordinator(run_dir, progress=progress, **CONFIG)
    coord.resume = coord.recorder.resume = resume_run
    coord.run_dir.mkdir(parents=True, exist_ok=True)
    coord.store.open()
    coord.recorder.open()
    coord.evals = _Evals()
    return coord


def _publish(coord, *versions: int) -> None:
    for v in versions:
        (coord.store.root / "weights" / f"v{v}.safetensors").write_bytes(b"x")


def test_the_last_checkpoint_is_written_before_the_final_evaluation_and_resumes_to_it(tmp_path, monkeypatch):
    """Was: the last iteration's checkpoint waited for the evaluation of the final weights; a stop
    there said "last complete iteration (1/2)" and the resume trained iteration 2 again."""
    run_dir = tmp_path / "run"
    coord = _opened(run_dir)
    _publish(coord, 0, 1, 2)
    coord.core.iteration = 2  # the core ended iteration 2 of 2
    monkeypatch.setattr(coord.store, "latest_version", 2)
    metrics = {"iteration": 1, "reward/mean": 0.5, "time/rollout_s": 1.0, "time/train_s": 1.0, "time/explore_s": 0.0}

    def interrupted(timeout_s, on_tick):
        got = latest_checkpoint(run_dir)
        assert got is not None and got[0] == 1, "the final evaluation started before the checkpoint"
        raise KeyboardInterrupt

    monkeypatch.setattr(coord, "_serve_until_evaluated", interrupted)
    with pytest.raises(KeyboardInterrupt):
        coord._end_iteration(1, metrics, 10.0)
    assert coord.evals.requested == [(1, 2)]
    st = load_checkpoint(latest_checkpoint(run_dir)[1])
    assert st["iteration"] == 2 and st["pending_row"]["reward/mean"] == 0.5
    assert (run_dir / "metrics.jsonl").read_text() == ""  # the row waits for the evaluation

    # resume: nothing to train; the final evaluation is queued again and the row written after it
    again = _opened(run_dir, resume_run=True)
    resume.restore(again, 0.0)
    assert again.core.iteration == 2 and again.history == [] and again.pending_row["iteration"] == 1
    assert again.snapshot(0.0)["iterations_done"] == 2  # status: 2/2 done, the row still to come
    again._catch_up_evaluations()
    assert again.evals.requested == [(-1, 0), (0, 1), (1, 2)]
    final = {"iteration": 1, "version": 2, "eval/score": 0.8}
    monkeypatch.setattr(again, "_serve_until_evaluated", lambda t, tick: {"eval/score": 0.8, "eval/iteration": 2})
    with (run_dir / "eval.jsonl").open("a") as f:
        f.write(json.dumps(final) + "\n")
    row, again.pending_row = again.pending_row, None
    again._finish_last_row(row, 1.0)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1] and rows[0]["eval/score"] == 0.8


def _stopped_after_the_last_iteration(tmp_path, monkeypatch):
    """A run directory whose coordinator ended iteration 2 of 2, checkpointed it and was stopped
    during the final evaluation (before saving final/)."""
    run_dir = tmp_path / "run"
    coord = _opened(run_dir)
    _publish(coord, 0, 1, 2)
    coord.core.iteration = 2
    monkeypatch.setattr(coord.store, "latest_version", 2)
    metrics = {"iteration": 1, "reward/mean": 0.5, "time/rollout_s": 1.0, "time/train_s": 1.0, "time/explore_s": 0.0}

    def interrupted(timeout_s, on_tick):
        raise KeyboardInterrupt

    monkeypatch.setattr(coord, "_serve_until_evaluated", interrupted)
    with pytest.raises(KeyboardInterrupt):
        coord._end_iteration(1, metrics, 10.0)
    coord.store.put_state("e1-3.L7", [], [])  # a committed state no request resumes from
    return run_dir


def test_a_resume_after_the_last_iteration_says_whether_final_is_saved_again(tmp_path, monkeypatch):
    """Was: a resume of a run whose last iteration was done but whose final/ is missing said only
    "every iteration is done; finishing the run" and then wrote final/ without a word."""
    run_dir = _stopped_after_the_last_iteration(tmp_path, monkeypatch)
    said: list[str] = []
    resume.restore(_opened(run_dir, resume_run=True, progress=said.append), 0.0)
    [line] = [m for m in said if m.startswith("resumed ")]
    assert line.endswith("every iteration is done; finishing the run (weights v2); final/ is missing: saving it"), line
    (run_dir / "final").mkdir()
    (run_dir / "final" / "model.safetensors").write_bytes(b"cut")
    said.clear()
    resume.restore(_opened(run_dir, resume_run=True, progress=said.append), 0.0)
    [line] = [m for m in said if m.startswith("resumed ")]
    assert "; final/ is damaged (" in line and line.endswith(": saving it again"), line


def test_a_resume_deletes_committed_states_no_request_resumes_from(tmp_path, monkeypatch):
    """A committed state whose request ended after the last checkpoint, or that a stopped
    coordinator had not deleted yet, would stay in the Tensor Store's state/ for good."""
    run_dir = _stopped_after_the_last_iteration(tmp_path, monkeypatch)
    again = _opened(run_dir, resume_run=True)
    assert again.store.state_keys() == ["e1-3.L7"]
    resume.restore(again, 0.0)
    assert again.store.state_keys() == []


def test_a_resume_reruns_an_evaluation_cut_off_and_records_one_left_unread(tmp_path, monkeypatch, caplog):
    """Was: evaluations still running or queued when the run stopped were never run again (only
    an iteration's end requests them), so eval.jsonl lacked the base model and best/ ignored it."""
    run_dir = tmp_path / "run"
    coord = _opened(run_dir)
    _publish(coord, 1, 2)  # v0 deleted by run.keep_weight_versions
    coord.core.iteration = 2
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "iter_0002.json").write_text(json.dumps({"iteration": 1, "version": 2, "eval/score": 0.7}))
    said = []
    coord.progress = said.append
    with caplog.at_level(logging.WARNING, logger="spotlight.coordinator"):
        coord._catch_up_evaluations()
    assert coord.evals.requested == [(0, 1)]  # v1: never evaluated; v2: its result is recorded
    assert [json.loads(line)["iteration"] for line in (run_dir / "eval.jsonl").read_text().splitlines()] == [1]
    assert caplog.text.count("evaluation of v0 skipped") == 1
    assert any("v1" in s for s in said)


def test_versions_a_queued_evaluation_will_read_are_kept_by_retention(tmp_path):
    """A held-out evaluation reads its version from the Tensor Store when it starts, so a version
    queued or being evaluated must not be deleted meanwhile (was: not in needed_versions, so an
    evaluation that fell behind found its weights gone)."""
    coord = _opened(tmp_path / "run")
    coord.evals.pending_versions = {3, 5}
    assert {3, 5} <= coord.needed_versions()


def test_discarded_names_the_iterations_a_resume_trains_again():
    from spotlight.coordinator.evaluation import discarded

    assert discarded(2, [-1, 0, 1, 2, 3]) == [2, 3]
    assert discarded(0, [-1, 0]) == [0]  # the base model's evaluation is never of discarded weights
    assert discarded(5, [-1, 1, 4]) == []


def test_a_result_of_weights_the_resume_trains_again_is_dropped_and_evaluated_again(tmp_path):
    """Was: a stop between iteration 2's evaluation and its checkpoint left ``eval/iter_0002.json``;
    the resumed run trained iteration 2 again, found that file, took the evaluation as done, and
    reported the discarded weights' score for the new ones."""
    from spotlight.coordinator.evaluation import Evaluations

    run_dir = tmp_path / "run"
    coord = _opened(run_dir)
    _publish(coord, 0, 1, 2)
    coord.core.iteration = 1  # the checkpoint holds iteration 1; iteration 2 is trained again
    (run_dir / "eval").mkdir()
    rows = [{"iteration": n, "version": n + 1, "eval/score": 0.5 + n / 10} for n in (-1, 0, 1)]
    for r in rows:
        path = run_dir / "eval" / f"iter_{r['iteration'] + 1:04d}"
        path.with_suffix(".json").write_text(json.dumps(r))
        path.with_suffix(".png").write_bytes(b"png")
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 1, "ver')
    said = []
    coord.progress = said.append
    coord._catch_up_evaluations()
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == [
        "iter_0000.json",
        "iter_0000.png",
        "iter_0001.json",
        "iter_0001.png",
    ]
    lines = (run_dir / "eval.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines[:2]] == [-1, 0]
    assert lines[2:] == ['{"iteration": 1, "ver']  # a torn line is kept as it was
    assert coord.evals.requested == []  # v0 and v1 have their results
    assert any("iteration 2" in s and "again" in s for s in said)
    # the re-trained iteration's evaluation is requested, not taken as done
    evals = Evaluations(run_dir, tmp_path / "cache")
    evals._start_next = lambda: None
    evals.request(1, 2)
    assert evals.queue == [(1, 2)]


def _write_results(run_dir, rows):
    (run_dir / "eval").mkdir(exist_ok=True)
    for r in rows:
        (run_dir / "eval" / f"iter_{r['iteration'] + 1:04d}.json").write_text(json.dumps(r))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("best_iteration", [1, 0])
def test_a_resume_removes_best_when_it_holds_weights_trained_again(tmp_path, best_iteration):
    """Was: ``best/`` was left as it was. After a stop between iteration 2's evaluation (the best
    score, so ``best/`` took its weights) and its checkpoint, the resumed run trained iteration 2
    again, but ``best/`` kept the thrown-away weights, and their score kept every later version
    out of ``best/``."""
    from spotlight.coordinator.evaluation import score_to_beat

    run_dir = tmp_path / "run"
    coord = _opened(run_dir)
    _publish(coord, 0, 1, 2)
    coord.core.iteration = 1  # the checkpoint holds iteration 1; iteration 2 is trained again
    rows = [{"iteration": n, "version": n + 1, "eval/score": s} for n, s in ((-1, 0.5), (0, 0.6), (1, 0.9))]
    rows[best_iteration + 1]["eval/score"] = 0.95
    _write_results(run_dir, rows)
    (run_dir / "best").mkdir()
    (run_dir / "best" / "best.json").write_text(json.dumps(rows[best_iteration + 1]))
    said = []
    coord.progress = said.append
    coord._catch_up_evaluations()
    if best_iteration == 1:
        assert not (run_dir / "best").exists()
        assert any(s.startswith("removed best/ (v2, the weights of iteration 2") for s in said), said
        # the re-trained iteration's evaluation must beat every result kept (iteration 1's 0.6)
        assert score_to_beat(run_dir, 1) == 0.6
    else:  # best/ holds iteration 1's weights, which the run keeps
        assert json.loads((run_dir / "best" / "best.json").read_text())["iteration"] == 0
        assert not any("best/" in s for s in said)
        assert score_to_beat(run_dir, 1) == 0.95


def test_score_to_beat_is_best_json_s_else_the_other_results_on_disk(tmp_path):
    from spotlight.coordinator.evaluation import score_to_beat

    assert score_to_beat(tmp_path, -1) == float("-inf")  # a run's first evaluation writes best/
    _write_results(tmp_path, [{"iteration": -1, "version": 0, "eval/score": 0.4}])
    (tmp_path / "eval" / "iter_0002.json").write_text('{"iteration": 1, "eval/score": NaN}')
    (tmp_path / "eval" / "iter_0003.json").write_text("{torn")
    assert score_to_beat(tmp_path, 0) == 0.4
    assert score_to_beat(tmp_path, -1) == float("-inf")  # its own result does not count
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text('{"iteration": 3, "eval/score": 0.2}')
    assert score_to_beat(tmp_path, 0) == 0.2
