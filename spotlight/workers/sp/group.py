"""Elastic sequence-parallel (SP) Rollout Worker groups (paper §3.2.2 "Insight 2", §4.4, §5).

A Rollout Worker *group* is k processes on one node that run one transformer with
diffusers' native context parallelism (Ulysses, ``ContextParallelConfig(ulysses_degree=k)``
applied through the model's ``_cp_plan``) over a ``torch.distributed`` process group
(gloo on CPU, NCCL on GPUs). The node Scheduler (``spotlight-agent``) decides who is in a
group; this module makes a member follow those decisions without a full restart.

Family-driven: a member serves whatever model family the run trains (Qwen-Image, FLUX.1 and
the tiny model; every class with a ``_cp_plan``, :mod:`spotlight.workers.sp.degrees`). It
builds the family's transformer from ``<checkpoint>/transformer``'s config on the ``meta``
device and loads the weights into it (as the Train Worker does), runs it in the family's dtype
(``model.dtype``: bfloat16 on CUDA), calls the family's own velocity (true CFG, ``img_shapes``,
pooled projections, guidance embedding) and carries every conditioning tensor of a batch to
the followers (negative prompt, pooled embeddings, masks).

Weights. A published *version* is either the whole transformer (full fine-tuning) or a LoRA
adapter (``train.lora_rank > 0``). With LoRA every member keeps ONE frozen base, read from
the checkpoint's safetensors through a memory map (on a GPU the member holds the device copy it
computes with), and the group only ever moves adapters. A full version handed in (the agent's
weight cache, memory-mapped) is used as it is: on a GPU the member holds one device copy; on
the CPU the model's parameters are the mapped tensors where the file puts them on a 64-byte
boundary and aligned private copies elsewhere (CPU kernels round differently off it,
:mod:`spotlight.models.alignment`; in a diffusers-written file nearly every tensor is off
it). A member that lacks the version receives it from rank 0, tensor by tensor, straight into
one flat buffer per dtype on its compute device (NVLink on GPUs, gloo on CPU): no host copy
on a GPU node, no pickle on the wire.

* **shrink** (a GPU is revoked): only that member's process exits. The survivors call
  :meth:`SPGroupMember.form` with the next :class:`GroupSpec`; it destroys the old process
  group (aborting the communicator first when the group broke, docs/architecture.md §6),
  forms a new one at the lower degree and rebuilds the parallel model from the weights the
  member already keeps (``weights_source == "memory"``). A group of one needs no process
  group and reuses its plain (SP-1) model object while the weights stay the same.
* **grow** (a GPU is added): a new process calls :meth:`SPGroupMember.form` with no
  weights; the survivors call it with the same spec. Rank 0 (a member that holds the
  weights; the node Scheduler lists such a member first) broadcasts them over the rebuilt
  group — ``weights_source == "broadcast"``. A warm spare (``spotlight.workers.rollout.spare``)
  pre-faults the receive buffer before it is assigned a GPU (:meth:`SPGroupMember.prewarm`).

Membership change protocol inside :meth:`SPGroupMember.form` (collective: every member of
the new spec calls it with the same spec, in any order; rendezvous is the TCP store of
``tcp://master_addr:master_port``, hosted by rank 0)::

    validate the degree (heads, image and text tokens)   local, before any collective,
    and weights given against the architecture           so every member fails alike
    destroy previous default process group               local (abort first if it broke)
    k == 1: keep the weights in memory, reuse the plain model; done
    init_process_group(rank = members.index(me))         rendezvous
    all_gather([holds, version, layout fingerprint])     every rank learns who lacks them
    if rank 0 holds none, or layouts differ -> SPGroupError on every rank
    if some rank lacks them / holds another version:
        broadcast(tensor) for every tensor, names sorted, src=0   receivers derive the layout
                                                         from a weightless skeleton of
                                                         their own config: no pickle
    build a FRESH model object on meta, load the weights (assign), add First Block Cache,
    enable_parallelism(ContextParallelConfig(ulysses_degree=k))

Why a fresh model object for every k > 1 generation: diffusers refuses
``enable_parallelism`` on a model that already has a ``_parallel_config`` ("cannot be called
twice"), and its hooks hold the old device mesh / process group. The skeleton is the family's
:meth:`~spotlight.models.families.base.ModelFamily.build_empty_transformer` (parameters on
``meta``, the RoPE tables Qwen-Image keeps as plain tensors real) and takes the kept tensors
with ``load_state_dict(..., assign=True)``: the parameters are the kept tensors, shared by
every model object of the same weights.

Known diffusers faults handled here (diffusers 0.42.1, torch 2.13.0+cpu):

* ``ModelMixin._resolve_parallel_config`` (called by ``enable_parallelism``) computes
  ``torch.device(device_type, rank % torch.accelerator.device_count())``; with no
  accelerator ``device_count()`` is 0 and this raises ``ZeroDivisionError``.
  :func:`_cpu_device_count_patch` replaces ``torch.accelerator.device_count`` by
  ``lambda: 1`` only while ``enable_parallelism`` runs and only when the real count is 0.
* Ulysses needs the head count and every split sequence to be divisible by the degree
  (``EquipartitionSharder.shard`` only ``assert``\\ s it, and a rank that fails while the
  others enter a collective hangs the group). :mod:`spotlight.workers.sp.degrees` says which
  degrees work; ``spotlight up`` refuses a ``cluster.sp_degree`` that does not, the node
  Scheduler forms only degrees that do, and :meth:`SPGroupMember.form` raises ``ValueError``
  before any collective for one that does not. The velocity pads the text of a family with a
  text mask (Qwen-Image, tiny) with masked zero tokens to a multiple of the degree (exact:
  padded keys are masked out and text RoPE positions are by index); FLUX.1 has no text mask,
  so its ``model.max_text_tokens`` must divide.
* Ulysses' key order and strided shards round differently from one worker;
  :mod:`spotlight.workers.sp.invariant` makes a group compute what one worker computes, bit
  for bit, so a rollout that crosses degrees is the rollout an uninterrupted worker makes.

Running a batch over a group (:func:`run_group_batch`): the leader (rank 0) owns the
:class:`~spotlight.rl.sampler.DenoiseState` and drives :class:`~spotlight.rl.sampler.Sampler`;
followers only mirror its transformer calls. Leader → followers, all ``dist.broadcast``
from rank 0 over the group::

    header int64[8] = [OP_BATCH, n, names_len, thr, 0…]   then meta int64[n, 8] (dtype code,
                      ndim, name length, shape…), names uint8[names_len], and the n tensors
                      of the batch's conditioning (``cond.embeds``, ``cond.mask``, every
                      extra: ``cond.neg.embeds``, ``cond.pooled``…) in their own dtypes
                      (thr: the batch's First-Block-Cache threshold, float64 bits)
    header          = [OP_STEP, ndim, *shape]     then latents f32[shape], sigma f32[B]
                                                  (any latent rank: [B, L, C], [B, C, h, w])
                                                  then every rank runs the parallel forward
    header          = [OP_END, 0…]                batch over (followers return)
    header          = [OP_WEIGHTS, version, 0…]   a new weight version follows
                                                  (:meth:`SPGroupMember.broadcast_weights`)
    header          = [OP_IDLE, 0…]               keep-alive while the leader has no work (a
                                                  follower's pending broadcast would otherwise
                                                  hit the group's timeout and break the group)
    header          = [OP_RELEASE, 0…]            stop serving (before a re-form or exit)

Shapes are in the headers, so followers allocate exact buffers. When a collective fails
mid-step (a peer died), the leader rolls its state back to the last completed step and
raises :class:`SPGroupError`; the state is then whole at a step boundary and can continue
after a re-form (or be committed to the Tensor Store). When a step fails for another reason
(the model raised), the leader rolls back, ends the batch on the followers (``OP_END``) and
re-raises: the group stays formed and the worker reports the failed batch.

First Block Cache on a group (exploration's reduced effective steps, paper §4.3.1).
diffusers' ``enable_cache`` cannot simply be switched on for a context-parallel model:

* hook order -- its head-block hook computes ``block output - block input`` and must
  see both sharded, i.e. sit inside the context-parallel split hook (Qwen-Image splits at
  ``transformer_blocks.0``). Enabled after ``enable_parallelism`` it would be registered
  outside it (the last registered hook is the outermost). So :meth:`SPGroupMember._build_model`
  installs First Block Cache on every fresh model BEFORE ``enable_parallelism`` and
  keeps it for the model's life; a per-batch threshold (0 = off) drives it.
* the skip decision -- diffusers compares the mean absolute change of the head block's
  residual with a threshold, and each rank sees only its shard: ranks could decide
  differently, and a rank that runs the tail blocks (with their all-to-alls) while
  another skips them hangs the group. The decision is replaced by
  :class:`_GroupCacheDecision`: the two sums behind the ratio are all-reduced over the
  group, so every rank takes the same decision, the one a single worker takes on the
  whole batch (same ratio, up to float summation order).

With threshold 0 (rollouts: always full fidelity) the decision is "compute" without any
collective, and the cached model's outputs equal the uncached model's. The leader counts
skipped forwards and reports them in ``DenoiseState.computed_steps`` like
:class:`~spotlight.workers.rollout.worker.RolloutExecutor`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import logging
import struct
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from spotlight.config import ModelConfig
from spotlight.models.alignment import ALIGN_BYTES, aligned
from spotlight.rl.sampler import Conditioning, DenoiseState, Sampler
from spotlight.workers.sp import invariant
from spotlight.workers.sp.degrees import cfg_split, degree_problem, sp_shape


def hide_library_notices() -> None:
    """Keep two notices of the SP group's libraries off the user's console (``spotlight profile``
    printed them at every group): torch's FutureWarning about the deprecated functional
    ``all_gather_tensor`` that diffusers' context-parallel hooks call (theirs to fix, not a
    user's), and diffusers' note at every ``enable_parallelism`` that the API is experimental
    (the SP tests pin what we rely on: tests/unit/workers/sp/). Installed at import."""
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\._functional_collectives\.all_gather_tensor` is deprecated",
        category=FutureWarning,
    )
    modeling = logging.getLogger("diffusers.models.modeling_utils")
    if not any(getattr(f, "__name__", "") == "_not_experimental_note" for f in modeling.filters):
        modeling.addFilter(_not_experimental_note)


def _not_experimental_note(record: logging.LogRecord) -> bool:
    return "`enable_parallelism` is an experimental feature" not in record.getMessage()


hide_library_notices()

log = logging.getLogger("spotlight.sp_group")

OP_BATCH, OP_STEP, OP_END, OP_RELEASE, OP_WEIGHTS, OP_IDLE = 1, 2, 3, 4, 5, 6
_HEADER_LEN = 8
_MAX_NDIM = _HEADER_LEN - 2
_DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.int64: 3,
    torch.int32: 4,
    torch.bool: 5,
    torch.float64: 6,
    torch.uint8: 7,
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


class SPGroupError(RuntimeError):
    """The group cannot form or a collective failed (a peer died, rank 0 has no weights)."""


def _threshold_to_int(threshold: float) -> int:
    """A float64 carried bit-exactly in an int64 header field."""
    return struct.unpack("<q", struct.pack("<d", float(threshold)))[0]


def _threshold_from_int(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


class _GroupCacheDecision:
    """Replaces ``FBCHeadBlockHook._should_compute_remaining_blocks`` on a member's model.

    diffusers 0.42.1 computes ``mean|r - r_prev| / mean|r_prev| > threshold`` over the
    head block's hidden-state residual ``r``. Here ``r`` is this rank's shard (equal-size
    shards, Ulysses equipartition; or this rank's CFG branch under CFG-parallel), so the two
    sums are all-reduced over the group: every rank gets the same numbers and takes the same
    decision, which is the full batch's. Threshold <= 0: always compute (no collective).
    Counts skipped forwards in ``member.cache_skips``.
    """

    def __init__(self, member: "SPGroupMember", hook) -> None:
        self.member = member
        self.hook = hook

    def __call__(self, residual: torch.Tensor) -> bool:
        member = self.member
        threshold = member.cache_threshold
        if threshold <= 0:
            return True
        prev = self.hook.state_manager.get_state().head_block_residual
        if prev is None:
            return True
        # float32 sums (bf16 sums of a large shard lose digits), float64 for the all-reduce
        sums = torch.stack([(residual - prev).abs().sum(dtype=torch.float32), prev.abs().sum(dtype=torch.float32)]).to(
            torch.float64
        )
        if member.sp_degree > 1:
            sums = sums.to(member._comm_device)
            dist.all_reduce(sums)
        diff = (sums[0] / sums[1]).item()
        compute = diff > threshold
        if not compute:
            member.cache_skips += 1
        return compute


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One generation of an SP group, decided by the node Scheduler.

    Attributes:
        members: worker ids; the index is the rank. ``members[0]`` must hold the weights.
        master_addr, master_port: TCP rendezvous of this generation (rank 0 hosts it);
            use a fresh port per generation.
        generation: increases with every re-form (logging / sanity only).
        pids: process ids of the members (same order; empty when unknown). A member watches its
            peers' processes and aborts the communicator when one dies (:class:`PeerWatch`).
    """

    members: tuple[str, ...]
    master_addr: str
    master_port: int
    generation: int
    pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("GroupSpec.members must not be empty")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"GroupSpec.members has duplicates: {self.members}")
        if self.pids and len(self.pids) != len(self.members):
            raise ValueError(f"GroupSpec.pids {self.pids} do not match members {self.members}")

    @property
    def world_size(self) -> int:
        return len(self.members)


