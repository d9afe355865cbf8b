"""Family x feature combinations (spotlight/config.py, ``SpotlightConfig._check_family_features``):
each either loads, and then the workers have a code path for it, or is refused at load time
with a ConfigError naming the field (the sd3 + First Block Cache case looped at run time)."""

from __future__ import annotations

import inspect

import diffusers
import pytest
from diffusers.models.cache_utils import CacheMixin

from spotlight.config import STEP_CACHE_FAMILIES, TRUE_CFG_FAMILIES, ConfigError, load_config
from spotlight.models.families import _MODULES

FAMILIES = ("tiny", "qwen-image", "sd3", "flux")

# feature -> config overrides
FEATURES = {
    "cache_threshold": {"explore.cache_threshold": 0.1},
    "cached_num_steps": {"explore.num_steps": 5},
    "sp_degree": {"cluster.sp_degree": 2},
    "reserved_sp_degree": {"cluster.reserved_sp_degree": 2},
    "negative_prompt": {"model.negative_prompt": "blurry"},
    "negative_prompt_without_cfg": {"model.negative_prompt": "blurry", "model.guidance_scale": 1.0},
    "guidance_scale": {"model.guidance_scale": 4.0},
    "lora": {"train.lora_rank": 4},
}

# the field each refusal must name
REFUSED = {
    ("sd3", "cache_threshold"): "explore.cache_threshold",
    ("sd3", "cached_num_steps"): "explore.num_steps",
    ("sd3", "sp_degree"): "cluster.sp_degree",  # no _cp_plan (spotlight/workers/sp/degrees.py)
    ("sd3", "reserved_sp_degree"): "cluster.reserved_sp_degree",
    ("flux", "negative_prompt"): "model.negative_prompt",
    **{(f, "negative_prompt_without_cfg"): "model.negative_prompt" for f in FAMILIES},
}


def _family_cls(name: str):
    import importlib

    return importlib.import_module(f"spotlight.models.families.{_MODULES[name]}").FAMILY


def _has_code_path(family: str, feature: str) -> bool:
    """What the worker code can run, read from the code (diffusers classes, the family modules)."""
    cls = _family_cls(family)
    transformer = getattr(diffusers, cls.transformer_class)
    if feature in ("cache_threshold", "cached_num_steps"):
        return issubclass(transformer, CacheMixin)
    if feature in ("sp_degree", "reserved_sp_degree"):
        return getattr(transformer, "_cp_plan", None) is not None  # the SP member is family-driven
    if feature == "negative_prompt":
        return "neg.embeds" in inspect.getsource(cls)  # the velocity runs the negative rows
    if feature == "guidance_scale":
        return "guidance" in inspect.getsource(cls.velocity)
    if feature == "lora":
        return bool(cls.default_lora_targets)
    return False


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_family_feature_loads_with_a_code_path_or_is_refused_naming_its_field(family, feature):
    overrides = {"model.family": family, **FEATURES[feature]}
    if family != "tiny":
        overrides |= {"model.pretrained_path": "/nonexistent/checkpoint", "model.image_size": 32}
    if feature == "cached_num_steps":
        overrides["explore.profile_path"] = "/nonexistent/profile.json"
    want = REFUSED.get((family, feature))
    if want is None:
        cfg = load_config(overrides=overrides)
        assert cfg.model.family == family
        assert _has_code_path(family, feature), f"{family} x {feature} loads but no worker code runs it"
    else:
        with pytest.raises(ConfigError) as err:
            load_config(overrides=overrides)
        assert f"{want}: " in str(err.value) and err.value.field in (want, None), str(err.value)


def test_the_tables_match_the_code():
    assert STEP_CACHE_FAMILIES == {f for f in FAMILIES if _has_code_path(f, "cache_threshold")}
    assert TRUE_CFG_FAMILIES == {f for f in FAMILIES if _has_code_path(f, "negative_prompt")}
    assert "sd3" not in STEP_CACHE_FAMILIES  # SD3Transformer2DModel: no CacheMixin
    from spotlight.workers.sp.degrees import CP_FAMILIES

    assert CP_FAMILIES == {f for f in FAMILIES if _has_code_path(f, "sp_degree")}


def test_a_profile_s_cached_arms_are_not_planned_for_sd3():
    from spotlight.coordinator.coordinator import build_core
    from spotlight.core.planner import StepOption
    from spotlight.core.request_scheduler import RequestScheduler
    from spotlight.core.seed_bank import SeedBank

    class Profile:
        t_step_s = 0.1

        def step_options(self):
            return [StepOption(0.0, 10.0, 1.0), StepOption(0.2, 5.0, 0.9)]

    overrides = {"model.family": "sd3", "model.pretrained_path": "/x", "explore.planner": "bandit"}
    cfg = load_config(overrides=overrides)
    core = build_core(cfg, RequestScheduler(), SeedBank(0, cfg.data.group_size), Profile(), num_prompts=64)
    assert core.planner is not None
    assert {o.cache_threshold for o in core.planner.step_options} == {0.0}
