"""spotlight.traces.actions: a trace file -> extended past its end -> placed on the
simulated spot nodes (what `spotlight simulate --trace` and the benchmark scripts replay)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from spotlight.traces import actions as ta
from spotlight.traces.formats import TracePlacement, load_trace, pingpong_trace

P3 = pathlib.Path(__file__).resolve().parents[3] / "examples" / "traces" / "bamboo" / "p3-trace.csv"
DAY = 86400.0


def test_the_trace_is_extended_then_placed_on_random_nodes():
    events = load_trace(P3)
    acts = ta.trace_actions(P3, spot_nodes=4, gpus_per_node=2, seed=7, until_s=3 * DAY)
    assert acts == TracePlacement(4, 2, 7, scale_to_capacity=True).plan(pingpong_trace(events, 3 * DAY))
    assert events[-1].t_s < 0.5 * DAY < acts[-1].t_s < 3 * DAY  # played past the 12-hour trace's end, cut at until_s
    assert {a.agent for a in acts} == {0, 1, 2, 3} and {a.gpu for a in acts} == {0, 1}


def test_the_default_horizon_outlasts_any_simulated_job():
    acts = ta.trace_actions(str(P3), spot_nodes=4, gpus_per_node=2)
    assert ta.TRACE_HORIZON_S - DAY < acts[-1].t_s < ta.TRACE_HORIZON_S
    assert acts == ta.trace_actions(P3, spot_nodes=4, gpus_per_node=2, seed=0)  # seeded: the same placement every time


def test_replicas_are_independent_placements_on_their_own_nodes():
    events = pingpong_trace(load_trace(P3), DAY)
    acts = ta.trace_actions(P3, spot_nodes=6, gpus_per_node=2, seed=3, replicas=3, until_s=DAY)
    assert [a.t_s for a in acts] == sorted(a.t_s for a in acts)
    for r in range(3):
        mine = [dataclasses.replace(a, agent=a.agent - 2 * r) for a in acts if 2 * r <= a.agent < 2 * r + 2]
        assert mine == TracePlacement(2, 2, 3 + r, scale_to_capacity=True).plan(events)
    assert len(acts) == sum(len(TracePlacement(2, 2, 3 + r, scale_to_capacity=True).plan(events)) for r in range(3))


def test_bad_inputs_raise_one_line_value_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"--spot-nodes \(5\) must be a multiple of --trace-replicas \(2\)"):
        ta.trace_actions(P3, spot_nodes=5, gpus_per_node=2, replicas=2)
    with pytest.raises(ValueError, match="must be a multiple"):
        ta.spot_actions(load_trace(P3), spot_nodes=4, gpus_per_node=2, seed=0, replicas=0)
    monkeypatch.setattr(ta, "load_trace", lambda path: [])
    with pytest.raises(ValueError, match="trace empty.csv has no events"):
        ta.trace_actions("empty.csv", spot_nodes=4, gpus_per_node=2)
