"""Every message on Spotlight's wire: typed structs, framing, protocol version.

A message is a ZeroMQ multipart frame list::

    [type (1 byte MsgType)] [body (msgpack of the type's Struct)] [raw tensor frame]*

Tensors travel as raw little-endian frames described by :class:`TensorMeta` entries in
the body (dtype name + shape); the receiver rebuilds them with ``torch.frombuffer``
(``spotlight/store/tensor_wire.py``). Nothing is ever unpickled: a body is decoded with a
typed msgspec decoder for exactly the type its first frame names, so a malformed body,
an unknown type byte or a missing tensor frame raises :class:`ProtocolError` and the
caller drops the message without changing state (docs/architecture.md §9).

The module is torch-free so the agent daemon can import it. New fields must have
defaults (checked by ``tests/unit/test_protocol.py``); bump :data:`PROTOCOL_VERSION`
when an old peer could not understand a message.

Who sends what::

    agent  → coordinator   REGISTER, HEARTBEAT, PULL, RESULT, COMMIT, FAIL, FETCH_WEIGHTS,
                           NOTICE, BYE
    coordinator → agent    REGISTERED, LEASES, WEIGHTS, WEIGHTS_CHUNK, ERROR, SHUTDOWN
    worker ↔ agent         WORKER_HELLO, PULL, LEASES, RESULT, COMMIT, FAIL, FETCH_WEIGHTS,
                           WEIGHTS, STOP (same structs, relayed without decoding tensors)
    trainer ↔ coordinator  TRAIN_READY, TRAIN_BATCH, TRAIN_DONE, WEIGHTS, WEIGHTS_CHUNK; a rank
                           started by torchrun or srun first TRAIN_HELLO → TRAIN_SETUP, and
                           TRAIN_HEARTBEAT from its own thread and connection
    CLI → coordinator      STATUS_REQUEST → STATUS

A weight version (one safetensors file, up to tens of GB) never travels as one frame: a
WEIGHTS header (size, chunk size and count, digest of the whole file) is followed by
WEIGHTS_CHUNK messages of at most ``cluster.weight_chunk_bytes`` each. Trainer rank 0
pushes its chunks in order (the coordinator's receive queue bounds what is in flight);
an agent pulls them with FETCH_WEIGHTS ranges, a bounded window at a time
(``spotlight/store/weight_sync.py`` has the file format, the chunk plan and the assembler)::

    trainer 0 ─ WEIGHTS(v, size, chunk_bytes, n, digest) ─ WEIGHTS_CHUNK(v, 0) … (v, n-1) ─▶ coordinator
    agent ─ FETCH_WEIGHTS(v, header, first_chunk=0, num_chunks=W) ─▶ coordinator
          ◀─ WEIGHTS(v, size, chunk_bytes, n, digest), WEIGHTS_CHUNK(v, 0) … (v, W-1)
          ─ FETCH_WEIGHTS(v, header=False, first_chunk=i, num_chunks=1) per chunk received ─▶
    worker ─ FETCH_WEIGHTS(v) ─▶ agent ─ WEIGHTS(v, found) ─▶ worker (reads the node's cached
          file ``<weights_dir>/v<v>.safetensors``; no path ever travels)
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from spotlight.errors import SpotlightError

PROTOCOL_VERSION = 3
"""Sent in REGISTER; the coordinator refuses any other version (2: CURVE transport, no HMAC;
3: weight versions in chunks, WEIGHTS_CHUNK and ranged FETCH_WEIGHTS). Fields an older peer
ignores safely need no new version: ``Leases.device``, ``Pull.residency`` / ``Pull.moves`` and
``Registered.offload_rollout_while_training`` (an older worker never releases its device and
reports no residency, so the coordinator never waits for it)."""

MAX_BODY_BYTES = 1 << 20
"""Largest msgpack body :func:`decode` accepts (tensors travel in their own frames)."""

FRAME_OVERHEAD_BYTES = 64 * 1024
"""Slack over the largest frame a peer sends, in a ``ZMQ_MAXMSGSIZE`` limit: libzmq checks it
against the frame as it is on the wire, which CURVE makes a few dozen bytes longer than its
plaintext."""

# Bounded field types: a body that violates them fails to decode, before any handler runs.
Id = Annotated[str, Meta(min_length=1, max_length=200)]
Text = Annotated[str, Meta(max_length=4096)]
Count = Annotated[int, Meta(ge=0, le=1 << 31)]
Version = Annotated[int, Meta(ge=-1, le=1 << 31)]
MAX_GPUS_PER_NODE = 64
"""Most GPUs one node registers (REGISTER's ``gpus``): the coordinator refuses more, so
``spotlight-agent join --gpus`` and the join command ``spotlight init`` writes stay within it."""
MAX_GPU_INDEX = 4095
"""Largest GPU index a message carries (REGISTER, HEARTBEAT, a train rank's ``gpu``): a body with
a larger one fails to decode, so every place that accepts a GPU index (``spotlight-agent join
--gpus``, ``add-gpu``, ``revoke``, ``spotlight init --reserved-rollout-gpus``) refuses it first."""
GpuIndex = Annotated[int, Meta(ge=0, le=MAX_GPU_INDEX)]
GpuList = Annotated[list[GpuIndex], Meta(max_length=MAX_GPU_INDEX + 1)]
IdList = Annotated[list[Id], Meta(max_length=65536)]
LeaseIdList = Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 62)]], Meta(max_length=65536)]
LeaseId = Annotated[int, Meta(ge=0, lt=1 << 62)]
ByteCount = Annotated[int, Meta(ge=0, le=1 << 50)]
"""A size or offset in bytes (at most 1 PiB)."""
ChunkIndex = Annotated[int, Meta(ge=0, lt=1 << 31)]
Digest = Annotated[str, Meta(max_length=200)]

MAX_CHUNKS_PER_FETCH = 64
"""Most WEIGHTS_CHUNK replies one FETCH_WEIGHTS may ask for (the receiver's window)."""


class ProtocolError(SpotlightError):
    """A frame list that cannot be decoded into a known, well-formed message."""


class MsgType(enum.IntEnum):
    REGISTER = 1
    REGISTERED = 2
    HEARTBEAT = 3
    PULL = 4
    LEASES = 5
    RESULT = 6
    COMMIT = 7
    FAIL = 8
    FETCH_WEIGHTS = 9
    WEIGHTS = 10
    # 11 and 12 are retired (a state fetch, never served: committed state travels with the
    # lease that resumes it); never reuse them, so an old peer's bytes cannot mean something new
    NOTICE = 13
    BYE = 14
    ERROR = 15
    SHUTDOWN = 16
    WEIGHTS_CHUNK = 17
    WORKER_HELLO = 20
    STOP = 21
    GROUP_FORM = 22
    GROUP_FORMED = 23
    TRAIN_READY = 30
    TRAIN_BATCH = 31
    TRAIN_DONE = 32
    TRAIN_HELLO = 33
    TRAIN_SETUP = 34
    TRAIN_HEARTBEAT = 35
    STATUS_REQUEST = 40
    STATUS = 41


class _Msg(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    pass


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """Describes one raw tensor frame: ``name``, numpy-style ``dtype`` name, ``shape``
    (at most 8 dimensions, each in [0, 2**40))."""

    name: Annotated[str, Meta(max_length=200)]
    dtype: Annotated[str, Meta(max_length=16)]
    shape: Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 40)]], Meta(max_length=8)]


