"""Every message on Spotlight's wire: typed structs, framing, protocol version.

A message is a ZeroMQ multipart frame list::

    [type (1 byte MsgType)] [body (msgpack of the type's Struct)] [raw tensor frame]*

Tensors travel as raw little-endian frames described by :class:`TensorMeta` entries in
the body (dtype name + shape); the receiver rebuilds them with ``torch.frombuffer``
(``spotlight/tensor_wire.py``). Nothing is ever unpickled: a body is decoded with a
typed msgspec decoder for exactly the type its first frame names, so a malformed body,
an unknown type byte or a missing tensor frame raises :class:`ProtocolError` and the
caller drops the message without changing state (DESIGN §9).

The module is torch-free so the agent daemon can import it. New fields must have
defaults (checked by ``tests/unit/test_protocol.py``); bump :data:`PROTOCOL_VERSION`
when an old peer could not understand a message.

Who sends what::

    agent  → coordinator   REGISTER, HEARTBEAT, PULL, RESULT, COMMIT, FAIL, FETCH_WEIGHTS,
                           FETCH_STATE, NOTICE, BYE
    coordinator → agent    REGISTERED, LEASES, WEIGHTS, STATE, ERROR, SHUTDOWN
    worker ↔ agent         WORKER_HELLO, PULL, LEASES, RESULT, COMMIT, FAIL, FETCH_WEIGHTS,
                           WEIGHTS, STOP (same structs, relayed without decoding tensors)
    trainer ↔ coordinator  TRAIN_READY, TRAIN_BATCH, TRAIN_DONE, WEIGHTS
    CLI → coordinator      STATUS_REQUEST → STATUS
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from spotlight.errors import SpotlightError

PROTOCOL_VERSION = 1
"""Sent in REGISTER; the coordinator refuses any other version."""


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
    FETCH_STATE = 11
    STATE = 12
    NOTICE = 13
    BYE = 14
    ERROR = 15
    SHUTDOWN = 16
    WORKER_HELLO = 20
    STOP = 21
    GROUP_FORM = 22
    TRAIN_READY = 30
    TRAIN_BATCH = 31
    TRAIN_DONE = 32
    STATUS_REQUEST = 40
    STATUS = 41


class _Msg(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    pass


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """Describes one raw tensor frame: ``name``, numpy-style ``dtype`` name, ``shape``."""

    name: str
    dtype: str
    shape: list[int]


# ---------------------------------------------------------------- membership


class Register(_Msg, kw_only=True):
    """Agent → coordinator handshake (DEALER identity = node_id)."""

    protocol_version: int
    node_id: str
    gpus: list[int]
    is_spot: bool = True
    hostname: str = ""
    pid: int = 0
    nonce: str = ""
    """Random hex chosen by the agent for this handshake."""
    auth: str = ""
    """HMAC-SHA256(secret, "register|node_id|nonce|protocol_version") in hex, when the coordinator requires a secret."""


class Registered(_Msg, kw_only=True):
    """Coordinator → agent: facts the coordinator decides."""

    node_id: str
    heartbeat_interval_s: float
    lease_timeout_s: float
    worker_batch_size: int
    torch_threads: int
    sp_degree: int = 1
    """Sequence-parallel degree of each worker group on the node (elastic below it)."""
    model: dict[str, Any]
    """The run's ``[model]`` config section (workers build the transformer from it)."""
    sampler: dict[str, Any]
    """The run's ``[sampler]`` config section."""
    lora: dict[str, Any] = {}
    """LoRA settings (rank, alpha, target_modules) when versions are adapters; {} = full weights."""
    latest_version: int
    session: str = ""
    """Per-registration token the agent echoes in every later message."""


class WorkerInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    worker_id: str
    gpus: list[int]
    busy: bool = False
    versions: list[int] = []
    pid: int = 0


class Heartbeat(_Msg, kw_only=True):
    node_id: str
    session: str = ""
    workers: list[WorkerInfo] = []
    in_flight: list[str] = []
    """Request ids currently held by this node's workers."""
    detector_healthy: bool = True
    detector_error: str = ""
    draining: bool = False
    gpus: list[int] | None = None
    """The node's current GPUs (after revocations/additions); None = unchanged."""


class Notice(_Msg, kw_only=True):
    """Agent → coordinator: a preemption notice (absolute wall-clock deadline)."""

    node_id: str
    session: str = ""
    source: str
    scope: str
    deadline_unix_s: float
    key: str
    kind: str
    is_hint: bool = False


class Bye(_Msg, kw_only=True):
    node_id: str
    session: str = ""
    reason: str = ""


class ErrorMsg(_Msg, kw_only=True):
    code: str
    message: str


class Shutdown(_Msg, kw_only=True):
    reason: str = ""


# ---------------------------------------------------------------- requests


