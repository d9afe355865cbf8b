"""The Qwen-Image family: ``QwenImageTransformer2DModel`` + ``AutoencoderKLQwenImage`` +
Qwen2.5-VL text encoder, driven exactly as diffusers' ``QwenImagePipeline`` drives them.

Flow-GRPO post-trains Qwen-Image with true classifier-free guidance (``train_qwenimage.py``,
config ``pickscore_qwenimage``: CFG scale 4.0, negative prompt ``" "``); this module
reproduces the pieces of ``diffusers.QwenImagePipeline.__call__`` that the sampler needs:

* **latents** are the VAE's ``[B, z, 1, H/8, W/8]`` latents packed into 2×2 patches:
  ``[B, L, C]`` with ``L = (H/16)·(W/16)`` tokens and ``C = 4·z`` channels (z = 16 for the
  real checkpoint, read from ``vae/config.json``);
* **sigmas**: ``linspace(1, 1/T, T)`` shifted by the scheduler with
  ``mu = calculate_shift(L, …)`` (resolution-dependent "dynamic" shift, the pipeline's
  scheduler config), then a final 0;
* **prompts** go through the pipeline's own ``encode_prompt`` (chat template, last hidden
  state of Qwen2.5-VL, template prefix dropped), zero-padded to ``model.max_text_tokens``;
* **velocity** is the transformer at ``timestep = sigma`` (the pipeline passes ``t / 1000``)
  with true CFG ``neg + w·(pos − neg)`` rescaled to the positive prediction's per-token
  norm, both branches in one batched forward;
* **decode** unpacks, de-normalises with the VAE's ``latents_mean`` / ``latents_std`` and
  decodes the single frame.

:func:`make_random_checkpoint` writes a tiny random-weight checkpoint of the real classes
(diffusers layout, loadable with ``QwenImagePipeline.from_pretrained``) for tests and the
GPU smoke check; its tokenizer is built offline.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pathlib
import re
from typing import Any, Callable

import numpy as np
import torch

from spotlight.errors import SpotlightError
from spotlight.models.families.base import ModelFamily, ModelLoadError, read_json, torch_dtype
from spotlight.rl.sampler import Conditioning

log = logging.getLogger("spotlight.models.qwen_image")

PIPELINE_MAX_TEXT_TOKENS = 1024
"""``QwenImagePipeline.tokenizer_max_length``: the most prompt tokens the pipeline encodes."""

_DEFAULT_Z_DIM = 16
_DEFAULT_TEMPORAL_DOWNSAMPLE = (False, True, True)


class QwenImageFamily(ModelFamily):
    """Qwen-Image (``Qwen/Qwen-Image`` and fine-tunes) in diffusers layout.

    Checkpoint folders: ``transformer/``, ``vae/``, ``scheduler/``, ``text_encoder/``,
    ``tokenizer/`` and ``model_index.json`` (what ``QwenImagePipeline.save_pretrained``
    writes).

    Defaults follow Flow-GRPO's ``pickscore_qwenimage`` config: true CFG with scale 4.0 and
    negative prompt ``" "``, LoRA on every attention projection of both streams and on both
    streams' MLPs.
    """

    name = "qwen-image"
    transformer_class = "QwenImageTransformer2DModel"
    pipeline_class = "QwenImagePipeline"
    block_names = ("transformer_blocks",)
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    default_guidance_scale = 4.0
    default_negative_prompt = " "

    encode_batch_size: int = 16
    """Prompts per text-encoder forward in :meth:`encode_prompts`."""
    text_encoding_is_causal = True
    """Qwen2.5-VL is a decoder: the prompt cache keeps uncut encodings for every ``max_text_tokens``."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self._vae = None
        self._vae_config: dict | None = None
        self._warned_no_neg = False

    # ------------------------------------------------------------------ checkpoint facts
    def vae_config(self) -> dict:
        """``vae/config.json`` as a dict (read once; no weights are loaded).

        Raises:
            ModelLoadError: no ``vae/`` folder or an unreadable config.
        """
        if self._vae_config is None:
            self._vae_config = read_json(self.component_dir("vae") / "config.json")
        return self._vae_config

    @property
    def z_dim(self) -> int:
        """VAE latent channels z (16 for Qwen-Image)."""
        return int(self.vae_config().get("z_dim", _DEFAULT_Z_DIM))

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per VAE latent side: ``2 ** len(temperal_downsample)`` (8 for Qwen-Image),
        as ``QwenImagePipeline.__init__`` computes it."""
        return 2 ** len(self.vae_config().get("temperal_downsample", _DEFAULT_TEMPORAL_DOWNSAMPLE))

    def packed_grid(self) -> tuple[int, int]:
        """``(h, w)`` of the packed token grid: ``image_size // (2 · vae_scale_factor)`` each.

        Raises:
            ModelLoadError: ``model.image_size`` is not a multiple of ``2 · vae_scale_factor``.
        """
        side = 2 * self.vae_scale_factor
        if self.cfg.image_size % side != 0:
            raise ModelLoadError(
                f"model.image_size={self.cfg.image_size} must be a multiple of {side} for this Qwen-Image VAE "
                f"(×{self.vae_scale_factor}, 2×2 packing)"
            )
        return self.cfg.image_size // side, self.cfg.image_size // side

    def _check_class(self, component: str, expected: str) -> pathlib.Path:
        d = self.component_dir(component)
        name = read_json(d / "config.json").get("_class_name")
        if name != expected:
            raise ModelLoadError(f"{d}: holds a {name!r}, not a {expected} (is {self.path} a Qwen-Image checkpoint?)")
        return d

    # ------------------------------------------------------------------ transformer
    def build_transformer(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """``QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer")`` in
        ``dtype``, eval mode, on the CPU.

        Raises:
            ModelLoadError: no ``transformer/`` folder, a transformer of another class, weights
                that do not load, or ``in_channels`` that disagree with the VAE's ``4·z_dim``.
        """
        self._check_class("transformer", self.transformer_class)
        try:
            model = self.transformer_cls().from_pretrained(str(self.path), subfolder="transformer", dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelLoadError(f"{self.path}/transformer: cannot load {self.transformer_class}: {exc}") from exc
        channels = self.latent_shape[1]
        if int(model.config.in_channels) != channels:
            raise ModelLoadError(
                f"{self.path}: transformer in_channels={model.config.in_channels} but the VAE's packed latents have "
                f"4·z_dim={channels} channels"
            )
        return model.eval()

    def transformer_config(self) -> dict:
        """``transformer/config.json``, checked against the VAE (``in_channels = 4·z_dim``).

        Raises:
            ModelLoadError: as :meth:`build_transformer`, before any weight loads.
        """
        self._check_class("transformer", self.transformer_class)
        config = super().transformer_config()
        channels = self.latent_shape[1]
        if int(config.get("in_channels", channels)) != channels:
            raise ModelLoadError(
                f"{self.path}: transformer in_channels={config.get('in_channels')} but the VAE's packed latents have "
                f"4·z_dim={channels} channels"
            )
        return config

    # ------------------------------------------------------------------ latents
    @property
    def latent_shape(self) -> tuple[int, int]:
        """``(L, C)``: ``L = (H/16)·(W/16)`` packed tokens (``H = W = model.image_size``),
        ``C = 4 · z_dim`` (64 for Qwen-Image). Read from ``vae/config.json``.

        Raises:
            ModelLoadError: no ``vae/`` folder, or ``image_size`` not a multiple of 16.
        """
        h, w = self.packed_grid()
        return h * w, 4 * self.z_dim

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """``[T + 1] float32`` sigmas, 1 → 0, exactly as ``QwenImagePipeline.__call__`` sets
        them: ``linspace(1, 1/T, T)``, ``mu = calculate_shift(L, base_image_seq_len,
        max_image_seq_len, base_shift, max_shift)`` from ``scheduler/`` config, then
        ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=…, mu=mu)`` (dynamic exponential
        shift and the terminal stretch to ``shift_terminal`` for Qwen-Image), and a final 0.

        ``shift`` (``sampler.shift``) is not used: the checkpoint's scheduler config decides
        the shift, as in the pipeline.

        Raises:
            ModelLoadError: no ``scheduler/`` folder.
            ValueError: ``num_steps < 1``.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.component_dir("scheduler")
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(self.path), subfolder="scheduler")
        base = np.linspace(1.0, 1.0 / num_steps, num_steps)
        conf = scheduler.config
        mu = calculate_shift(
            self.latent_shape[0],
            conf.get("base_image_seq_len", 256),
            conf.get("max_image_seq_len", 4096),
            conf.get("base_shift", 0.5),
            conf.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=base, device="cpu", mu=mu)
        return scheduler.sigmas.to(torch.float32).clone()

    # ------------------------------------------------------------------ text
    def _load_text_pipeline(self, device: torch.device | str):
        from diffusers import QwenImagePipeline

        self.component_dir("text_encoder")
        self.component_dir("tokenizer")
        dtype = torch_dtype(self.cfg.dtype, device)
        try:
            pipe = QwenImagePipeline.from_pretrained(str(self.path), transformer=None, vae=None, dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelLoadError(f"{self.path}: cannot load the Qwen-Image text encoder/tokenizer: {exc}") from exc
        pipe.text_encoder.to(device).eval()
        return pipe

    def _encode_rows(self, pipe, prompts: list[str], device) -> tuple[list[torch.Tensor], list[int]]:
        """One ``encode_prompt`` call, uncut: each prompt's real token embeddings ``[len_i, D]
        float32`` on the CPU (the pipeline's own limit of :data:`PIPELINE_MAX_TEXT_TOKENS`) and
        the lengths (:func:`spotlight.models.text_cache.pack_rows`)."""
        from spotlight.models.text_cache import pack_rows

        template, drop_idx = pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx)
        ids = pipe.tokenizer([template.format(p) for p in prompts], truncation=False, verbose=False)["input_ids"]
        empty = [p for p, row in zip(prompts, ids) if len(row) <= drop_idx]
        if empty:  # the pipeline would fail inside on an empty sequence: say which prompt instead
            raise EmptyEncodingError(
                f"qwen-image: {empty[0]!r} encodes to no tokens with {self.path}/tokenizer once the pipeline "
                f"drops its {drop_idx}-token template prefix"
            )
        # Encoded uncut (the pipeline's own limit): the text encoder is causal, so the first T
        # rows equal encode_prompt(max_sequence_length=T) for any T (text_cache cuts on load).
        embeds, mask = pipe.encode_prompt(
            prompt=list(prompts), device=device, num_images_per_prompt=1, max_sequence_length=PIPELINE_MAX_TEXT_TOKENS
        )
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.int64, device=embeds.device)
        rows, lengths = pack_rows(embeds.float().cpu(), mask.to(torch.int64).cpu())
        return [r.clone() for r in rows], lengths

    def prompt_token_counts(self, prompts: list[str]) -> list[int] | None:
        """Qwen2.5-VL tokens of each prompt in the pipeline's chat template, the dropped
        system prefix not counted and the 5-token closing suffix counted: what
        ``model.max_text_tokens`` cuts (the mask lengths :meth:`encode_prompts` sees).
        Loads the tokenizer only; None when it does not load."""
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.path / "tokenizer"), local_files_only=True)
        except (OSError, ValueError, ImportError):
            return None
        template, drop_idx = _pipeline_template()
        return [
            len(ids) - drop_idx
            for ids in tok([template.format(p) for p in prompts], truncation=False, verbose=False)["input_ids"]
        ]

    def _warn_cut(self, prompts: list[str], lengths: list[int], level: int = logging.WARNING) -> None:
        T = self.cfg.max_text_tokens
        cut = [(n, p) for n, p in zip(lengths, prompts) if n > T]
        if cut:
            longest, example = max(cut, key=lambda x: x[0])
            log.log(
                level,
                "qwen-image: %d of %d prompt(s) exceed model.max_text_tokens=%d after the chat template "
                "and were cut (longest: %d tokens, %r)",
                len(cut),
                len(prompts),
                T,
                longest,
                example[:80],
            )

    def encode_prompts(
        self, prompts: list[str], device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None
    ) -> Conditioning:
        """Encode ``prompts`` with ``QwenImagePipeline.encode_prompt`` (Qwen2.5-VL, the
        pipeline's chat template, its first 34 template tokens dropped), batched
        :attr:`encode_batch_size` at a time on ``device`` in ``model.dtype`` (bf16 on CUDA
        with ``auto``); the text encoder is loaded here and freed afterwards (the transformer
        and VAE are never loaded). ``progress(n)``: prompts encoded so far, after each batch.

        Every row is zero-padded, or cut, to ``T = model.max_text_tokens`` tokens (the
        template's closing ``<|im_end|>\\n<|im_start|>assistant\\n`` counts: 5 tokens for the
        real tokenizer); cut prompts are logged at INFO (:meth:`prompt_token_counts` counts them
        without encoding; ``spotlight up`` reports them). The cut is that of
        :meth:`encode_prompts_packed`'s uncut encodings: the encoder is causal.

        Returns:
            :class:`Conditioning` on the CPU: ``embeds [N, T, D] float32`` (D = 3584 for
            Qwen-Image), ``mask [N, T] int64`` (1 = token, 0 = padding) and, when CFG is on
            (guidance scale > 1), ``extra["neg.embeds"] [1, T, D]`` / ``extra["neg.mask"]
            [1, T]``: the negative prompt's encoding, one row shared by every prompt.

        Raises:
            ModelLoadError: the text encoder or tokenizer folder is missing or does not load.
        """
        from spotlight.models.text_cache import unpack_conditioning

        return unpack_conditioning(self.encode_prompts_packed(prompts, device, progress), self.cfg.max_text_tokens)

    def encode_prompts_packed(
        self, prompts: list[str], device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """:meth:`encode_prompts` before the cut: every prompt's whole encoding (up to the
        pipeline's :data:`PIPELINE_MAX_TEXT_TOKENS`), and the negative prompt's with CFG, in
        the packed layout of :mod:`spotlight.models.text_cache` (``packed.embeds``,
        ``lengths.embeds``, ``packed.neg.embeds``, ``lengths.neg.embeds``).

        Raises:
            ModelLoadError: the text encoder or tokenizer folder is missing or does not load.
        """
        from spotlight.models.text_cache import packed_stream

        device = torch.device(device)
        pipe = self._load_text_pipeline(device)
        try:
            dim = int(pipe.text_encoder.config.get_text_config().hidden_size)
            with torch.no_grad():
                rows, lengths = [], []
                for i in range(0, len(prompts), self.encode_batch_size):
                    r, n = self._encode_rows(pipe, prompts[i : i + self.encode_batch_size], device)
                    rows.extend(r)
                    lengths.extend(n)
                    if progress is not None:
                        progress(len(lengths))
                # `spotlight up` reports the cut prompts once (prompt_token_counts)
                self._warn_cut(prompts, lengths, logging.INFO)
                out = packed_stream("embeds", rows, lengths, dim)
                if self.guidance_scale > 1:
                    nr, nl = self._encode_rows(pipe, [self.negative_prompt], device)
                    self._warn_cut([self.negative_prompt], nl)
                    out |= packed_stream("neg.embeds", nr, nl, dim)
        finally:
            del pipe
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return out

    # ------------------------------------------------------------------ velocity
    def velocity(
        self, transformer: torch.nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """Velocity ``[B, L, C] float32`` of packed ``latents [B, L, C]`` at noise level
        ``sigma [B]`` (1 = noise; passed as the transformer's ``timestep``, which is what the
        pipeline's ``t / 1000`` is).

        Inputs are cast to the transformer's parameter dtype. With true CFG (guidance scale
        ``w > 1`` and ``cond.extra`` holding ``neg.embeds`` / ``neg.mask``) the positive and
        negative rows run as one ``[2B]`` forward (both padded to the same T), then, as in
        ``QwenImagePipeline.__call__``: ``comb = neg + w·(pos − neg)``,
        ``v = comb · ‖pos‖ / ‖comb‖`` (norms over the channel axis, per token), computed in
        float32.
        """
        dtype = next(transformer.parameters()).dtype
        h, w = self.packed_grid()
        batch = latents.shape[0]
        scale = self.guidance_scale
        use_cfg = scale > 1 and "neg.embeds" in cond.extra
        if scale > 1 and not use_cfg and not self._warned_no_neg:
            log.warning(
                "qwen-image: guidance scale %.3g > 1 but the conditioning has no neg.* tensors; running without CFG",
                scale,
            )
            self._warned_no_neg = True
        x = latents.to(dtype)
        t = sigma.to(device=latents.device, dtype=dtype).reshape(-1).expand(batch)
        embeds, mask = cond.embeds, cond.mask
        if use_cfg:
            x = torch.cat([x, x])
            t = torch.cat([t, t])
            embeds = torch.cat([embeds, cond.rows("neg.embeds", batch).to(embeds.device)])
            mask = torch.cat([mask, cond.rows("neg.mask", batch).to(mask.device)])
        mask = mask.to(device=latents.device)
        out = transformer(
            hidden_states=x,
            encoder_hidden_states=embeds.to(device=latents.device, dtype=dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            timestep=t,
            img_shapes=[(1, h, w)] * x.shape[0],
            return_dict=False,
        )[0].float()
        if not use_cfg:
            return out
        return self.combine_cfg(out[:batch], out[batch:])

    def combine_cfg(self, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """True CFG of the two branches' predictions, as ``QwenImagePipeline.__call__``:
        ``comb = neg + w·(pos − neg)`` rescaled to the positive prediction's per-token norm."""
        comb = neg + self.guidance_scale * (pos - neg)
        return comb * (
            torch.linalg.vector_norm(pos, dim=-1, keepdim=True) / torch.linalg.vector_norm(comb, dim=-1, keepdim=True)
        )

    def velocity_branch(
        self, transformer: torch.nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, branch: str
    ) -> torch.Tensor:
        """One CFG branch's prediction ``[B, L, C] float32``: ``branch = "pos"`` (the prompts) or
        ``"neg"`` (the negative prompt), each as its own ``[B]`` forward. CFG-parallel SP groups
        run the two on different ranks and combine them with :meth:`combine_cfg`."""
        if branch == "neg":
            b = latents.shape[0]
            cond = Conditioning(cond.rows("neg.embeds", b), cond.rows("neg.mask", b))
        elif branch != "pos":
            raise ValueError(f"branch must be 'pos' or 'neg', got {branch!r}")
        else:
            cond = Conditioning(cond.embeds, cond.mask)
        dtype = next(transformer.parameters()).dtype
        h, w = self.packed_grid()
        mask = cond.mask.to(device=latents.device)
        return transformer(
            hidden_states=latents.to(dtype),
            encoder_hidden_states=cond.embeds.to(device=latents.device, dtype=dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            timestep=sigma.to(device=latents.device, dtype=dtype).reshape(-1).expand(latents.shape[0]),
            img_shapes=[(1, h, w)] * latents.shape[0],
            return_dict=False,
        )[0].float()

    # ------------------------------------------------------------------ images
    def load_decoder(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        """Load ``AutoencoderKLQwenImage`` from ``vae/`` once (frozen, eval) on ``device`` in
        ``dtype``; later calls are no-ops.

        Raises:
            ModelLoadError: no ``vae/`` folder, another VAE class, or weights that do not load.
        """
        if self._vae is not None:
            return
        from diffusers import AutoencoderKLQwenImage

        self._check_class("vae", "AutoencoderKLQwenImage")
        try:
            vae = AutoencoderKLQwenImage.from_pretrained(str(self.path), subfolder="vae", dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelLoadError(f"{self.path}/vae: cannot load AutoencoderKLQwenImage: {exc}") from exc
        self._vae = vae.to(device).eval().requires_grad_(False)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents ``[B, L, C]`` → images ``[B, 3, H, W] uint8`` on the CPU, as
        ``QwenImagePipeline.__call__`` decodes: ``_unpack_latents`` → ``[B, z, 1, h, w]``,
        ``x · latents_std + latents_mean``, ``vae.decode(x).sample[:, :, 0]``, then
        ``[-1, 1] → [0, 255]`` (clamped, rounded). Loads the VAE on ``latents.device`` in
        ``model.dtype`` if :meth:`load_decoder` was not called.
        """
        from diffusers import QwenImagePipeline

        if self._vae is None:
            self.load_decoder(latents.device, torch_dtype(self.cfg.dtype, latents.device))
        vae = self._vae
        size = self.cfg.image_size
        z = QwenImagePipeline._unpack_latents(latents, size, size, self.vae_scale_factor)
        z = z.to(device=vae.device, dtype=vae.dtype)
        z_dim = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
        z = z / inv_std + mean
        with torch.no_grad():
            image = vae.decode(z, return_dict=False)[0][:, :, 0]
        image = (image.float() / 2 + 0.5).clamp(0, 1)
        return (image * 255).round().to(torch.uint8).cpu()

    def components(self) -> tuple[str, ...]:
        return ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")


FAMILY = QwenImageFamily


# ====================================================================== random checkpoint
QWEN_IMAGE_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "stochastic_sampling": False,
}
"""Qwen/Qwen-Image's published ``scheduler/scheduler_config.json`` values."""

TINY_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    # head_dim 16 → 8 rotary frequencies split over (temporal, height, width) M-RoPE sections
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
}
"""Tiny Qwen2.5-VL text tower (``Qwen2_5_VLConfig.text_config``); vocab size and special
token ids are filled in from the tokenizer."""

TINY_VISION_CONFIG: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "fullatt_block_indexes": [0],
}
"""Tiny Qwen2.5-VL vision tower (unused by Qwen-Image, but part of the class);
``out_hidden_size`` follows the text hidden size."""

TINY_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 16,
    "z_dim": 4,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "latents_mean": [0.1, -0.2, 0.3, -0.4],
    "latents_std": [1.5, 0.5, 2.0, 1.0],
}
"""Tiny ``AutoencoderKLQwenImage``: ×8 spatial (three downsamples, as the real VAE), z = 4."""

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "axes_dims_rope": (4, 6, 6),
    "guidance_embeds": False,
}
"""Tiny ``QwenImageTransformer2DModel``; ``in_channels = 4·z``, ``out_channels = z`` and
``joint_attention_dim`` = text hidden size are derived."""

QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Special tokens of the Qwen2.5-VL tokenizer the random checkpoint carries (``<|endoftext|>``
is pad/eos/unk; the chat template uses ``<|im_start|>`` / ``<|im_end|>``)."""


def _byte_symbols() -> list[str]:
    """The byte-level BPE alphabet: one printable unicode symbol per byte value 0..255.

    Bytes that print as themselves in Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) keep
    their own character; the remaining 68 bytes (controls, space, soft hyphen, …) are mapped,
    in byte order, to ``chr(256)``, ``chr(257)``, … (so space is ``Ġ`` and newline ``Ċ``).
    """
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, spare = [], 256
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(spare))
            spare += 1
    return symbols


class EmptyEncodingError(SpotlightError, ValueError):
    """A prompt (or the negative prompt) the checkpoint's tokenizer encodes to no tokens."""


def build_tokenizer():
    """A byte-level BPE ``Qwen2Tokenizer`` built offline for the random checkpoint.

    Vocabulary: the 256 byte symbols (id = byte value), then one merged symbol per merge,
    then :data:`QWEN_SPECIAL_TOKENS` (added as special tokens). The merges spell every word
    of ``QwenImagePipeline``'s chat template, so the template prefix tokenizes to exactly the
    pipeline's ``prompt_template_encode_start_idx`` (34) tokens, as with the real Qwen
    tokenizer, and the pipeline drops exactly the system prompt. Any text round-trips
    (byte-level).

    Raises:
        RuntimeError: the template prefix does not tokenize to the pipeline's drop count
            (a diffusers template change).
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    template, drop_idx = _pipeline_template()
    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    special = "|".join(re.escape(s) for s in QWEN_SPECIAL_TOKENS)
    plain_text = [seg for seg in re.split(special, template.replace("{}", " ")) if seg]
    splitter = Qwen2Tokenizer(vocab=dict(vocab), merges=[])._tokenizer.pre_tokenizer
    merges: list[tuple[str, str]] = []
    for seg in plain_text:
        for word, _ in splitter.pre_tokenize_str(seg):
            for k in range(2, len(word) + 1):  # left-to-right chain: w[:k-1] + w[k-1]
                if word[:k] not in vocab:
                    merges.append((word[: k - 1], word[k - 1]))
                    vocab[word[:k]] = len(vocab)
    for tok in QWEN_SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS], special_tokens=True
    )
    prefix = template.split("{}")[0]
    n = len(tokenizer(prefix).input_ids)
    if n != drop_idx:
        raise RuntimeError(
            f"the offline Qwen tokenizer splits the QwenImagePipeline template prefix into {n} tokens, "
            f"the pipeline drops {drop_idx}"
        )
    return tokenizer


def _pipeline_template() -> tuple[str, int]:
    """``(prompt_template_encode, prompt_template_encode_start_idx)`` of diffusers'
    ``QwenImagePipeline`` (read from an instance without components)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx)


def _random_parts(
    seed: int,
    transformer_kwargs: dict[str, Any] | None,
    image_size: int,
    text_kwargs: dict[str, Any] | None,
    vae_kwargs: dict[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any], Any, Any]:
    """``(transformer config, VAE config, text encoder config, tokenizer)`` of a random
    checkpoint, the transformer's derived fields (``in_channels``, ``out_channels``,
    ``joint_attention_dim``) checked against the VAE and text encoder.

    Raises:
        ValueError: as :func:`make_random_checkpoint`.
    """
    from transformers import Qwen2_5_VLConfig

    vae_cfg = dict(TINY_VAE_CONFIG, **(vae_kwargs or {}))
    z_dim = int(vae_cfg["z_dim"])
    for key, value in (("latents_mean", 0.0), ("latents_std", 1.0)):
        if len(vae_cfg[key]) != z_dim:  # a z_dim override without its own statistics: neutral ones
            vae_cfg[key] = [value] * z_dim
    scale = 2 ** len(vae_cfg["temperal_downsample"])
    if image_size % (2 * scale) != 0:
        raise ValueError(f"image_size={image_size} must be a multiple of {2 * scale}")
    text_cfg = dict(TINY_TEXT_CONFIG, **(text_kwargs or {}))
    text_cfg["rope_parameters"] = dict(text_cfg["rope_parameters"])
    text_hidden = int(text_cfg["hidden_size"])
    derived = {"in_channels": 4 * z_dim, "out_channels": z_dim, "joint_attention_dim": text_hidden}
    tcfg = dict(TINY_TRANSFORMER_CONFIG)
    for key, value in (transformer_kwargs or {}).items():
        if key in derived and value != derived[key]:
            raise ValueError(
                f"transformer_kwargs[{key!r}]={value} does not fit this checkpoint (needs {derived[key]}: "
                f"VAE z_dim={z_dim}, text hidden={text_hidden})"
            )
        tcfg[key] = value
    tcfg.update(derived)
    if sum(tcfg["axes_dims_rope"]) != tcfg["attention_head_dim"]:
        raise ValueError(
            f"axes_dims_rope {tcfg['axes_dims_rope']} must sum to attention_head_dim={tcfg['attention_head_dim']}"
        )

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text_cfg.update(
        vocab_size=len(tokenizer),
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision_cfg = dict(TINY_VISION_CONFIG, out_hidden_size=text_hidden)
    te_config = Qwen2_5_VLConfig(
        text_config=text_cfg,
        vision_config=vision_cfg,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return tcfg, vae_cfg, te_config, tokenizer


def make_random_checkpoint(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    transformer_kwargs: dict[str, Any] | None = None,
    image_size: int = 32,
    dtype: torch.dtype = torch.float32,
    text_kwargs: dict[str, Any] | None = None,
    vae_kwargs: dict[str, Any] | None = None,
    max_shard_size: str | None = None,
) -> pathlib.Path:
    """Write a tiny random-weight Qwen-Image checkpoint of the real classes, in diffusers
    layout (``QwenImagePipeline(...).save_pretrained(path)``): ``transformer/``, ``vae/``,
    ``scheduler/``, ``text_encoder/``, ``tokenizer/``, ``model_index.json``.

    Components (configs in :data:`TINY_TRANSFORMER_CONFIG`, :data:`TINY_VAE_CONFIG`,
    :data:`TINY_TEXT_CONFIG`, :data:`TINY_VISION_CONFIG`, :data:`QWEN_IMAGE_SCHEDULER_CONFIG`):
    ``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage`` (z = 4, ×8),
    ``Qwen2_5_VLForConditionalGeneration`` (text hidden 32), ``FlowMatchEulerDiscreteScheduler``
    with Qwen-Image's scheduler config and the offline :func:`build_tokenizer`. The whole
    transformer is built in memory: for real sizes, :func:`make_streamed_checkpoint`.

    Args:
        path: output folder (created; existing files are overwritten).
        seed: torch seed for all weights; the caller's CPU RNG state is restored afterwards.
        transformer_kwargs: overrides of :data:`TINY_TRANSFORMER_CONFIG` (e.g. a real-width
            ``num_attention_heads=24, attention_head_dim=128, axes_dims_rope=(16, 56, 56)``).
            ``in_channels`` / ``out_channels`` / ``joint_attention_dim`` follow the VAE and
            text encoder and may only be given with those values.
        image_size: the image side the checkpoint is meant for; must be a multiple of 16
            (VAE ×8 and 2×2 packing). The saved files do not depend on it.
        dtype: dtype of the saved weights (all components).
        text_kwargs: overrides of :data:`TINY_TEXT_CONFIG` (:data:`QWEN_IMAGE_TEXT_WIDTH`: the
            real text width, so the transformer's ``txt_in`` has its real shape).
        vae_kwargs: overrides of :data:`TINY_VAE_CONFIG` (``z_dim=16``: the real latent
            channels; latent statistics default to mean 0, std 1 for another ``z_dim``).
        max_shard_size: cut each component's weights into safetensors files of at most this
            size (``"500MB"``; None: diffusers' default), as the real checkpoint is cut.

    Returns:
        ``pathlib.Path(path)``.

    Raises:
        ValueError: ``image_size`` not a multiple of 16, or ``transformer_kwargs`` setting a
            derived field to a value that would not fit the VAE / text encoder.
    """
    from diffusers import QwenImageTransformer2DModel

    tcfg, _, _, _ = _random_parts(seed, transformer_kwargs, image_size, text_kwargs, vae_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(**tcfg)
        pipe = _random_pipeline(
            seed, transformer, image_size, text_kwargs, vae_kwargs, transformer_kwargs, seeded=False
        )
    return _save_pipeline(pipe, path, dtype, max_shard_size)


def _random_pipeline(seed, transformer, image_size, text_kwargs, vae_kwargs, transformer_kwargs, *, seeded=True):
    """A ``QwenImagePipeline`` of random components around ``transformer`` (None: none)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLForConditionalGeneration

    _, vae_cfg, te_config, tokenizer = _random_parts(seed, transformer_kwargs, image_size, text_kwargs, vae_kwargs)
    with torch.random.fork_rng(devices=[]):
        if seeded:
            torch.manual_seed(seed)
        vae = AutoencoderKLQwenImage(**vae_cfg)
        text_encoder = Qwen2_5_VLForConditionalGeneration(te_config)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


def _save_pipeline(pipe, path, dtype: torch.dtype, max_shard_size: str | None = None) -> pathlib.Path:
    if dtype != torch.float32:
        for module in (pipe.transformer, pipe.vae, pipe.text_encoder):
            if module is not None:
                module.to(dtype)
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    pipe.save_pretrained(str(out), safe_serialization=True, **kwargs)
    return out


QWEN_IMAGE_TEXT_WIDTH: dict[str, Any] = {
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
}
"""``text_kwargs`` giving the random text encoder Qwen2.5-VL-7B's width (3584 = 28 heads × 128,
4 KV heads, M-RoPE sections (16, 24, 24)) on :data:`TINY_TEXT_CONFIG`'s 2 layers and small MLP:
the transformer's ``joint_attention_dim`` (its ``txt_in``) is then the real one, 3584."""


def write_random_transformer(
    folder: str | os.PathLike,
    config: dict[str, Any],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    max_shard_bytes: int = 5 << 30,
    progress=None,
):
    """Write a random ``QwenImageTransformer2DModel`` of ``config`` (its ``config.json`` included)
    to ``folder`` without ever holding it whole: its weights are made one block at a time on
    ``device`` (fast on a GPU; a 3072-wide block takes ~10 s on 2 CPU cores), cast to ``dtype``,
    copied to the host and streamed into sharded safetensors files
    (:func:`spotlight.models.random_weights.write_sharded_safetensors`). Group 0 is everything
    outside ``transformer_blocks`` (the model built with 0 layers: embedders, ``txt_in``,
    ``norm_out``, ``proj_out``), group i + 1 is block i, each built by its own class with its own
    seed. Loads with ``QwenImageTransformer2DModel.from_pretrained`` and the Train Workers'
    sharded load.

    Returns:
        the :class:`~spotlight.models.random_weights.StreamedWrite` (files, parameters, the host
        bytes it held at most).

    Raises:
        ValueError: a block class whose tensors differ from the model's (a diffusers change).
    """
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    from spotlight.models.random_weights import Group, write_sharded_safetensors

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    with init_empty_weights(include_buffers=False):
        meta = QwenImageTransformer2DModel.from_config(config)
    meta.save_config(str(folder))
    cast = lambda t: dtype if t.is_floating_point() else t.dtype  # noqa: E731
    specs = {name: (cast(t), tuple(t.shape)) for name, t in meta.state_dict().items()}
    blocks = "transformer_blocks."
    rest = tuple(n for n in specs if not n.startswith(blocks))
    block_cls = type(meta.transformer_blocks[0]) if len(meta.transformer_blocks) else None
    c = meta.config
    block_kwargs = dict(
        dim=int(c.num_attention_heads) * int(c.attention_head_dim),
        num_attention_heads=int(c.num_attention_heads),
        attention_head_dim=int(c.attention_head_dim),
        zero_cond_t=bool(getattr(c, "zero_cond_t", False)),
    )
    del meta

    def made(module: torch.nn.Module, prefix: str) -> tuple[dict[str, torch.Tensor], int]:
        sd = module.state_dict()
        on_host = sum(t.numel() * t.element_size() for t in sd.values()) if device.type == "cpu" else 0
        out = {prefix + k: v.detach().to("cpu", cast(v), copy=True) for k, v in sd.items()}
        return out, on_host

    def seeded(index: int):
        ctx = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        ctx.__enter__()
        torch.manual_seed(seed * 1_000_003 + index)
        return ctx

    def make_rest() -> tuple[dict[str, torch.Tensor], int]:
        ctx = seeded(0)
        try:
            with torch.device(device):
                module = QwenImageTransformer2DModel.from_config({**dict(config), "num_layers": 0})
            return made(module, "")
        finally:
            ctx.__exit__(None, None, None)

    def make_block(i: int) -> tuple[dict[str, torch.Tensor], int]:
        ctx = seeded(i + 1)
        try:
            with torch.device(device):
                module = block_cls(**block_kwargs)
            return made(module, f"{blocks}{i}.")
        finally:
            ctx.__exit__(None, None, None)

    groups = [Group("embedders and output layers", rest, make_rest)]
    for i in range(int(config.get("num_layers", 0))):
        names = tuple(n for n in specs if n.startswith(f"{blocks}{i}."))
        groups.append(Group(f"block {i}", names, lambda i=i: make_block(i)))
    return write_sharded_safetensors(folder, specs, groups, max_shard_bytes=max_shard_bytes, progress=progress)


def make_streamed_checkpoint(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    transformer_kwargs: dict[str, Any] | None = None,
    image_size: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    text_kwargs: dict[str, Any] | None = None,
    vae_kwargs: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
    max_shard_bytes: int = 5 << 30,
    progress=None,
):
    """:func:`make_random_checkpoint`'s layout and components, with the transformer written by
    :func:`write_random_transformer` (one block at a time, sharded files with diffusers'
    index): a random checkpoint of any size, e.g. Qwen-Image's real 20 B architecture
    (:data:`spotlight.models.param_count.PRESETS` ``"qwen-image-20b"`` with
    :data:`QWEN_IMAGE_TEXT_WIDTH` and ``vae_kwargs={"z_dim": 16}``), 41 GB in bf16, with about
    one block (0.7 GB) in host memory at a time.

    Returns:
        the transformer's :class:`~spotlight.models.random_weights.StreamedWrite`.

    Raises:
        ValueError: as :func:`make_random_checkpoint`.
    """
    tcfg, _, _, _ = _random_parts(seed, transformer_kwargs, image_size, text_kwargs, vae_kwargs)
    out = pathlib.Path(path)
    pipe = _random_pipeline(seed, None, image_size, text_kwargs, vae_kwargs, transformer_kwargs)
    quiet = logging.getLogger("diffusers.pipelines.pipeline_utils")  # "transformer=None cannot be saved": it is next
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        _save_pipeline(pipe, out, dtype)
    finally:
        quiet.setLevel(level)
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text())
    index["transformer"] = ["diffusers", "QwenImageTransformer2DModel"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return write_random_transformer(
        out / "transformer",
        tcfg,
        seed=seed,
        dtype=dtype,
        device=device,
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )


__all__ = [
    "FAMILY",
    "QWEN_IMAGE_TEXT_WIDTH",
    "QwenImageFamily",
    "build_tokenizer",
    "make_random_checkpoint",
    "make_streamed_checkpoint",
    "write_random_transformer",
]
