"""The coordinator carries out the collapse guard's alerts (docs/collapse-guard.md): console,
event log, status snapshot, and with ``guard.action = "stop"`` a stop with the alert as the
run's error. The coordinator is only built, never started (no socket, no file)."""

from __future__ import annotations

import pytest

from spotlight.config import EXAMPLES_DIR, load_config
from spotlight.coordinator.status import snapshot
from tests.factories import toy_coordinator


def _coordinator(tmp_path, **overrides):
    return toy_coordinator(tmp_path / "run", **overrides)


def _feed(coord, speckle):
    for i, v in enumerate(speckle):
        coord.history.append({"iteration": i, "image/speckle": v, "reward/mean": 0.1 * i})
        coord._guard(float(i))


def test_warn_logs_an_event_and_shows_in_status_without_stopping(tmp_path, caplog):
    coord = _coordinator(tmp_path)
    _feed(coord, [0.02, 0.02, 0.3, 0.3, 0.3])
    assert coord.error is None
    assert [a.kind for a in coord.guard_alerts] == ["image_drift"]  # once, not every iteration
    assert any(e["kind"] == "guard" for e in coord.events.to_list())
    assert "collapse guard" in caplog.text
    snap = snapshot(coord, 5.0)
    assert snap["guard_alerts"][0]["iteration"] == 4 and snap["guard_alerts"][0]["metric"] == "image/speckle"


def test_stop_sets_the_run_error(tmp_path):
    coord = _coordinator(tmp_path, **{"guard.action": "stop"})
    _feed(coord, [0.02, 0.02, 0.3, 0.3])
    assert coord.error and "collapse guard stopped the run at iteration 4" in coord.error


def test_disabled_guard_raises_nothing(tmp_path):
    coord = _coordinator(tmp_path, **{"guard.enabled": False, "guard.action": "stop"})
    _feed(coord, [0.02, 0.02, 0.3, 0.3])
    assert coord.error is None and coord.guard_alerts == []


ROLLBACK = {
    "guard.action": "rollback",
    "eval.every": 1,
    "eval.prompts_path": "examples/prompts/geneval/train_metadata.jsonl",
}


def _evaluated(coord, scores: dict[int, float]) -> None:
    """``eval.jsonl`` as the Eval Worker results leave it: version -> eval/score."""
    import json

    coord.run_dir.mkdir(parents=True, exist_ok=True)
    with (coord.run_dir / "eval.jsonl").open("w") as f:
        for v, score in scores.items():
            f.write(json.dumps({"iteration": v - 1, "version": v, "eval/score": score}) + "\n")


def _latest(monkeypatch, coord, version: int) -> None:
    monkeypatch.setattr(coord.store, "latest_version", version)  # as if v0..version were published


def test_rollback_replaces_the_next_update_with_the_best_version_and_a_lower_rate(tmp_path, monkeypatch):
    said = []
    coord = _coordinator(tmp_path, **ROLLBACK)
    coord.progress = said.append
    _evaluated(coord, {0: 0.30, 1: 0.55, 2: 0.41})
    _feed(coord, [0.02, 0.02, 0.3, 0.3])
    assert coord.error is None and coord._rollback is not None and coord._rollback[0] == 1
    assert any("rollback to v1 (held-out 0.550) planned" in e["detail"] for e in coord.events.to_list())
    _latest(monkeypatch, coord, 4)
    assert coord._rollback_for_update(4) == (1, 0.5)
    assert "rolls back to v1" in said[-1] and coord.rollbacks_done == 1
    assert coord._rollback_for_update(5) == (-1, 1.0)  # once
    coord.evals.queue.append((4, 5))  # an evaluation still queued: its checkpoint is kept too
    assert coord._kept_train_versions() == (1, 5)


def test_rollback_when_the_weights_in_use_are_the_best_only_lowers_the_rate(tmp_path, monkeypatch):
    coord = _coordinator(tmp_path, **ROLLBACK, **{"guard.rollback_lr_factor": 0.25})
    _evaluated(coord, {0: 0.3, 3: 0.6})
    _feed(coord, [0.02, 0.02, 0.3, 0.3])
    _latest(monkeypatch, coord, 3)
    assert coord._rollback_for_update(3) == (-1, 0.25)


def test_rollback_before_any_evaluation_returns_to_the_base_model(tmp_path, monkeypatch):
    coord = _coordinator(tmp_path, **ROLLBACK)
    _feed(coord, [0.02, 0.02, 0.3, 0.3])
    _latest(monkeypatch, coord, 4)
    assert coord._rollback_for_update(4) == (0, 0.5) and coord._kept_train_versions() == (0,)


def test_rollbacks_stop_the_run_after_max_rollbacks(tmp_path, monkeypatch):
    coord = _coordinator(tmp_path, **ROLLBACK, **{"guard.max_rollbacks": 1})
    _latest(monkeypatch, coord, 9)
    _feed(coord, [0.02, 0.02, 0.3, 0.3])
    coord._rollback_for_update(4)
    coord.history.append({"iteration": 4, "image/speckle": 0.02, "reward/mean": 0.5})  # clears
    coord._guard(5.0)
    for i in (5, 6):
        coord.history.append({"iteration": i, "image/speckle": 0.3, "reward/mean": 0.5})
        coord._guard(float(i))
    assert coord.error and "after 1 rollbacks (guard.max_rollbacks)" in coord.error


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"guard.action": "rollback", "eval.every": 0}, "needs eval.every > 0"),
        ({**ROLLBACK, "eval.every": 3, "run.checkpoint_every": 2}, "must be a multiple of run.checkpoint_every"),
        ({**ROLLBACK, "guard.rollback_lr_factor": 0.0}, "guard.rollback_lr_factor"),
        ({**ROLLBACK, "guard.max_rollbacks": 0}, "guard.max_rollbacks"),
    ],
)
def test_rollback_configs_that_could_not_roll_back_are_refused(overrides, fragment):
    from spotlight.config import ConfigError

    with pytest.raises(ConfigError, match=fragment):
        load_config(EXAMPLES_DIR / "jpeg-toy" / "config.toml", overrides=overrides)
