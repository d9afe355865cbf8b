"""Parameter counts on the meta device: the published architectures of the presets, the
config's own transformer, and the LoRA adapter the config adds."""

from __future__ import annotations

import pytest

from spotlight.config import SpotlightConfig, config_from_dict
from spotlight.core import memory_plan
from spotlight.models.param_count import PlanError, count_model


@pytest.mark.parametrize(
    "preset, billions, hidden, blocks",
    [("qwen-image-20b", 20.4, 3072, 60), ("flux-12b", 11.9, 3072, 57), ("sd3.5-large", 8.1, 2432, 38)],
)
def test_presets_count_the_published_sizes(preset, billions, hidden, blocks):
    size = count_model(SpotlightConfig(), preset)
    assert abs(size.params / 1e9 - billions) / billions < 0.03, size.params
    assert (size.hidden_size, size.num_blocks, size.lora_params) == (hidden, blocks, 0)


def test_lora_adapter_is_counted_with_the_family_targets():
    cfg = config_from_dict({"train": {"lora_rank": 64}})
    size = count_model(cfg, "qwen-image-20b")
    # rank 64 on Qwen-Image's attention + MLPs: 0.85 GB in bf16 (README, "LoRA or full fine-tuning")
    assert size.family == "qwen-image" and abs(2 * size.lora_params / 1e9 - 0.85) < 0.01


def test_tiny_config_counts_its_own_transformer():
    from spotlight.models.dit import build_transformer

    cfg = SpotlightConfig()
    size = count_model(cfg)
    assert size.params == sum(p.numel() for p in build_transformer(cfg.model, 384).parameters())
    assert size.num_blocks == cfg.model.num_layers
    assert size.hidden_size == cfg.model.num_attention_heads * cfg.model.attention_head_dim


def test_unknown_preset_is_one_error():
    with pytest.raises(PlanError, match="--preset nope: choose from qwen-image-20b, flux-12b, sd3.5-large"):
        count_model(SpotlightConfig(), "nope")


def test_plan_tables_agree_with_the_families():
    import importlib

    from spotlight.models.families import _MODULES

    for name, module in _MODULES.items():
        family = importlib.import_module(f"spotlight.models.families.{module}").FAMILY
        assert memory_plan.DEFAULT_GUIDANCE[name] == family.default_guidance_scale, name
