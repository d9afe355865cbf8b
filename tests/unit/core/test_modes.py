"""Run modes (spotlight/core/modes.py): one table for the simulator's policies and the real
system's ``run.mode``."""

from __future__ import annotations

import pytest

from spotlight.config import ConfigError, load_config
from spotlight.core.modes import MODE_NAMES, POLICIES, mode_overrides
from spotlight.sim import simulator


def _effective(cfg) -> dict:
    """What a loaded config makes the real system do, in the Policy's terms."""
    explore = cfg.explore.mode if cfg.explore.active and cfg.num_explored_prompts > 0 else "off"
    out = {
        "use_spot": cfg.cluster.use_spot,
        "explore_mode": explore,
        "reuse_exploration": cfg.explore.reuse_as_rollout,
        "elastic": cfg.cluster.reconfiguration == "elastic",
        "live_migration": cfg.cluster.live_migration,
        "stream_extra": cfg.explore.stream_extra,
    }
    if explore != "off":
        out["planner"] = cfg.explore.planner
    return out


@pytest.mark.parametrize("name", MODE_NAMES)
def test_config_mode_does_what_the_simulators_policy_says(name):
    p = POLICIES[name]
    # a config file that says the opposite of the baseline: the mode wins
    cfg = load_config(
        overrides={
            "run.mode": name,
            "explore.mode": "stale",
            "explore.stream_extra": True,
            "cluster.reconfiguration": "elastic",
            "cluster.use_spot": True,
        }
    )
    want = {
        "use_spot": p.use_spot,
        "explore_mode": p.explore_mode,
        "reuse_exploration": p.reuse_exploration,
        "elastic": p.elastic,
        "live_migration": p.live_migration,
        "stream_extra": p.stream_extra,
    }
    if p.explore_mode != "off":
        want["planner"] = p.planner
    assert _effective(cfg) == want
    assert cfg.run.mode == name


def test_one_table_and_spotlight_changes_nothing():
    assert simulator.POLICIES is POLICIES
    assert MODE_NAMES == ("spotlight", "rlboost", "rlboost+explore", "verl-omni-spot", "reserved-only")
    assert mode_overrides("spotlight") == {}
    assert (
        load_config(overrides={"explore.mode": "off"}).explore.mode == "off"
    )  # default mode keeps the file's settings
    with pytest.raises(ValueError, match="unknown mode 'ray'"):
        mode_overrides("ray")
    with pytest.raises(ConfigError, match="run.mode"):
        load_config(overrides={"run.mode": "ray"})


def test_best_of_n_reuse_makes_full_fidelity_rollouts_of_every_prompt():
    cfg = load_config(overrides={"run.mode": "verl-omni-spot", "explore.cache_threshold": 0.1, "explore.num_steps": 4})
    assert cfg.explore.cache_threshold == 0 and cfg.explore.num_steps == 0 and cfg.data.num_control_prompts == 0
    with pytest.raises(ConfigError, match="num_control_prompts"):
        load_config(
            overrides={"explore.mode": "critical_path", "explore.planner": "fixed", "explore.reuse_as_rollout": True}
        )
    with pytest.raises(ConfigError, match="critical_path"):
        load_config(overrides={"explore.reuse_as_rollout": True})


def test_switches_validated():
    with pytest.raises(ConfigError, match="reserved_sp_degree"):
        load_config(overrides={"cluster.reserved_sp_degree": 0})
    with pytest.raises(ConfigError, match="reconfiguration"):
        load_config(overrides={"cluster.reconfiguration": "reboot"})
    cfg = load_config(overrides={"cluster.live_migration": False, "run.mode": "rlboost"})
    assert cfg.cluster.live_migration is False  # a study switch, independent of the mode
