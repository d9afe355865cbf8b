"""Parameter counts for the memory plan (:mod:`spotlight.core.memory_plan`), without weights.

The family's diffusers transformer class is built ``from_config`` under ``torch.device("meta")``
(no memory, no download) from the checkpoint's ``transformer/config.json``, the tiny family's
model section, or a preset of a published architecture; the LoRA adapter the config would
add is counted by adding it (peft) to that meta model.
"""

from __future__ import annotations

from spotlight.core.memory_plan import ModelSize
from spotlight.errors import SpotlightError

PRESETS: dict[str, tuple[str, str, dict]] = {
    # Qwen-Image: 60 dual-stream blocks, 24 heads × 128, Qwen2.5-VL-7B text width 3584, 16-channel VAE
    "qwen-image-20b": (
        "qwen-image",
        "QwenImageTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=60,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            axes_dims_rope=(16, 56, 56),
        ),
    ),
    # FLUX.1-dev: 19 double + 38 single blocks, 24 heads × 128, T5 width 4096, CLIP pooled 768
    "flux-12b": (
        "flux",
        "FluxTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
    ),
    # SD3.5-large: 38 blocks, 38 heads × 64, T5 width 4096, CLIP-L + CLIP-G pooled 2048
    "sd3.5-large": (
        "sd3",
        "SD3Transformer2DModel",
        dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=38,
            attention_head_dim=64,
            num_attention_heads=38,
            joint_attention_dim=4096,
            caption_projection_dim=2432,
            pooled_projection_dim=2048,
            pos_embed_max_size=192,
            qk_norm="rms_norm",
        ),
    ),
}
"""``spotlight plan --preset NAME``: (family, diffusers class, transformer config)."""


class PlanError(SpotlightError):
    """The transformer of a plan cannot be counted (unknown preset, unreadable config)."""


def transformer_config(cfg, preset: str | None = None) -> tuple[str, str, dict]:
    """``(family, diffusers class name, transformer config)`` of ``preset``, else of ``cfg``'s
    model (the tiny family's model section, or the checkpoint's ``transformer/config.json``).

    Raises:
        PlanError: an unknown preset; a checkpoint without a readable transformer config.
    """
    if preset is not None:
        if preset not in PRESETS:
            raise PlanError(f"--preset {preset}: choose from {', '.join(PRESETS)}")
        preset_family = PRESETS[preset][0]
        if cfg.model.family != "tiny" and cfg.model.family != preset_family:
            # its text tokens and CFG rows would be the config's family's, its blocks the preset's
            fitting = [name for name, (fam, _, _) in PRESETS.items() if fam == cfg.model.family]
            raise PlanError(
                f"--preset {preset} is a {preset_family} architecture and this config's model.family is "
                f"{cfg.model.family}: use --preset {' or '.join(fitting)}, or a {preset_family} config"
            )
        return PRESETS[preset]
    from spotlight.models.families import ModelLoadError, get_family

    family = get_family(cfg.model)
    if cfg.model.family == "tiny" and cfg.model.source == "tiny":
        from spotlight.models import dit

        return "tiny", family.transformer_class, dit.transformer_kwargs(cfg.model, family.text_dim)
    try:
        family.check_pipeline()  # another family's checkpoint would be counted as this family's class
        config = family.transformer_config()
    except (ModelLoadError, OSError, ValueError) as exc:
        hint = ""
        fitting = [name for name, (fam, _, _) in PRESETS.items() if fam == cfg.model.family]
        if not family.path.is_dir() and fitting:  # a family with published sizes (tiny has none)
            hint = f"; without the checkpoint at hand, plan a published size with --preset {' or '.join(fitting)}"
        raise PlanError(f"cannot read the transformer's config of {cfg.model.pretrained_path}: {exc}{hint}") from None
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    return cfg.model.family, family.transformer_class, config


def count_model(cfg, preset: str | None = None) -> ModelSize:
    """The :class:`ModelSize` of ``cfg``'s transformer (or ``preset``'s), with the LoRA adapter
    of ``cfg.train`` counted, all on the meta device.

    Raises:
        PlanError: as :func:`transformer_config`, or LoRA targets that match nothing.
    """
    family, cls_name, config = transformer_config(cfg, preset)  # a bad preset is refused before torch loads
    import importlib

    import diffusers
    import torch

    from spotlight.models.families import _MODULES
    from spotlight.models.lora import add_lora, lora_spec

    with torch.device("meta"):
        model = getattr(diffusers, cls_name).from_config(config)
    params = sum(p.numel() for p in model.parameters())
    lora = 0
    if cfg.train.lora_rank > 0:
        targets = importlib.import_module(f"spotlight.models.families.{_MODULES[family]}").FAMILY.default_lora_targets
        try:
            with torch.device("meta"):
                lora = add_lora(model, lora_spec(cfg.train), targets, seed=0)
        except SpotlightError as exc:
            raise PlanError(str(exc)) from None
    c = model.config
    blocks = int(c.num_layers) + int(getattr(c, "num_single_layers", 0) or 0)
    return ModelSize(
        family=family,
        params=params,
        lora_params=lora,
        hidden_size=int(c.num_attention_heads) * int(c.attention_head_dim),
        num_blocks=blocks,
    )
