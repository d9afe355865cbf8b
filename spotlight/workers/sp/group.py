"""Elastic sequence-parallel (SP) Rollout Worker groups (paper §3.2.2 "Insight 2", §4.4, §5).

A Rollout Worker *group* is k processes on one node that run one transformer with
diffusers' native context parallelism (Ulysses, ``ContextParallelConfig(ulysses_degree=k)``
applied through the model's ``_cp_plan``) over a ``torch.distributed`` process group
(gloo on CPU, NCCL on GPUs). The node Scheduler (``spotlight-agent``) decides who is in a
group; this module makes a member follow those decisions without a full restart:

* **shrink** (a GPU is revoked): only that member's process exits. The survivors call
  :meth:`SPGroupMember.form` with the next :class:`GroupSpec`; it destroys the old process
  group, forms a new one at the lower degree and rebuilds the parallel model from the
  full weights the member already keeps in host memory (``weights_source == "memory"``;
  nothing is loaded from disk or from the coordinator). A group of one needs no process
  group and reuses its plain (SP-1) model object while the weights stay the same, so a
  shrink to SP 1 costs no rendezvous and no model build.
* **grow** (a GPU is added): a new process calls :meth:`SPGroupMember.form` with no
  weights; the survivors call it with the same spec. Rank 0 (a member that holds the
  weights; the node Scheduler lists such a member first) broadcasts them over the rebuilt
  group — ``weights_source == "broadcast"``. The paper (§5) uses
  ``torch.distributed._broadcast_coalesced``, which packs tensors into buckets and unpacks
  them on arrival; here every member already *keeps* its weights as one flat buffer per
  dtype, so the transfer is one ``dist.broadcast`` per buffer straight from the sender's
  kept buffer into the receiver's (no packing copy, no unpacking copy), and the receiver's
  tensors are views into what arrived. A warm spare (``spotlight.workers.rollout.spare``)
  pre-faults that receive buffer before it is assigned a GPU (:meth:`SPGroupMember.prewarm`).

Membership change protocol inside :meth:`SPGroupMember.form` (collective: every member of
the new spec calls it with the same spec, in any order; rendezvous is the TCP store of
``tcp://master_addr:master_port``, hosted by rank 0)::

    validate spec (degree vs. heads / image tokens)      local, before any collective,
                                                         so every member fails alike
    destroy previous default process group               local
    k == 1: keep the weights in memory, reuse the plain model; done
    init_process_group(rank = members.index(me))         rendezvous
    all_gather([holds_weights, version])                 every rank learns who lacks them
    if rank 0 holds none  -> SPGroupError on every rank
    if some rank lacks them / holds another version:
        broadcast(version)                                           from rank 0
        broadcast(flat buffer) per dtype, src=0          receivers derive the layout
                                                         (names sorted, shapes, dtypes)
                                                         from a weightless skeleton of
                                                         their own config: no pickle
    build a FRESH model object, load_state_dict(kept, assign=True),
    enable_parallelism(ContextParallelConfig(ulysses_degree=k))

Why a fresh model object for every k > 1 generation: diffusers refuses
``enable_parallelism`` on a model that already has a ``_parallel_config`` ("cannot be called
twice"), and its hooks hold the old device mesh / process group. The skeleton is built under
diffusers' ``no_init_weights()`` (no random init cost) and then takes the kept tensors with
``load_state_dict(..., assign=True)``: on the CPU the parameters *are* the kept tensors
(no copy); on a GPU they are views into one device copy of them, made once per weights and
shared by every model object (received weights arrive on the device directly). (A
``meta``-device skeleton does not work for Qwen-Image: ``QwenEmbedRope.pos_freqs`` /
``neg_freqs`` are plain tensor attributes, not buffers, so they would stay on ``meta``
after loading.)

Known diffusers faults handled here (diffusers 0.42.1, torch 2.13.0+cpu):

* ``ModelMixin._resolve_parallel_config`` (``diffusers/models/modeling_utils.py``, called by
  ``enable_parallelism``) computes
  ``torch.device(device_type, rank % torch.accelerator.device_count())``; with no
  accelerator ``device_count()`` is 0 and this raises ``ZeroDivisionError: integer modulo by
  zero``. :func:`_cpu_device_count_patch` replaces ``torch.accelerator.device_count`` by
  ``lambda: 1`` only while ``enable_parallelism`` runs and only when the real count is 0.
  The resulting ``cpu:0`` is merely recorded (``ContextParallelConfig._device``); nothing
  in diffusers 0.42.1 reads it back. The mesh itself is built with
  ``init_device_mesh(device_type="cpu")`` on the default (gloo) group.
* Ulysses needs the head count and every split sequence to be divisible by the degree
  (``EquipartitionSharder.shard`` only ``assert``\\ s it, and a rank that fails while the
  others enter a collective hangs the group). :meth:`SPGroupMember.form` rejects a degree
  that does not divide ``num_attention_heads`` or the image-token count with a
  ``ValueError`` before any collective; the velocity function pads the text sequence with
  masked zero tokens to a multiple of the degree (exact: padded keys are masked out and
  text RoPE positions are by index, so real tokens keep theirs). diffusers'
  ``ulysses_anything`` was tried and does not help the tiny model (2 heads at degree 3
  fails ``_maybe_pad_qkv_head``'s assertion), so it is not used.

Running a batch over a group (:func:`run_group_batch`): the leader (rank 0) owns the
:class:`~spotlight.rl.sampler.DenoiseState` and drives :class:`~spotlight.rl.sampler.Sampler`;
followers only mirror its transformer calls. Leader → followers, all ``dist.broadcast``
from rank 0 over the group::

    header int64[8] = [OP_BATCH, B, T, D, thr, 0…]  then embeds f32[B, T, D], mask i64[B, T]
                                               (thr: the batch's First-Block-Cache threshold,
                                               float64 bits; every rank resets its cache)
    header          = [OP_STEP,  B, L, C, 0…]  then latents f32[B, L, C], sigma f32[B]
                                               then every rank runs the parallel forward
    header          = [OP_END, 0…]             batch over (followers return)
    header          = [OP_RELEASE, 0…]         stop serving (before a re-form or exit)

Shapes are in the header, so followers allocate exact buffers. When a collective fails
mid-step (a peer died), the leader rolls its state back to the last completed step and
raises :class:`SPGroupError`; the state is then whole at a step boundary and can continue
after a re-form (or be committed to the Tensor Store).

First Block Cache on a group (exploration's reduced effective steps, paper §4.3.1).
diffusers' ``enable_cache`` cannot simply be switched on for a context-parallel model:

* hook order -- its head-block hook computes ``block output - block input`` and must
  see both sharded, i.e. sit inside the context-parallel split hook of
  ``transformer_blocks.0``. Enabled after ``enable_parallelism`` it would be registered
  outside it (the last registered hook is the outermost) and subtract the sharded output
  from the full input. Moving the split hook out again is no remedy: by our reading of
  ``HookRegistry.remove_hook``, removing a hook rewires the next one's ``forward``, which
  for the cache hook is its ``new_forward``. So :meth:`SPGroupMember._build_model`
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
import logging
import struct
import time
from typing import Callable

import torch
import torch.distributed as dist

from spotlight.config import ModelConfig
from spotlight.models.dit import make_velocity_fn, token_shape, transformer_kwargs
from spotlight.rl.sampler import Conditioning, DenoiseState, Sampler

log = logging.getLogger("spotlight.sp_group")

OP_BATCH, OP_STEP, OP_END, OP_RELEASE = 1, 2, 3, 4
_HEADER_LEN = 8


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
    shards, Ulysses equipartition), so the two sums are all-reduced over the group: every
    rank gets the same numbers and takes the same decision, which is the full batch's.
    Threshold <= 0: always compute (no collective). Counts skipped forwards in
    ``member.cache_skips``.
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
    """

    members: tuple[str, ...]
    master_addr: str
    master_port: int
    generation: int

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("GroupSpec.members must not be empty")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"GroupSpec.members has duplicates: {self.members}")

    @property
    def world_size(self) -> int:
        return len(self.members)