def check_sp_degree(model_cfg: ModelConfig, degree: int, *, text_dim: int = 384) -> None:
    """Raise ``ValueError`` if Ulysses cannot split the run's model ``degree`` ways
    (:func:`spotlight.workers.sp.degrees.degree_problem`; reads the checkpoint's configs only)."""
    from spotlight.models.families import get_family

    problem = degree_problem(sp_shape(get_family(model_cfg, text_dim=text_dim)), degree)
    if problem:
        raise ValueError(problem)


@contextlib.contextmanager
def _cpu_device_count_patch():
    """Make ``torch.accelerator.device_count()`` return 1 while diffusers resolves its device.

    diffusers 0.42.1 ``ModelMixin._resolve_parallel_config`` does
    ``torch.device(device_type, rank % torch.accelerator.device_count())``, which is a
    ``ZeroDivisionError`` on a machine without an accelerator. Applied only when the
    real count is 0, and only around ``enable_parallelism``.
    """
    if torch.accelerator.device_count() != 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def _clear_method_caches(model) -> None:
    """Drop per-instance entries of diffusers' method-level LRU caches for ``model``'s modules.

    ``QwenEmbedRope`` memoises its frequency helpers with ``lru_cache_unless_export`` (some
    with ``maxsize=None``), keyed on ``self``: each discarded model object would otherwise
    stay alive through the cache, together with its context-parallel hooks, config and
    device meshes — a leak per re-form. The wrapper hides ``cache_clear``, so find the
    ``functools.lru_cache`` object in its closure (best effort; clears the whole cache of
    that method, which only costs a recomputation).
    """
    seen: set[int] = set()
    for module in model.modules():
        for attr in vars(type(module)).values():
            fn = getattr(attr, "__func__", attr)
            if id(fn) in seen or not callable(fn):
                continue
            seen.add(id(fn))
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    content = cell.cell_contents
                except ValueError:
                    continue
                if hasattr(content, "cache_clear"):
                    content.cache_clear()


