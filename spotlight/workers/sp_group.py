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
  nothing is loaded from disk or from the coordinator).
* **grow** (a GPU is added): a new process calls :meth:`SPGroupMember.form` with no
  weights; the survivors call it with the same spec. Rank 0 (a member that holds the
  weights; the node Scheduler lists such a member first) broadcasts them over the rebuilt
  group with ``torch.distributed._broadcast_coalesced`` (per-tensor ``broadcast`` where
  that private helper is missing), after announcing their metadata with
  ``broadcast_object_list`` (paper §5) — ``weights_source == "broadcast"``.

Membership change protocol inside :meth:`SPGroupMember.form` (collective: every member of
the new spec calls it with the same spec, in any order; rendezvous is the TCP store of
``tcp://master_addr:master_port``, hosted by rank 0)::

    validate spec (degree vs. heads / image tokens)      local, before any collective,
                                                         so every member fails alike
    destroy previous default process group               local
    init_process_group(rank = members.index(me))         rendezvous
    all_gather([holds_weights, version])                 every rank learns who lacks them
    if rank 0 holds none  -> SPGroupError on every rank
    if some rank lacks them / holds another version:
        broadcast_object_list([arch config, names, shapes, dtypes])  from rank 0
        _broadcast_coalesced(tensors, src=0)                         receivers fill buffers
    build a FRESH model object, load_state_dict(kept, assign=True),
    enable_parallelism(ContextParallelConfig(ulysses_degree=k)) when k > 1

Why a fresh model object each time: diffusers refuses ``enable_parallelism`` on a model
that already has a ``_parallel_config`` ("cannot be called twice"), and its hooks hold
the old device mesh / process group. The skeleton is built under diffusers'
``no_init_weights()`` (no random init cost) and then takes the kept tensors with
``load_state_dict(..., assign=True)``: on the CPU the parameters *are* the kept tensors
(no copy); on a GPU they are copied to the device once. (A ``meta``-device skeleton does
not work for Qwen-Image: ``QwenEmbedRope.pos_freqs`` / ``neg_freqs`` are plain tensor
attributes, not buffers, so they would stay on ``meta`` after loading.)

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
:class:`~spotlight.workers.common.RolloutExecutor`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import struct
from typing import Callable

import torch
import torch.distributed as dist

from spotlight.config import ModelConfig
from spotlight.models.dit import make_velocity_fn, token_shape, transformer_kwargs
from spotlight.rl.sampler import Conditioning, DenoiseState, Sampler

log = logging.getLogger("spotlight.sp_group")

BROADCAST_BUCKET_BYTES = 256 << 20
"""Bucket size for ``_broadcast_coalesced`` (tensors are flattened into buckets this big)."""

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
        sums = torch.stack([(residual - prev).abs().sum(dtype=torch.float32), prev.abs().sum(dtype=torch.float32)]).to(torch.float64)
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


class SPGroupMember:
    """One process's membership in an SP group; owns the process group and the (parallel) transformer.

    Args:
        model_cfg: the run's ``[model]`` section.
        worker_id: this worker's id (its position in ``GroupSpec.members`` is its rank).
        device: where the transformer runs (``cpu`` → gloo, ``cuda:i`` → NCCL).
        text_dim: width D of the text embeddings (``joint_attention_dim``).
        timeout_s: rendezvous / collective timeout of the process group.
    """

    def __init__(self, model_cfg: ModelConfig, worker_id: str, device: torch.device, *, text_dim: int = 384, timeout_s: float = 120.0):
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
        self._arch: dict | None = None
        self._source: str = ""
        self.cache_threshold: float = 0.0
        """First-Block-Cache threshold of the current batch (0 = off), see :meth:`begin_batch`."""
        self.cache_supported = False
        """Whether the current model has First Block Cache installed (>= 2 transformer blocks)."""
        self.cache_skips = 0
        """Forwards whose tail blocks were skipped by the cache (monotonic; the leader diffs it)."""

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
        """The kept full weights (CPU tensors). Raises ``RuntimeError`` if none are held."""
        if self._state is None:
            raise RuntimeError(f"worker {self.worker_id} holds no weights")
        return self._state

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------ membership
    def form(self, spec: GroupSpec, *, state_dict: dict | None = None, version: int | None = None) -> None:
        """(Re)join the group described by ``spec`` (collective over ``spec.members``).

        Args:
            spec: the new generation; this worker must be one of its members.
            state_dict: full weights to use from now on (``weights_source = "given"``);
                None keeps the weights already in memory, or receives them from rank 0.
                CPU tensors are kept by reference (on the CPU they become the model's
                parameters, no copy): do not modify them in place afterwards.
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
        self._teardown()
        if state_dict is not None:
            self._state = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
            self.weights_version = version
            self._source = "given"
        elif self._state is not None:
            self._source = "memory"
            if version is not None:
                self.weights_version = version
        self.rank = spec.members.index(self.worker_id)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        from spotlight.workers.rendezvous import bound_store  # the store listens on master_addr only

        dist.init_process_group(
            self.backend,
            store=bound_store(spec.master_addr, spec.master_port, self.rank, spec.world_size, datetime.timedelta(seconds=self.timeout_s)),
            rank=self.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        self.spec = spec
        try:
            if spec.world_size > 1:
                self._exchange_weights()
            elif self._state is None:
                raise SPGroupError(f"worker {self.worker_id} forms a group of one but holds no weights")
            self.model = self._build_model(spec.world_size)
        except BaseException:
            self._teardown()
            raise
        log.info(
            "worker %s: formed generation %d, rank %d/%d, weights from %s",
            self.worker_id, spec.generation, self.rank, spec.world_size, self._source,
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
        mine = torch.tensor([int(have), self.weights_version if self.weights_version is not None else -1], dtype=torch.int64, device=dev)
        flags = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(world)]
        dist.all_gather(flags, mine)
        flags = [tuple(int(x) for x in f.cpu()) for f in flags]
        if flags[0][0] == 0:
            raise SPGroupError(f"rank 0 ({self.spec.members[0]}) of generation {self.spec.generation} holds no weights")
        receivers = [r for r in range(world) if flags[r] != flags[0]]
        if not receivers:
            return
        # No pickle on the wire (DESIGN §9): every member derives the tensor list from its own
        # copy of the architecture (names sorted, shapes and dtypes from a weightless
        # skeleton); only the version number and the raw tensors travel.
        ver = torch.tensor([self.weights_version if (self.rank == 0 and self.weights_version is not None) else -1], dtype=torch.int64, device=dev)
        dist.broadcast(ver, src=0)
        if self.rank == 0:
            entries = [(n, tuple(self._state[n].shape), self._state[n].dtype) for n in sorted(self._state)]
        else:
            entries = self._skeleton_entries()
        meta = {"arch": self._arch_config(), "version": None if int(ver.item()) < 0 else int(ver.item()), "entries": entries}
        receiving = self.rank in receivers
        if receiving:
            tensors = [torch.empty(shape, dtype=dt, device=dev) for _, shape, dt in meta["entries"]]
        else:
            tensors = [self._state[n].to(dev) for n, _, _ in meta["entries"]]
        coalesced = getattr(dist, "_broadcast_coalesced", None)
        if coalesced is not None:
            coalesced(dist.group.WORLD, tensors, BROADCAST_BUCKET_BYTES, 0)
        else:  # pragma: no cover - torch builds without the private helper
            for t in tensors:
                dist.broadcast(t, src=0)
        if receiving:
            self._state = {n: t.to("cpu") for (n, _, _), t in zip(meta["entries"], tensors)}
            self._arch = meta["arch"]
            self.weights_version = meta["version"]
            self._source = "broadcast"

    def _skeleton_entries(self) -> list[tuple[str, tuple, torch.dtype]]:
        """(name, shape, dtype) of every weight, sorted by name, from a weightless skeleton."""
        from diffusers.models.modeling_utils import no_init_weights

        with no_init_weights():
            skel = _model_class().from_config(self._arch_config())
        sd = skel.state_dict()
        return [(n, tuple(sd[n].shape), sd[n].dtype) for n in sorted(sd)]

    def _build_model(self, world: int):
        """A fresh transformer object holding the kept weights, with First Block Cache
        installed (off until :meth:`begin_batch` sets a threshold) and then parallelised
        when ``world > 1`` (module docstring: the cache must sit inside the split hooks)."""
        from diffusers.models.modeling_utils import no_init_weights

        with no_init_weights():
            model = _model_class().from_config(self._arch_config())
        model.load_state_dict(self._state, strict=True, assign=True)
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
        raise SPGroupError(f"SP group generation {member.spec.generation} broke on follower {member.worker_id}: {exc}") from exc


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
) -> DenoiseState | None:
    """Denoise ``state`` over the group (leader) or mirror the leader's forwards (follower).

    On the leader (rank 0) this runs ``sampler.advance`` until ``state.step`` reaches
    ``stop_at`` (default: the last step) or ``should_stop(state)`` is True between steps,
    broadcasting the transformer inputs so followers join every parallel forward. On a
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

    if world > 1:
        def step_fn(latents, sigma, cond_):
            b, l, c = latents.shape
            _bcast_header(member, OP_STEP, b, l, c)
            _bcast(member, latents.float())
            _bcast(member, sigma.float())
            return vfn(latents, sigma, cond_)
    else:
        step_fn = vfn

    try:
        if world > 1:
            b, t, d = cond.embeds.shape
            _bcast_header(member, OP_BATCH, b, t, d, _threshold_to_int(member.cache_threshold))
            _bcast(member, cond.embeds.float())
            mask = cond.mask if cond.mask is not None else torch.ones((b, t), dtype=torch.long)
            _bcast(member, mask.long())
        with torch.no_grad():
            while state.step < end:
                if should_stop is not None and should_stop(state):
                    break
                snap = (state.step, state.latents, len(state.window_latents), len(state.log_probs), state.computed_steps.clone())
                try:
                    skips = member.cache_skips
                    sampler.advance(state, step_fn, cond)
                    if member.cache_skips != skips:  # the cache skipped the tail blocks
                        state.computed_steps -= 1
                except Exception:
                    state.step, state.latents = snap[0], snap[1]
                    del state.window_latents[snap[2]:]
                    del state.log_probs[snap[3]:]
                    state.computed_steps = snap[4]
                    raise
        if world > 1:
            _bcast_header(member, OP_END)
    except (RuntimeError, dist.DistError) as exc:
        if isinstance(exc, SPGroupError) or world == 1:
            raise
        raise SPGroupError(f"SP group generation {member.spec.generation} broke at step {state.step}: {exc}") from exc
    return state