def check_sp_degree(model_cfg: ModelConfig, degree: int) -> None:
    """Raise ``ValueError`` if Ulysses cannot split the model ``degree`` ways.

    Ulysses shards the sequence (image and text tokens) and, inside attention, swaps to a
    split over heads, so both must divide evenly. Text tokens are padded by the velocity
    function instead (see module docstring); image tokens cannot be padded (their RoPE
    positions come from the image grid).
    """
    if degree < 1:
        raise ValueError(f"SP degree must be >= 1, got {degree}")
    if degree == 1:
        return
    heads = model_cfg.num_attention_heads
    if heads % degree:
        raise ValueError(
            f"SP degree {degree} does not divide num_attention_heads={heads}: Ulysses splits heads "
            f"across ranks; use a degree in {[d for d in range(1, heads + 1) if heads % d == 0]}"
        )
    n_img, _ = token_shape(model_cfg)
    if n_img % degree:
        raise ValueError(f"SP degree {degree} does not divide the {n_img} image tokens (image_size/patch_size)²")


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


def _model_class():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel


Entry = tuple[str, tuple, torch.dtype]
"""``(name, shape, dtype)`` of one weight tensor."""


def _layout(entries: list[Entry]) -> list[tuple[torch.dtype, int, list[tuple[str, tuple, int, int]]]]:
    """How weights sit in flat buffers: one buffer per dtype (dtypes in name order), the tensors
    in ``entries`` order (names sorted) back to back. Returns ``[(dtype, numel, [(name, shape,
    offset, numel)…])…]``; every member derives the same layout from the same entries."""
    out = []
    for dt in sorted({e[2] for e in entries}, key=str):
        items, off = [], 0
        for name, shape, d in entries:
            if d == dt:
                n = 1
                for s in shape:
                    n *= int(s)
                items.append((name, tuple(shape), off, n))
                off += n
        out.append((dt, off, items))
    return out