Tensors = Annotated[list[TensorMeta], Meta(max_length=4096)]


# ---------------------------------------------------------------- membership


class Register(_Msg, kw_only=True):
    """Agent → coordinator handshake (DEALER identity = node_id)."""

    protocol_version: int
    node_id: Id
    gpus: GpuList
    is_spot: bool = True
    hostname: Text = ""
    pid: Count = 0
    instance_id: Annotated[str, Meta(max_length=64)] = ""
    """Random id the agent process draws once at start and sends in every REGISTER: the same
    id = the same agent reconnecting; another id while the node id's session is alive = a
    second agent claiming a node id in use (refused, ``node_id_in_use``). "" = an agent that
    predates it (re-registers as before)."""


class Registered(_Msg, kw_only=True):
    """Coordinator → agent: facts the coordinator decides."""

    node_id: str
    heartbeat_interval_s: float
    lease_timeout_s: float
    worker_batch_size: int
    torch_threads: int
    sp_degree: int = 1
    """Sequence-parallel degree of each worker group on the node (elastic below it)."""
    sp_degrees: list[int] = []
    """The degrees up to ``sp_degree`` the model can run at (``spotlight.workers.sp.degrees``);
    the node Scheduler forms groups of these sizes only. Empty = every degree."""
    sp_cfg_parallel: bool = False
    """``cluster.sp_cfg_parallel``: even-sized groups of a true-CFG model split the CFG branches."""
    sp_backend: Literal["diffusers", "xfuser"] = "diffusers"
    """``cluster.sp_backend``: the SP groups' parallel attention."""
    model: dict[str, Any]
    """The run's ``[model]`` config section (workers build the transformer from it)."""
    sampler: dict[str, Any]
    """The run's ``[sampler]`` config section."""
    lora: dict[str, Any] = {}
    """LoRA settings (rank, alpha, target_modules) when versions are adapters; {} = full weights."""
    latest_version: int
    session: str = ""
    """Per-registration token the agent echoes in every later message."""
    weight_window_chunks: Annotated[int, Meta(ge=1, le=MAX_CHUNKS_PER_FETCH)] = 4
    """WEIGHTS_CHUNK replies the agent keeps requested at once while it fetches a version."""
    reconfiguration: Literal["elastic", "restart"] = "elastic"
    """``cluster.reconfiguration``: on a GPU set change, re-form the affected SP group in place,
    or stop every worker of the node and start fresh ones (the baselines' engine restart)."""
    live_migration: bool = True
    """``cluster.live_migration``: stopped workers commit in-flight state (else give it back)."""
    offload_rollout_while_training: bool | None = None
    """``cluster.offload_rollout_while_training``: whether the node's workers give their device
    memory back when told (``Leases.device``); None = on CUDA with a real family."""


class WorkerInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    worker_id: Id
    gpus: GpuList
    busy: bool = False
    versions: Annotated[list[Version], Meta(max_length=64)] = []
    pid: Count = 0


class Heartbeat(_Msg, kw_only=True):
    node_id: Id
    session: Text = ""
    workers: Annotated[list[WorkerInfo], Meta(max_length=4096)] = []
    in_flight: IdList = []
    """Request ids currently held by this node's workers."""
    detector_healthy: bool = True
    detector_error: Text = ""
    draining: bool = False
    gpus: GpuList | None = None
    """The node's current GPUs (after revocations/additions); None = unchanged."""
    workers_error: Text = ""
    """Why some of the node's GPUs get no workers any more (their workers failed every start);
    empty when none."""
    gpus_given_up: GpuList = []
    """Those GPUs: still the node's (and billed) but serving nothing, so not rollout capacity."""


class Notice(_Msg, kw_only=True):
    """Agent → coordinator: a preemption notice (absolute wall-clock deadline)."""

    node_id: Id
    session: Text = ""
    source: Text
    scope: Text
    deadline_unix_s: float
    key: Text
    kind: Text
    is_hint: bool = False


class Bye(_Msg, kw_only=True):
    node_id: Id
    session: Text = ""
    reason: Text = ""


class ErrorMsg(_Msg, kw_only=True):
    code: str
    message: str
    retry_after_s: float = 0.0
    """``node_id_in_use``: seconds the current holder must stay silent before the node id is
    free (a crashed agent's restart may try once more after them); 0 = not given."""


class Shutdown(_Msg, kw_only=True):
    reason: str = ""


# ---------------------------------------------------------------- requests


class DeviceMove(msgspec.Struct, kw_only=True, frozen=True):
    """One move of a Rollout Worker's model weights between its device and host memory
    (``spotlight/core/offload.py``): ``kind`` "offload" (device → host, its device memory freed
    for a Train Worker) or "reload" (host → device), ``seconds`` it took, ``size_bytes`` moved
    (0 on the CPU, where nothing moves)."""

    kind: Literal["offload", "reload"]
    seconds: Annotated[float, Meta(ge=0.0, le=1e6)]
    size_bytes: ByteCount = 0


