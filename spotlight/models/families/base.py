"""The one small interface every model family implements (docs/architecture.md §7).

A *family* knows how to load one kind of diffusers checkpoint and drive it for
Flow-GRPO: which transformer class it is, how prompts are encoded (its own text
encoder(s) and template), what shape the sampler denoises, the scheduler's sigma
schedule, the velocity call with classifier-free guidance, and how latents become images
for the reward. Everything else — sampler, workers, trainer, coordinator — only talks to
this interface.

Who calls what (and so which components each process loads):

* the **coordinator** calls :meth:`ModelFamily.encode_prompts` once per prompt set (text
  encoders load there only, and the result is cached on disk);
* **Rollout Workers** call :meth:`build_transformer`, :meth:`velocity` and
  :meth:`decode` (transformer + VAE);
* **Train Workers** call :meth:`build_transformer` and :meth:`velocity` (transformer only;
  the VAE and text encoders are frozen and never wrapped for training).

Shapes: latents are ``[B, *latent_shape]`` float32 in the sampler (packed tokens
``[B, L, C]`` for Qwen-Image, FLUX and the tiny model, ``[B, C, h, w]`` for SD3); images are
``[B, 3, H, W]`` uint8. Conditioning tensors are batch-first and padded to a fixed text
length so rows from different prompts batch together.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import os
import pathlib
from typing import Callable, ClassVar

import torch

from spotlight.config import ModelConfig
from spotlight.errors import SpotlightError
from spotlight.rl.sampler import Conditioning

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"

LORA_LAYER_TYPES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
"""The layer types a ``train.lora_target_modules`` name may match: those peft's LoRA wraps (it
refuses any other module a name matches, such as a norm or a whole block, when it injects)."""
"""The adapter file :meth:`ModelFamily.save_lora` writes (diffusers' name)."""


class ModelLoadError(SpotlightError):
    """A checkpoint directory is missing, incomplete or of another family."""


def torch_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """``model.dtype`` → torch dtype: ``auto`` is bfloat16 on CUDA and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class ModelFamily(abc.ABC):
    """A DiT family: loading, prompt encoding, latent layout, CFG velocity, decoding.

    Args:
        cfg: the run's ``[model]`` section (``family``, ``pretrained_path``, ``image_size``,
            ``guidance_scale``, ``negative_prompt``, ``max_text_tokens``, ``dtype``).

    Class attributes:
        name: the ``model.family`` value.
        transformer_class: diffusers class name of the transformer.
        pipeline_class: diffusers pipeline whose helpers (prompt encoding, packing,
            ``save_lora_weights``) the family uses.
        block_names: ``ModuleList`` attributes of the transformer that FSDP2 shards one
            block at a time (then the root).
        default_lora_targets: module names LoRA adapts by default (Flow-GRPO's choice).
        default_guidance_scale: used when ``model.guidance_scale == 0``.
        default_negative_prompt: used when ``model.negative_prompt == ""`` and CFG is on.
    """

    name: ClassVar[str]
    transformer_class: ClassVar[str]
    pipeline_class: ClassVar[str]
    block_names: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    default_lora_targets: ClassVar[tuple[str, ...]] = ()
    default_guidance_scale: ClassVar[float] = 1.0
    default_negative_prompt: ClassVar[str] = ""
    activation_checkpointing: ClassVar[bool] = True
    """Default of ``train.activation_checkpointing`` (None) for this family."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    # ------------------------------------------------------------------ settings
    @property
    def guidance_scale(self) -> float:
        """CFG scale w (true CFG) or the FLUX guidance-embedding value."""
        return self.cfg.guidance_scale if self.cfg.guidance_scale > 0 else self.default_guidance_scale

    @property
    def negative_prompt(self) -> str:
        return self.cfg.negative_prompt or self.default_negative_prompt

    @property
    def path(self) -> pathlib.Path:
        """The diffusers-format checkpoint directory (``model.pretrained_path``)."""
        return self.cfg.pretrained_dir

    def component_dir(self, name: str) -> pathlib.Path:
        """``<pretrained_path>/<name>``.

        Raises:
            ModelLoadError: the folder does not exist (message names what a diffusers
                checkpoint of this family must hold).
        """
        d = self.path / name
        if not self.path.is_dir():
            raise ModelLoadError(f"checkpoint directory not found: {self.path} (model.pretrained_path)")
        if not d.is_dir():
            raise ModelLoadError(
                f"{self.path}: no '{name}/' folder; a {self.name} checkpoint in diffusers layout "
                f"(model_index.json + {', '.join(self.components())}) is expected"
            )
        return d

    def components(self) -> tuple[str, ...]:
        """Sub-folders a checkpoint of this family holds (for error messages and checks)."""
        return ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")

    def check(self) -> None:
        """Cheap up-front check that the checkpoint has every component folder (no weights load).

        Raises:
            ModelLoadError: a folder is missing (the message names it and the expected layout).
        """
        self.check_pipeline()
        for name in self.components():
            d = self.component_dir(name)
            if not any(d.glob("*config*.json")):
                raise ModelLoadError(f"{d}: no config file; the '{name}/' folder of the checkpoint is incomplete")
        weights = [
            f
            for f in self.component_dir("transformer").iterdir()
            if f.suffix in (".safetensors", ".bin") or f.name.endswith(".index.json")
        ]
        if not weights:
            raise ModelLoadError(
                f"{self.path / 'transformer'}: no weight files (*.safetensors); the checkpoint is incomplete"
            )

    def check_pipeline(self) -> None:
        """The checkpoint folder exists and, where it has a ``model_index.json``, holds this
        family's pipeline (reads that one file: what a command that needs only the config files,
        such as ``spotlight plan``, checks before it trusts them).

        Raises:
            ModelLoadError: no such folder, or another family's checkpoint.
        """
        if not self.path.is_dir():
            raise ModelLoadError(f"checkpoint directory not found: {self.path} (model.pretrained_path)")
        index = self.path / "model_index.json"
        if index.is_file():
            pipeline = str(read_json(index).get("_class_name", ""))
            if pipeline and not pipeline.startswith(self.pipeline_class.removesuffix("Pipeline")):
                raise ModelLoadError(
                    f"{self.path} is a {pipeline} checkpoint (model_index.json), "
                    f"not {self.name} ({self.pipeline_class}); check model.family"
                )

    def check_lora_targets(self, targets: list[str]) -> None:
        """Every LoRA target module name matches a module of the transformer (checked on the
        ``meta`` device from its config: no weights load).

        Raises:
            ModelLoadError: a name matches no module (the message lists them), or matches one
                that LoRA cannot wrap (:data:`LORA_LAYER_TYPES`: a norm, a block, the model).
        """
        import diffusers

        config_path = self.component_dir("transformer") / "config.json" if self.cfg.pretrained_path else None
        cls = getattr(diffusers, self.transformer_class)
        with torch.device("meta"):
            model = cls.from_config(read_json(config_path)) if config_path else self.build_transformer()
        modules = [(n, m) for n, m in model.named_modules() if n]  # "" is the model itself

        matched = {t: [(n, m) for n, m in modules if t and (n == t or n.endswith("." + t))] for t in targets}
        examples = ", ".join(self.default_lora_targets[:4])
        unknown = [t for t in targets if not matched[t]]
        if unknown:
            raise ModelLoadError(
                f"train.lora_target_modules: {unknown} match no module of {self.transformer_class} (e.g. {examples})"
            )
        # peft wraps only these layer types and refuses any other module a name matches
        for t in targets:
            other = [(n, m) for n, m in matched[t] if not isinstance(m, LORA_LAYER_TYPES)]
            if other:
                n, m = other[0]
                raise ModelLoadError(
                    f"train.lora_target_modules: {t!r} matches {n} ({type(m).__name__}), which LoRA cannot "
                    f"wrap: name Linear layers (e.g. {examples})"
                )

    def identity(self) -> str:
        """Stable text naming the checkpoint and prompt settings (prompt-cache key).

        ``model.max_text_tokens`` is part of it only for a bidirectional text encoder: a causal
        one's cache holds uncut encodings that any ``max_text_tokens`` cuts on load
        (:attr:`text_encoding_is_causal`, :mod:`spotlight.models.text_cache`)."""
        parts = [
            self.name,
            str(self.path.resolve()) if self.cfg.pretrained_path else "",
            "uncut" if self.text_encoding_is_causal else str(self.cfg.max_text_tokens),
            self.negative_prompt,
            str(self.guidance_scale > 1),
        ]
        idx = self.path / "model_index.json"
        if idx.is_file():
            parts.append(idx.read_text())
        return "|".join(parts)

    # ------------------------------------------------------------------ transformer
    @abc.abstractmethod
    def build_transformer(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """Load (or, for the tiny family, build) the transformer, in ``dtype``, eval mode, CPU.

        Raises:
            ModelLoadError: the checkpoint cannot be loaded.
        """

    def transformer_cls(self):
        import diffusers

        return getattr(diffusers, self.transformer_class)

    def transformer_config(self) -> dict:
        """The transformer's diffusers config (``transformer/config.json``; no weights load).

        Raises:
            ModelLoadError: no ``transformer/`` folder, an unreadable config, or a transformer of
                another class.
        """
        d = self.component_dir("transformer")
        config = read_json(d / "config.json")
        found = config.get("_class_name")
        if found is not None and found != self.transformer_class:
            raise ModelLoadError(f"{d} holds a {found}, not a {self.transformer_class} ({self.name} family)")
        return config

    def transformer_weight_files(self) -> list[pathlib.Path]:
        """The transformer's ``*.safetensors`` files (every shard of a sharded checkpoint), or
        ``[]`` when it has none (a model built from config, or ``.bin`` weights: then only
        :meth:`build_transformer` can load it)."""
        return sorted(self.component_dir("transformer").glob("*.safetensors"))

    def build_empty_transformer(self) -> torch.nn.Module:
        """The transformer from its config with every parameter on the ``meta`` device (no
        memory, no init), eval mode: what a Train Worker shards before it loads its shards.

        Buffers and the plain tensors a module computes in ``__init__`` (diffusers keeps
        Qwen-Image's RoPE tables that way, not as buffers, so no checkpoint holds them) stay
        real, on the CPU: accelerate's ``init_empty_weights(include_buffers=False)``, the
        context diffusers' own ``low_cpu_mem_usage`` loading uses. Under a bare
        ``torch.device("meta")`` those tables would be meta too and nothing could fill them.

        Raises:
            ModelLoadError: as :meth:`transformer_config`.
        """
        from accelerate import init_empty_weights

        config = self.transformer_config()
        with init_empty_weights(include_buffers=False):
            model = self.transformer_cls().from_config(config)
        return model.eval()

    # ------------------------------------------------------------------ latents
    @property
    @abc.abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample shape the sampler denoises (packed tokens, or ``(C, h, w)``)."""

    @abc.abstractmethod
    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """``[T + 1] float32`` sigma schedule from 1 to 0, as the family's pipeline sets it
        (its scheduler config; dynamic shifting from the image sequence length where the
        pipeline uses it). ``shift`` is ``sampler.shift`` (used where the family's
        scheduler has a static shift and no config of its own)."""

    # ------------------------------------------------------------------ text
    text_encoding_is_causal: ClassVar[bool] = False
    """Whether the text encoder is causal (a token's embedding depends only on the tokens
    before it), so the encoding cut to ``T`` tokens is the first ``T`` rows of the uncut one.
    Such a family implements :meth:`encode_prompts_packed` and its prompt cache serves every
    ``model.max_text_tokens`` (:mod:`spotlight.models.text_cache`). False for T5, CLIP and
    BERT-like encoders, which see the padding up to ``T``."""

    @abc.abstractmethod
    def encode_prompts(
        self, prompts: list[str], device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None
    ) -> Conditioning:
        """Encode every prompt with the family's text encoder(s) and template, on ``device``
        in ``model.dtype`` (bf16 on CUDA with ``auto``); ``progress(n)`` is called with the
        number of prompts encoded so far after each batch.

        Returns:
            :class:`Conditioning` with ``embeds [N, T, D] float32``, ``mask [N, T] int64``
            (T = ``model.max_text_tokens``, zero-padded) and family extras (pooled
            projections, the negative prompt's tensors ``neg.*`` as one shared row when CFG
            is on).
        """

    def encode_prompts_packed(
        self, prompts: list[str], device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """A causal family's uncut encodings in the packed layout of
        :mod:`spotlight.models.text_cache` (what its prompt cache stores).

        Raises:
            NotImplementedError: the family's text encoder is not causal.
        """
        raise NotImplementedError(f"{self.name}: its text encoder is not causal; encodings cannot be cut")

    def text_encoder_bytes(self) -> int:
        """Bytes of the checkpoint's text encoder weights (``text_encoder*/`` files; 0 when the
        family has none on disk): what encoding on a GPU must find free there."""
        if not self.cfg.pretrained_path:
            return 0
        try:
            dirs = [d for d in self.path.iterdir() if d.is_dir() and d.name.startswith("text_encoder")]
        except OSError:
            return 0
        return sum(f.stat().st_size for d in dirs for f in d.iterdir() if f.suffix in (".safetensors", ".bin"))

    prompt_tokenizer_dir: ClassVar[str] = ""
    """Checkpoint subfolder of the tokenizer whose length ``model.max_text_tokens`` limits
    ("" = the family counts no tokens; see :meth:`prompt_token_counts`)."""

    def prompt_token_counts(self, prompts: list[str]) -> list[int] | None:
        """Tokens of each prompt as the family's length-limited text encoder counts them
        (special tokens included; what ``model.max_text_tokens`` cuts), or None when the
        family cannot tell. Loads only a tokenizer (``prompt_tokenizer_dir``); a tokenizer
        that does not load gives None (encoding then reports the checkpoint's problem)."""
        if not self.prompt_tokenizer_dir:
            return None
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.path / self.prompt_tokenizer_dir), local_files_only=True)
        except (OSError, ValueError, ImportError):
            return None
        return [
            len(ids)
            for ids in tok(list(prompts), add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        ]

    # ------------------------------------------------------------------ velocity
    @abc.abstractmethod
    def velocity(
        self, transformer: torch.nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """Velocity ``v [B, *latent_shape] float32`` at noise level ``sigma [B]`` (1 = noise),
        with the family's guidance (true CFG / guidance embedding). Runs the transformer in
        its own dtype; ``latents`` and ``cond`` are on the transformer's device."""

    def make_velocity_fn(self, transformer: torch.nn.Module):
        """``velocity_fn(latents, sigma, cond) -> v`` for :class:`spotlight.rl.sampler.Sampler`;
        moves ``sigma`` to the latents' device."""

        def velocity_fn(latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
            return self.velocity(transformer, latents, sigma.to(latents.device), cond)

        return velocity_fn

    # ------------------------------------------------------------------ images
    def load_decoder(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        """Load the VAE (frozen, eval) once; a no-op for pixel-space families."""

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents ``[B, *latent_shape]`` → ``[B, 3, H, W] uint8`` images on the CPU."""

    # ------------------------------------------------------------------ LoRA / saving
    def save_lora(
        self,
        directory: str | os.PathLike,
        lora_state_dict: dict[str, torch.Tensor],
        adapter_metadata: dict | None = None,
    ) -> None:
        """Write a LoRA adapter in diffusers format (``pytorch_lora_weights.safetensors``,
        loadable with ``pipeline.load_lora_weights`` / ``transformer.load_lora_adapter``),
        through the family pipeline's ``save_lora_weights``."""
        import diffusers

        pipe_cls = getattr(diffusers, self.pipeline_class)
        kwargs = {}
        if adapter_metadata is not None:
            kwargs["transformer_lora_adapter_metadata"] = adapter_metadata
        pipe_cls.save_lora_weights(
            str(directory), transformer_lora_layers=lora_state_dict, safe_serialization=True, **kwargs
        )

    def load_lora(self, transformer: torch.nn.Module, directory: str | os.PathLike) -> torch.nn.Module:
        """Load the adapter :meth:`save_lora` wrote in ``directory`` onto ``transformer`` (rank
        and alpha from the file's peft metadata) and return it.

        diffusers only warns when no key of the file matches a module (the "trained" model
        would then be the base model) and raises torch's multi-line size-mismatch error for an
        adapter of another model size or rank: both become one line here.

        Raises:
            ModelLoadError: the file is not a LoRA adapter of this transformer, or holds none
                of its LoRA weights.
        """
        from diffusers.utils import logging as diffusers_logging

        lora_file = pathlib.Path(directory) / LORA_WEIGHTS_NAME
        level = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity(diffusers_logging.CRITICAL)  # its warnings: our one line below
        try:
            transformer.load_lora_adapter(str(directory), prefix="transformer", weight_name=LORA_WEIGHTS_NAME)
        except (RuntimeError, ValueError, KeyError) as exc:  # e.g. a tensor of another shape
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
            why = next((line for line in lines if "mismatch" in line), lines[0])
            raise ModelLoadError(f"{lora_file}: not a LoRA adapter of this transformer ({why[:300]})") from None
        finally:
            diffusers_logging.set_verbosity(level)
        if not getattr(transformer, "peft_config", None):
            raise ModelLoadError(
                f"{lora_file}: holds no LoRA weights of this transformer (no key matches its modules); "
                "scores would be the base model's"
            )
        return transformer


def prompt_cache_path(family: ModelFamily, prompts: list[str], cache_dir: pathlib.Path) -> pathlib.Path:
    """Where :func:`cached_conditioning` keeps the embeddings of ``prompts``."""
    digest = hashlib.sha256(("\n".join(prompts) + "|" + family.identity()).encode()).hexdigest()[:16]
    return pathlib.Path(cache_dir) / f"{family.name}-{digest}.safetensors"


@contextlib.contextmanager
def quiet_text_encoders():
    """Raise the ``transformers`` and ``diffusers`` loggers to ERROR for the block: their tokenizers
    and pipelines warn once per *batch* of prompts longer than a text encoder's window ("The
    following part of your input was truncated because CLIP can only handle sequences up to 77
    tokens: [...]", pad tokens and all), megabytes of console for a 25,000-prompt set. The product
    says how many prompts were cut, once (:func:`spotlight.tasks.prompts.truncation_report`)."""
    import logging

    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    # each library's own setter: it configures the library's root logger first (a first use inside
    # the block would otherwise reset a level set here to the library's default)
    libraries = (diffusers_logging, transformers_logging)
    before = [lib.get_verbosity() for lib in libraries]
    for lib in libraries:
        lib.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        for lib, level in zip(libraries, before):
            lib.set_verbosity(level)


def cached_conditioning(
    family: ModelFamily,
    prompts: list[str],
    cache_dir: pathlib.Path,
    *,
    device: torch.device | str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> Conditioning:
    """:meth:`ModelFamily.encode_prompts` once per (prompt set, checkpoint, settings), cached
    as safetensors in ``cache_dir`` (text encoders are only loaded on a cache miss, on
    ``device``; ``progress`` as in :meth:`ModelFamily.encode_prompts`).

    A causal family's cache holds the uncut encodings, packed, and serves every
    ``model.max_text_tokens`` (:mod:`spotlight.models.text_cache`); other families' caches
    are per ``max_text_tokens``.

    Raises:
        DiskSpaceError: the cache file would not fit in ``cache_dir``."""
    from safetensors.torch import load_file, save_file

    from spotlight.models import text_cache

    path = prompt_cache_path(family, prompts, cache_dir)
    if path.is_file():
        return _from_cache(family, load_file(path))
    from spotlight.util.disk import ensure_free_space

    with quiet_text_encoders():
        if family.text_encoding_is_causal:
            tensors = family.encode_prompts_packed(prompts, device, progress)
        else:
            tensors = family.encode_prompts(prompts, device, progress).to_tensors()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    ensure_free_space(path.parent, sum(t.numel() * t.element_size() for t in tensors.values()), "the prompt cache")
    dtype = torch_dtype(family.cfg.dtype, torch.device(device))
    save_file(
        tensors,
        tmp,
        metadata={
            "prompts": str(len(prompts)),
            "family": family.name,
            "encoded_on": f"{torch.device(device)} ({str(dtype).removeprefix('torch.')})",
            "layout": "packed" if text_cache.is_packed(tensors) else "padded",
        },
    )
    os.replace(tmp, path)
    return _from_cache(family, tensors)


def _from_cache(family: ModelFamily, tensors: dict[str, torch.Tensor]) -> Conditioning:
    from spotlight.models import text_cache

    if text_cache.is_packed(tensors):
        return text_cache.unpack_conditioning(tensors, family.cfg.max_text_tokens)
    return Conditioning.from_tensors(tensors)


def read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
