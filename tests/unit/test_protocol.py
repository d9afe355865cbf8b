"""Wire protocol: every message round-trips, defaults stay optional, bad frames raise
ProtocolError; tensor frames and safetensors blobs round-trip without pickle."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from spotlight import protocol as P
from spotlight.config import REPO_ROOT
from spotlight.store.tensor_wire import bytes_to_state_dict, pack_tensors, state_dict_to_bytes, unpack_tensors

META = P.TensorMeta("cond.embeds", "float32", [2, 3, 4])

SAMPLES: dict[P.MsgType, P._Msg] = {
    P.MsgType.REGISTER: P.Register(
        protocol_version=P.PROTOCOL_VERSION, node_id="spot-0", gpus=[0, 1], is_spot=False, hostname="h", pid=12
    ),
    P.MsgType.REGISTERED: P.Registered(
        node_id="spot-0",
        heartbeat_interval_s=1.0,
        lease_timeout_s=120.0,
        worker_batch_size=8,
        torch_threads=1,
        model={"source": "tiny", "axes_dims_rope": [8, 12, 12]},
        sampler={"num_steps": 10, "noise_level": 1.0},
        latest_version=3,
        session="s1",
        offload_rollout_while_training=True,
    ),
    P.MsgType.HEARTBEAT: P.Heartbeat(
        node_id="spot-0",
        session="s1",
        workers=[P.WorkerInfo(worker_id="spot-0/gpu0", gpus=[0], busy=True, versions=[2, 3], pid=99)],
        in_flight=["r1", "r2"],
        detector_healthy=False,
        detector_error="boom",
        draining=True,
    ),
    P.MsgType.PULL: P.Pull(
        node_id="spot-0",
        session="s1",
        worker_id="spot-0/gpu0",
        max_requests=4,
        versions=[3],
        residency="released",
        moves=[P.DeviceMove(kind="offload", seconds=1.25, size_bytes=41 << 30)],
    ),
    P.MsgType.LEASES: P.Leases(
        worker_id="spot-0/gpu0",
        items=[
            P.LeaseItem(
                lease_id=1, request_id="r1", kind="rollout", iteration=2, prompt_index=5, seed=77, weight_version=3
            ),
            P.LeaseItem(
                lease_id=2,
                request_id="r2",
                kind="explore",
                iteration=2,
                prompt_index=6,
                seed=78,
                weight_version=2,
                params={"cache_threshold": 0.5, "num_steps": 4},
                resume_step=3,
            ),
        ],
        tensors=[META, P.TensorMeta("cond.mask", "int64", [2, 3])],
        device="reclaim",
    ),
    P.MsgType.RESULT: P.Result(
        node_id="spot-0",
        session="s1",
        worker_id="spot-0/gpu0",
        batch_id="b1",
        items=[P.ResultItem(request_id="r1", lease_id=1, computed_steps=10)],
        tensors=[P.TensorMeta("images", "uint8", [1, 3, 32, 32])],
        elapsed_s=1.5,
        num_gpus=2.0,
    ),
    P.MsgType.COMMIT: P.Commit(
        node_id="spot-0",
        session="s1",
        worker_id="spot-0/gpu0",
        items=[P.CommitItem(request_id="r1", lease_id=1, step=4, seed=77, weight_version=3)],
        tensors=[P.TensorMeta("state.0.latents", "float32", [256, 12])],
    ),
    P.MsgType.FAIL: P.Fail(
        node_id="spot-0", session="s1", worker_id="w", request_ids=["r1"], lease_ids=[1], reason="oom"
    ),
    P.MsgType.FETCH_WEIGHTS: P.FetchWeights(
        node_id="spot-0", session="s1", worker_id="w", version=3, header=False, first_chunk=5, num_chunks=4
    ),
    P.MsgType.WEIGHTS: P.Weights(
        version=3,
        size_bytes=1234,
        format="safetensors",
        found=True,
        chunk_bytes=1000,
        num_chunks=2,
        digest="sha256:" + "0" * 64,
    ),
    P.MsgType.WEIGHTS_CHUNK: P.WeightsChunk(version=3, index=1, offset=1000, size_bytes=234),
    P.MsgType.NOTICE: P.Notice(
        node_id="spot-0",
        session="s1",
        source="gce",
        scope="node",
        deadline_unix_s=1.7e9,
        key="k",
        kind="preempt",
        is_hint=True,
    ),
    P.MsgType.BYE: P.Bye(node_id="spot-0", session="s1", reason="preempted"),
    P.MsgType.ERROR: P.ErrorMsg(code="bad_session", message="unknown session"),
    P.MsgType.SHUTDOWN: P.Shutdown(reason="run finished"),
    P.MsgType.WORKER_HELLO: P.WorkerHello(worker_id="spot-0/gpu0", gpus=[0], pid=4321),
    P.MsgType.STOP: P.Stop(commit=False, reason="node draining"),
    P.MsgType.GROUP_FORM: P.GroupForm(
        members=["n/gpu0", "n/gpu1"], master_addr="127.0.0.1", master_port=29500, generation=2, version=3
    ),
    P.MsgType.GROUP_FORMED: P.GroupFormed(worker_id="n/gpu1", generation=2, sp=2, took_s=0.8),
    P.MsgType.TRAIN_READY: P.TrainReady(rank=0, world_size=2, version=0),
    P.MsgType.TRAIN_BATCH: P.TrainBatch(
        iteration=1, version=1, micro_batches=[[0, 1], [2]], tensors=[P.TensorMeta("advantages", "float32", [3])]
    ),
    P.MsgType.TRAIN_DONE: P.TrainDone(rank=0, iteration=1, new_version=2, metrics={"train/loss": -0.5}, train_s=3.0),
    P.MsgType.TRAIN_HELLO: P.TrainHello(
        protocol_version=P.PROTOCOL_VERSION,
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        num_nodes=2,
        host="node-b",
        gpu=1,
        pid=7,
    ),
    P.MsgType.TRAIN_SETUP: P.TrainSetup(
        config_toml="[run]\niterations = 2\n",
        session="s1",
        resume_version=3,
        checkpoint_dir="/r",
        heartbeat_interval_s=1.0,
    ),
    P.MsgType.TRAIN_HEARTBEAT: P.TrainHeartbeat(rank=1, session="s1"),
    P.MsgType.STATUS_REQUEST: P.StatusRequest(),
    P.MsgType.STATUS: P.Status(snapshot={"phase": "rollout", "nodes": [{"id": "spot-0", "gpus": 2}], "cost": 1.5}),
}


def _payload_for(msg) -> list[bytes]:
    return [b"\x00" * 4 for _ in getattr(msg, "tensors", [])]


def test_samples_cover_every_message_type():
    assert set(SAMPLES) == set(P.MESSAGE_TYPES)
    for t, msg in SAMPLES.items():
        assert type(msg) is P.MESSAGE_TYPES[t]


@pytest.mark.parametrize("mtype", list(P.MESSAGE_TYPES), ids=lambda t: t.name)
def test_round_trip(mtype):
    msg = SAMPLES[mtype]
    payload = _payload_for(msg)
    frames = P.encode(msg, payload, msg_type=mtype)
    assert frames[0] == bytes([int(mtype)])
    got_type, body, got_payload = P.decode([bytes(f) for f in frames])
    assert got_type == mtype
    assert body == msg
    assert got_payload == payload


def test_encode_picks_type_from_struct():
    frames = P.encode(SAMPLES[P.MsgType.WEIGHTS])
    assert frames[0] == bytes([P.MsgType.WEIGHTS])
    frames = P.encode(SAMPLES[P.MsgType.FETCH_WEIGHTS])
    assert frames[0] == bytes([P.MsgType.FETCH_WEIGHTS])


def _has_default(field: msgspec.structs.FieldInfo) -> bool:
    return field.default is not msgspec.NODEFAULT or field.default_factory is not msgspec.NODEFAULT


def _default_of(field: msgspec.structs.FieldInfo):
    return field.default if field.default is not msgspec.NODEFAULT else field.default_factory()


def _optional_cases():
    for mtype, cls in P.MESSAGE_TYPES.items():
        for f in msgspec.structs.fields(cls):
            if _has_default(f):
                yield pytest.param(mtype, f.name, id=f"{mtype.name}.{f.name}")


@pytest.mark.parametrize("mtype,field", list(_optional_cases()))
def test_fields_with_defaults_are_optional(mtype, field):
    body = msgspec.to_builtins(SAMPLES[mtype])
    body.pop(field, None)
    cls = P.MESSAGE_TYPES[mtype]
    info = {f.name: f for f in msgspec.structs.fields(cls)}[field]
    _, decoded, _ = P.decode([bytes([int(mtype)]), msgspec.msgpack.encode(body), *_payload_for(SAMPLES[mtype])])
    assert getattr(decoded, field) == _default_of(info)


@pytest.mark.parametrize(
    "item",
    [
        SAMPLES[P.MsgType.HEARTBEAT].workers[0],
        SAMPLES[P.MsgType.LEASES].items[1],
        SAMPLES[P.MsgType.RESULT].items[0],
        SAMPLES[P.MsgType.COMMIT].items[0],
        SAMPLES[P.MsgType.PULL].moves[0],
    ],
    ids=lambda it: type(it).__name__,
)
def test_nested_item_defaults_are_optional(item):
    cls = type(item)
    fields = msgspec.structs.fields(cls)
    required = {f.name: getattr(item, f.name) for f in fields if not _has_default(f)}
    # only required fields on the wire: decodes, and every other field takes its default
    got = msgspec.msgpack.Decoder(cls).decode(msgspec.msgpack.encode(required))
    for f in fields:
        if _has_default(f):
            assert getattr(got, f.name) == _default_of(f)


def test_every_message_has_a_sample_with_required_fields_only():
    """Required fields must really be required (a missing one is a ProtocolError)."""
    for mtype, msg in SAMPLES.items():
        cls = P.MESSAGE_TYPES[mtype]
        for f in msgspec.structs.fields(cls):
            if _has_default(f):
                continue
            body = msgspec.to_builtins(msg)
            del body[f.name]
            with pytest.raises(P.ProtocolError):
                P.decode([bytes([int(mtype)]), msgspec.msgpack.encode(body)])


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([bytes([P.MsgType.REGISTER]), b"\xc1\xff"], id="not-msgpack"),
        pytest.param([bytes([P.MsgType.REGISTER]), msgspec.msgpack.encode([1, 2, 3])], id="array-body"),
        pytest.param(
            [
                bytes([P.MsgType.REGISTER]),
                msgspec.msgpack.encode({"protocol_version": "one", "node_id": "n", "gpus": []}),
            ],
            id="wrong-type",
        ),
        pytest.param([bytes([P.MsgType.PULL]), msgspec.msgpack.encode({"worker_id": "w"})], id="missing-required"),
        pytest.param([bytes([99]), msgspec.msgpack.encode({})], id="unknown-type"),
        pytest.param([bytes([0]), msgspec.msgpack.encode({})], id="type-zero"),
        pytest.param([b"\x01\x02", msgspec.msgpack.encode({})], id="two-byte-type"),
        pytest.param([b"", msgspec.msgpack.encode({})], id="empty-type"),
        pytest.param([bytes([P.MsgType.SHUTDOWN])], id="one-frame"),
        pytest.param([], id="no-frames"),
    ],
)
def test_malformed_frames_raise_protocol_error(frames):
    with pytest.raises(P.ProtocolError):
        P.decode(frames)


def test_fewer_payload_frames_than_tensors():
    msg = P.Result(
        worker_id="w",
        batch_id="b",
        items=[],
        tensors=[P.TensorMeta("a", "uint8", [1]), P.TensorMeta("b", "uint8", [1])],
    )
    frames = P.encode(msg, [b"\x01"])
    with pytest.raises(P.ProtocolError):
        P.decode(frames)
    # exactly enough frames decodes
    P.decode(P.encode(msg, [b"\x01", b"\x02"]))


def test_protocol_error_is_a_spotlight_error():
    from spotlight.errors import SpotlightError

    assert issubclass(P.ProtocolError, SpotlightError)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    body = msgspec.to_builtins(SAMPLES[P.MsgType.BYE])
    body["from_the_future"] = [1, 2]
    _, decoded, _ = P.decode([bytes([P.MsgType.BYE]), msgspec.msgpack.encode(body)])
    assert decoded == SAMPLES[P.MsgType.BYE]


@pytest.mark.procs
def test_protocol_module_does_not_import_torch():
    code = "import spotlight.protocol, sys; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- tensor_wire


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(2, 3, generator=g),
        "bf16": torch.randn(4, 5, generator=g).bfloat16(),
        "u8": torch.randint(0, 256, (2, 3, 4, 4), generator=g, dtype=torch.uint8),
        "i64": torch.tensor([-(2**62), 0, 2**62 + 7]),
        "bool": torch.tensor([[True, False], [False, True]]),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "f16": torch.randn(3, generator=g).half(),
        "i32": torch.tensor([1, -2], dtype=torch.int32),
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.empty(2, 0, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.25),
        "noncontig": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }


def test_pack_unpack_round_trip():
    src = _sample_tensors()
    metas, frames = pack_tensors(src)
    assert [m.name for m in metas] == list(src)
    assert all(isinstance(f, bytes) for f in frames)
    # through the full message path
    msg = P.Leases(worker_id="w", tensors=metas)
    _, body, payload = P.decode(P.encode(msg, frames))
    out = unpack_tensors(body.tensors, payload)
    assert list(out) == list(src)
    for name, t in src.items():
        assert out[name].dtype == t.dtype, name
        assert out[name].shape == t.shape, name
        assert torch.equal(out[name], t), name
    # unpacked tensors are writable copies, not views of the frames
    out["f32"] += 1.0
    again = unpack_tensors(metas, frames)
    assert torch.equal(again["f32"], src["f32"])


def test_unpack_rejects_wrong_frame_size():
    metas, frames = pack_tensors({"x": torch.zeros(2, 3)})
    with pytest.raises(P.ProtocolError):
        unpack_tensors(metas, [frames[0][:-1]])
    with pytest.raises(P.ProtocolError):
        unpack_tensors(metas, [frames[0] + b"\x00\x00\x00\x00"])
    with pytest.raises(P.ProtocolError):
        unpack_tensors([P.TensorMeta("x", "float32", [2, 2])], [frames[0]])


def test_unpack_rejects_bad_metas():
    with pytest.raises(P.ProtocolError):
        unpack_tensors([P.TensorMeta("x", "complex64", [1])], [b"\x00" * 8])
    with pytest.raises(P.ProtocolError):
        unpack_tensors([P.TensorMeta("x", "float32", [-1])], [b""])
    with pytest.raises(P.ProtocolError):
        unpack_tensors([P.TensorMeta("x", "uint8", [1]), P.TensorMeta("y", "uint8", [1])], [b"\x00"])


def test_pack_rejects_unsupported_dtype():
    with pytest.raises(ValueError):
        pack_tensors({"c": torch.zeros(2, dtype=torch.complex64)})


def test_state_dict_bytes_round_trip():
    sd = {
        "layer.weight": torch.randn(4, 3),
        "layer.bias": torch.zeros(4),
        "emb": torch.randn(2, 2).bfloat16(),
        "steps": torch.tensor([1, 2, 3]),
        "view": torch.arange(6.0).reshape(2, 3)[:, 1],
    }
    blob = state_dict_to_bytes(sd)
    assert isinstance(blob, bytes)
    back = bytes_to_state_dict(memoryview(blob))
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # and the transformer's own state dict
    lin = torch.nn.Linear(3, 2)
    back = bytes_to_state_dict(state_dict_to_bytes(lin.state_dict()))
    lin2 = torch.nn.Linear(3, 2)
    lin2.load_state_dict(back)
    assert torch.equal(lin2.weight, lin.weight)