class Pull(_Msg, kw_only=True):
    """Worker → agent → coordinator: "I am idle, give me up to N requests"."""

    node_id: Text = ""
    session: Text = ""
    worker_id: Id
    max_requests: Annotated[int, Meta(ge=0, le=4096)]
    versions: Annotated[list[Version], Meta(max_length=64)] = []
    """Weight versions the worker already holds (a hint)."""
    residency: Literal["", "resident", "released"] = ""
    """Where the worker's model weights are: "resident" on its device, "released" to host
    memory (it answered ``Leases.device = "release"``); "" = a worker that never releases its
    device (``cluster.offload_rollout_while_training`` off for it, an SP group, an older worker):
    the coordinator never waits for it."""
    moves: Annotated[list[DeviceMove], Meta(max_length=16)] = []
    """The moves of its weights since its previous PULL (their cost goes to ``time/offload_s``
    and ``time/reload_s`` in metrics.jsonl)."""


class LeaseItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    lease_id: int
    request_id: str
    kind: str
    iteration: int
    prompt_index: int
    seed: int
    weight_version: int
    params: dict[str, Any] = {}
    resume_step: int | None = None
    """When set, tensors ``state.<i>.*`` carry the committed state to resume from."""


class Leases(_Msg, kw_only=True):
    """Granted requests; tensors ``cond.embeds`` [B, T, D], ``cond.mask`` [B, T] (+ resume state)."""

    worker_id: str
    items: list[LeaseItem] = []
    tensors: list[TensorMeta] = []
    device: Literal["", "release", "reclaim"] = ""
    """The coordinator's word on the worker's device memory, for a worker of the reserved node
    on a GPU a Train Worker also uses (``spotlight/core/offload.py``): "release" (no items: the
    update trains on your GPU now, move your weights to host memory), "reclaim" (training there
    is over: have your weights on the device before the next batch); "" = keep them where they
    are (every other worker, an agent's own reply, an older coordinator)."""


class ResultItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: Id
    lease_id: LeaseId
    computed_steps: Annotated[int, Meta(ge=0, le=1 << 20)] = 0


class Result(_Msg, kw_only=True):
    """Finished requests of one batch. Tensors: ``images`` [B, 3, H, W] uint8; for rollouts
    also ``window_latents`` [B, W+1, L, C] and ``log_probs`` [B, W] float32."""

    node_id: Text = ""
    session: Text = ""
    worker_id: Id
    batch_id: Text
    items: Annotated[list[ResultItem], Meta(max_length=4096)]
    tensors: Tensors = []
    elapsed_s: float = 0.0
    num_gpus: Annotated[float, Meta(ge=1.0, le=4096.0)] = 1.0
    """GPUs the worker occupied while it denoised the batch, time-averaged: 1 for a
    single-GPU worker, the SP degree for a sequence-parallel group (between two degrees
    when the group re-formed mid-batch). ``elapsed_s * num_gpus`` is the batch's
    GPU-seconds, the unit of the Planner's budget (``spotlight.core.planner.step_time_gpu_s``).
    The agent's heartbeat cannot tell: it lists each group member as a 1-GPU worker."""


class CommitItem(msgspec.Struct, kw_only=True):
    request_id: Id
    lease_id: LeaseId
    step: Annotated[int, Meta(ge=0, le=1 << 20)]
    seed: int
    weight_version: Version


class Commit(_Msg, kw_only=True):
    """In-flight state committed before preemption; tensors ``state.<i>.<name>``."""

    node_id: Text = ""
    session: Text = ""
    worker_id: Id
    items: Annotated[list[CommitItem], Meta(max_length=4096)]
    tensors: Tensors = []


