"""Crash-and-resume state of the pure cores: seed bank, instance manager (cost).

The Planner's round trip is tested in test_planner.py (test_state_dict_round_trip_same_next_plan)."""

from __future__ import annotations

import json

import pytest

from spotlight.core.instance_manager import InstanceManager
from spotlight.core.seed_bank import SeedBank, candidate_seeds


def _json(d):
    return json.loads(json.dumps(d, allow_nan=False))


def test_seed_bank_round_trip():
    bank = SeedBank(run_seed=3, group_size=4)
    cands = candidate_seeds(3, 5, 1, 6)
    bank.record_exploration(5, 1, cands, [0.1, 0.9, 0.5, 0.3, 0.8, 0.2])
    bank.record_exploration(6, 0, [7, 8, 9], [float("nan"), 1.0, float("nan")])  # short pick
    fresh = SeedBank(run_seed=3, group_size=4)
    fresh.load_state_dict(_json(bank.state_dict()))
    for key in [(5, 1), (6, 0), (5, 0), (7, 2)]:
        assert fresh.seeds_for(*key) == bank.seeds_for(*key)
    assert fresh.seeds_for(5, 1)[1] is True and fresh.seeds_for(5, 0)[1] is False
    assert fresh.state_dict() == bank.state_dict()
    assert fresh.seeds_for(6, 0)[1] is False  # one finite candidate: picks kept, not explored
    # forget still works on restored keys
    fresh.forget(6)
    assert fresh.seeds_for(5, 1)[1] is False and fresh.seeds_for(6, 0)[0][0] == 8


def test_seed_bank_loads_version_1_state_without_counts():
    """A checkpoint written before the explored counts existed still loads; its slots
    count as explored iff any seed was picked (the rule it was written under)."""
    old = {"version": 1, "run_seed": 3, "group_size": 4, "selected": [[5, 1, [11, 12, 13, 14]], [5, 2, []]]}
    bank = SeedBank(run_seed=3, group_size=4)
    bank.load_state_dict(_json(old))
    assert bank.seeds_for(5, 1) == ([11, 12, 13, 14], True)
    assert bank.seeds_for(5, 2)[1] is False
    assert bank.explored_slots(5) == {1}
    # new entries recorded after the load use the counts; the state round-trips as version 2
    bank.record_exploration(6, 0, candidate_seeds(3, 6, 0, 6), [0.1, 0.9, 0.5, 0.3, 0.8, 0.2], required=8)
    assert bank.seeds_for(6, 0)[1] is False
    state = _json(bank.state_dict())
    assert state["version"] == 2 and state["counts"] == [[6, 0, 6, 8]]
    again = SeedBank(run_seed=3, group_size=4)
    again.load_state_dict(state)
    assert again.state_dict() == bank.state_dict()
    assert again.explored_slots(5) == {1} and again.explored_slots(6) == set()


def test_seed_bank_load_rejects_another_run():
    state = _json(SeedBank(run_seed=3, group_size=4).state_dict())
    for other in (SeedBank(run_seed=4, group_size=4), SeedBank(run_seed=3, group_size=2)):
        with pytest.raises(ValueError, match="seed bank state is for"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        SeedBank(3, 4).load_state_dict({**state, "version": 3})


def test_instance_manager_restores_cost_not_nodes():
    im = InstanceManager(heartbeat_timeout_s=10.0)
    im.register("spot", "s", [0, 1], True, now=0.0)
    im.register("res", "r", [0], False, now=0.0)
    im.integrate(5.0)
    state = _json(im.state_dict())
    fresh = InstanceManager(heartbeat_timeout_s=10.0)
    fresh.load_state_dict(state)
    assert fresh.gpu_seconds(spot=True) == 10.0 and fresh.gpu_seconds(spot=False) == 5.0
    assert fresh.nodes == {}  # agents register again after a restart
    # accumulation continues from the restored totals; downtime is not billed
    fresh.register("spot", "s2", [0], True, now=100.0)
    fresh.integrate(104.0)
    assert fresh.gpu_seconds(spot=True) == 14.0 and fresh.gpu_seconds(spot=False) == 5.0
    assert fresh.cost_usd(3600.0, 0.0) == pytest.approx(14.0)
    with pytest.raises(ValueError, match="version"):
        fresh.load_state_dict({"version": 7, "gpu_seconds": {"spot": 0, "reserved": 0}})
    with pytest.raises(ValueError, match=">= 0"):
        fresh.load_state_dict({"version": 1, "gpu_seconds": {"spot": -1, "reserved": 0}})
