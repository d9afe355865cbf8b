"""Memory and disk plan of a run: bytes per GPU, per host and on disk, from parameter counts
and the config (docs/planning.md has the formulas, the presets and a worked 20 B table).

Pure: no torch, no I/O. A shell counts the parameters (:mod:`spotlight.models.param_count`,
from the transformer's config on the meta device) and calls :func:`plan_memory`; ``spotlight
plan`` prints the result, ``spotlight up`` refuses a config whose GPUs cannot hold it
(``cluster.gpu_memory_gib``).

Per trainer GPU (FSDP2 shards over ``W`` ranks: ``train.num_train_workers``, or over more than
one node — HSDP, a replica per node — the ranks of one node, ``num_train_workers /
num_train_nodes``; ``P`` transformer parameters, ``T`` trainable ones: ``P`` for full
fine-tuning, the LoRA adapter's otherwise):

* parameters: full fine-tuning ``4·P/W`` (fp32 master); LoRA ``b·P/W + 4·T/W`` (frozen base
  in the compute dtype, ``b`` = 2 for bf16, plus the fp32 adapter);
* gradients ``4·T/W``; Adam state ``8·T/W`` (two fp32 moments);
* the KL reference of full fine-tuning (``train.kl_beta > 0``): a second sharded model, frozen,
  in the compute dtype: ``b·P/W`` (LoRA's reference is the policy without its adapter: none);
* gathered blocks: FSDP2 all-gathers one block's parameters in the compute dtype and
  prefetches the next, ``2·b·P/blocks``; in the backward one block's unsharded gradient
  before its reduce-scatter, ``(b + 4)·T/blocks`` (``b·T/blocks`` in fp32);
* activations of one training forward: the trainer runs one SDE window step of one
  micro-batch at a time (forward, loss, backward, then the next step), so
  ``tokens = rows · cfg · (image + text tokens)`` with ``rows`` = the rollout batch
  (``cluster.worker_batch_size``; rollout batches are never merged) cut to
  ``train.micro_batch_size``, and ``cfg`` = 2 with true CFG (the negative rows run in the
  same forward). Without activation checkpointing ``tokens · blocks · a``; with it
  ``tokens · blocks · hidden · b`` (the block inputs) ``+ tokens · a`` (one block
  recomputed). ``a`` = :data:`BLOCK_ACT_BYTES_PER_TOKEN` (120 KiB) scaled by ``hidden / 3072`` and by
  ``b / 2``;
* the reserved Rollout Worker's model copy, if it shares the GPU
  (``cluster.reserved_rollout_gpus`` ∩ the trainer ranks): ``b·P`` (+ ``b·T`` for the adapter)
  plus its inference activations (one block of ``worker_batch_size · cfg · tokens``). With
  ``cluster.offload_rollout_while_training`` (None: on CUDA for every family but tiny) the
  worker holds it only while the trainer does not train, so the GPU's peak is the trainer's
  resident state plus the larger of its training transients (gradients, gathered blocks,
  activations) and the worker's copy: the line counts only what the copy exceeds them by,
  ``max(0, copy − transients)``, and the reserved host holds the released copy (pinned);
* a CUDA context reserve (:data:`CUDA_RESERVE_BYTES`; none on the CPU).

Disk, at its peak (``K_w = run.keep_weight_versions``, ``K_t = run.keep_train_checkpoints``):
``(K_w + 1)`` weight versions in the Tensor Store (the newest ``K_w`` and the one arriving),
one more in the trainer's spool file while it streams, ``(K_t + 1)`` trainer checkpoints of
``12·T`` (the kept ones and the one being written) and the final model; with held-out
evaluation and ``eval.keep_best``, ``best/`` and its replacement while it is written; the
committed rollout states (paper §4.5) of at most every request of an iteration
(:func:`committed_states_bytes`).
"""

from __future__ import annotations

import dataclasses
import math

from spotlight.core.offload import offload_enabled

GIB = 1 << 30

BLOCK_ACT_BYTES_PER_TOKEN = 120 * 1024
"""Activation bytes a Qwen-Image transformer block keeps for the backward, per token, in bf16 at
hidden size :data:`REFERENCE_HIDDEN`. Measured with the Train Worker itself (LoRA r64, true
CFG, 512²) on a real-width block in fp32 on the CPU: 114 and 131 KiB at width 1536 on 1 and 2
ranks, from the peaks with and without activation checkpointing (``benchmarks/trainer_memory.py``,
docs/planning.md §3); other widths scale linearly by hidden size, fp32 by 2."""