class Fail(_Msg, kw_only=True):
    """Leases given back unfinished. ``reason``: why, for a failed batch the worker's exception
    line (``Type: message``, cut to :data:`MAX_REASON_CHARS`; the coordinator keeps it as the
    request's error and counts it toward ``cluster.max_request_failures``).
    ``consecutive_failures``: the worker's batches in a row that failed, this one included
    (0: not a failure of the batch, e.g. a stop); ``unhealthy``: the worker backs off before
    its next pull because of them."""

    node_id: Text = ""
    session: Text = ""
    worker_id: Id
    request_ids: IdList
    lease_ids: LeaseIdList
    reason: Text
    consecutive_failures: Count = 0
    unhealthy: bool = False


MAX_REASON_CHARS = 1000
"""Longest ``Fail.reason`` a worker sends (an exception message can be any length; ``Text`` allows 4096)."""


class FetchWeights(_Msg, kw_only=True):
    """Ask for weight ``version``: its WEIGHTS header (``header``) and/or the WEIGHTS_CHUNK
    replies ``first_chunk`` … ``first_chunk + num_chunks - 1`` (clipped to the version's
    chunk count; ``first_chunk`` past the end is an error). A worker asks its agent with the
    defaults (header only): the agent answers from its node cache."""

    node_id: Text = ""
    session: Text = ""
    worker_id: Text = ""
    version: Version
    header: bool = True
    first_chunk: ChunkIndex = 0
    num_chunks: Annotated[int, Meta(ge=0, le=MAX_CHUNKS_PER_FETCH)] = 0


class Weights(_Msg, kw_only=True):
    """Header of one weight version (a safetensors file of ``size_bytes``): it travels as
    ``num_chunks`` WEIGHTS_CHUNK messages of ``chunk_bytes`` (the last one shorter).
    ``digest`` is ``"<algorithm>:<hex>"`` of the whole file (sha256 or blake2b,
    :mod:`spotlight.store.weight_sync`). ``found=False``: the version is not published (yet).
    From an agent to its worker the header means "the file is in the node cache"."""

    version: Version
    size_bytes: ByteCount
    format: str = "safetensors"
    found: bool = True
    chunk_bytes: ByteCount = 0
    num_chunks: ChunkIndex = 0
    digest: Digest = ""


class WeightsChunk(_Msg, kw_only=True):
    """Bytes ``[offset, offset + size_bytes)`` of weight ``version``'s file, chunk ``index``
    (offset = index × the header's chunk_bytes), in one raw frame."""

    version: Version
    index: ChunkIndex
    offset: ByteCount
    size_bytes: ByteCount


class WorkerHello(_Msg, kw_only=True):
    worker_id: str
    gpus: list[int]
    pid: int


class GroupForm(_Msg, kw_only=True):
    """Agent → workers of one SP group: (re)form the group (elastic SP, paper §4.4).

    ``members[0]`` is the leader (it pulls work and holds the weights); a member that lacks
    them receives them from the leader by torch.distributed broadcast."""

    members: list[str]
    master_addr: str
    master_port: int
    generation: int
    version: int = -1
    """Weight version the leader must hold before forming (fetched if missing)."""
    pids: list[int] = []
    """Process ids of the members (same order): each member watches its peers and aborts its
    communicator as soon as one dies (NCCL; docs/architecture.md §6). Empty when unknown."""


class GroupFormed(_Msg, kw_only=True):
    """Worker → agent: this member has formed SP group generation ``generation`` of ``sp``
    members (process group up, weights in place, model built) and serves; ``took_s`` seconds
    after it started forming. Lets the node Scheduler know when a reconfiguration is over
    (never sent to the coordinator)."""

    worker_id: str
    generation: int
    sp: int
    took_s: float = 0.0


class Stop(_Msg, kw_only=True):
    """Agent → worker: commit in-flight state (if ``commit``) and exit."""

    commit: bool = True
    reason: str = ""


# ---------------------------------------------------------------- training


Rank = Annotated[int, Meta(ge=0, lt=65536)]
WorldSize = Annotated[int, Meta(ge=1, le=65536)]
ConfigText = Annotated[str, Meta(max_length=256 * 1024)]


