"""Stable Diffusion 3 / 3.5: ``SD3Transformer2DModel`` + ``AutoencoderKL``, prompts through
CLIP-L, CLIP-G and T5-XXL (diffusers ``StableDiffusion3Pipeline``).

Everything follows diffusers 0.42 ``pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py``
and Flow-GRPO's ``scripts/train_sd3.py``:

* latents are unpacked ``[B, C, h, w]`` (C = the VAE's ``latent_channels``, 16 for SD3,
  ``h = image_size / vae_scale_factor``);
* the sigma schedule is the checkpoint's ``FlowMatchEulerDiscreteScheduler``
  (``set_timesteps``; static shift 3.0 for SD3.5, dynamic shift with the pipeline's ``mu``
  when the scheduler config asks for it);
* prompts: ``encode_prompt`` of the pipeline, ``T = 77`` CLIP tokens (CLIP-L ‖ CLIP-G widths,
  zero-padded to the T5 width) followed by ``max_sequence_length`` T5 tokens; no text mask;
  pooled projections ``[N, P]`` (CLIP-L ‖ CLIP-G text projections);
* the transformer takes the raw scheduler timestep ``t = 1000·σ``;
* true classifier-free guidance with the negative prompt ("" by default, scale 4.5): one
  forward on ``[negative; positive]``, ``v = v_u + w·(v_c − v_u)`` with the unconditional
  half detached (gradients only flow through the conditional branch, as in Flow-GRPO's
  SD3 trainer);
* decoding: ``latents / scaling_factor + shift_factor`` through the VAE.

It also holds :class:`VaeLatentFamily`, the parts shared with the FLUX family (loading,
VAE decoding, the text-only pipeline), and the tiny random-weight component builders used by
``make_random_checkpoint`` here and in ``flux.py``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Any, Callable, Iterator

import torch

from spotlight.models.families.base import ModelFamily, ModelLoadError, read_json, torch_dtype
from spotlight.rl.sampler import Conditioning, make_sigmas

ENCODE_CHUNK = 32
"""Prompts are encoded this many at a time (bounds text-encoder activation memory)."""


# ---------------------------------------------------------------------------- shared base
class VaeLatentFamily(ModelFamily):
    """Common code of the diffusers families that denoise ``AutoencoderKL`` latents (SD3, FLUX).

    Subclasses set the class attributes of :class:`ModelFamily` and implement
    ``latent_shape``, ``sigmas``, ``encode_prompts``, ``velocity`` and ``decode`` (usually via
    :meth:`_decode_unpacked`).
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self._vae = None
        self._text_pipe = None
        self._text_pipe_key: tuple | None = None

    # ------------------------------------------------------------------ configs
    def component_config(self, name: str) -> dict:
        """``<pretrained_path>/<name>/config.json`` (``scheduler_config.json`` for the scheduler).

        Raises:
            ModelLoadError: the folder or its config file is missing or unreadable.
        """
        d = self.component_dir(name)
        fname = "scheduler_config.json" if name == "scheduler" else "config.json"
        if not (d / fname).is_file():
            raise ModelLoadError(f"{d}: no {fname}; not a diffusers component folder")
        return read_json(d / fname)

    @property
    def vae_scale_factor(self) -> int:
        """Pixel → latent downsampling: ``2 ** (len(vae.block_out_channels) - 1)`` (8 for SD3/FLUX),
        as the pipelines compute it."""
        return 2 ** (len(self.component_config("vae")["block_out_channels"]) - 1)

    @property
    def latent_channels(self) -> int:
        """Channels of one VAE latent pixel (``vae/config.json`` ``latent_channels``; 16 for SD3/FLUX)."""
        return int(self.component_config("vae")["latent_channels"])

    # ------------------------------------------------------------------ transformer
    def build_transformer(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """``<transformer_class>.from_pretrained(path, subfolder="transformer", dtype=dtype, local_files_only=True)``,
        eval mode, on the CPU.

        Raises:
            ModelLoadError: no ``transformer/`` folder, a transformer of another class, or
                diffusers cannot load it.
        """
        cfg = self.component_config("transformer")
        found = cfg.get("_class_name")
        if found is not None and found != self.transformer_class:
            raise ModelLoadError(
                f"{self.path}/transformer holds a {found}, not a {self.transformer_class} ({self.name} family)"
            )
        try:
            model = self.transformer_cls().from_pretrained(
                os.fspath(self.path), subfolder="transformer", dtype=dtype, local_files_only=True
            )
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelLoadError(
                f"cannot load the {self.name} transformer from {self.path}/transformer: {exc}"
            ) from exc
        return model.eval()

    # ------------------------------------------------------------------ text pipeline
    def _pipeline_cls(self):
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def text_pipeline(self, device: torch.device | str = "cpu"):
        """The family's diffusers pipeline with its text encoders and tokenizers only
        (``from_pretrained(path, transformer=None, vae=None)``), in ``model.dtype``, on
        ``device``; loaded once and kept.

        Raises:
            ModelLoadError: the checkpoint's text components cannot be loaded.
        """
        device = torch.device(device)
        dtype = torch_dtype(self.cfg.dtype, device)
        key = (str(device), dtype)
        if self._text_pipe is None or self._text_pipe_key != key:
            self._text_pipe = None
            if not (self.path / "model_index.json").is_file():
                raise ModelLoadError(
                    f"{self.path}: no model_index.json; a {self.name} checkpoint in diffusers layout is expected"
                )
            for name in self.components():
                if name.startswith(("text_encoder", "tokenizer")):
                    self.component_dir(name)
            try:
                pipe = self._pipeline_cls().from_pretrained(
                    os.fspath(self.path), transformer=None, vae=None, dtype=dtype, local_files_only=True
                )
            except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
                raise ModelLoadError(f"cannot load the {self.name} text encoders from {self.path}: {exc}") from exc
            pipe.set_progress_bar_config(disable=True)
            self._text_pipe = pipe.to(device)
            self._text_pipe_key = key
        return self._text_pipe

    # ------------------------------------------------------------------ VAE
    def load_decoder(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        """Load ``AutoencoderKL`` from ``vae/`` (frozen, eval) once, on ``device`` in ``dtype``.

        Raises:
            ModelLoadError: no ``vae/`` folder or diffusers cannot load it.
        """
        if self._vae is not None:
            return
        from diffusers import AutoencoderKL

        self.component_dir("vae")
        try:
            vae = AutoencoderKL.from_pretrained(
                os.fspath(self.path), subfolder="vae", dtype=dtype, local_files_only=True
            )
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the VAE from {self.path}/vae: {exc}") from exc
        vae.requires_grad_(False)
        self._vae = vae.to(device).eval()

    @torch.no_grad()
    def _decode_unpacked(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` latents (model space) → ``[B, 3, H, W] uint8`` on the CPU.

        Undoes the pipelines' latent normalisation (``latents / scaling_factor +
        shift_factor``), decodes with the VAE (loaded on the CPU in float32 if
        :meth:`load_decoder` was not called) and maps [-1, 1] to 0…255 like
        ``VaeImageProcessor.postprocess`` (``round((x / 2 + 0.5).clamp(0, 1) * 255)``).
        """
        if self._vae is None:
            self.load_decoder()
        vae = self._vae
        p = next(vae.parameters())
        z = latents.to(device=p.device, dtype=torch.float32) / vae.config.scaling_factor
        if vae.config.shift_factor is not None:
            z = z + vae.config.shift_factor
        img = vae.decode(z.to(p.dtype), return_dict=False)[0]
        img = (img.float() / 2 + 0.5).clamp(0, 1)
        return (img * 255).round().to(torch.uint8).cpu()


def chunked(items: list[str], size: int) -> Iterator[list[str]]:
    """Consecutive slices of ``items`` of at most ``size`` elements."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def batch_sigmas(sigma: torch.Tensor, batch: int) -> torch.Tensor:
    """``sigma`` (scalar, ``[1]`` or ``[B]``) → ``[B] float32`` on its device."""
    s = sigma.reshape(-1).float()
    return s.expand(batch) if s.numel() == 1 else s


# ---------------------------------------------------------------------------- tiny builders
@contextlib.contextmanager
def scoped_seed(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for the block, restoring the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_vae(latent_channels: int, *, scaling_factor: float, shift_factor: float, blocks: int = 4, width: int = 8):
    """A tiny random ``AutoencoderKL`` with ``2 ** (blocks - 1)`` downsampling (8 with 4 blocks),
    ``width`` channels per block, 4 GroupNorm groups and no quant convs (as the SD3/FLUX VAEs)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=(width,) * blocks,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def tiny_clip_text(
    hidden: int, *, with_projection: bool, projection_dim: int | None = None, hidden_act: str = "quick_gelu"
):
    """A tiny random CLIP text tower over :mod:`spotlight.models.offline_tokenizers`' vocabulary:
    2 layers, 2 heads, ``hidden`` width, 77 positions, ``projection_dim`` (default ``hidden``).

    Returns ``CLIPTextModelWithProjection`` (SD3: ``text_embeds`` are the pooled projections)
    or ``CLIPTextModel`` (FLUX: ``pooler_output``)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from spotlight.models import offline_tokenizers as ot

    vocab, _ = ot.clip_vocab()
    config = CLIPTextConfig(
        vocab_size=ot.CLIP_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=projection_dim or hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=ot.CLIP_MAX_LENGTH,
        hidden_act=hidden_act,
        bos_token_id=vocab[ot.CLIP_BOS],
        eos_token_id=vocab[ot.CLIP_EOS],
        pad_token_id=vocab[ot.CLIP_EOS],
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config).eval()


def tiny_t5_encoder(d_model: int):
    """A tiny random ``T5EncoderModel`` (T5 v1.1 style: gated-GELU FFN) of width ``d_model``,
    2 layers, 2 heads, vocabulary :data:`~spotlight.models.offline_tokenizers.T5_VOCAB_SIZE`."""
    from transformers import T5Config, T5EncoderModel

    from spotlight.models import offline_tokenizers as ot

    if d_model % 2:
        raise ValueError(f"T5 width {d_model} must be even (2 heads)")
    config = T5Config(
        vocab_size=ot.T5_VOCAB_SIZE,
        d_model=d_model,
        d_kv=d_model // 2,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config).eval()


def tiny_tokenizers(clip_count: int) -> dict[str, Any]:
    """``clip_count`` CLIP tokenizers and one T5 tokenizer (offline), keyed as the pipelines name
    them: SD3 ``tokenizer``, ``tokenizer_2`` (CLIP) and ``tokenizer_3`` (T5); FLUX
    ``tokenizer`` (CLIP) and ``tokenizer_2`` (T5)."""
    from spotlight.models import offline_tokenizers as ot

    out: dict[str, Any] = {}
    for i in range(clip_count):
        out["tokenizer" if i == 0 else f"tokenizer_{i + 1}"] = ot.build_clip_tokenizer()
    out[f"tokenizer_{clip_count + 1}"] = ot.build_t5_tokenizer()
    return out


# ---------------------------------------------------------------------------- SD3
class SD3Family(VaeLatentFamily):
    """Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``) for Flow-GRPO.

    Latents ``[B, C, h, w]`` float32 (C = VAE ``latent_channels``, ``h = w =
    image_size / vae_scale_factor``). Conditioning: ``embeds [N, 77 + max_text_tokens, D]``
    (D = T5 width, 4096 for SD3), ``mask`` all ones (SD3 attends to every token, padding
    included), ``extra["pooled"] [N, P]`` (P = 2048), and with CFG (``guidance_scale > 1``)
    ``extra["neg.embeds"]``, ``extra["neg.pooled"]`` for the negative prompt, one shared row.
    """

    prompt_tokenizer_dir = "tokenizer_3"  # T5: max_sequence_length = model.max_text_tokens

    name = "sd3"
    transformer_class = "SD3Transformer2DModel"
    pipeline_class = "StableDiffusion3Pipeline"
    block_names = ("transformer_blocks",)
    # Flow-GRPO scripts/train_sd3.py: LoRA on the joint attention projections.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    default_guidance_scale = 4.5
    default_negative_prompt = ""

    def components(self) -> tuple[str, ...]:
        return (
            "transformer",
            "vae",
            "scheduler",
            "text_encoder",
            "tokenizer",
            "text_encoder_2",
            "tokenizer_2",
            "text_encoder_3",
            "tokenizer_3",
        )

    # ------------------------------------------------------------------ latents
    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, h, w)`` = ``(latent_channels, image_size / vsf, image_size / vsf)``."""
        side = self.cfg.image_size // self.vae_scale_factor
        return (self.latent_channels, side, side)

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """``[T + 1] float32`` from 1 to 0, as ``StableDiffusion3Pipeline.__call__`` sets them:
        ``FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")`` and
        ``set_timesteps(T)`` (the config's static ``shift``: 3.0 for SD3.5), with
        ``mu = calculate_shift((h/p)·(w/p), base_image_seq_len, max_image_seq_len,
        base_shift, max_shift)`` (the pipeline's defaults 256, 4096, 0.5, 1.16) when the
        config sets ``use_dynamic_shifting``. ``shift`` (``sampler.shift``) is only used for a
        checkpoint without a ``scheduler/`` folder.

        Raises:
            ValueError: ``num_steps < 1``.
            ModelLoadError: the scheduler config cannot be read.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if not (self.path / "scheduler").is_dir():
            return make_sigmas(num_steps, shift)
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        sched_cfg = self.component_config("scheduler")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(sched_cfg)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            patch = int(self.component_config("transformer").get("patch_size", 2))
            side = self.cfg.image_size // self.vae_scale_factor
            kwargs["mu"] = calculate_shift(
                (side // patch) * (side // patch),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.to(torch.float32).clone()

    # ------------------------------------------------------------------ text
    def _encode(self, pipe, prompts: list[str], device, progress=None) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, done = [], [], 0
        for chunk in chunked(prompts, ENCODE_CHUNK):
            pe, _, pp, _ = pipe.encode_prompt(
                prompt=chunk,
                prompt_2=None,
                prompt_3=None,
                device=device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=False,
                max_sequence_length=self.cfg.max_text_tokens,
            )
            embeds.append(pe.float().cpu())
            pooled.append(pp.float().cpu())
            done += len(chunk)
            if progress is not None:
                progress(done)
        return torch.cat(embeds), torch.cat(pooled)

    @torch.no_grad()
    def encode_prompts(
        self, prompts: list[str], device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None
    ) -> Conditioning:
        """Encode with ``StableDiffusion3Pipeline.encode_prompt`` (CLIP-L, CLIP-G, T5; the same
        prompt for all three; ``max_sequence_length = model.max_text_tokens``), on ``device`` in
        ``model.dtype``; ``progress(n)`` after each chunk. T5 runs without an attention mask
        over the padding to ``max_text_tokens`` (as the pipeline runs it): an encoding cannot
        be cut to another length, so the prompt cache is per ``max_text_tokens``.

        The negative prompt (CFG only) is encoded once by the same call and repeated per
        row; this equals what ``encode_prompt(..., do_classifier_free_guidance=True,
        negative_prompt=...)`` returns for every row.

        Returns:
            :class:`Conditioning` on the CPU: ``embeds [N, 77 + max_text_tokens, D] float32``,
            ``mask [N, T] int64`` all ones, ``extra["pooled"] [N, P] float32``; with
            ``guidance_scale > 1`` also ``extra["neg.embeds"] [1, T, D]`` and
            ``extra["neg.pooled"] [1, P]`` (shared by every row; ``Conditioning.index`` expands).

        Raises:
            ValueError: ``prompts`` is empty.
            ModelLoadError: the text encoders cannot be loaded.
        """
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        device = torch.device(device)
        pipe = self.text_pipeline(device)
        embeds, pooled = self._encode(pipe, prompts, device, progress)
        mask = torch.ones(embeds.shape[:2], dtype=torch.int64)
        extra = {"pooled": pooled}
        if self.guidance_scale > 1:
            neg_embeds, neg_pooled = self._encode(pipe, [self.negative_prompt], device)
            # one shared row (Conditioning.index expands it): not one copy per prompt
            extra["neg.embeds"] = neg_embeds[:1].clone()
            extra["neg.pooled"] = neg_pooled[:1].clone()
        return Conditioning(embeds, mask, extra)

    # ------------------------------------------------------------------ velocity
    def velocity(self, transformer, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``v [B, C, h, w] float32`` at ``sigma [B]``.

        The transformer gets the raw scheduler timestep ``1000·σ`` (float32, as the pipeline
        passes ``scheduler.timesteps``), ``hidden_states [B, C, h, w]``,
        ``encoder_hidden_states`` and ``pooled_projections`` in its own dtype. With
        ``guidance_scale = w > 1`` the negative and positive rows run in one forward
        (``[neg; pos]``) and ``v = v_u + w·(v_c − v_u)`` is formed in float32 with ``v_u``
        detached: gradients reach the parameters only through the conditional branch
        (Flow-GRPO SD3 trainer; no effect under ``torch.no_grad``).

        Raises:
            ValueError: CFG is on but ``cond`` has no ``neg.embeds`` / ``neg.pooled``
                (prompts encoded with ``guidance_scale <= 1``).
        """
        dtype = next(transformer.parameters()).dtype
        b = latents.shape[0]
        x = latents.to(dtype)
        t = batch_sigmas(sigma, b) * 1000.0
        embeds = cond.embeds.to(dtype)
        pooled = cond.extra["pooled"].to(dtype)
        w = self.guidance_scale
        if w <= 1:
            out = transformer(
                hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False
            )[0]
            return out.float()
        if "neg.embeds" not in cond.extra or "neg.pooled" not in cond.extra:
            raise ValueError(
                f"sd3 CFG (guidance_scale={w}) needs the negative prompt's 'neg.embeds' and 'neg.pooled' in the "
                "conditioning; encode the prompts with the same guidance_scale"
            )
        out = transformer(
            hidden_states=torch.cat([x, x]),
            timestep=torch.cat([t, t]),
            encoder_hidden_states=torch.cat([cond.rows("neg.embeds", x.shape[0]).to(dtype), embeds]),
            pooled_projections=torch.cat([cond.rows("neg.pooled", x.shape[0]).to(dtype), pooled]),
            return_dict=False,
        )[0]
        v_u, v_c = out.float().chunk(2)
        v_u = v_u.detach()
        return v_u + w * (v_c - v_u)

    # ------------------------------------------------------------------ images
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` → ``[B, 3, H, W] uint8`` on the CPU (``latents / scaling_factor +
        shift_factor``, ``vae.decode``, [-1, 1] → 0…255; SD3.5: 1.5305 / 0.0609)."""
        return self._decode_unpacked(latents)

    # ------------------------------------------------------------------ tiny checkpoints
    @staticmethod
    def make_random_checkpoint(
        path: str | os.PathLike,
        *,
        seed: int = 0,
        transformer_kwargs: dict | None = None,
        image_size: int = 32,
    ) -> pathlib.Path:
        """Write a tiny random-weight SD3.5-style checkpoint in diffusers layout (the real
        classes, saved by ``StableDiffusion3Pipeline(...).save_pretrained(path)``), loadable
        offline by ``StableDiffusion3Pipeline.from_pretrained(path)`` and by this family.

        Default components (``transformer_kwargs`` overrides the transformer's; the text
        encoders and VAE follow its ``joint_attention_dim``, ``pooled_projection_dim`` and
        ``in_channels``):

        * ``SD3Transformer2DModel``: sample_size ``image_size // 8``, patch 2, 16 in/out
          channels, 2 layers, 2 heads × 16, ``caption_projection_dim`` 32 (= heads × dim),
          ``joint_attention_dim`` 64, ``pooled_projection_dim`` 48, ``pos_embed_max_size``
          16, ``qk_norm="rms_norm"``, ``dual_attention_layers=(0,)`` (SD3.5);
        * ``AutoencoderKL``: 4 blocks of 8 channels (×8 downsampling), 16 latent channels,
          scaling 1.5305, shift 0.0609;
        * CLIP-L: ``CLIPTextModelWithProjection`` width 16 (projection 16), CLIP-G: width
          32 (projection 32) — their hidden states (16 + 32 = 48) are zero-padded to the
          T5 width 64 by ``encode_prompt``; pooled = 16 + 32 = 48;
        * ``T5EncoderModel`` width 64; tokenizers from :mod:`spotlight.models.offline_tokenizers`;
        * ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.

        Weights are drawn from ``seed`` in a scoped torch RNG (the caller's RNG state is
        restored).

        Returns:
            ``path`` as a :class:`pathlib.Path`.

        Raises:
            ValueError: ``pooled_projection_dim`` cannot be split into two even CLIP widths
                whose sum fits the T5 width (``joint_attention_dim``).
        """
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

        tk: dict[str, Any] = dict(
            sample_size=image_size // 8,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=64,
            pooled_projection_dim=48,
            pos_embed_max_size=16,
            qk_norm="rms_norm",
            dual_attention_layers=(0,),
        )
        tk.update(transformer_kwargs or {})
        tk.setdefault("caption_projection_dim", tk["num_attention_heads"] * tk["attention_head_dim"])
        pooled_dim, t5_dim = int(tk["pooled_projection_dim"]), int(tk["joint_attention_dim"])
        clip_l = (pooled_dim // 3) // 2 * 2
        clip_g = pooled_dim - clip_l
        if clip_l < 2 or clip_g % 2 or clip_l + clip_g > t5_dim:
            raise ValueError(
                f"pooled_projection_dim={pooled_dim} must split into two even CLIP widths whose sum fits "
                f"joint_attention_dim={t5_dim}"
            )
        path = pathlib.Path(path)
        with scoped_seed(seed):
            transformer = SD3Transformer2DModel(**tk)
            vae = tiny_vae(int(tk["in_channels"]), scaling_factor=1.5305, shift_factor=0.0609)
            text_encoder = tiny_clip_text(clip_l, with_projection=True, hidden_act="quick_gelu")
            text_encoder_2 = tiny_clip_text(clip_g, with_projection=True, hidden_act="gelu")
            text_encoder_3 = tiny_t5_encoder(t5_dim)
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            text_encoder_3=text_encoder_3,
            **tiny_tokenizers(2),
        )
        pipe.save_pretrained(os.fspath(path))
        return path


FAMILY = SD3Family


make_random_checkpoint = SD3Family.make_random_checkpoint
"""Module-level alias: every family module exposes
``make_random_checkpoint(path, *, seed, transformer_kwargs, image_size)``."""
