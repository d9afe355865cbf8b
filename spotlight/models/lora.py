"""LoRA adapters (peft, through diffusers' ``PeftAdapterMixin``) and weight versions.

In a LoRA run (``train.lora_rank > 0``) the transformer's base weights are frozen and a
published weight version is the adapter alone (paper §4.2 weight sync): Rollout Workers keep
one frozen base copy and swap adapter versions.
In a full fine-tuning run a version is the whole transformer state dict.

Names: a version maps the transformer's own parameter names (``…to_q.lora_A.default.weight``
for LoRA, every state-dict key otherwise) to CPU tensors. The adapter in ``final/`` is
written in diffusers' LoRA format (``pytorch_lora_weights.safetensors`` with peft metadata)
by the family pipeline's ``save_lora_weights``, so ``pipeline.load_lora_weights(final)`` and
``transformer.load_lora_adapter(final, prefix="transformer")`` load it.

Defaults follow Flow-GRPO (``scripts/train_sd3.py``, ``train_flux.py``,
``train_qwenimage.py``): Gaussian init of ``lora_A``, ``lora_B = 0`` (so v0 equals the
base model), α = 2·r, target modules per family.
"""

from __future__ import annotations

from typing import Any

import torch

from spotlight.config import TrainConfig
from spotlight.errors import SpotlightError


class WeightVersionError(SpotlightError):
    """A published weight version does not fit the worker's transformer."""


def lora_spec(train: TrainConfig) -> dict[str, Any]:
    """The LoRA settings Rollout Workers need (sent at registration); ``{}`` = no LoRA."""
    if not train.use_lora:
        return {}
    return {
        "rank": train.lora_rank,
        "alpha": train.lora_alpha or 2.0 * train.lora_rank,
        "target_modules": list(train.lora_target_modules),
    }


def lora_config(spec: dict[str, Any], default_targets: tuple[str, ...]):
    """``peft.LoraConfig`` for ``spec`` (:func:`lora_spec`)."""
    from peft import LoraConfig

    targets = list(spec.get("target_modules") or default_targets)
    return LoraConfig(
        r=int(spec["rank"]), lora_alpha=float(spec["alpha"]), init_lora_weights="gaussian", target_modules=targets
    )


def add_lora(transformer: torch.nn.Module, spec: dict[str, Any], default_targets: tuple[str, ...], *, seed: int) -> int:
    """Freeze ``transformer`` and add a trainable LoRA adapter (seeded init).

    Returns:
        Number of trainable (adapter) parameters.

    Raises:
        SpotlightError: none of the target modules exist in the transformer.
    """
    transformer.requires_grad_(False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        transformer.add_adapter(lora_config(spec, default_targets))
    except ValueError as exc:  # peft: "Target modules … not found in the base model"
        raise SpotlightError(f"LoRA: {exc}") from None
    finally:
        torch.random.set_rng_state(state)
    n = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    if n == 0:
        raise SpotlightError("LoRA adapter has no trainable parameters: check train.lora_target_modules")
    return n


def initial_adapter_state(transformer: torch.nn.Module, spec: dict[str, Any], *, seed: int) -> dict[str, torch.Tensor]:
    """The adapter's initial weights, full size, on the CPU, float32: peft's ``"gaussian"`` init
    (``lora_A ~ N(0, 1/r)``, ``lora_B = 0``, so v0 is the base model) drawn from a generator
    seeded with ``seed``, parameter by parameter in ``named_parameters`` order.

    The values depend on nothing but ``seed`` and the adapter's names and shapes, so they are
    the same on every rank, after a restart, and whether the adapter was added to a real or a
    ``meta`` transformer (the Train Worker adds it to a meta one and loads these).

    Raises:
        SpotlightError: an adapter parameter that is neither ``lora_A`` nor ``lora_B``.
    """
    g = torch.Generator().manual_seed(seed)
    std = 1.0 / float(spec["rank"])
    out = {}
    for name, p in transformer.named_parameters():
        if "lora_" not in name:
            continue
        if ".lora_A." in name:
            out[name] = torch.empty(tuple(p.shape)).normal_(0.0, std, generator=g)
        elif ".lora_B." in name:
            out[name] = torch.zeros(tuple(p.shape))
        else:
            raise SpotlightError(f"LoRA: unexpected adapter parameter {name}")
    return out


def is_lora(transformer: torch.nn.Module) -> bool:
    return any("lora_" in n for n, _ in transformer.named_parameters())


def load_version(transformer: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a published version: the whole state dict, or (LoRA) the adapter over the frozen base.

    Raises:
        WeightVersionError: unknown keys, or (full) missing keys, or (LoRA) an adapter
            parameter missing from the version.
    """
    result = transformer.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys:
        raise WeightVersionError(
            f"weight version has {len(result.unexpected_keys)} unknown keys, e.g. {result.unexpected_keys[:3]}"
        )
    missing = result.missing_keys
    if is_lora(transformer):
        missing = [k for k in missing if "lora_" in k]
    if missing:
        raise WeightVersionError(f"weight version lacks {len(missing)} keys, e.g. {missing[:3]}")


def adapter_metadata(transformer: torch.nn.Module) -> dict | None:
    """peft's ``LoraConfig`` of the default adapter as a dict (saved next to the weights)."""
    cfg = getattr(transformer, "peft_config", {}).get("default")
    if cfg is None:
        return None
    meta = cfg.to_dict()
    for k, v in list(meta.items()):
        if isinstance(v, set):
            meta[k] = sorted(v)
    return meta