class TrainHello(_Msg, kw_only=True):
    """Trainer → coordinator, first message of a rank the coordinator did not start (torchrun,
    srun: ``python -m spotlight.workers.train.launch``). ``host`` and ``gpu`` (the rank's GPU on
    that host) bill the rank's GPU per node; the coordinator answers TRAIN_SETUP or an ERROR."""

    protocol_version: int
    rank: Rank
    world_size: WorldSize
    local_rank: Rank = 0
    local_world_size: WorldSize = 1
    num_nodes: WorldSize = 1
    host: Annotated[str, Meta(max_length=255)] = ""
    gpu: Annotated[int, Meta(ge=-1, le=MAX_GPU_INDEX)] = -1
    """The GPU's index on ``host`` (-1: none, the CPU)."""
    pid: Count = 0


class TrainSetup(_Msg, kw_only=True):
    """Coordinator → trainer, the answer to TRAIN_HELLO: what the coordinator would have put on
    the command line of a rank it started, and the session its heartbeats name. ``config_toml`` is the run's config
    (``RUN_DIR/config.toml``); ``resume_version`` the trainer checkpoint a resumed run loads (-1:
    none); ``checkpoint_dir`` where trainer checkpoints go ("" = none), a path on the
    coordinator's host that every rank must see (a shared file system) unless the rank was
    given its own."""

    config_toml: ConfigText
    session: Id
    """Names this rank's connection in its TRAIN_HEARTBEATs."""
    resume_version: Version = -1
    checkpoint_dir: Text = ""
    heartbeat_interval_s: Annotated[float, Meta(gt=0, le=3600)] = 2.0


class TrainHeartbeat(_Msg, kw_only=True):
    """Trainer → coordinator every ``heartbeat_interval_s`` from a thread of a rank the
    coordinator did not start, on a connection of its own (the rank's main thread may be busy
    in a step for minutes): a rank silent for the coordinator's timeout is lost."""

    rank: Rank
    session: Id


class TrainReady(_Msg, kw_only=True):
    rank: Rank
    world_size: WorldSize
    version: Version


class TrainBatch(_Msg, kw_only=True):
    """Samples of iteration ``iteration`` produced with ``version``. Tensors:
    ``window_latents`` [N, W+1, L, C], ``log_probs`` [N, W], ``advantages`` [N] float32,
    ``cond.embeds`` [N, T, D], ``cond.mask`` [N, T]. ``micro_batches`` lists sample
    indices per micro-batch (the rollout batches, so recomputation matches rollout)."""

    iteration: int
    version: int
    micro_batches: list[list[int]]
    tensors: list[TensorMeta] = []
    checkpoint: bool = True
    """Save the trainer checkpoint of the new version (``run.checkpoint_every``)."""
    rollback_version: Annotated[int, Meta(ge=-1, lt=1 << 62)] = -1
    """>= 0: the collapse guard's rollback (docs/collapse-guard.md): instead of training on this
    batch, load the trainer checkpoint of that version (the best held-out one) and publish it as
    the new version; -1: train as usual."""
    lr_scale: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    """Multiply the learning rate by this before the step (a rollback lowers it)."""
    keep_versions: Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 62)]], Meta(max_length=64)] = []
    """Versions whose trainer checkpoints must survive pruning (the best held-out version and those
    still being evaluated: what a rollback may need)."""


class TrainDone(_Msg, kw_only=True):
    rank: Annotated[int, Meta(ge=0, lt=65536)]
    iteration: Version
    new_version: Version
    metrics: Annotated[dict[Annotated[str, Meta(max_length=200)], float], Meta(max_length=1024)] = {}
    train_s: float = 0.0


# ---------------------------------------------------------------- status


class StatusRequest(_Msg, kw_only=True):
    pass


class Status(_Msg, kw_only=True):
    snapshot: dict[str, Any]