Entry = tuple[str, tuple, torch.dtype]
"""``(name, shape, dtype)`` of one weight tensor."""


def _layout(entries: list[Entry]) -> list[tuple[torch.dtype, int, list[tuple[str, tuple, int, int]]]]:
    """How received weights sit in flat buffers: one buffer per dtype (dtypes in name order),
    the tensors in ``entries`` order (names sorted), each starting on a 64-byte boundary
    (:mod:`spotlight.models.alignment`: CPU kernels round differently off it). Returns
    ``[(dtype, numel, [(name, shape, offset, numel)…])…]``; every member derives the same layout
    from the same entries."""
    out = []
    for dt in sorted({e[2] for e in entries}, key=str):
        items, off = [], 0
        step = max(1, ALIGN_BYTES // dt.itemsize)
        for name, shape, d in entries:
            if d == dt:
                n = 1
                for s in shape:
                    n *= int(s)
                off = -(-off // step) * step
                items.append((name, tuple(shape), off, n))
                off += n
        out.append((dt, off, items))
    return out


def _views(flat: dict[torch.dtype, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    return {name: flat[dt][off : off + n].view(shape) for dt, _, items in layout for name, shape, off, n in items}


def _fingerprint(entries: list[Entry]) -> int:
    """A signed 64-bit digest of the tensor layout (names, shapes, dtypes): members compare it
    before any weight moves, so a member built from another config fails the form on every rank
    instead of receiving garbage."""
    text = "\n".join(f"{n}|{tuple(s)}|{d}" for n, s, d in entries).encode()
    return struct.unpack("<q", hashlib.sha256(text).digest()[:8])[0]


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not yet reaped by its parent,
    counts as gone)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def abort_communicator() -> bool:
    """Abort this process's default process group and every subgroup (NCCL: ``ncclCommAbort``),
    so a collective blocked on a dead peer returns with an error instead of waiting for the
    timeout, and the NCCL watchdog has nothing left to kill the process for. Returns False when
    there was nothing to abort, or the backend cannot abort (gloo: a dead peer's closed
    sockets already fail its collectives)."""
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        c10d._abort_process_group()
    except (RuntimeError, ValueError, AttributeError, NotImplementedError) as exc:
        log.warning("could not abort the process group (%s); it is destroyed instead", exc)
        return False
    return True


class PeerWatch:
    """Watches the processes of a group's other members and calls ``on_dead(pid)`` once, from a
    daemon thread, as soon as one is gone (docs/architecture.md §6: an NCCL collective whose peer
    died blocks until its timeout; the survivor aborts its communicator instead, so its collective
    fails at once, its denoising state rolls back to the last completed step, and the group
    re-forms without the dead member). Members of a group share a node, so their pids are
    local."""

    def __init__(self, pids: list[int], on_dead: Callable[[int], None], interval_s: float = 0.1):
        import threading

        self.pids = [int(p) for p in pids if int(p) > 0]
        self.on_dead = on_dead
        self.interval_s = interval_s
        self._stop = threading.Event()
        self.dead: int | None = None
        self._thread = threading.Thread(target=self._run, name="sp-peer-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for pid in self.pids:
                if not _pid_alive(pid):
                    self.dead = pid
                    if not self._stop.is_set():
                        self.on_dead(pid)
                    return

    def stop(self) -> None:
        self._stop.set()
        import threading

        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class SPGroupMember:
    """One process's membership in an SP group; owns the process group and the (parallel)
    transformer of the run's model family.

    Args:
        model_cfg: the run's ``[model]`` section (the family, its checkpoint and dtype).
        worker_id: this worker's id (its position in ``GroupSpec.members`` is its rank).
        device: where the transformer runs (``cpu`` → gloo, ``cuda:i`` → NCCL).
        text_dim: width D of the tiny family's text embeddings (other families read theirs
            from the checkpoint).
        lora: LoRA settings (:func:`spotlight.models.lora.lora_spec`); ``{}`` = a version is
            the whole transformer. With LoRA a version is the adapter alone and every member
            keeps one frozen base read from the checkpoint.
        timeout_s: rendezvous / collective timeout of the process group.
        watch_peers: abort the communicator when a peer's process dies (:class:`PeerWatch`);
            None = on NCCL only (gloo notices a dead peer by itself).
        backend: ``cluster.sp_backend``: ``"diffusers"`` (its context parallelism) or ``"xfuser"``
            (xDiT's process groups and model wrapper, CUDA only:
            :mod:`spotlight.workers.sp.xfuser_backend`).
        cfg_parallel: with true CFG, an even-sized group runs the positive rows on its first
            half of ranks and the negative rows on its second (one all-gather per step), each
            half splitting its sequence Ulysses-wise over ``degree / 2`` ranks
            (``cluster.sp_cfg_parallel``; docs/architecture.md §6).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        worker_id: str,
        device: torch.device,
        *,
        text_dim: int = 384,
        lora: dict | None = None,
        timeout_s: float = 120.0,
        watch_peers: bool | None = None,
        cfg_parallel: bool = False,
        backend: str = "diffusers",
    ):
        from spotlight.models.families import get_family

        self.model_cfg = model_cfg
        self.family = get_family(model_cfg, text_dim=text_dim)
        self.worker_id = worker_id
        self.text_dim = text_dim
        self.lora = dict(lora or {})
        self.timeout_s = timeout_s
        self.watch_peers = watch_peers
        self.cfg_parallel = cfg_parallel
        if backend not in ("diffusers", "xfuser"):
            raise ValueError(f"SP backend must be 'diffusers' or 'xfuser', got {backend!r}")
        self.sp_backend = backend
        self._xfuser = None  # XfuserAdapter, made on the first form (it needs the device)
        self.dtype: torch.dtype | None = None
        self._entries: list[Entry] | None = None
        self._base_names: dict[str, str] = {}
        self._set_device(device)
        self.spec: GroupSpec | None = None
        self.rank: int = -1
        self.model = None
        self.weights_version: int | None = None
        self._state: dict[str, torch.Tensor] | None = None  # the version's tensors as kept
        self._compute: dict[str, torch.Tensor] | None = None  # … on the device, in the family dtype
        self._base: dict[str, torch.Tensor] | None = None  # LoRA: frozen base, model names, on the device
        self._plain = None  # the SP-1 model object, reused while the weights stay the same
        self._xmodel = None  # xfuser: the SP>1 model object, reused across re-forms while the weights stay
        self._recv_flat: dict[torch.dtype, torch.Tensor] | None = None  # pre-faulted by prewarm()
        self._shape = None
        self._source: str = ""
        self._broken = False
        self._watch: PeerWatch | None = None
        self.cache_threshold: float = 0.0
        """First-Block-Cache threshold of the current batch (0 = off), see :meth:`begin_batch`."""
        self.cache_supported = False
        """Whether the current model has First Block Cache installed (>= 2 transformer blocks)."""
        self.cache_skips = 0
        """Forwards whose tail blocks were skipped by the cache (monotonic; the leader diffs it)."""
        self.last_header_s = time.monotonic()
        """When the leader last sent the followers a header (:func:`keepalive`)."""
        self.keepalive_s = min(10.0, timeout_s / 4)
        """Longest a leader stays silent while its group idles (:func:`keepalive`)."""
        self.form_timings_s: dict[str, float] = {}
        """Seconds spent in each phase of the last :meth:`form`: ``teardown`` (old group),
        ``rendezvous`` (new process group; 0 at SP 1, which needs none), ``weights``
        (exchange), ``build`` (model object)."""

    def _set_device(self, device) -> None:
        from spotlight.models.families import torch_dtype

        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        dtype = torch_dtype(self.model_cfg.dtype, self.device)
        if dtype != self.dtype:
            self._entries = None  # the layout's dtypes follow the family dtype on this device
        self.dtype = dtype

    # ------------------------------------------------------------ properties
    @property
    def sp_degree(self) -> int:
        return self.spec.world_size if self.spec is not None else 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def weights_source(self) -> str:
        """How the last :meth:`form` got the weights: ``"given"``, ``"memory"`` or ``"broadcast"``."""
        return self._source

    @property
    def shape(self):
        """The model's :class:`~spotlight.workers.sp.degrees.SPShape` (heads, tokens; read once)."""
        if self._shape is None:
            self._shape = sp_shape(self.family)
        return self._shape

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The kept weight version (the adapter alone with LoRA): the tensors handed in, or the
        views into the buffers they were received in. Raises ``RuntimeError`` if none are held.
        Do not modify them in place (models alias them)."""
        if self._state is None:
            raise RuntimeError(f"worker {self.worker_id} holds no weights")
        return self._state

    @property
    def cfg_split(self) -> bool:
        """The current generation runs CFG-parallel (:func:`~spotlight.workers.sp.degrees.cfg_split`)."""
        return self.spec is not None and cfg_split(self.shape, self.spec.world_size, self.cfg_parallel)

    @property
    def ulysses_degree(self) -> int:
        """Ranks that split one forward's sequence: the degree, or half of it under CFG-parallel."""
        return self.sp_degree // 2 if self.cfg_split else self.sp_degree

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def mark_broken(self) -> None:
        """A collective of the current generation failed: the next teardown aborts the
        communicator instead of waiting on it (NCCL)."""
        self._broken = True

    # ------------------------------------------------------------ warm spare
    def prewarm(self, *, preallocate: bool = True) -> None:
        """Prepare a member that will receive its weights by broadcast (a warm spare, before
        it is assigned a GPU): derive the tensor layout from a weightless skeleton (first-use
        costs of the model class), read the model's SP shape, and on the CPU pre-fault the
        receive buffers (``preallocate``), so none of it happens while a group waits.

        Never touches CUDA. Raises ``ModelLoadError`` if the checkpoint's config cannot be read.
        """
        entries = self._skeleton_entries()
        _ = self.shape
        if preallocate and self.device.type == "cpu":
            self._recv_flat = {dt: torch.zeros(total, dtype=dt) for dt, total, _ in _layout(entries)}

    def reassign(self, worker_id: str, device: torch.device | str) -> None:
        """Give a prepared member (a warm spare's) its worker id and device once assigned.

        Raises:
            RuntimeError: the member already formed a group or holds weights.
        """
        if self.spec is not None or self._state is not None:
            raise RuntimeError(f"member {self.worker_id} is in use; only an unused member can be reassigned")
        self.worker_id = worker_id
        self._set_device(device)
        if self.device.type != "cpu":
            self._recv_flat = None  # NCCL receives into device memory

    # ------------------------------------------------------------ membership
    def form(self, spec: GroupSpec, *, state_dict: dict | None = None, version: int | None = None) -> None:
        """(Re)join the group described by ``spec`` (collective over ``spec.members``).

        A group of one needs no process group: it only drops the old one and takes the
        weights in memory (the SP-1 model object is reused while they stay the same).

        Args:
            spec: the new generation; this worker must be one of its members.
            state_dict: a weight version to use from now on (``weights_source = "given"``): the
                whole transformer, or with LoRA the adapter; used as it is (no host copy).
                None keeps the weights already in memory, or receives them from rank 0.
            version: weight version of ``state_dict`` (members whose version differs from
                rank 0's receive rank 0's weights); None keeps the current one.

        Raises:
            ValueError: this worker is not in ``spec``, the degree cannot split the model, or
                ``state_dict`` does not fit the architecture (raised before any collective,
                identically on every member).
            SPGroupError: rank 0 holds no weights, or members build different architectures.
        """
        if self.worker_id not in spec.members:
            raise ValueError(f"worker {self.worker_id!r} is not a member of {spec.members}")
        problem = degree_problem(self.shape, spec.world_size, cfg_parallel=self.cfg_parallel)
        if problem:
            raise ValueError(problem)
        given = self._adopt(state_dict) if state_dict is not None else None
        t0 = time.perf_counter()
        self._teardown()
        t1 = time.perf_counter()
        if given is not None:
            self._keep(*given, version=version)
            self._source = "given"
        elif self._state is not None:
            self._source = "memory"
            if version is not None:
                self.weights_version = version
        self.rank = spec.members.index(self.worker_id)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if spec.world_size > 1:
            self._init_process_group(spec)
        self.spec = spec
        self.last_header_s = time.monotonic()
        t2 = time.perf_counter()
        try:
            if spec.world_size > 1:
                self._exchange_weights()
            elif self._state is None:
                raise SPGroupError(f"worker {self.worker_id} forms a group of one but holds no weights")
            t3 = time.perf_counter()
            self.model = self._build_model(spec.world_size)
        except BaseException:
            self._teardown()
            raise
        t4 = time.perf_counter()
        self.form_timings_s = {"teardown": t1 - t0, "rendezvous": t2 - t1, "weights": t3 - t2, "build": t4 - t3}
        log.info(
            "worker %s: formed generation %d, rank %d/%d, weights from %s",
            self.worker_id,
            spec.generation,
            self.rank,
            spec.world_size,
            self._source,
        )

    def _init_process_group(self, spec: GroupSpec) -> None:
        """Join ``spec``'s process group as ``self.rank`` (the rendezvous store listens on
        ``spec.master_addr`` only); an NCCL group is bound to this worker's GPU (``device_id``).
        Starts watching the peers' processes (:class:`PeerWatch`) where asked."""
        from spotlight.workers.sp.rendezvous import bound_store

        device_id = None
        if self.backend == "nccl":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            device_id = torch.device("cuda", index)

        dist.init_process_group(
            self.backend,
            store=bound_store(
                spec.master_addr,
                spec.master_port,
                self.rank,
                spec.world_size,
                datetime.timedelta(seconds=self.timeout_s),
            ),
            rank=self.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            device_id=device_id,
        )
        if self.sp_backend == "xfuser":
            split = cfg_split(self.shape, spec.world_size, self.cfg_parallel)
            self._xfuser_adapter().setup(
                self.rank,
                spec.world_size,
                ulysses_degree=spec.world_size // 2 if split else spec.world_size,
                cfg_degree=2 if split else 1,
            )
        watch = self.backend == "nccl" if self.watch_peers is None else self.watch_peers
        peers = [p for i, p in enumerate(spec.pids) if i != self.rank]
        if watch and peers:
            self._watch = PeerWatch(peers, self._peer_died)

    def _xfuser_adapter(self):
        if self._xfuser is None:
            from spotlight.workers.sp.xfuser_backend import XfuserAdapter

            self._xfuser = XfuserAdapter(self.family.name, self.device)
        return self._xfuser

    def _peer_died(self, pid: int) -> None:
        """:class:`PeerWatch`'s callback (its thread): abort the communicator now."""
        log.warning("worker %s: group peer pid %d is gone; aborting the communicator", self.worker_id, pid)
        self._broken = True
        abort_communicator()

    def leave(self) -> None:
        """Destroy this process's process group and parallel model (weights stay in memory)."""
        self._teardown()

    def _teardown(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self.model is not None:
            _clear_method_caches(self.model)
        self.model = None  # its hooks hold the old mesh; never reuse a parallelised object
        if dist.is_available() and dist.is_initialized():
            if self._broken and self.backend == "nccl":
                # a dead peer's communicator: waiting on it (destroy) could block until the
                # timeout and let the watchdog kill this survivor; abort it (NCCL)
                abort_communicator()
        if self._xfuser is not None:
            self._xfuser.teardown()  # xfuser's groups go with ours (re-formed every generation)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self._broken = False
        self.spec = None
        self.rank = -1

    # ------------------------------------------------------------ weights
    def _skeleton(self, world: int = 1):
        """A fresh transformer of the family with every parameter on ``meta`` (and the LoRA
        adapter, with LoRA), eval mode: what a model object is built from. With the xfuser
        backend a group of several builds xfuser's wrapper class (same config and names)."""
        if world > 1 and self.sp_backend == "xfuser":
            from accelerate import init_empty_weights

            with init_empty_weights(include_buffers=False):
                model = self._xfuser_adapter().model_class().from_config(self.family.transformer_config())
        else:
            model = self.family.build_empty_transformer()
        if self.lora:
            from spotlight.models.lora import add_lora

            add_lora(model, self.lora, self.family.default_lora_targets, seed=self.model_cfg.init_seed)
        return model.eval()

    def _skeleton_entries(self) -> list[Entry]:
        """(name, shape, dtype) of every tensor of a weight version (with LoRA: the adapter's),
        sorted by name, in this member's dtype, from a weightless skeleton (cached)."""
        if self._entries is None:
            sd = self._skeleton().state_dict()
            names = [n for n in sorted(sd) if not self.lora or "lora_" in n]
            self._entries = [
                (n, tuple(sd[n].shape), self.dtype if sd[n].is_floating_point() else sd[n].dtype) for n in names
            ]
            # peft renames an adapted Linear's weight to ``….base_layer.weight``; checkpoints have ``….weight``
            self._base_names = {n: n.replace(".base_layer", "") for n in sd if "lora_" not in n} if self.lora else {}
        return self._entries

    def _adopt(self, state_dict: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """``(kept, compute)`` for a weight version handed in: ``kept`` is ``state_dict`` itself,
        ``compute`` the same tensors on the device in the family dtype (the very same tensors,
        no copy, where they already are).

        Raises:
            ValueError: names or shapes are not the architecture's (the adapter alone with LoRA).
        """
        from spotlight.models.lora import WeightVersionError

        entries = self._skeleton_entries()
        want = {n: (s, d) for n, s, d in entries}
        missing, unknown = sorted(set(want) - set(state_dict)), sorted(set(state_dict) - set(want))
        what = "LoRA adapter" if self.lora else "transformer"
        if missing or unknown:
            raise WeightVersionError(
                f"weight version does not fit the {self.family.transformer_class} {what}: {len(missing)} missing "
                f"(e.g. {missing[:3]}), {len(unknown)} unknown (e.g. {unknown[:3]})"
            )
        compute = {}
        for n, (shape, dt) in want.items():
            t = state_dict[n]
            if tuple(t.shape) != shape:
                raise WeightVersionError(f"weight version: {n} has shape {tuple(t.shape)}, the model {shape}")
            compute[n] = aligned(t.to(self.device, dt))  # on the CPU: a mapped tensor off 64 bytes is copied
        return state_dict, compute

    def _keep(self, state: dict, compute: dict, *, version: int | None) -> None:
        """Make ``state`` the kept version and ``compute`` what models are built from; models
        built before keep theirs."""
        self._state, self._compute = state, compute
        self.weights_version = version
        self._plain = self._xmodel = None

    def _base_state(self) -> dict[str, torch.Tensor]:
        """LoRA: the frozen base under the model's names, on the device in the family dtype,
        read once: the checkpoint's ``transformer/*.safetensors`` through a memory map (on the
        CPU a tensor the file puts on a 64-byte boundary is the mapped tensor itself, shared
        through the node's page cache; one off it is an aligned private copy), or for a model
        without weight files (the tiny family built from its config) the family's own seeded
        build.

        Raises:
            ModelLoadError: the checkpoint lacks a base weight.
        """
        if self._base is None:
            self._skeleton_entries()
            files = self.family.transformer_weight_files()
            if files:
                from spotlight.store.tensor_wire import mmap_state_dict

                host: dict[str, torch.Tensor] = {}
                for f in files:
                    host.update(mmap_state_dict(f))
            else:
                host = self.family.build_transformer(self.dtype).state_dict()
            out = {}
            for name, ckpt_name in self._base_names.items():
                t = host.get(ckpt_name)
                if t is None:
                    from spotlight.models.families import ModelLoadError

                    raise ModelLoadError(f"{self.family.path}: the transformer checkpoint has no {ckpt_name}")
                out[name] = aligned(t.to(self.device, self.dtype if t.is_floating_point() else t.dtype))
            self._base = out
        return self._base

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The tensors a model object is built from (on the device, family dtype)."""
        if not self.lora:
            return self._compute
        return {**self._base_state(), **self._compute}

    def broadcast_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Collective over the formed group: rank 0 keeps ``state_dict`` as ``version`` and
        sends it (an ``OP_WEIGHTS`` header first, so followers in :func:`serve_batch` join); the
        others (``state_dict=None``) receive it into fresh buffers; every member loads it into
        its model. The previous weights are left untouched (the model takes the new tensors
        instead of being overwritten in place), so a caller that still holds the previous
        :meth:`state_dict` (an older version kept for stale-weight exploration) keeps it.

        Raises:
            SPGroupError: a collective failed, or rank 0 passed no weights.
            ValueError: rank 0's weights do not fit the architecture (before anything is sent).
        """
        if self.is_leader:
            if state_dict is None:
                raise SPGroupError("rank 0 must pass the weights to broadcast")
            kept = self._adopt(state_dict)
            if self.sp_degree > 1:
                _bcast_header(self, OP_WEIGHTS, version)
                self._broadcast_tensors(kept[1], receiving=False)
            self._keep(*kept, version=version)
        else:
            got = self._broadcast_tensors(None, receiving=True)
            self._keep(got, got, version=version)
        self._load_into_model()

    def _load_into_model(self) -> None:
        """Point the current model's parameters at the kept weights (no in-place copy)."""
        if self.model is None:
            return
        self.model.load_state_dict(self._model_state(), strict=True, assign=True)
        if self.sp_degree == 1:
            self._plain = self.model  # still the plain model, now of these weights
        elif self.sp_backend == "xfuser":
            self._xmodel = self.model

    def _exchange_weights(self) -> None:
        world = self.spec.world_size
        dev = self._comm_device
        have = self._state is not None
        mine = torch.tensor(
            [
                int(have),
                self.weights_version if self.weights_version is not None else -1,
                _fingerprint(self._skeleton_entries()),
            ],
            dtype=torch.int64,
            device=dev,
        )
        flags = [torch.zeros(3, dtype=torch.int64, device=dev) for _ in range(world)]
        dist.all_gather(flags, mine)
        flags = [tuple(int(x) for x in f.cpu()) for f in flags]
        if flags[0][0] == 0:
            raise SPGroupError(f"rank 0 ({self.spec.members[0]}) of generation {self.spec.generation} holds no weights")
        other = [self.spec.members[r] for r in range(world) if flags[r][2] != flags[0][2]]
        if other:
            raise SPGroupError(
                f"members {other} build another model than rank 0 ({self.spec.members[0]}): every member of a group "
                "must run the same config (model section, LoRA settings, dtype)"
            )
        receivers = [r for r in range(world) if flags[r][:2] != flags[0][:2]]
        if not receivers:
            return
        # members that already hold rank 0's version stay out of the transfer (a subgroup;
        # new_group is itself collective, so every rank takes part in creating it)
        group = None if len(receivers) == world - 1 else dist.new_group(ranks=[0, *receivers])
        try:
            if self.rank in receivers:
                got = self._broadcast_tensors(None, receiving=True, group=group)
                self._keep(got, got, version=None if flags[0][1] < 0 else flags[0][1])
                self._source = "broadcast"
            elif self.rank == 0:
                self._broadcast_tensors(self._compute, receiving=False, group=group)
        finally:
            if group is not None:
                dist.destroy_process_group(group)

    def _broadcast_tensors(self, tensors: dict | None, *, receiving: bool, group=None):
        """Rank 0's version tensors → receivers (``group``: rank 0 and the receivers; None = the
        whole group), one ``dist.broadcast`` per tensor in name order, straight into one flat
        buffer per dtype on the receiver's compute device (no pickle: names, shapes and dtypes
        come from each member's own skeleton). Returns the received views on a receiver."""
        dev = self._comm_device
        entries = self._skeleton_entries()
        if receiving:
            layout = _layout(entries)
            flat = {}
            for dt, total, _ in layout:
                buf = self._recv_flat.pop(dt, None) if (self._recv_flat and dev.type == "cpu") else None
                if buf is None or buf.numel() != total:
                    buf = torch.empty(total, dtype=dt, device=dev)
                flat[dt] = buf
            self._recv_flat = None
            views = _views(flat, layout)
            for name, _, _ in entries:
                dist.broadcast(views[name], src=0, group=group)
            return views
        for name, _, dt in entries:
            t = tensors[name]
            if t.device != dev or t.dtype != dt or not t.is_contiguous():
                t = t.to(device=dev, dtype=dt).contiguous()
            dist.broadcast(t, src=0, group=group)
        return None

    # ------------------------------------------------------------ model objects
    def _build_model(self, world: int):
        """The transformer object for a group of ``world``: at SP 1 the plain model, reused while
        the weights stay the same; otherwise a fresh object (diffusers' ``enable_parallelism``
        binds it to this generation's mesh) whose parameters are the kept weights. First
        Block Cache is installed on every fresh object (off until :meth:`begin_batch` sets a
        threshold) before it is parallelised (module docstring: the cache must sit inside the
        split hooks)."""
        if world == 1 and self._plain is not None:
            return self._plain
        if world > 1 and self._xmodel is not None:
            # xfuser's wrapper reads its groups at every forward: one object survives re-forms
            self.cache_threshold = 0.0
            return self._xmodel
        model = self._skeleton(world)
        model.load_state_dict(self._model_state(), strict=True, assign=True)
        model = model.to(self.device).eval().requires_grad_(False)
        self.cache_threshold = 0.0
        self.cache_supported = self._install_cache(model)
        ulysses = self.ulysses_degree if world > 1 else 1
        if ulysses > 1 and self.sp_backend == "diffusers":
            from diffusers import ContextParallelConfig

            mesh = None
            if self.cfg_split:  # two halves (positive, negative rows), each a Ulysses group
                from torch.distributed.device_mesh import init_device_mesh

                kind = "cuda" if self.device.type == "cuda" else "cpu"
                mesh = init_device_mesh(kind, (2, 1, ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
            with _cpu_device_count_patch():
                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, mesh=mesh))
            if self.cache_supported:
                from diffusers.hooks import HookRegistry

                # the split hooks were registered on blocks after the cache's: drop stale child lists
                HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()
        elif world == 1:
            self._plain = model
        elif self.sp_backend == "xfuser":
            self._xmodel = model
        return model

    def blocks(self, model=None) -> list:
        """The transformer's blocks in the order they run (every list of the family's
        ``block_names``: FLUX's double-stream, then single-stream blocks)."""
        model = self.model if model is None else model
        return [b for name in self.family.block_names for b in getattr(model, name, [])]

    def _install_cache(self, model) -> bool:
        """First Block Cache with the group-wide decision; False (no cache) for a model that has
        no cache support (no ``enable_cache``) or fewer than two blocks in all (diffusers needs a
        head and a tail block)."""
        blocks = self.blocks(model)
        if len(blocks) < 2 or not hasattr(model, "enable_cache"):
            return False
        from diffusers.hooks import FirstBlockCacheConfig
        from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

        model.enable_cache(FirstBlockCacheConfig(threshold=0.0))  # the real threshold: _GroupCacheDecision
        hook = blocks[0]._diffusers_hook.get_hook(_FBC_LEADER_BLOCK_HOOK)
        hook._should_compute_remaining_blocks = _GroupCacheDecision(self, hook)
        return True

    def begin_batch(self, cache_threshold: float) -> None:
        """Set the First-Block-Cache threshold of the next batch (0 = off) and clear the
        cache state, so its first step computes fully. Every member calls it at the start
        of a batch (the leader in :func:`run_group_batch`, followers on ``OP_BATCH``)."""
        if self.model is None:
            raise RuntimeError(f"worker {self.worker_id} is not in a formed group")
        threshold = float(cache_threshold)
        if threshold < 0 or threshold != threshold:
            raise ValueError(f"cache threshold must be >= 0, got {cache_threshold!r}")
        self.cache_threshold = threshold if self.cache_supported else 0.0
        if self.cache_supported:
            self.model._reset_stateful_cache()

    # ------------------------------------------------------------ compute
    def _key_order(self, ulysses: int) -> Callable[[Conditioning, Conditioning], contextlib.AbstractContextManager]:
        """``key_order(cond, padded)``: the context a forward at this Ulysses degree runs in, so the
        group computes what one worker computes (:mod:`spotlight.workers.sp.invariant`); a no-op
        at degree 1 or with the xfuser backend. ``padded``: ``cond`` after :func:`pad_text`.

        Raises (from the context): ValueError for a negative prompt of another text length
        (a CFG-parallel rank takes the prompts' length for it)."""
        if not (ulysses > 1 and self.sp_backend == "diffusers" and invariant.install()):
            return lambda cond, padded: contextlib.nullcontext()

        def key_order(cond: Conditioning, padded: Conditioning):
            text = cond.embeds.shape[1]
            neg = cond.extra.get("neg.embeds")
            if neg is not None and neg.shape[1] != text:
                raise ValueError(f"negative prompt of {neg.shape[1]} tokens, prompts of {text}: encode both alike")
            return invariant.joint_key_order(padded.embeds.shape[1], ulysses, padded.embeds.shape[1] - text)

        return key_order

    def velocity_fn(self) -> Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]:
        """``velocity_fn(latents [B, *latent_shape], sigma [B], cond) -> v`` on the group: the
        family's own velocity (its guidance included) through the parallel model.

        Same signature as :meth:`~spotlight.models.families.base.ModelFamily.make_velocity_fn`'s
        result. With ``sp_degree > 1`` every rank must call it with the same inputs (see
        :func:`run_group_batch`); every rank gets the full output, on the device of
        ``latents``. A family with a text mask has its text padded with masked zero tokens to a
        multiple of the degree.

        Raises:
            RuntimeError: the member is not in a formed group.
        """
        if self.model is None:
            raise RuntimeError(f"worker {self.worker_id} is not in a formed group")
        model, family, device = self.model, self.family, self.device
        world, ulysses = self.sp_degree, self.ulysses_degree
        # xfuser's wrapper pads (or replicates) the text itself
        pad = ulysses > 1 and self.shape.pads_text and self.sp_backend == "diffusers"
        cached = self.cache_supported
        if self.cfg_split:
            return self._cfg_parallel_velocity_fn(pad)

        key_order = self._key_order(ulysses)

        def velocity_fn(latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
            c = pad_text(cond, world) if pad else cond
            with key_order(cond, c), model.cache_context("sp") if cached else contextlib.nullcontext():
                out = family.velocity(model, latents.to(device), sigma.to(device), c.to(device))
            return out.to(latents.device)

        return velocity_fn

    def _cfg_parallel_velocity_fn(self, pad: bool):
        """CFG-parallel: this rank's half computes its branch (positive or negative rows) of the
        batch, one ``all_gather`` brings both branches to every rank, and the family combines them
        (:meth:`~spotlight.models.families.qwen_image.QwenImageFamily.combine_cfg`)."""
        model, family, device = self.model, self.family, self.device
        world, half = self.sp_degree, self.sp_degree // 2
        branch = "pos" if self.rank < half else "neg"
        cached, comm = self.cache_supported, self._comm_device

        key_order = self._key_order(self.ulysses_degree)

        def velocity_fn(latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
            c = pad_text(cond, half) if pad else cond
            with key_order(cond, c), model.cache_context("sp") if cached else contextlib.nullcontext():
                mine = family.velocity_branch(model, latents.to(device), sigma.to(device), c.to(device), branch)
            parts = [torch.empty_like(mine, device=comm) for _ in range(world)]
            dist.all_gather(parts, mine.to(comm).contiguous())
            return family.combine_cfg(parts[0], parts[half]).to(latents.device)

        return velocity_fn


_TEXT_PAIRS = (("embeds", "mask"), ("neg.embeds", "neg.mask"))


def pad_text(cond: Conditioning, multiple: int) -> Conditioning:
    """``cond`` with its text (and the negative prompt's) padded with masked zero tokens to a
    multiple of ``multiple`` tokens: exact for a transformer that masks its text keys
    (Qwen-Image; text RoPE positions are by index, so real tokens keep theirs)."""

    def padded(embeds: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = (-embeds.shape[1]) % multiple
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        if not n:
            return embeds, mask
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, n))
        return embeds, torch.cat([mask, mask.new_zeros((mask.shape[0], n))], dim=1)

    embeds, mask = padded(cond.embeds, cond.mask)
    extra = dict(cond.extra)
    if "neg.embeds" in extra:
        extra["neg.embeds"], extra["neg.mask"] = padded(extra["neg.embeds"], extra.get("neg.mask"))
    return Conditioning(embeds, mask, extra)


# ---------------------------------------------------------------- batch protocol


def _bcast_header(member: SPGroupMember, op: int, *fields: int) -> None:
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    h[0] = op
    for i, f in enumerate(fields):
        h[1 + i] = int(f)
    dist.broadcast(h.to(member._comm_device), src=0)
    member.last_header_s = time.monotonic()


def keepalive(member: SPGroupMember) -> bool:
    """Leader of a group of several, outside a batch: send ``OP_IDLE`` when nothing was sent for
    :attr:`SPGroupMember.keepalive_s`. Followers wait for the next header inside a broadcast, which
    times out after the group's timeout (gloo and NCCL alike) and would break an idle group.
    Returns True when one was sent.

    Raises:
        SPGroupError: the broadcast failed (the group broke).
    """
    if not member.is_leader or member.sp_degree <= 1:
        return False
    if time.monotonic() - member.last_header_s < member.keepalive_s:
        return False
    try:
        _bcast_header(member, OP_IDLE)
    except RuntimeError as exc:
        member.mark_broken()
        raise SPGroupError(f"SP group generation {member.spec.generation} broke while idle: {exc}") from exc
    return True


def _recv_header(member: SPGroupMember) -> list[int]:
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=member._comm_device)
    dist.broadcast(h, src=0)
    return [int(x) for x in h.cpu()]


def _bcast(member: SPGroupMember, t: torch.Tensor) -> None:
    dist.broadcast(t.to(member._comm_device).contiguous(), src=0)


def _recv(member: SPGroupMember, shape, dtype) -> torch.Tensor:
    """A tensor broadcast by rank 0, on the group's communication device."""
    t = torch.empty(tuple(shape), dtype=dtype, device=member._comm_device)
    dist.broadcast(t, src=0)
    return t


def _tensor_meta(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(meta int64[n, 8], names uint8[…])`` describing ``tensors``: per row the dtype code, the
    number of dimensions, the name's byte length and the shape.

    Raises:
        ValueError: a dtype without a code, or more than 5 dimensions (before anything is sent).
    """
    meta = torch.zeros(len(tensors), _HEADER_LEN, dtype=torch.int64)
    names = b""
    for i, (name, t) in enumerate(tensors.items()):
        raw = name.encode()
        if t.dtype not in _DTYPE_CODES or t.dim() > _HEADER_LEN - 3:
            raise ValueError(f"conditioning tensor {name}: {t.dtype} [{tuple(t.shape)}] cannot be sent to the group")
        meta[i, 0], meta[i, 1], meta[i, 2] = _DTYPE_CODES[t.dtype], t.dim(), len(raw)
        for j, s in enumerate(t.shape):
            meta[i, 3 + j] = int(s)
        names += raw
    return meta, torch.frombuffer(bytearray(names), dtype=torch.uint8) if names else torch.zeros(0, dtype=torch.uint8)


def _bcast_batch(member: SPGroupMember, cond: Conditioning) -> None:
    """Leader: open a batch on the followers: an OP_BATCH header (tensor count, name bytes,
    the cache threshold), the tensors' descriptions, then every conditioning tensor."""
    tensors = {k: v.contiguous() for k, v in cond.to_tensors().items()}
    meta, names = _tensor_meta(tensors)
    _bcast_header(member, OP_BATCH, len(tensors), names.numel(), _threshold_to_int(member.cache_threshold))
    _bcast(member, meta)
    if names.numel():
        _bcast(member, names)
    for t in tensors.values():
        _bcast(member, t)


def _recv_batch(member: SPGroupMember, n: int, names_len: int) -> Conditioning:
    """Follower: the conditioning tensors :func:`_bcast_batch` sent."""
    meta = _recv(member, (n, _HEADER_LEN), torch.int64).cpu()
    raw = bytes(_recv(member, (names_len,), torch.uint8).cpu().tolist()) if names_len else b""
    tensors, pos = {}, 0
    for row in meta.tolist():
        code, ndim, name_len = row[:3]
        if code not in _CODE_DTYPES or not 0 <= ndim <= _HEADER_LEN - 3:
            raise SPGroupError(f"malformed batch description from the leader: {row}")
        name = raw[pos : pos + name_len].decode()
        pos += name_len
        tensors[name] = _recv(member, row[3 : 3 + ndim], _CODE_DTYPES[code])
    return Conditioning.from_tensors(tensors)


def serve_batch(member: SPGroupMember) -> bool:
    """Follower side of one batch: mirror the leader's forwards until ``OP_END`` (weight
    versions sent in between, ``OP_WEIGHTS``, are received and loaded).

    A forward that raises on this member (the model, not the group) is logged and the batch
    continues to be followed: the leader ends it (its forward raised too) or the group breaks.

    Returns:
        True after a batch ended, False when the leader sent ``OP_RELEASE``.

    Raises:
        SPGroupError: a collective failed (the leader or another peer died).
    """
    cond: Conditioning | None = None
    vfn = None
    try:
        while True:
            op, *f = _recv_header(member)
            if op == OP_RELEASE:
                return False
            if op == OP_END:
                return True
            if op == OP_IDLE:
                continue
            if op == OP_WEIGHTS:
                member.broadcast_weights(None, f[0])
            elif op == OP_BATCH:
                member.begin_batch(_threshold_from_int(f[2]))
                cond = _recv_batch(member, f[0], f[1])
                vfn = member.velocity_fn()
            elif op == OP_STEP:
                if cond is None:
                    raise SPGroupError("OP_STEP before OP_BATCH")
                ndim = f[0]
                if not 1 <= ndim <= _MAX_NDIM:
                    raise SPGroupError(f"malformed OP_STEP header from the leader: {[op, *f]}")
                shape = f[1 : 1 + ndim]
                latents = _recv(member, shape, torch.float32)
                sigma = _recv(member, shape[:1], torch.float32)
                try:
                    with torch.no_grad():
                        vfn(latents, sigma, cond)
                except (SPGroupError, dist.DistError):
                    raise
                except Exception:  # the model's own failure: the leader decides what follows
                    log.exception("worker %s: a forward of the group's batch failed", member.worker_id)
            else:
                raise SPGroupError(f"unknown SP group op {op}")
    except SPGroupError:
        member.mark_broken()
        raise
    except RuntimeError as exc:  # dist.DistError is a RuntimeError
        member.mark_broken()
        raise SPGroupError(
            f"SP group generation {member.spec.generation} broke on follower {member.worker_id}: {exc}"
        ) from exc


def serve_until_released(member: SPGroupMember) -> int:
    """Follower loop: serve batches until the leader releases the group. Returns batches served."""
    n = 0
    while serve_batch(member):
        n += 1
    return n


def release_followers(member: SPGroupMember) -> None:
    """Leader: tell followers to stop serving (before a re-form, or before they leave)."""
    if member.is_leader and member.sp_degree > 1:
        _bcast_header(member, OP_RELEASE)


def run_group_batch(
    member: SPGroupMember,
    sampler: Sampler | None,
    state: DenoiseState | None,
    cond: Conditioning | None,
    *,
    stop_at: int | None = None,
    should_stop: Callable[[DenoiseState], bool] | None = None,
    cache_threshold: float = 0.0,
    on_step: Callable[[DenoiseState], None] | None = None,
) -> DenoiseState | None:
    """Denoise ``state`` over the group (leader) or mirror the leader's forwards (follower).

    On the leader (rank 0) this runs ``sampler.advance`` until ``state.step`` reaches
    ``stop_at`` (default: the last step) or ``should_stop(state)`` is True between steps,
    broadcasting the transformer inputs so followers join every parallel forward;
    ``on_step(state)`` is called after every completed step. On a
    follower it ignores ``sampler``/``state``/``cond``, serves one batch and returns None.

    ``cache_threshold`` (leader; > 0 only for exploration) runs the batch with First Block
    Cache at that threshold on every member (module docstring); a step whose tail blocks
    were skipped does not count in ``state.computed_steps``. The cache state starts empty
    at every call, so a batch continued after a re-form recomputes its next step fully.

    Returns:
        The leader's ``state`` (advanced in place), or None on a follower.

    Raises:
        SPGroupError: a collective failed (a peer died). The leader's state is rolled back
            to the last completed step first, so it can continue after a re-form.
        Exception: a step failed for another reason (the model raised): the state is rolled
            back, the followers were told the batch ended, and the group stays formed.
    """
    if not member.is_leader:
        serve_batch(member)
        return None
    end = sampler.cfg.num_steps if stop_at is None else min(stop_at, sampler.cfg.num_steps)
    member.begin_batch(cache_threshold)
    vfn = member.velocity_fn()
    world = member.sp_degree

    step_fn = _broadcasting_step_fn(member, vfn) if world > 1 else vfn
    try:
        if world > 1:
            _bcast_batch(member, cond)
        with torch.no_grad():
            while state.step < end:
                if should_stop is not None and should_stop(state):
                    break
                _advance_or_roll_back(member, sampler, state, step_fn, cond)
                if on_step is not None:
                    on_step(state)
        if world > 1:
            _bcast_header(member, OP_END)
    except SPGroupError:
        member.mark_broken()
        raise
    except Exception as exc:
        if world == 1:
            raise
        broke = f"SP group generation {member.spec.generation} broke at step {state.step}: {exc}"
        if isinstance(exc, dist.DistError):
            member.mark_broken()
            raise SPGroupError(broke) from exc
        try:  # the model raised: end the batch on the followers (this fails too if the group broke)
            _bcast_header(member, OP_END)
        except Exception:
            member.mark_broken()
            raise SPGroupError(broke) from exc
        raise
    return state


def _broadcasting_step_fn(member: SPGroupMember, vfn: Callable) -> Callable:
    """The leader's velocity function for a group of several: each call first broadcasts an
    OP_STEP header (the latents' shape) and the step's latents and sigma so that followers join
    the forward."""

    def step_fn(latents, sigma, cond_):
        shape = tuple(int(s) for s in latents.shape)
        if not 1 <= len(shape) <= _MAX_NDIM:
            raise ValueError(f"latents of shape {shape} cannot be sent to the group")
        _bcast_header(member, OP_STEP, len(shape), *shape)
        _bcast(member, latents.float())
        _bcast(member, sigma.float().reshape(-1).expand(shape[0]))
        return vfn(latents, sigma, cond_)

    return step_fn


def _advance_or_roll_back(
    member: SPGroupMember, sampler: Sampler, state: DenoiseState, step_fn: Callable, cond: Conditioning
) -> None:
    """One denoising step of ``state``; a step whose tail blocks the cache skipped is not
    counted in ``state.computed_steps``. If the step raises, ``state`` is restored to the
    last completed step before the exception propagates."""
    snap = (
        state.step,
        state.latents,
        len(state.window_latents),
        len(state.log_probs),
        state.computed_steps.clone(),
    )
    try:
        skips = member.cache_skips
        sampler.advance(state, step_fn, cond)
        if member.cache_skips != skips:  # the cache skipped the tail blocks
            state.computed_steps -= 1
    except Exception:
        state.step, state.latents = snap[0], snap[1]
        del state.window_latents[snap[2] :]
        del state.log_probs[snap[3] :]
        state.computed_steps = snap[4]
        raise