REFERENCE_HIDDEN = 3072
"""Hidden size at which :data:`BLOCK_ACT_BYTES_PER_TOKEN` was measured (Qwen-Image: 24 × 128)."""

CUDA_RESERVE_BYTES = 1 * GIB
"""CUDA context, NCCL buffers and allocator slack per GPU (not on the CPU)."""

COORDINATOR_MEMORY_VERSIONS = 3
"""Weight versions of at most ``cluster.weight_memory_max_bytes`` the coordinator also keeps in memory."""

AGENT_CACHED_VERSIONS = 2
"""Weight versions a spot node holds (v_n for exploration while v_n+1 arrives), memory-mapped."""

# families: classifier-free guidance run as doubled rows, and text tokens beyond max_text_tokens
DEFAULT_GUIDANCE = {"tiny": 1.0, "qwen-image": 4.0, "sd3": 4.5, "flux": 3.5}
"""``model.guidance_scale = 0`` resolves to these (the families' defaults)."""
TRUE_CFG = {"tiny": True, "qwen-image": True, "sd3": True, "flux": False}
"""Families whose guidance runs the negative rows through the transformer (FLUX embeds it)."""
EXTRA_TEXT_TOKENS = {"sd3": 77}
"""Text tokens a family adds to ``model.max_text_tokens`` (SD3: CLIP's 77 before T5's)."""


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """What the plan needs of the transformer.

    Attributes:
        family: ``model.family`` the numbers are of.
        params: every transformer parameter (P).
        lora_params: parameters of the LoRA adapter the config would add (0 without LoRA).
        hidden_size: heads × head dim.
        num_blocks: transformer blocks (FLUX: double + single).
    """

    family: str
    params: int
    lora_params: int
    hidden_size: int
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class Line:
    """One row of the plan: ``name``, its bytes and how they were computed."""

    name: str
    bytes: int
    formula: str


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per trainer GPU, per rollout GPU, on the reserved host, on a spot host and on disk."""

    trainer_gpu: tuple[Line, ...]
    rollout_gpu: tuple[Line, ...]
    reserved_host: tuple[Line, ...]
    spot_host: tuple[Line, ...]
    disk: tuple[Line, ...]
    gpu_limit_bytes: int | None
    tokens_per_micro_batch: int
    rows_per_micro_batch: int
    activation_checkpointing: bool
    version_bytes: int
    train_checkpoint_bytes: int
    final_bytes: int

    @staticmethod
    def total(lines: tuple[Line, ...]) -> int:
        return sum(line.bytes for line in lines)

    @property
    def trainer_gpu_bytes(self) -> int:
        return self.total(self.trainer_gpu)

    @property
    def rollout_gpu_bytes(self) -> int:
        return self.total(self.rollout_gpu)

    @property
    def disk_bytes(self) -> int:
        return self.total(self.disk)

    def problems(
        self, *, limit_source: str = "cluster.gpu_memory_gib", kinds=("trainer GPU", "rollout GPU")
    ) -> list[str]:
        """One line per GPU kind in ``kinds`` that exceeds ``gpu_limit_bytes`` (none without a
        limit); ``limit_source`` says where the limit came from."""
        if self.gpu_limit_bytes is None:
            return []
        out = []
        for kind, lines in (("trainer GPU", self.trainer_gpu), ("rollout GPU", self.rollout_gpu)):
            need = self.total(lines)
            if kind in kinds and need > self.gpu_limit_bytes:
                parts = ", ".join(f"{line.name} {size_text(line.bytes)}" for line in lines if line.bytes)
                given = gib_as_given(self.gpu_limit_bytes, min_places=0)
                limit = float(given)  # as the line shows it
                digits = 1  # as many as it takes for the need not to read as the limit (1.07 vs 1)
                while round(need / GIB, digits) <= limit and digits < 6:
                    digits += 1
                out.append(f"a {kind} needs {need / GIB:.{digits}f} GiB but {limit_source} = {given} ({parts})")
        return out


def gib_places(limit_bytes: int) -> int:
    """The fewest decimal places of a GPU size of ``limit_bytes`` as the user gave it.

    A plan holds ``--gpu-memory-gib`` / ``cluster.gpu_memory_gib`` as ``int(x · 2³⁰)`` bytes
    (:func:`plan_memory`), whose GiB are not ``x`` again: 0.001 gives 1073741 bytes, 0.000999999
    GiB at six digits. ``x`` rounded to these places gives the same bytes, so the size reads as
    it was written (0.001, 79.99, 80)."""
    for places in range(13):
        if int(round(limit_bytes / GIB, places) * GIB) == limit_bytes:
            return places
    return 12


def gib_as_given(limit_bytes: int, *, min_places: int = 1) -> str:
    """A GPU size of ``limit_bytes`` in GiB as the user gave it (:func:`gib_places`), with at
    least ``min_places`` decimals: ``80.0``, ``79.99``, ``0.001``."""
    return f"{limit_bytes / GIB:.{max(gib_places(limit_bytes), min_places)}f}"


def gib(n: int | float) -> str:
    """``n`` bytes as ``12.3 GiB``."""
    return f"{n / GIB:.1f} GiB"


def size_text(n: int | float) -> str:
    """``n`` bytes as ``12.3 GiB``, or ``850.2 MiB`` below 1 GiB (a tiny model's terms would all
    read 0.0 GiB)."""
    return gib(n) if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def image_tokens(family: str, image_size: int, patch_size: int) -> int:
    """Image tokens per sample: tiny ``(H/patch)²``; the VAE families ``(H/16)²`` (VAE ×8, 2×2 patches)."""
    side = image_size // (patch_size if family == "tiny" else 16)
    return side * side


def latent_values(family: str, image_size: int) -> int:
    """Values of one sample's latent: tiny's pixels ``3·H²``; the VAE families' ``16·(H/8)²``
    (16 latent channels at 1/8 of the image side, packed or not)."""
    return 3 * image_size * image_size if family == "tiny" else 16 * (image_size // 8) ** 2


def largest_worker_frame_bytes(cfg) -> tuple[int, str]:
    """The largest frame a Rollout Worker sends the coordinator, and what it is: a RESULT carries
    each tensor of its batch as one frame (``spotlight.store.tensor_wire.pack_tensors``), the
    biggest of which is a rollout's SDE window latents, ``B·(W+1)·latent·4`` bytes, or the batch's
    decoded images, ``B·3·H²`` (``B`` = ``cluster.worker_batch_size``); a COMMIT's frames are one
    request's each, and smaller. Plus the wire's slack (:data:`spotlight.protocol.FRAME_OVERHEAD_BYTES`). Pure."""
    from spotlight.protocol import FRAME_OVERHEAD_BYTES as overhead

    b, h = cfg.cluster.worker_batch_size, cfg.model.image_size
    window = b * (cfg.sampler.sde_window_size + 1) * latent_values(cfg.model.family, h) * 4
    images = b * 3 * h * h
    if window >= images:
        return (
            window + overhead,
            "RESULT frame of SDE window latents (worker_batch_size × (sde_window_size + 1) latents)",
        )
    return images + overhead, "RESULT frame of decoded images (worker_batch_size images)"


def committed_states_bytes(cfg, family: str) -> tuple[int, str]:
    """Disk bytes of the committed rollout states the Tensor Store may hold at once, and the
    formula. A preempted Rollout Worker commits each unfinished request's state (its latent, the
    SDE window's latents so far and their log-probs: at most ``W + 2`` float32 latents); a
    request keeps only its newest commit, and a state is deleted once no request can resume from
    it, so at most every request of one iteration has one: the rollout's ``N·G`` and, with
    exploration, the next batch's ``N·d`` candidates (docs/planning.md §2)."""
    d = cfg.data
    requests = d.prompts_per_iteration * d.group_size
    explore = getattr(cfg, "explore", None)
    explored = bool(explore is not None and explore.enabled and explore.mode != "off")
    if explored:
        requests += d.prompts_per_iteration * explore.num_candidates
    latent = latent_values(family, cfg.model.image_size) * 4
    who = "(N·G rollouts + N·d explored)" if explored else "N·G rollouts"
    return requests * (cfg.sampler.sde_window_size + 2) * latent, f"{who} × (W+2)·latent·4, at most"