MESSAGE_TYPES: dict[MsgType, type[_Msg]] = {
    MsgType.REGISTER: Register,
    MsgType.REGISTERED: Registered,
    MsgType.HEARTBEAT: Heartbeat,
    MsgType.PULL: Pull,
    MsgType.LEASES: Leases,
    MsgType.RESULT: Result,
    MsgType.COMMIT: Commit,
    MsgType.FAIL: Fail,
    MsgType.FETCH_WEIGHTS: FetchWeights,
    MsgType.WEIGHTS: Weights,
    MsgType.NOTICE: Notice,
    MsgType.BYE: Bye,
    MsgType.ERROR: ErrorMsg,
    MsgType.SHUTDOWN: Shutdown,
    MsgType.WEIGHTS_CHUNK: WeightsChunk,
    MsgType.WORKER_HELLO: WorkerHello,
    MsgType.STOP: Stop,
    MsgType.GROUP_FORM: GroupForm,
    MsgType.GROUP_FORMED: GroupFormed,
    MsgType.TRAIN_READY: TrainReady,
    MsgType.TRAIN_BATCH: TrainBatch,
    MsgType.TRAIN_DONE: TrainDone,
    MsgType.TRAIN_HELLO: TrainHello,
    MsgType.TRAIN_SETUP: TrainSetup,
    MsgType.TRAIN_HEARTBEAT: TrainHeartbeat,
    MsgType.STATUS_REQUEST: StatusRequest,
    MsgType.STATUS: Status,
}
_TYPE_OF = {cls: t for t, cls in MESSAGE_TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in MESSAGE_TYPES.items()}


def encode(
    msg: _Msg, frames: list[bytes | memoryview] | None = None, *, msg_type: MsgType | None = None
) -> list[bytes | memoryview]:
    """Frame list for ``msg`` followed by raw ``frames`` (tensor payloads).

    Args:
        msg: any message struct of this module.
        frames: raw payload frames, in the order of the body's ``tensors`` metas.
        msg_type: override the type byte (tests forge frames with it).
    """
    t = msg_type if msg_type is not None else _TYPE_OF[type(msg)]
    return [bytes([int(t)]), _ENCODER.encode(msg), *(frames or [])]


def decode(frames: list[bytes] | list[Any], *, max_body_bytes: int = MAX_BODY_BYTES) -> tuple[MsgType, Any, list[Any]]:
    """Decode a frame list into ``(type, struct, payload_frames)``.

    The body's size is checked before it is parsed, and every field's type and bounds
    (lengths, ranges) are enforced by the typed decoder, so handlers receive only
    well-formed structs.

    Raises:
        ProtocolError: empty list, unknown type byte, a body over ``max_body_bytes``, a
            malformed or out-of-bounds body (including pathological nesting), or fewer
            payload frames than the body's ``tensors`` declares.
    """
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames (type, body), got {len(frames)}")
    head = bytes(frames[0])
    if len(head) != 1:
        raise ProtocolError(f"type frame must be 1 byte, got {len(head)}")
    try:
        mtype = MsgType(head[0])
    except ValueError:
        raise ProtocolError(f"unknown message type {head[0]}") from None
    if len(frames[1]) > max_body_bytes:
        raise ProtocolError(f"{mtype.name} body of {len(frames[1])} bytes exceeds the limit of {max_body_bytes}")
    try:
        body = _DECODERS[mtype].decode(bytes(frames[1]))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {mtype.name} body: {exc}") from None
    except (
        RecursionError,
        MemoryError,
        ValueError,
        TypeError,
        OverflowError,
    ) as exc:  # e.g. 10^5-deep nesting in an Any field
        raise ProtocolError(f"malformed {mtype.name} body: {type(exc).__name__}") from None
    payload = list(frames[2:])
    metas = getattr(body, "tensors", None)
    if metas is not None and len(payload) < len(metas):
        raise ProtocolError(f"{mtype.name} declares {len(metas)} tensors but carries {len(payload)} frames")
    return mtype, body, payload


# Exit status of an agent that will not (re)join because its VM has an active preemption notice
# (EX_TEMPFAIL). The systemd unit lists it in RestartPreventExitStatus: restarting the agent on
# a VM that is going away cannot help; the replacement VM starts a fresh agent. `spotlight up
# --local` reads it too, so it lives here rather than in the agent daemon.
EXIT_NODE_PREEMPTED = 75
