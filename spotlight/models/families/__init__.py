"""Model families (one module each) behind :class:`~spotlight.models.families.base.ModelFamily`.

``get_family(cfg)`` returns the family object for the run's ``[model]`` section:

=============  ======================================  =====================================
family         transformer / pipeline (diffusers)      text encoder(s)
=============  ======================================  =====================================
tiny           QwenImageTransformer2DModel, pixels     MiniLM-L6 token embeddings (wheel)
qwen-image     QwenImageTransformer2DModel + VAE       Qwen2.5-VL (QwenImagePipeline template)
sd3            SD3Transformer2DModel + AutoencoderKL   CLIP-L, CLIP-G, T5-XXL
flux           FluxTransformer2DModel + AutoencoderKL  CLIP-L (pooled), T5-XXL
=============  ======================================  =====================================
"""

from __future__ import annotations

import importlib

from spotlight.config import ModelConfig
from spotlight.models.families.base import ModelFamily, ModelLoadError, cached_conditioning, torch_dtype

_MODULES = {"tiny": "tiny", "qwen-image": "qwen_image", "sd3": "sd3", "flux": "flux"}

__all__ = ["ModelFamily", "ModelLoadError", "cached_conditioning", "get_family", "torch_dtype"]


def get_family(cfg: ModelConfig, *, text_dim: int | None = None) -> ModelFamily:
    """The :class:`ModelFamily` for ``cfg.family`` (its module is imported on first use).

    ``text_dim`` sets the tiny family's text-embedding width (tests use small ones); the other
    families read theirs from the checkpoint and ignore it.

    Raises:
        ValueError: unknown family name.
    """
    try:
        mod = importlib.import_module(f"spotlight.models.families.{_MODULES[cfg.family]}")
    except KeyError:
        raise ValueError(f"unknown model family {cfg.family!r}; choose one of {sorted(_MODULES)}") from None
    family = mod.FAMILY(cfg)
    if text_dim is not None and hasattr(family, "text_dim"):
        family.text_dim = text_dim
    return family
