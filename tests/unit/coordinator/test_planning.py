"""The coordinator's planning path: Instance Manager (live spot GPUs) + measured training
time + profile → Planner → the exploration it submits. The chosen action must shrink
when the training window or the spot GPU count shrinks, and must never overrun W.

The coordinator is only built, never started: construction binds no socket and writes no file,
so its planning path runs without a network or a run directory."""

from __future__ import annotations

import torch

from spotlight.config import EXAMPLES_DIR, load_config
from spotlight.coordinator.coordinator import Coordinator
from spotlight.core.request_scheduler import RequestKind


def _coordinator(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no cached profile
    cfg = load_config(
        EXAMPLES_DIR / "jpeg-toy" / "config.toml",
        overrides={
            "explore.mode": "stale",
            "explore.planner": "bandit",
            "planner.beta": 0.0,
            "planner.sequence_step": 4,
            "run.iterations": 50,
        },
    )
    n = 40
    embeds, mask = torch.zeros(n, 16, 384), torch.ones(n, 16, dtype=torch.long)
    coord = Coordinator(
        cfg,
        tmp_path / "run",
        bind="tcp://127.0.0.1:0",
        prompts=[f"p{i}" for i in range(n)],
        embeds=embeds,
        mask=mask,
        progress=lambda s: None,
    )
    coord.step_times.t_step_s = 0.01
    return coord


def _learn_bigger_is_better(coord, now):
    """Feedback proportional to d·s so the bandit prefers the most expensive arms that fit."""
    for a in coord.core.planner.actions:
        coord.core.planner.update(a, a.num_sequences * a.effective_steps)


def test_choice_shrinks_with_training_window_and_spot_gpus(tmp_path, monkeypatch):
    coord = _coordinator(tmp_path, monkeypatch)
    try:
        for i in range(4):
            coord.instances.register(f"spot-{i}", "s", [0], True, now=0.0)
        coord.instances.register("reserved-0", "s", [0], False, now=0.0)
        _learn_bigger_is_better(coord, 0.0)
        C = coord.cfg.num_explored_prompts

        assert coord.server is None and not (tmp_path / "run").exists()  # nothing bound, nothing written

        def chosen(train_s):
            coord.core.last_train_s = train_s  # as the core measured it in the iteration before
            a = coord.core.choose_action(1, 1.0, coord.observation())
            log = coord.core.plan_logs[1]
            if a is not None:
                assert a.num_sequences * C * a.effective_steps * coord.step_times.t_step_s <= log["budget_s"] + 1e-9
            return a, log

        big, log_big = chosen(10.0)
        assert log_big["num_spot_gpus"] == 4
        # C = 8, s = 10 (no profile), t_step = 0.01: T_plan = 0.8·d; the d grid starts above K = 8
        small, log_small = chosen(6.0)  # shorter training window
        assert small.num_sequences * small.effective_steps < big.num_sequences * big.effective_steps
        # two spot agents die: N_spot 4 -> 2, same window
        coord.instances.goodbye("spot-0", 2.0, "preempted")
        coord.instances.goodbye("spot-1", 2.0, "preempted")
        fewer, log_fewer = chosen(6.0)
        assert log_fewer["num_spot_gpus"] == 2
        assert fewer.num_sequences * fewer.effective_steps < small.num_sequences * small.effective_steps
        # nothing fits: explore nothing rather than overrun
        none, log_none = chosen(0.05)
        assert none is None and "no action fits" in log_none["reason"]
        # the chosen action is what gets submitted
        n = coord.core.submit_exploration(1, 0, fewer, 3.0)
        assert n == C * fewer.num_sequences
        assert len(coord.sched.requests(iteration=1, kind=RequestKind.EXPLORE)) == n
    finally:
        coord.close()
