"""`spotlight profile`'s table: t_step, threshold -> effective steps / cost, accuracy; and the
coordinator-side loader the Planner reads it through."""

from __future__ import annotations

import json

import pytest
import torch

from spotlight.config import load_config
from spotlight.errors import SpotlightError
from spotlight.studies.profiling import load_profile, run_profile, spearman


def test_spearman_edges():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) != spearman([1, 1, 1], [1, 2, 3])  # nan: constant side


def test_profile_table_roundtrip(tmp_path):
    # the embedded default (shapes task): its reward reads each image's prompt text
    cfg = load_config(overrides={"cluster.worker_batch_size": 4})
    prompts = ["a photo of a red circle", "a photo of two squares", "a photo of a triangle"]
    n = len(prompts)
    embeds, mask = torch.randn(n, 16, 384), torch.ones(n, 16, dtype=torch.long)
    from spotlight.rl.sampler import Conditioning

    prof = run_profile(
        cfg,
        Conditioning(embeds, mask),
        thresholds=[0.7, 100.0],
        num_prompts=2,
        num_seeds=4,
        progress=lambda s: None,
        prompts=prompts,
    )
    rows = {r["cache_threshold"]: r for r in prof["steps"]}
    assert rows[0.0]["effective_steps"] == cfg.sampler.num_steps and rows[0.0]["accuracy"] == 1.0
    # a huge threshold caches every step after the first: 1 effective step, and the
    # measured cost is more than 1 full step (the head block still runs each step)
    assert rows[100.0]["effective_steps"] == 1.0
    assert rows[100.0]["cost_steps"] >= rows[100.0]["effective_steps"]
    assert all(r["accuracy"] is None or -1.0 <= r["accuracy"] <= 1.0 for r in prof["steps"])
    json.dumps(prof, allow_nan=False)  # strict JSON: an unknown accuracy is null, never NaN
    assert prof["t_step_s"]["cpu/sp1"] > 0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    loaded = load_profile(load_config(overrides={"explore.profile_path": str(path)}))
    opts = {o.cache_threshold: o for o in loaded.step_options()}
    assert opts[100.0].effective_steps == 1.0 and opts[100.0].cost_steps == rows[100.0]["cost_steps"]


def test_missing_or_bad_profile_is_a_clear_error(tmp_path):
    with pytest.raises(SpotlightError, match="not found"):
        load_profile(load_config(overrides={"explore.profile_path": str(tmp_path / "nope.json")}))
    bad = tmp_path / "bad.json"
    for text in ("{}", "[1, 2]", '{"steps": []}'):  # was: "('t_step_s')", "list indices must be integers …"
        bad.write_text(text)
        with pytest.raises(SpotlightError) as info:
            load_profile(load_config(overrides={"explore.profile_path": str(bad)}))
        assert str(info.value) == (
            f"{bad}: not a Spotlight profile (expected a JSON object with t_step_s and steps, "
            "as `spotlight profile` writes)"
        )


def test_unmeasurable_accuracy_is_refused_not_a_crash(tmp_path):
    """A 0/1 or partial-credit reward can tie every prompt's seeds: Spearman is undefined.
    The profile stores null and the Planner sees accuracy -1 (below any threshold)."""
    prof = {
        "version": 2,
        "config_key": "x",
        "created_unix_s": 0.0,
        "t_step_s": {"cpu/sp1": 0.01},
        "steps": [
            {"cache_threshold": 0.0, "effective_steps": 10.0, "cost_steps": 10.0, "accuracy": 1.0},
            {"cache_threshold": 0.7, "effective_steps": 4.0, "cost_steps": 4.5, "accuracy": None},
        ],
    }
    from spotlight.studies.profiling import PROFILE_VERSION

    prof["version"] = PROFILE_VERSION
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    opts = {
        o.cache_threshold: o
        for o in load_profile(load_config(overrides={"explore.profile_path": str(path)})).step_options()
    }
    assert opts[0.7].accuracy == -1.0 and opts[0.0].accuracy == 1.0


@pytest.mark.parametrize(
    ("steps", "why"),
    [
        pytest.param([], "no steps", id="no-steps"),
        pytest.param([{"effective_steps": 10.0}], "a row of its steps lacks 'cache_threshold'", id="row-without-key"),
        pytest.param([{"cache_threshold": "x", "effective_steps": 10.0}], "could not convert", id="not-a-number"),
        pytest.param(
            [{"cache_threshold": -1.0, "effective_steps": 4.0}],
            "cache_threshold must be a finite number >= 0",
            id="negative",
        ),
        pytest.param(
            [{"cache_threshold": 0.5, "effective_steps": 0.0}],
            "effective_steps must be a finite number > 0",
            id="no-steps-left",
        ),
        pytest.param(
            [{"cache_threshold": 0.5, "effective_steps": 4.0, "cost_steps": -2.0}], "cost_steps", id="bad-cost"
        ),
    ],
)
def test_a_profile_whose_rows_cannot_be_planned_is_refused_when_loaded(tmp_path, steps, why):
    """Was: loaded, then `KeyError: 'cache_threshold'` or `ValueError: all 0 step options
    refused` when the coordinator built its Planner, as a traceback."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"t_step_s": {"cpu/sp1": 0.01}, "steps": steps}))
    with pytest.raises(SpotlightError) as info:
        load_profile(load_config(overrides={"explore.profile_path": str(path)}))
    msg = str(info.value)
    assert msg.startswith(f"{path}: not a Spotlight profile (") and why in msg and "\n" not in msg, msg


def test_the_planner_always_has_the_full_rollout(tmp_path):
    """A profile without a threshold-0 row (edited by hand), or one whose full rollout was
    measured with fewer steps than the run takes, still gives the Planner the run's own full
    rollout (was: `ValueError: all … step options refused` at coordinator start)."""
    from spotlight.coordinator.coordinator import build_core
    from spotlight.core.request_scheduler import RequestScheduler
    from spotlight.core.seed_bank import SeedBank

    path = tmp_path / "p.json"
    steps = [
        {"cache_threshold": 0.0, "effective_steps": 3.0, "accuracy": 1.0},
        {"cache_threshold": 0.5, "effective_steps": 2.0, "accuracy": 0.2},
    ]
    path.write_text(json.dumps({"t_step_s": {"cpu/sp1": 0.01}, "steps": steps}))
    cfg = load_config(overrides={"explore.profile_path": str(path), "planner.min_effective_steps": 5.0})
    core = build_core(cfg, RequestScheduler(), SeedBank(0, cfg.data.group_size), load_profile(cfg), num_prompts=64)
    full = [(o.cache_threshold, o.effective_steps, o.accuracy) for o in core.planner.step_options]
    assert full == [(0.0, float(cfg.sampler.num_steps), 1.0)], full