def rollout_samples_bytes(cfg, family: str, *, copies: int = 2) -> tuple[int, str]:
    """Bytes of one iteration's rollout samples, and the formula: each sample's ``uint8`` image
    (``3·H²``) and its SDE window's ``W + 1`` float32 latents (:func:`latent_values` each),
    ``copies`` times — the coordinator holds them twice, as received and stacked into the
    Train Workers' batch while it is sent; ``run.save_rollouts`` writes them once. The rollout
    is ``N·G`` samples (``data.prompts_per_iteration · data.group_size``; best-of-N that reuses
    its candidates as the rollout keeps the window of every candidate, ``N·d``). Exploration
    candidates keep only their reward once scored."""
    d = cfg.data
    explore = getattr(cfg, "explore", None)
    reuse = bool(explore is not None and getattr(explore, "reuse_as_rollout", False))
    per_prompt = max(explore.num_candidates, d.group_size) if reuse else d.group_size
    samples = d.prompts_per_iteration * per_prompt
    window = cfg.sampler.sde_window_size + 1
    image = 3 * cfg.model.image_size * cfg.model.image_size
    latent = latent_values(family, cfg.model.image_size) * 4
    who = "N·d" if reuse else "N·G"
    times = f"{copies}·" if copies != 1 else ""
    return samples * (image + copies * window * latent), f"{who} × (3·H² + {times}(W+1)·latent·4), {samples} samples"


