"""The coordinator carries out the collapse guard's alerts (docs/collapse-guard.md): console,
event log, status snapshot, and with ``guard.action = "stop"`` a stop with the alert as the
run's error. The coordinator is only built, never started (no socket, no file)."""

from __future__ import annotations

import torch

from spotlight.config import EXAMPLES_DIR, load_config
from spotlight.coordinator.coordinator import Coordinator
from spotlight.coordinator.status import snapshot


def _coordinator(tmp_path, **overrides):
    cfg = load_config(EXAMPLES_DIR / "jpeg-toy" / "config.toml", overrides=overrides)
    n = 8
    return Coordinator(
        cfg,
        tmp_path / "run",
        bind="tcp://127.0.0.1:0",
        prompts=[f"p{i}" for i in range(n)],
        embeds=torch.zeros(n, 16, 384),
        mask=torch.ones(n, 16, dtype=torch.long),
        progress=lambda s: None,
    )


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