def _views(flat: dict[torch.dtype, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    return {name: flat[dt][off : off + n].view(shape) for dt, _, items in layout for name, shape, off, n in items}


def _as_flat(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[torch.dtype, torch.Tensor], dict[str, torch.Tensor], list]:
    """``(flat buffers, views by name, layout)`` of ``state_dict`` on the CPU.

    Zero-copy when ``state_dict`` already consists of views laid out as :func:`_layout` says
    (what :meth:`SPGroupMember.state_dict` returns); otherwise the tensors are copied once into
    fresh flat buffers.
    """
    layout = _layout([(n, tuple(state_dict[n].shape), state_dict[n].dtype) for n in sorted(state_dict)])
    flat: dict[torch.dtype, torch.Tensor] = {}
    for dt, total, items in layout:
        first = state_dict[items[0][0]] if items else None
        adoptable = (
            first is not None
            and first.device.type == "cpu"
            and first.untyped_storage().nbytes() == total * first.element_size()
            and all(
                (t := state_dict[name]).untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and t.storage_offset() == off
                and t.is_contiguous()
                for name, _, off, _ in items
            )
        )
        if adoptable:
            flat[dt] = torch.empty(0, dtype=dt).set_(first.untyped_storage(), 0, (total,))
        else:
            buf = torch.empty(total, dtype=dt)
            for name, shape, off, n in items:
                buf[off : off + n].view(shape).copy_(state_dict[name].detach())
            flat[dt] = buf
    return flat, _views(flat, layout), layout


class SPGroupMember:
    """One process's membership in an SP group; owns the process group and the (parallel) transformer.

    The full weights are kept in host memory as one flat buffer per dtype (:meth:`state_dict`
    returns views into it): a peer copy is one ``dist.broadcast`` per buffer straight into the
    receiver's buffer (no per-tensor messages, no bucket copies), and every model object built
    from them aliases those buffers on the CPU (on a GPU, one device copy shared by every model
    object of the same weights).

    Args:
        model_cfg: the run's ``[model]`` section.
        worker_id: this worker's id (its position in ``GroupSpec.members`` is its rank).
        device: where the transformer runs (``cpu`` → gloo, ``cuda:i`` → NCCL).
        text_dim: width D of the text embeddings (``joint_attention_dim``).
        timeout_s: rendezvous / collective timeout of the process group.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        worker_id: str,
        device: torch.device,
        *,
        text_dim: int = 384,
        timeout_s: float = 120.0,
    ):
        self.model_cfg = model_cfg
        self.worker_id = worker_id
        self.device = torch.device(device)
        self.text_dim = text_dim
        self.timeout_s = timeout_s
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.spec: GroupSpec | None = None
        self.rank: int = -1
        self.model = None
        self.weights_version: int | None = None
        self._state: dict[str, torch.Tensor] | None = None
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self._flat_layout: list = []
        self._dev_flat: dict[torch.dtype, torch.Tensor] | None = None  # GPU: one device copy of _flat
        self._dev_state: dict[str, torch.Tensor] | None = None  # … and its views
        self._plain = None  # the SP-1 model object, reused while the weights stay the same
        self._entries: list[Entry] | None = None
        self._recv_flat: dict[torch.dtype, torch.Tensor] | None = None  # pre-faulted by prewarm()
        self._arch: dict | None = None
        self._source: str = ""
        self.cache_threshold: float = 0.0
        """First-Block-Cache threshold of the current batch (0 = off), see :meth:`begin_batch`."""
        self.cache_supported = False
        """Whether the current model has First Block Cache installed (>= 2 transformer blocks)."""
        self.cache_skips = 0
        """Forwards whose tail blocks were skipped by the cache (monotonic; the leader diffs it)."""
        self.form_timings_s: dict[str, float] = {}
        """Seconds spent in each phase of the last :meth:`form`: ``teardown`` (old group),
        ``rendezvous`` (new process group; 0 at SP 1, which needs none), ``weights``
        (exchange), ``build`` (model object)."""

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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The kept full weights: CPU views into the flat buffers, names sorted. Raises
        ``RuntimeError`` if none are held. Do not modify them in place (models alias them)."""
        if self._state is None:
            raise RuntimeError(f"worker {self.worker_id} holds no weights")
        return self._state

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------ warm spare
    def prewarm(self, *, preallocate: bool = True) -> None:
        """Prepare a member that will receive its weights by broadcast (a warm spare, before
        it is assigned a GPU): derive the tensor layout from a weightless skeleton, build one
        throw-away skeleton (first-use costs of the model class), and on the CPU pre-fault the
        receive buffers (``preallocate``), so none of it happens while a group waits.

        Never touches CUDA. Raises ``OSError`` if a pretrained model's config cannot be read.
        """
        entries = self._skeleton_entries()
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
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type != "cpu":
            self._recv_flat = None  # NCCL receives into device memory

    # ------------------------------------------------------------ membership
    def form(self, spec: GroupSpec, *, state_dict: dict | None = None, version: int | None = None) -> None:
        """(Re)join the group described by ``spec`` (collective over ``spec.members``).

        A group of one needs no process group: it only drops the old one and takes the
        weights in memory (the SP-1 model object is reused while they stay the same).

        Args:
            spec: the new generation; this worker must be one of its members.
            state_dict: full weights to use from now on (``weights_source = "given"``);
                None keeps the weights already in memory, or receives them from rank 0.
                They are copied once into the member's flat buffers unless they already are
                views laid out that way (what :meth:`state_dict` returns).
            version: weight version of ``state_dict`` (members whose version differs from
                rank 0's receive rank 0's weights); None keeps the current one.

        Raises:
            ValueError: this worker is not in ``spec``, or the degree cannot split the model
                (raised before any collective, identically on every member).
            SPGroupError: rank 0 holds no weights.
        """
        if self.worker_id not in spec.members:
            raise ValueError(f"worker {self.worker_id!r} is not a member of {spec.members}")
        check_sp_degree(self.model_cfg, spec.world_size)
        t0 = time.perf_counter()
        self._teardown()
        t1 = time.perf_counter()
        if state_dict is not None:
            self._keep(*_as_flat(state_dict), None, version=version)
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
        ``spec.master_addr`` only); an NCCL group is bound to this worker's GPU (``device_id``)."""
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

    def leave(self) -> None:
        """Destroy this process's process group and parallel model (weights stay in memory)."""
        self._teardown()

    def _teardown(self) -> None:
        if self.model is not None:
            _clear_method_caches(self.model)
        self.model = None  # its hooks hold the old mesh; never reuse a parallelised object
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.spec = None
        self.rank = -1

    # ------------------------------------------------------------ weights
    def _keep(self, flat: dict, views: dict, layout: list, dev_flat: dict | None, *, version: int | None) -> None:
        """Make ``views`` (into ``flat``) the kept weights; models built before keep theirs.
        ``dev_flat``: the same weights already on this member's GPU (received there)."""
        self._flat, self._state, self._flat_layout = flat, views, layout
        self.weights_version = version
        self._dev_flat = dev_flat
        self._dev_state = None if dev_flat is None else _views(dev_flat, layout)
        self._plain = None

    def broadcast_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Collective over the formed group: rank 0 keeps ``state_dict`` as ``version`` and
        sends it; the others (``state_dict=None``) receive it into fresh buffers; every member
        loads it into its model. The previous weights are left untouched (the model takes the
        new tensors instead of being overwritten in place), so a caller that still holds the
        previous :meth:`state_dict` (an older version kept for stale-weight exploration) keeps
        it. Names are not sent: every member derives the layout from its own weights' names,
        shapes and dtypes (same architecture).

        Raises:
            SPGroupError: a collective failed, or rank 0 passed no weights.
        """
        if self.is_leader:
            if state_dict is None:
                raise SPGroupError("rank 0 must pass the weights to broadcast")
            self._keep(*_as_flat(state_dict), None, version=version)
            if self.sp_degree > 1:
                self._broadcast_flat(self._flat_layout, receiving=False)
        else:
            self._keep(*self._broadcast_flat(self._flat_layout, receiving=True), version=version)
        self._load_into_model()

    def _load_into_model(self) -> None:
        """Point the current model's parameters at the kept weights (no in-place copy)."""
        if self.model is None:
            return
        self.model.load_state_dict(self._model_state(), strict=True, assign=True)
        if self.sp_degree == 1:
            self._plain = self.model  # still the plain model, now of these weights

    def _broadcast_flat(self, layout: list, *, receiving: bool):
        """Every rank: rank 0's flat buffers → receivers (``receiving``), straight into them.
        Returns ``(flat, views, layout, device flat or None)`` on a receiver, else None."""
        dev = self._comm_device
        flat: dict[torch.dtype, torch.Tensor] = {}
        for dt, total, _ in layout:
            if receiving:
                buf = self._recv_flat.pop(dt, None) if self._recv_flat else None
                if buf is None or buf.numel() != total or dev.type != "cpu":
                    buf = torch.empty(total, dtype=dt, device=dev)
            else:
                if dev.type == "cpu":
                    buf = self._flat[dt]
                else:
                    self._model_state()
                    buf = self._dev_flat[dt]
                if buf.numel() != total:
                    raise SPGroupError(
                        f"worker {self.worker_id}: kept {dt} weights have {buf.numel()} elements, the layout {total}"
                    )
            dist.broadcast(buf, src=0)
            flat[dt] = buf
        self._recv_flat = None
        if not receiving:
            return None
        if dev.type == "cpu":
            return flat, _views(flat, layout), layout, None
        host = {dt: b.to("cpu") for dt, b in flat.items()}
        return host, _views(host, layout), layout, flat  # the received device buffers are the device copy

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The tensors a model object is built from: the kept CPU views, or on a GPU views into
        one device copy of them (made once per weights; received buffers are used as is)."""
        if self.device.type == "cpu":
            return self._state
        if self._dev_state is None:
            self._dev_flat = {dt: f.to(self.device) for dt, f in self._flat.items()}
            self._dev_state = _views(self._dev_flat, self._flat_layout)
        return self._dev_state

    def _arch_config(self) -> dict:
        if self._arch is None:
            if self.model_cfg.source == "pretrained":
                cfg = _model_class().load_config(self.model_cfg.pretrained_dir)
                self._arch = {k: v for k, v in dict(cfg).items() if not k.startswith("_")}
            else:
                self._arch = transformer_kwargs(self.model_cfg, self.text_dim)
        return self._arch

    def _exchange_weights(self) -> None:
        world = self.spec.world_size
        dev = self._comm_device
        have = self._state is not None
        mine = torch.tensor(
            [int(have), self.weights_version if self.weights_version is not None else -1], dtype=torch.int64, device=dev
        )
        flags = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(world)]
        dist.all_gather(flags, mine)
        flags = [tuple(int(x) for x in f.cpu()) for f in flags]
        if flags[0][0] == 0:
            raise SPGroupError(f"rank 0 ({self.spec.members[0]}) of generation {self.spec.generation} holds no weights")
        receivers = [r for r in range(world) if flags[r] != flags[0]]
        if not receivers:
            return
        # No pickle on the wire (docs/architecture.md §9): every member derives the tensor layout from its own
        # copy of the architecture (names sorted, shapes and dtypes from a weightless
        # skeleton); only the version number and the raw flat buffers travel.
        ver = torch.tensor(
            [self.weights_version if (self.rank == 0 and self.weights_version is not None) else -1],
            dtype=torch.int64,
            device=dev,
        )
        dist.broadcast(ver, src=0)
        receiving = self.rank in receivers
        layout = self._flat_layout if (self.rank == 0 or not receiving) else _layout(self._skeleton_entries())
        got = self._broadcast_flat(layout, receiving=receiving)
        if receiving:
            self._keep(*got, version=None if int(ver.item()) < 0 else int(ver.item()))
            self._source = "broadcast"

    def _skeleton_entries(self) -> list[Entry]:
        """(name, shape, dtype) of every weight, sorted by name, from a weightless skeleton (cached)."""
        if self._entries is None:
            from diffusers.models.modeling_utils import no_init_weights

            with no_init_weights():
                skel = _model_class().from_config(self._arch_config())
            sd = skel.state_dict()
            self._entries = [(n, tuple(sd[n].shape), sd[n].dtype) for n in sorted(sd)]
        return self._entries

    def _build_model(self, world: int):
        """The transformer object for a group of ``world``: at SP 1 the plain model, reused while
        the weights stay the same; otherwise a fresh object (diffusers' ``enable_parallelism``
        binds it to this generation's mesh) whose parameters alias the kept weights. First
        Block Cache is installed on every fresh object (off until :meth:`begin_batch` sets a
        threshold) before it is parallelised (module docstring: the cache must sit inside the
        split hooks)."""
        if world == 1 and self._plain is not None:
            return self._plain
        from diffusers.models.modeling_utils import no_init_weights

        with no_init_weights():
            model = _model_class().from_config(self._arch_config())
        model.load_state_dict(self._model_state(), strict=True, assign=True)
        model = model.to(self.device).eval()
        self.cache_threshold = 0.0
        self.cache_supported = self._install_cache(model)
        if world > 1:
            from diffusers import ContextParallelConfig

            with _cpu_device_count_patch():
                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            if self.cache_supported:
                from diffusers.hooks import HookRegistry

                # the split hooks were registered on blocks after the cache's: drop stale child lists
                HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()
        else:
            self._plain = model
        return model

    def _install_cache(self, model) -> bool:
        """First Block Cache with the group-wide decision; False (no cache) for a model with
        fewer than two transformer blocks (diffusers needs a head and a tail block)."""
        blocks = getattr(model, "transformer_blocks", None)
        if blocks is None or len(blocks) < 2:
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
    def velocity_fn(self) -> Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]:
        """``velocity_fn(latents [B, L, C], sigma [B], cond) -> v [B, L, C]`` on the group.

        Same signature as :func:`spotlight.models.dit.make_velocity_fn`'s result. With
        ``sp_degree > 1`` every rank must call it with the same inputs (see
        :func:`run_group_batch`); every rank gets the full output, on the device of
        ``latents``. Text tokens are padded with masked zeros to a multiple of the degree.

        Raises:
            RuntimeError: the member is not in a formed group.
            ValueError: the image-token count is not divisible by the degree.
        """
        if self.model is None:
            raise RuntimeError(f"worker {self.worker_id} is not in a formed group")
        model = self.model
        base = make_velocity_fn(model, self.model_cfg)
        world = self.sp_degree
        device = self.device
        cached = self.cache_supported

        def velocity_fn(latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
            embeds, mask = cond.embeds, cond.mask
            if world > 1:
                if latents.shape[1] % world:
                    raise ValueError(f"{latents.shape[1]} image tokens are not divisible by SP degree {world}")
                pad = (-embeds.shape[1]) % world
                if pad:
                    if mask is None:
                        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
                    embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
                    mask = torch.cat([mask, mask.new_zeros((mask.shape[0], pad))], dim=1)
            with model.cache_context("sp") if cached else contextlib.nullcontext():
                out = base(
                    latents.to(device),
                    sigma.to(device),
                    Conditioning(embeds.to(device), None if mask is None else mask.to(device)),
                )
            return out.to(latents.device)

        return velocity_fn


# ---------------------------------------------------------------- batch protocol


def _bcast_header(member: SPGroupMember, op: int, *fields: int) -> None:
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    h[0] = op
    for i, f in enumerate(fields):
        h[1 + i] = int(f)
    dist.broadcast(h.to(member._comm_device), src=0)


def _recv_header(member: SPGroupMember) -> list[int]:
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=member._comm_device)
    dist.broadcast(h, src=0)
    return [int(x) for x in h.cpu()]


def _bcast(member: SPGroupMember, t: torch.Tensor) -> None:
    dist.broadcast(t.to(member._comm_device).contiguous(), src=0)


def _recv(member: SPGroupMember, shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=member._comm_device)
    dist.broadcast(t, src=0)
    return t.cpu()


def serve_batch(member: SPGroupMember) -> bool:
    """Follower side of one batch: mirror the leader's forwards until ``OP_END``.

    Returns:
        True after a batch ended, False when the leader sent ``OP_RELEASE``.

    Raises:
        SPGroupError: a collective failed (the leader or another peer died).
    """
    vfn = member.velocity_fn()
    cond: Conditioning | None = None
    try:
        while True:
            op, *f = _recv_header(member)
            if op == OP_RELEASE:
                return False
            if op == OP_END:
                return True
            if op == OP_BATCH:
                b, t, d = f[:3]
                member.begin_batch(_threshold_from_int(f[3]))
                cond = Conditioning(_recv(member, (b, t, d), torch.float32), _recv(member, (b, t), torch.int64))
            elif op == OP_STEP:
                if cond is None:
                    raise SPGroupError("OP_STEP before OP_BATCH")
                b, n_tok, c = f[:3]
                latents = _recv(member, (b, n_tok, c), torch.float32)
                sigma = _recv(member, (b,), torch.float32)
                with torch.no_grad():
                    vfn(latents, sigma, cond)
            else:
                raise SPGroupError(f"unknown SP group op {op}")
    except SPGroupError:
        raise
    except RuntimeError as exc:  # dist.DistError is a RuntimeError
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
    except (RuntimeError, dist.DistError) as exc:
        if isinstance(exc, SPGroupError) or world == 1:
            raise
        raise SPGroupError(f"SP group generation {member.spec.generation} broke at step {state.step}: {exc}") from exc
    return state


def _broadcasting_step_fn(member: SPGroupMember, vfn: Callable) -> Callable:
    """The leader's velocity function for a group of several: each call first broadcasts an
    OP_STEP header and the step's latents and sigma so that followers join the forward."""

    def step_fn(latents, sigma, cond_):
        b, l, c = latents.shape
        _bcast_header(member, OP_STEP, b, l, c)
        _bcast(member, latents.float())
        _bcast(member, sigma.float())
        return vfn(latents, sigma, cond_)

    return step_fn


def _bcast_batch(member: SPGroupMember, cond: Conditioning) -> None:
    """Leader: open a batch on the followers (OP_BATCH header with the cache threshold, then
    the text embeddings and mask)."""
    b, t, d = cond.embeds.shape
    _bcast_header(member, OP_BATCH, b, t, d, _threshold_to_int(member.cache_threshold))
    _bcast(member, cond.embeds.float())
    mask = cond.mask if cond.mask is not None else torch.ones((b, t), dtype=torch.long)
    _bcast(member, mask.long())


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