def uses_true_cfg(family: str, guidance_scale: float) -> bool:
    """Whether the negative rows run through the transformer beside the positive ones."""
    scale = guidance_scale if guidance_scale > 0 else DEFAULT_GUIDANCE.get(family, 1.0)
    return TRUE_CFG.get(family, False) and scale > 1


def block_act_bytes_per_token(hidden_size: int, dtype_bytes: int) -> float:
    """``a``: activation bytes per token per block, scaled from the Qwen-Image measurement."""
    return BLOCK_ACT_BYTES_PER_TOKEN * hidden_size / REFERENCE_HIDDEN * dtype_bytes / 2


def rows_per_forward(cfg) -> int:
    """Rows of one training forward (before CFG doubles them): the rollout batch
    (``cluster.worker_batch_size``, never merged; at most the iteration's samples) cut to
    ``train.micro_batch_size``."""
    rows = min(cfg.cluster.worker_batch_size, cfg.data.prompts_per_iteration * cfg.data.group_size)
    micro = getattr(cfg.train, "micro_batch_size", None)
    return min(rows, micro) if micro else rows


def plan_memory(cfg, size: ModelSize, *, device: str = "cuda") -> MemoryPlan:
    """The memory and disk plan of ``cfg`` (a :class:`~spotlight.config.SpotlightConfig`) for a
    transformer of ``size``; ``device`` "cuda" (bf16 compute and rollouts where the config says
    ``auto``) or "cpu" (everything fp32).

    ``train.activation_checkpointing`` None means on for every family but tiny.
    """
    t, m, c = cfg.train, cfg.model, cfg.cluster
    w = t.num_train_workers // max(1, getattr(t, "num_train_nodes", 1))  # the shard group: one node's ranks
    lora = t.lora_rank > 0
    p, trainable = size.params, (size.lora_params if lora else size.params)
    cuda = device == "cuda"
    model_b = 2 if cuda and m.dtype in ("auto", "bfloat16") else 4
    compute_b = 4 if not cuda or t.mixed_precision == "fp32" else (2 if t.mixed_precision == "bf16" else model_b)

    rows = rows_per_forward(cfg)
    ckpt = getattr(t, "activation_checkpointing", None)
    ckpt = size.family != "tiny" if ckpt is None else bool(ckpt)
    cfg_rows = 2 if uses_true_cfg(size.family, m.guidance_scale) else 1
    seq = (
        image_tokens(size.family, m.image_size, m.patch_size)
        + m.max_text_tokens
        + EXTRA_TEXT_TOKENS.get(size.family, 0)
    )
    tokens = rows * cfg_rows * seq
    a = block_act_bytes_per_token(size.hidden_size, compute_b)
    blocks = size.num_blocks

    trainer: list[Line] = []
    if lora:
        trainer.append(Line("parameters", _ceil(compute_b * p / w + 4 * trainable / w), f"{compute_b}·P/W + 4·T/W"))
    else:
        trainer.append(Line("parameters", _ceil(4 * p / w), "4·P/W (fp32 master)"))
    trainer.append(Line("gradients", _ceil(4 * trainable / w), "4·T/W"))
    trainer.append(Line("Adam state", _ceil(8 * trainable / w), "8·T/W"))
    if t.kl_beta > 0 and not lora:
        trainer.append(Line("KL reference", _ceil(compute_b * p / w), f"{compute_b}·P/W (frozen, compute dtype)"))
    grad_b = compute_b + 4 if compute_b < 4 else compute_b  # unsharded block gradient (+ its fp32 reduction)
    trainer.append(
        Line(
            "gathered blocks",
            _ceil((2 * compute_b * p + grad_b * trainable) / blocks),
            f"2·{compute_b}·P/blocks + {grad_b}·T/blocks",
        )
    )
    if ckpt:
        act = tokens * blocks * size.hidden_size * compute_b + tokens * a
        formula = f"tokens·blocks·hidden·{compute_b} + tokens·a (checkpointed)"
    else:
        act = tokens * blocks * a
        formula = "tokens·blocks·a"
    trainer.append(Line("activations", _ceil(act), formula))

    worker_model = model_b * (p + (trainable if lora else 0))
    worker_act = _ceil(c.worker_batch_size * cfg_rows * seq * block_act_bytes_per_token(size.hidden_size, model_b))
    rollout = [
        Line("model copy", worker_model, f"{model_b}·P" + (f" + {model_b}·T" if lora else "")),
        Line("inference activations", worker_act, "worker_batch·cfg·seq·a (one block)"),
    ]
    shared = bool(set(c.reserved_rollout_gpus) & set(range(w)))
    setting = getattr(c, "offload_rollout_while_training", None)
    offload = shared and cuda and offload_enabled(setting, device_type=device, family=size.family)
    if offload:  # released while the trainer trains: only what the copy exceeds the training transients by
        transients = sum(line.bytes for line in trainer if line.name in ("gradients", "gathered blocks", "activations"))
        trainer.append(
            Line(
                "rollout worker",
                max(0, worker_model + worker_act - transients),
                "copy + inference act. − transients, ≥ 0 (offloaded while training)",
            )
        )
    elif shared:
        trainer.append(Line("rollout worker", worker_model + worker_act, "model copy + inference activations"))
    if cuda:
        trainer.append(Line("CUDA reserve", CUDA_RESERVE_BYTES, "context, NCCL, allocator"))
        rollout.append(Line("CUDA reserve", CUDA_RESERVE_BYTES, "context, NCCL, allocator"))

    version = model_b * (trainable if lora else p)
    publish = version if lora else 4 * p + (version if model_b != 4 else 0)
    coord_mem = COORDINATOR_MEMORY_VERSIONS * version if version <= c.weight_memory_max_bytes else 0
    samples_b, samples_formula = rollout_samples_bytes(cfg, size.family)
    reserved_host = (
        Line("trainer rank 0: version gather", publish, f"{model_b}·T" if lora else f"4·P + {model_b}·P"),
        Line("coordinator: versions in memory", coord_mem, f"{COORDINATOR_MEMORY_VERSIONS} versions if small"),
        Line("coordinator: rollout samples", samples_b, samples_formula),
    )
    if offload:
        reserved_host += (Line("rollout worker: released copy (pinned)", worker_model, "model copy"),)
    spot_host = (Line("agent: cached versions (mmap)", AGENT_CACHED_VERSIONS * version, "2 versions"),)
    keep = cfg.run.keep_weight_versions
    keep_train = getattr(cfg.run, "keep_train_checkpoints", 1)
    ckpt_bytes = 12 * trainable  # fp32 weights + two fp32 Adam moments (LoRA: the adapter's)
    final = 4 * (trainable if lora else p)
    stored = keep + 1 if keep else cfg.run.iterations + 1
    disk = (
        Line(
            "tensor store versions",
            version * stored,
            f"{f'({keep} + 1 arriving)' if keep else 'every'} × version ({size_text(version)})",
        ),
        Line("trainer spool", version, "1 version while rank 0 streams it"),
        Line(
            "trainer checkpoints",
            (keep_train + 1) * ckpt_bytes,
            f"({keep_train} + 1 being written) × 12·T ({size_text(ckpt_bytes)})",
        ),
        Line("final model", final, "4·T" if lora else "4·P (fp32)"),
    )
    ev = getattr(cfg, "eval", None)
    if ev is not None and ev.every > 0 and ev.keep_best:  # the eval worker saves in final/'s layout
        best = 4 * trainable if lora else model_b * p
        disk += (
            Line(
                "best model (eval.keep_best)",
                2 * best,
                f"(1 + 1 being written) × {'4·T' if lora else f'{model_b}·P'} ({size_text(best)})",
            ),
        )
    states, states_formula = committed_states_bytes(cfg, size.family)
    disk += (Line("committed rollout states", states, states_formula),)
    if getattr(cfg.run, "save_rollouts", False):  # kept for every iteration: audits and tests
        one, formula = rollout_samples_bytes(cfg, size.family, copies=1)
        disk += (Line("saved rollouts (run.save_rollouts)", cfg.run.iterations * one, f"iterations × {formula}"),)
    limit = getattr(c, "gpu_memory_gib", None)
    return MemoryPlan(
        trainer_gpu=tuple(trainer),
        rollout_gpu=tuple(rollout),
        reserved_host=reserved_host,
        spot_host=spot_host,
        disk=disk,
        gpu_limit_bytes=None if limit is None else int(limit * GIB),
        tokens_per_micro_batch=tokens,
        rows_per_micro_batch=rows,
        activation_checkpointing=ckpt,
        version_bytes=version,
        train_checkpoint_bytes=ckpt_bytes,
        final_bytes=final,
    )


def _ceil(x: float) -> int:
    return int(math.ceil(x))
