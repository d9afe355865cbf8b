"""Bytes per published weight version: full fine-tuning vs LoRA (adapter-only versions).

Two parts, printed as tables (Markdown, for ``benchmarks/RESULTS.md``):

1. **Measured** on the tiny random-weight checkpoints of every family (the ones the test
   suite runs): the serialized size of what the trainer publishes (``spotlight.store.tensor_wire``
   safetensors bytes), the whole transformer vs the LoRA adapter at the family's default
   target modules (rank 4 as in the tests, and rank 64).
2. **Arithmetic** for the real models, counted on the ``meta`` device (no memory, no download):
   the transformer built from the published architecture config and a LoRA adapter added with
   the family's default targets at Flow-GRPO's rank; bytes = parameters × 2 (bfloat16, what
   ``model.dtype = "auto"`` publishes on CUDA) and × 4 (float32).

Usage: ``python benchmarks/version_bytes.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile

import torch

from spotlight.models.param_count import PRESETS  # the published architectures, one place

REAL = {
    # published transformer configs (diffusers-format config.json of each release)
    "qwen-image": (
        "QwenImageTransformer2DModel",
        "Qwen-Image (20 B)",
        64,
        PRESETS["qwen-image-20b"][2],
    ),
    "sd3": (
        "SD3Transformer2DModel",
        "SD3.5 Medium (2.5 B)",
        32,
        dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        ),
    ),
    "flux": (
        "FluxTransformer2DModel",
        "FLUX.1-dev (12 B)",
        64,
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
}


def _family(name: str, path: str = "x"):
    from spotlight.config import ModelConfig
    from spotlight.models.families import get_family

    return get_family(ModelConfig() if name == "tiny" else ModelConfig(family=name, pretrained_path=path))


def _lora_params(model, family, rank: int) -> dict[str, torch.Tensor]:
    from spotlight.models.lora import add_lora

    add_lora(model, {"rank": rank, "alpha": 2.0 * rank, "target_modules": []}, family.default_lora_targets, seed=0)
    return {k: v for k, v in model.named_parameters() if v.requires_grad}


def measured() -> list[str]:
    from spotlight.store.tensor_wire import state_dict_to_bytes

    rows = [
        "| family (tiny test checkpoint) | transformer params | full version | LoRA r=4 version | LoRA r=64 version | "
        "full / LoRA r=4 |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("tiny", "qwen-image", "sd3", "flux"):
        with tempfile.TemporaryDirectory() as d:
            if name != "tiny":
                importlib.import_module(f"spotlight.models.families.{name.replace('-', '_')}").make_random_checkpoint(
                    d, seed=0
                )
            fam = _family(name, d)
            full = fam.build_transformer()
            n = sum(p.numel() for p in full.parameters())
            full_b = len(state_dict_to_bytes({k: v.contiguous() for k, v in full.state_dict().items()}))
            sizes = {}
            for r in (4, 64):
                m = fam.build_transformer()
                sizes[r] = len(
                    state_dict_to_bytes({k: v.detach().contiguous() for k, v in _lora_params(m, fam, r).items()})
                )
        rows.append(f"| {name} | {n:,} | {full_b:,} B | {sizes[4]:,} B | {sizes[64]:,} B | {full_b / sizes[4]:.1f}× |")
    return rows


def arithmetic() -> list[str]:
    import diffusers

    rows = [
        "| model | transformer params | full version bf16 | LoRA rank | adapter params | LoRA version bf16 | full / "
        "LoRA |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (cls_name, label, rank, kwargs) in REAL.items():
        fam = _family(name)
        with torch.device("meta"):
            model = getattr(diffusers, cls_name)(**kwargs)
        n = sum(p.numel() for p in model.parameters())
        lora = sum(p.numel() for p in _lora_params(model, fam, rank).values())
        rows.append(
            f"| {label} | {n / 1e9:.2f} B | {2 * n / 1e9:.1f} GB | {rank} | {lora / 1e6:.0f} M | {2 * lora / 1e9:.2f} "
            f"GB | {n / lora:.0f}× |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    # no options: --help prints the docstring and anything else is refused before anything runs
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    torch.set_num_threads(1)
    print("## Measured: tiny checkpoints (float32 versions, as CPU runs publish)\n")
    print("\n".join(measured()))
    print("\n## Arithmetic: real sizes (meta device; bfloat16 versions, as CUDA runs publish)\n")
    print("\n".join(arithmetic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
