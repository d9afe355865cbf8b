"""What `spotlight up --local` replays: synthetic preemption cycles,
the whole trace unscaled (`--trace-mode full`) or a scaled slice (`slice`, the default)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotlight.traces.formats import (
    TracePlacement,
    alive_counts,
    default_time_scale,
    fragmentation_timeline,
    load_trace,
    slice_trace,
)
from spotlight.traces.replay_plan import plan_local_replay
from spotlight.traces.synthetic import preemption_cycles

P3 = Path(__file__).resolve().parents[3] / "examples" / "traces" / "bamboo" / "p3-trace.csv"


def test_preemption_cycles_option_gives_n_cycles_per_iteration():
    plan = plan_local_replay(
        iterations=3, agents=4, gpus_per_agent=2, preemption_cycles=2, cycle_down_s=5.0, cycle_iteration_s=30.0
    )
    assert plan.actions == preemption_cycles(
        4, 2, cycles_per_iteration=2, iteration_s=30.0, iterations=3, down_s=5.0, seed=0
    )
    losses = [a for a in plan.actions if a.kind in ("revoke_gpu", "preempt_node")]
    gains_after_start = [a for a in plan.actions if a.kind in ("add_gpu", "start_node") and a.t_s > 0]
    assert len(losses) == len(gains_after_start) == 3 * 2 * 4  # 6 cycles, half of 8 GPUs each
    assert sorted({a.t_s for a in losses}) == [7.5, 22.5, 37.5, 52.5, 67.5, 82.5]  # evenly spaced in 30 s windows
    assert sorted({a.t_s for a in gains_after_start}) == [t + 5.0 for t in (7.5, 22.5, 37.5, 52.5, 67.5, 82.5)]
    assert "2 cycles per ~30s iteration" in plan.notes[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"preemption_cycles": 8, "cycle_down_s": 5.0},
            r"--preemption-cycles 8: 8 cycles of 5.0s per 30.0s iteration overlap",
        ),
        ({"preemption_cycles": 1, "cycle_down_s": 0.0}, r"--preemption-cycles 1: iteration_s and down_s must be > 0"),
        ({"preemption_cycles": 1, "time_scale": 2.0}, r"--time-scale applies to --trace"),
        ({"preemption_cycles": 1, "agents": 0}, r"needs at least one spot agent"),
        ({"preemption_cycles": 1, "trace": P3}, r"either --trace or --preemption-cycles"),
        ({}, r"either --trace or --preemption-cycles"),
        ({"trace": P3, "trace_mode": "whole"}, r"--trace-mode 'whole': expected one of slice, full"),
    ],
)
def test_bad_values_give_one_clear_line(kwargs, message):
    args = {"iterations": 4, "agents": 2, "gpus_per_agent": 2, **kwargs}
    with pytest.raises(ValueError, match=message) as info:
        plan_local_replay(**args)
    assert "\n" not in str(info.value)


def test_full_mode_replays_the_whole_trace_and_says_how_many_agents_it_needs():
    with pytest.raises(
        ValueError, match=r"--trace-mode full: .*peaks at 32 alive GPUs .* at least 16 agents of 2 GPUs"
    ):
        plan_local_replay(iterations=4, agents=2, gpus_per_agent=2, trace=P3, trace_mode="full")
    plan = plan_local_replay(iterations=4, agents=16, gpus_per_agent=2, trace=P3, trace_mode="full", seed=1)
    events = load_trace(P3)
    scale = default_time_scale(events[-1].t_s, 4)
    assert len(plan.actions) == len(events)  # one local action per trace event, none invented or dropped
    live = {t: n for t, n, _ in fragmentation_timeline(plan.actions, 2)}
    assert live == {t / scale: n for t, n in alive_counts(events)}
    assert any("whole trace" in n for n in plan.notes)


def test_slice_mode_is_the_scaled_slice_as_before():
    plan = plan_local_replay(
        iterations=4, agents=2, gpus_per_agent=2, trace=P3, trace_start_s=3000.0, trace_duration_s=1800.0, seed=5
    )
    expected = TracePlacement(2, 2, 5, scale_to_capacity=True).plan(
        slice_trace(load_trace(P3), 3000.0, 1800.0), time_scale=default_time_scale(1800.0, 4), end_s=1800.0
    )
    assert plan.actions == expected


def test_a_slice_past_the_end_of_a_short_trace_is_refused(tmp_path):
    """A 6-minute SkyPilot trace at the default --trace-start-s 3000 was replayed as a constant
    pool without a word (new-user trial)."""
    sky = tmp_path / "sky.json"
    sky.write_text('{"gap_seconds": 60, "data": [1, 2, 2, 1, 0, 3]}')
    with pytest.raises(ValueError, match="trace ends at 300s, before --trace-start-s 3000s"):
        plan_local_replay(
            iterations=2, agents=2, gpus_per_agent=2, trace=sky, trace_start_s=3000.0, trace_duration_s=1800.0, seed=0
        )
    assert plan_local_replay(
        iterations=2, agents=2, gpus_per_agent=2, trace=sky, trace_start_s=0.0, trace_duration_s=300.0, seed=0
    ).actions
