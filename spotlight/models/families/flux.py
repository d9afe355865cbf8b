"""FLUX.1 (dev / schnell): ``FluxTransformer2DModel`` + ``AutoencoderKL``, prompts through
CLIP-L (pooled only) and T5-XXL (diffusers ``FluxPipeline``).

Everything follows diffusers 0.42 ``pipelines/flux/pipeline_flux.py`` and Flow-GRPO's
``scripts/train_flux.py``:

* latents are packed 2×2 VAE-latent patches ``[B, L, 4·C]`` (``FluxPipeline._pack_latents``):
  ``L = (H / (2·vsf)) · (W / (2·vsf))`` tokens (vsf = 8, so ``(H/16)·(W/16)``), C = 16;
* the sigma schedule is ``np.linspace(1, 1/T, T)`` shifted by the checkpoint's
  ``FlowMatchEulerDiscreteScheduler`` with ``mu = calculate_shift(L, …)`` (dynamic shift);
* prompts: ``encode_prompt`` → T5 ``prompt_embeds [N, max_sequence_length, 4096]`` and the
  CLIP-L pooled output ``[N, 768]``; ``txt_ids`` are zeros; no text mask;
* the transformer takes ``timestep = t / 1000 = σ``, ``img_ids`` from
  ``FluxPipeline._prepare_latent_image_ids`` and, for guidance-distilled checkpoints
  (``guidance_embeds``, FLUX.1-dev), ``guidance = guidance_scale`` (3.5) per row — no true CFG;
* decoding: ``_unpack_latents``, ``latents / scaling_factor + shift_factor``, VAE.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Callable

import numpy as np
import torch

from spotlight.models.families.sd3 import (
    ENCODE_CHUNK,
    VaeLatentFamily,
    batch_sigmas,
    chunked,
    scoped_seed,
    tiny_clip_text,
    tiny_t5_encoder,
    tiny_tokenizers,
    tiny_vae,
)
from spotlight.rl.sampler import Conditioning


class FluxFamily(VaeLatentFamily):
    """FLUX.1 (``FluxPipeline``) for Flow-GRPO.

    Latents ``[B, L, 4·C]`` float32 packed tokens. Conditioning: ``embeds [N,
    max_text_tokens, D]`` (T5 width, 4096), ``mask`` all ones, ``extra["pooled"] [N, P]``
    (CLIP-L pooled output, 768). ``guidance_scale`` is the guidance-embedding value
    (FLUX.1-dev: 3.5), ignored by checkpoints without ``guidance_embeds`` (schnell).
    """

    prompt_tokenizer_dir = "tokenizer_2"  # T5: max_sequence_length = model.max_text_tokens

    name = "flux"
    transformer_class = "FluxTransformer2DModel"
    pipeline_class = "FluxPipeline"
    block_names = ("transformer_blocks", "single_transformer_blocks")
    # Flow-GRPO scripts/train_flux.py: attention projections and both feed-forwards of the
    # double-stream blocks (the single-stream blocks match only to_q/to_k/to_v).
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    default_guidance_scale = 3.5
    default_negative_prompt = ""

    def components(self) -> tuple[str, ...]:
        return ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

    def identity(self) -> str:
        # No negative prompt and no true CFG: the conditioning does not depend on them.
        parts = [self.name, str(self.path.resolve()), str(self.cfg.max_text_tokens)]
        idx = self.path / "model_index.json"
        if idx.is_file():
            parts.append(idx.read_text())
        return "|".join(parts)

    # ------------------------------------------------------------------ latents
    @property
    def latent_grid(self) -> tuple[int, int]:
        """``(h, w)`` of the unpacked VAE latent: ``2 · (image_size // (2 · vsf))`` each."""
        side = 2 * (self.cfg.image_size // (2 * self.vae_scale_factor))
        return side, side

    @property
    def latent_shape(self) -> tuple[int, int]:
        """``(L, 4·C)`` = ``((h/2)·(w/2), 4 · latent_channels)``."""
        h, w = self.latent_grid
        return ((h // 2) * (w // 2), 4 * self.latent_channels)

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """``[T + 1] float32`` from 1 to 0, as ``FluxPipeline.__call__`` sets them:
        ``set_timesteps(sigmas=np.linspace(1, 1/T, T), mu=calculate_shift(L,
        base_image_seq_len, max_image_seq_len, base_shift, max_shift))`` (defaults 256, 4096,
        0.5, 1.15; L = image tokens) on ``FlowMatchEulerDiscreteScheduler`` from the
        checkpoint's ``scheduler/`` config (``use_flow_sigmas`` configs use their own
        sigmas). ``shift`` is not used: FLUX schedulers carry their own shift settings.

        Raises:
            ValueError: ``num_steps < 1``.
            ModelLoadError: no readable ``scheduler/`` config.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.component_config("scheduler"))
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        mu = calculate_shift(
            self.latent_shape[0],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(num_steps, device="cpu", sigmas=sigmas, mu=mu)
        return scheduler.sigmas.to(torch.float32).clone()

    # ------------------------------------------------------------------ text
    @torch.no_grad()
    def encode_prompts(
        self, prompts: list[str], device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None
    ) -> Conditioning:
        """Encode with ``FluxPipeline.encode_prompt`` (CLIP-L pooled output, T5 token
        embeddings; ``max_sequence_length = model.max_text_tokens``), on ``device`` in
        ``model.dtype``; ``progress(n)`` after each chunk. T5 runs without an attention mask
        over the padding to ``max_text_tokens`` (as the pipeline runs it): an encoding cannot
        be cut to another length, so the prompt cache is per ``max_text_tokens``.

        Returns:
            :class:`Conditioning` on the CPU: ``embeds [N, max_text_tokens, D] float32``,
            ``mask [N, T] int64`` all ones, ``extra["pooled"] [N, P] float32``.

        Raises:
            ValueError: ``prompts`` is empty.
            ModelLoadError: the text encoders cannot be loaded.
        """
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        device = torch.device(device)
        pipe = self.text_pipeline(device)
        embeds, pooled = [], []
        for chunk in chunked(prompts, ENCODE_CHUNK):
            pe, pp, _text_ids = pipe.encode_prompt(
                prompt=chunk,
                prompt_2=None,
                device=device,
                num_images_per_prompt=1,
                max_sequence_length=self.cfg.max_text_tokens,
            )
            embeds.append(pe.float().cpu())
            pooled.append(pp.float().cpu())
            if progress is not None:
                progress(sum(len(x) for x in embeds))
        e = torch.cat(embeds)
        return Conditioning(e, torch.ones(e.shape[:2], dtype=torch.int64), {"pooled": torch.cat(pooled)})

    # ------------------------------------------------------------------ velocity
    def guidance_embeds(self, transformer) -> bool:
        """Whether the transformer takes a guidance value (``config.guidance_embeds``)."""
        cfg = getattr(transformer, "config", None)
        return bool(getattr(cfg, "guidance_embeds", False))

    def velocity(self, transformer, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``v [B, L, 4·C] float32`` at ``sigma [B]``.

        As ``FluxPipeline``: ``hidden_states`` packed latents, ``timestep = σ`` (the
        pipeline's ``t / 1000``) in the transformer dtype, ``img_ids [L, 3]`` from
        ``_prepare_latent_image_ids``, ``txt_ids = zeros [T, 3]``, ``guidance = full([B],
        guidance_scale)`` float32 when ``transformer.config.guidance_embeds`` (else None).
        """
        from diffusers import FluxPipeline

        dtype = next(transformer.parameters()).dtype
        device = latents.device
        b = latents.shape[0]
        h, w = self.latent_grid
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype)
        txt_ids = torch.zeros(cond.embeds.shape[1], 3, device=device, dtype=dtype)
        guidance = None
        if self.guidance_embeds(transformer):
            guidance = torch.full([b], float(self.guidance_scale), device=device, dtype=torch.float32)
        out = transformer(
            hidden_states=latents.to(dtype),
            timestep=batch_sigmas(sigma, b).to(dtype),
            guidance=guidance,
            pooled_projections=cond.extra["pooled"].to(dtype),
            encoder_hidden_states=cond.embeds.to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return out.float()

    # ------------------------------------------------------------------ images
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed ``[B, L, 4·C]`` → ``[B, 3, H, W] uint8`` on the CPU
        (``FluxPipeline._unpack_latents``, ``/ scaling_factor + shift_factor`` — FLUX.1:
        0.3611 / 0.1159 —, ``vae.decode``, [-1, 1] → 0…255)."""
        from diffusers import FluxPipeline

        size = self.cfg.image_size
        z = FluxPipeline._unpack_latents(latents.float(), size, size, self.vae_scale_factor)
        return self._decode_unpacked(z)

    # ------------------------------------------------------------------ tiny checkpoints
    @staticmethod
    def make_random_checkpoint(
        path: str | os.PathLike,
        *,
        seed: int = 0,
        transformer_kwargs: dict | None = None,
        image_size: int = 32,
    ) -> pathlib.Path:
        """Write a tiny random-weight FLUX.1-dev-style checkpoint in diffusers layout (the real
        classes, saved by ``FluxPipeline(...).save_pretrained(path)``), loadable offline by
        ``FluxPipeline.from_pretrained(path)`` and by this family.

        Default components (``transformer_kwargs`` overrides the transformer's; the text
        encoders and VAE follow its ``joint_attention_dim``, ``pooled_projection_dim`` and
        ``in_channels``):

        * ``FluxTransformer2DModel``: patch 1, 64 in channels (= 4 × 16 packed), 1 double +
          1 single block, 2 heads × 16, ``axes_dims_rope=(4, 6, 6)``, ``joint_attention_dim``
          64, ``pooled_projection_dim`` 32, ``guidance_embeds=True``;
        * ``AutoencoderKL``: 4 blocks of 8 channels (×8), 16 latent channels, scaling
          0.3611, shift 0.1159;
        * ``CLIPTextModel`` width 32 (pooled output = ``pooled_projection_dim``),
          ``T5EncoderModel`` width 64; tokenizers from :mod:`spotlight.models.offline_tokenizers`;
        * ``FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True,
          base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)``.

        ``image_size`` is accepted for symmetry with the SD3 builder (FLUX has no sample
        size in its config). Weights come from ``seed`` in a scoped torch RNG.

        Returns:
            ``path`` as a :class:`pathlib.Path`.

        Raises:
            ValueError: ``in_channels`` is not a multiple of 4 (2×2 packing).
        """
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

        del image_size
        tk: dict[str, Any] = dict(
            patch_size=1,
            in_channels=64,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=64,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
        tk.update(transformer_kwargs or {})
        if int(tk["in_channels"]) % 4:
            raise ValueError(f"FLUX in_channels={tk['in_channels']} must be 4 × the VAE latent channels")
        path = pathlib.Path(path)
        with scoped_seed(seed):
            transformer = FluxTransformer2DModel(**tk)
            vae = tiny_vae(int(tk["in_channels"]) // 4, scaling_factor=0.3611, shift_factor=0.1159)
            text_encoder = tiny_clip_text(int(tk["pooled_projection_dim"]), with_projection=False)
            text_encoder_2 = tiny_t5_encoder(int(tk["joint_attention_dim"]))
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipe = FluxPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            transformer=transformer,
            **tiny_tokenizers(1),
        )
        pipe.save_pretrained(os.fspath(path))
        return path


FAMILY = FluxFamily


make_random_checkpoint = FluxFamily.make_random_checkpoint
"""Module-level alias: every family module exposes
``make_random_checkpoint(path, *, seed, transformer_kwargs, image_size)``."""