class Pull(_Msg, kw_only=True):
    """Worker → agent → coordinator: "I am idle, give me up to N requests"."""

    node_id: str = ""
    session: str = ""
    worker_id: str
    max_requests: int
    versions: list[int] = []
    """Weight versions the worker already holds (a hint)."""


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


class ResultItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    lease_id: int
    computed_steps: int = 0


class Result(_Msg, kw_only=True):
    """Finished requests of one batch. Tensors: ``images`` [B, 3, H, W] uint8; for rollouts
    also ``window_latents`` [B, W+1, L, C] and ``log_probs`` [B, W] float32."""

    node_id: str = ""
    session: str = ""
    worker_id: str
    batch_id: str
    items: list[ResultItem]
    tensors: list[TensorMeta] = []
    elapsed_s: float = 0.0


class CommitItem(msgspec.Struct, kw_only=True):
    request_id: str
    lease_id: int
    step: int
    seed: int
    weight_version: int


class Commit(_Msg, kw_only=True):
    """In-flight state committed before preemption; tensors ``state.<i>.<name>``."""

    node_id: str = ""
    session: str = ""
    worker_id: str
    items: list[CommitItem]
    tensors: list[TensorMeta] = []


class Fail(_Msg, kw_only=True):
    node_id: str = ""
    session: str = ""
    worker_id: str
    request_ids: list[str]
    lease_ids: list[int]
    reason: str


class FetchWeights(_Msg, kw_only=True):
    node_id: str = ""
    session: str = ""
    worker_id: str = ""
    version: int


class Weights(_Msg, kw_only=True):
    """One weight version: a single raw frame holding a safetensors file."""

    version: int
    size_bytes: int
    format: str = "safetensors"
    found: bool = True


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


class Stop(_Msg, kw_only=True):
    """Agent → worker: commit in-flight state (if ``commit``) and exit."""

    commit: bool = True
    reason: str = ""


# ---------------------------------------------------------------- training


class TrainReady(_Msg, kw_only=True):
    rank: int
    world_size: int
    version: int


class TrainBatch(_Msg, kw_only=True):
    """Samples of iteration ``iteration`` produced with ``version``. Tensors:
    ``window_latents`` [N, W+1, L, C], ``log_probs`` [N, W], ``advantages`` [N] float32,
    ``cond.embeds`` [N, T, D], ``cond.mask`` [N, T]. ``micro_batches`` lists sample
    indices per micro-batch (the rollout batches, so recomputation matches rollout)."""

    iteration: int
    version: int
    micro_batches: list[list[int]]
    tensors: list[TensorMeta] = []


class TrainDone(_Msg, kw_only=True):
    rank: int
    iteration: int
    new_version: int
    metrics: dict[str, float] = {}
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
    MsgType.FETCH_STATE: FetchWeights,
    MsgType.STATE: Weights,
    MsgType.NOTICE: Notice,
    MsgType.BYE: Bye,
    MsgType.ERROR: ErrorMsg,
    MsgType.SHUTDOWN: Shutdown,
    MsgType.WORKER_HELLO: WorkerHello,
    MsgType.STOP: Stop,
    MsgType.GROUP_FORM: GroupForm,
    MsgType.TRAIN_READY: TrainReady,
    MsgType.TRAIN_BATCH: TrainBatch,
    MsgType.TRAIN_DONE: TrainDone,
    MsgType.STATUS_REQUEST: StatusRequest,
    MsgType.STATUS: Status,
}
_TYPE_OF = {cls: t for t, cls in MESSAGE_TYPES.items() if t not in (MsgType.FETCH_STATE, MsgType.STATE)}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in MESSAGE_TYPES.items()}


def encode(msg: _Msg, frames: list[bytes | memoryview] | None = None, *, msg_type: MsgType | None = None) -> list[bytes | memoryview]:
    """Frame list for ``msg`` followed by raw ``frames`` (tensor payloads).

    Args:
        msg: any message struct of this module.
        frames: raw payload frames, in the order of the body's ``tensors`` metas.
        msg_type: override the type byte (FETCH_STATE/STATE share structs with weights).
    """
    t = msg_type if msg_type is not None else _TYPE_OF[type(msg)]
    return [bytes([int(t)]), _ENCODER.encode(msg), *(frames or [])]


def decode(frames: list[bytes] | list[Any]) -> tuple[MsgType, Any, list[Any]]:
    """Decode a frame list into ``(type, struct, payload_frames)``.

    Raises:
        ProtocolError: empty list, unknown type byte, malformed body, or fewer payload
            frames than the body's ``tensors`` declares.
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
    try:
        body = _DECODERS[mtype].decode(bytes(frames[1]))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {mtype.name} body: {exc}") from None
    payload = list(frames[2:])
    metas = getattr(body, "tensors", None)
    if metas is not None and len(payload) < len(metas):
        raise ProtocolError(f"{mtype.name} declares {len(metas)} tensors but carries {len(payload)} frames")
    return mtype, body, payload
