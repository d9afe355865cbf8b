"""The post-trained DiT: a diffusers ``QwenImageTransformer2DModel``, its latent packing
and the velocity call the sampler uses.

Shapes: ``images [B, 3, H, W]`` in [-1, 1]; packed latents ``[B, L, C]`` with
``L = (H/p)·(W/p)`` tokens and ``C = 3·p²`` channels for the pixel-space tiny model
(the same 2×2 packing ``QwenImagePipeline._pack_latents`` applies to VAE latents).
"""

from __future__ import annotations

import torch

from spotlight.config import ModelConfig
from spotlight.rl.sampler import Conditioning

PIXEL_CHANNELS = 3


def transformer_kwargs(cfg: ModelConfig, text_dim: int) -> dict:
    """Constructor arguments of the tiny pixel-space Qwen-Image transformer."""
    return dict(
        patch_size=cfg.patch_size,
        in_channels=PIXEL_CHANNELS * cfg.patch_size**2,
        out_channels=PIXEL_CHANNELS,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=text_dim,
        axes_dims_rope=tuple(cfg.axes_dims_rope),
    )


def build_transformer(cfg: ModelConfig, text_dim: int = 384, *, seed: int | None = None):
    """Build (tiny, seeded random weights) or load (pretrained) the transformer.

    Args:
        cfg: the ``[model]`` config section.
        text_dim: width D of the text embeddings (``joint_attention_dim``).
        seed: torch seed for random init; defaults to ``cfg.init_seed``.

    Returns:
        ``QwenImageTransformer2DModel`` in float32, eval mode, on the CPU.

    Raises:
        OSError: ``pretrained_path`` cannot be loaded (diffusers' error).
    """
    from diffusers import QwenImageTransformer2DModel

    if cfg.source == "pretrained":
        model = QwenImageTransformer2DModel.from_pretrained(cfg.pretrained_dir, torch_dtype=torch.float32)
    else:
        state = torch.random.get_rng_state()
        torch.manual_seed(cfg.init_seed if seed is None else seed)
        try:
            model = QwenImageTransformer2DModel(**transformer_kwargs(cfg, text_dim))
        finally:
            torch.random.set_rng_state(state)
    return model.float().eval()


def token_shape(cfg: ModelConfig) -> tuple[int, int]:
    """``(L, C)`` of one packed latent."""
    side = cfg.image_size // cfg.patch_size
    return side * side, PIXEL_CHANNELS * cfg.patch_size**2


def pack(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[B, 3, H, W] -> [B, (H/p)(W/p), 3·p²]`` (QwenImagePipeline's 2×2 packing)."""
    b, c, h, w = images.shape
    p = patch_size
    x = images.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpack(latents: torch.Tensor, image_size: int, patch_size: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[B, L, 3·p²] -> [B, 3, H, W]``."""
    b = latents.shape[0]
    p = patch_size
    side = image_size // p
    x = latents.view(b, side, side, PIXEL_CHANNELS, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, PIXEL_CHANNELS, image_size, image_size)


def decode_images(latents: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Packed pixel latents → ``[B, 3, H, W] uint8`` images (no VAE weights needed)."""
    img = unpack(latents.float(), cfg.image_size, cfg.patch_size)
    return ((img.clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)


def make_velocity_fn(transformer, cfg: ModelConfig):
    """``velocity_fn(latents [B, L, C], sigma [B], cond) -> v [B, L, C]``.

    Qwen-Image takes ``timestep = t / 1000 = sigma`` and ``img_shapes`` of (frames, h, w)
    tokens per sample (diffusers ``QwenImagePipeline``).
    """
    side = cfg.image_size // cfg.patch_size

    def velocity_fn(latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        out = transformer(
            hidden_states=latents,
            encoder_hidden_states=cond.embeds,
            encoder_hidden_states_mask=cond.mask,
            timestep=sigma.to(latents.dtype),
            img_shapes=[(1, side, side)] * latents.shape[0],
            return_dict=False,
        )[0]
        return out

    return velocity_fn
