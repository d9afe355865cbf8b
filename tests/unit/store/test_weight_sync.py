"""Weight versions in chunks (spotlight/store/weight_sync.py, the Tensor Store, the coordinator's
WEIGHTS / WEIGHTS_CHUNK / FETCH_WEIGHTS handlers, agent/weight_cache.py, the worker's loader):
a version published by a trainer in chunks and fetched by an agent arrives bit-identical, even
when it is larger than ``cluster.max_message_bytes``; bad chunks are refused with one ERROR and
change nothing; the coordinator never holds a whole large version in memory."""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time

import pytest
import torch
import zmq

from agent.weight_cache import WeightCache
from spotlight import protocol as P
from spotlight.config import EXAMPLES_DIR, load_config
from spotlight.net.security import (
    add_client,
    apply_client,
    ephemeral_client,
    init_keys,
    load_client_keys,
    load_server_keys,
)
from spotlight.store.tensor_store import TensorStore
from spotlight.store.tensor_wire import mmap_state_dict, save_version
from spotlight.store.weight_sync import (
    ChunkReceiver,
    ServedVersion,
    WeightSyncError,
    chunk_span,
    fetch_replies,
    file_digest,
    num_chunks,
    send_version,
)

CHUNK = 64 * 1024  # the smallest cluster.weight_chunk_bytes


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _state_dict(numel: int = 800_000, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.weight": torch.randn(numel // 2, generator=g).reshape(-1, 100),
        "blocks.0.bias": torch.randn(numel // 2, generator=g).to(torch.bfloat16),
        "steps": torch.arange(7, dtype=torch.int64),
        "scale": torch.tensor(0.5),
    }


# ---------------------------------------------------------------- the assembler


def test_chunk_receiver_any_order_once_each_digest_checked(tmp_path):
    data = os.urandom(5 * 1000 + 123)
    n = num_chunks(len(data), 1000)
    r = ChunkReceiver(tmp_path / "v.bin", 3, len(data), 1000, _digest(data))
    order = [4, 0, 5, 2, 1, 3]
    for k, i in enumerate(order):
        off, length = chunk_span(i, len(data), 1000)
        # refused, changing nothing: out of range, wrong offset, wrong length, a duplicate
        with pytest.raises(WeightSyncError, match="out of range"):
            r.add(n, n * 1000, b"x")
        with pytest.raises(WeightSyncError, match="expected"):
            r.add(i, off + 1, data[off : off + length])
        with pytest.raises(WeightSyncError, match="expected"):
            r.add(i, off, data[off : off + length] + b"x")
        if k:
            prev_off, prev_len = chunk_span(order[k - 1], len(data), 1000)
            with pytest.raises(WeightSyncError, match="twice"):
                r.add(order[k - 1], prev_off, data[prev_off : prev_off + prev_len])
        assert r.received_chunks == k and not (tmp_path / "v.bin").exists()
        assert r.add(i, off, memoryview(data)[off : off + length]) == (k == n - 1)
    assert r.done and (tmp_path / "v.bin").read_bytes() == data
    assert not (tmp_path / "v.bin.part").exists()


def test_chunk_receiver_digest_mismatch_discards_everything(tmp_path):
    data = os.urandom(2500)
    r = ChunkReceiver(tmp_path / "v.bin", 0, len(data), 1000, _digest(data))
    r.add(0, 0, data[:1000])
    r.add(2, 2000, data[2000:])
    bad = bytearray(data[1000:2000])
    bad[7] ^= 1
    with pytest.raises(WeightSyncError, match="digest mismatch"):
        r.add(1, 1000, bytes(bad))
    assert r.failed and not list(tmp_path.iterdir())
    with pytest.raises(WeightSyncError, match="discarded"):
        r.add(1, 1000, data[1000:2000])


def test_saved_version_round_trips_bit_identically_through_chunks_and_mmap(tmp_path):
    from safetensors.torch import load_file

    sd = _state_dict(20_000)
    size, digest = save_version(sd, tmp_path / "src.safetensors")
    assert digest == file_digest(tmp_path / "src.safetensors") and size == os.path.getsize(tmp_path / "src.safetensors")
    assert all(
        torch.equal(load_file(tmp_path / "src.safetensors")[k], v) for k, v in sd.items()
    )  # safetensors reads it
    blob = (tmp_path / "src.safetensors").read_bytes()
    r = ChunkReceiver(tmp_path / "dst.safetensors", 1, size, CHUNK, digest)
    for i in reversed(range(r.num_chunks)):
        off, length = r.expected(i)
        r.add(i, off, blob[off : off + length])
    got = mmap_state_dict(tmp_path / "dst.safetensors")
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)


# ---------------------------------------------------------------- the Tensor Store


def test_tensor_store_never_holds_a_large_version_in_memory(tmp_path):
    store = TensorStore(tmp_path, memory_max_bytes=4 * CHUNK).open()
    data = os.urandom(10 * CHUNK + 5)
    store.begin_weights(0, len(data), CHUNK, _digest(data))
    n = num_chunks(len(data), CHUNK)
    for i in range(n):
        off, length = chunk_span(i, len(data), CHUNK)
        assert store.put_weights_chunk(0, i, off, memoryview(data)[off : off + length]) == (i == n - 1)
        if i < n - 1:  # mid-upload: the bytes went to the .part file, none are buffered
            assert store.latest_version == -1 and store._weights == {}
            assert store.stats()["weights_upload"]["received_bytes"] == off + length
            assert (tmp_path / "weights" / "v0.safetensors.part").stat().st_size == len(data)
    assert store.latest_version == 0 and store._upload is None
    assert store.stats()["weights_in_memory"] == []  # above memory_max_bytes: disk only
    served = store.read_weights(0, CHUNK, CHUNK)
    assert isinstance(served.obj, mmap.mmap) and bytes(served) == data[CHUNK : 2 * CHUNK]  # a slice of the map, no copy
    assert store.weights_info(0).digest == _digest(data) and store.weights_info(0).size_bytes == len(data)
    # a small version is kept in memory as well
    store.put_weights(1, b"small")
    assert store.stats()["weights_in_memory"] == [1] and bytes(store.read_weights(1, 1, 3)) == b"mal"
    # a fresh store (coordinator restart) finds both with their digests
    fresh = TensorStore(tmp_path, memory_max_bytes=0).open()
    assert fresh.weights_info(0).digest == _digest(data) and bytes(fresh.read_weights(1, 0, 5)) == b"small"
    assert fresh.weights_info(7) is None and fresh.read_weights(7, 0, 1) is None
    with pytest.raises(WeightSyncError):
        fresh.read_weights(0, len(data) - 1, 2)
    fresh.prune_weights(keep_from=1)
    assert fresh.weights_info(0) is None and not (tmp_path / "weights" / "v0.digest").exists()


def test_tensor_store_refused_chunks_change_nothing(tmp_path):
    store = TensorStore(tmp_path).open()
    data = os.urandom(3 * CHUNK)
    with pytest.raises(WeightSyncError):
        store.begin_weights(0, len(data), CHUNK, "md5:abc")  # unknown digest algorithm
    with pytest.raises(WeightSyncError, match="no upload"):
        store.put_weights_chunk(0, 0, 0, data[:CHUNK])
    store.begin_weights(0, len(data), CHUNK, _digest(data))
    store.put_weights_chunk(0, 0, 0, data[:CHUNK])
    for args in (
        (1, 1, CHUNK, data[CHUNK : 2 * CHUNK]),
        (0, 3, 3 * CHUNK, b"x"),
        (0, 0, 0, data[:CHUNK]),
        (0, 1, CHUNK, data[:10]),
    ):
        with pytest.raises(WeightSyncError):
            store.put_weights_chunk(*args)
        assert store.stats()["weights_upload"]["received_bytes"] == CHUNK and store.latest_version == -1
    store.put_weights_chunk(0, 1, CHUNK, data[CHUNK : 2 * CHUNK])
    with pytest.raises(WeightSyncError, match="digest mismatch"):
        store.put_weights_chunk(0, 2, 2 * CHUNK, bytes(CHUNK))
    assert store.latest_version == -1 and store._upload is None and not list((tmp_path / "weights").iterdir())


# ---------------------------------------------------------------- through the coordinator


class _Run:
    """A real Coordinator (CURVE sockets, Tensor Store) served on a thread, with a trainer-keyed
    and an agent-keyed DEALER. max_message_bytes = 1 MiB, chunks of 64 KiB."""

    def __init__(self, tmp_path, **overrides):
        from spotlight.coordinator.coordinator import Coordinator

        keys_dir = tmp_path / "keys"
        init_keys(keys_dir)
        add_client(keys_dir, "agent", "spot-a")
        cfg = load_config(
            EXAMPLES_DIR / "jpeg-toy" / "config.toml",
            overrides={
                "cluster.max_message_bytes": 1 << 20,
                "cluster.weight_chunk_bytes": CHUNK,
                "cluster.weight_memory_max_bytes": 0,
                **overrides,
            },
        )
        n = 4
        self.coord = Coordinator(
            cfg,
            tmp_path / "run",
            bind="tcp://127.0.0.1:0",
            keys=load_server_keys(keys_dir),
            prompts=[f"p{i}" for i in range(n)],
            embeds=torch.zeros(n, 4, 384),
            mask=torch.ones(n, 4, dtype=torch.long),
            progress=lambda s: None,
        ).start()
        self.ctx = zmq.Context()
        self.trainer = self._dealer(
            self.coord.server.trainer_endpoint, ephemeral_client(self.coord.keys, "trainer", "test")
        )
        self.agent = self._dealer(self.coord.endpoint, load_client_keys(keys_dir, role="agent"))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _dealer(self, endpoint, creds):
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        apply_client(s, creds)
        s.connect(endpoint)
        return s

    def _serve(self):
        while not self.stop.is_set():
            self.coord.control.serve_once(20)

    def recv(self, sock, timeout_s=20.0):
        assert sock.poll(int(timeout_s * 1000)), "no reply from the coordinator"
        return P.decode(sock.recv_multipart(copy=False))

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for s in (self.trainer, self.agent):
            s.close(0)
        self.ctx.term()
        self.coord.close()


@pytest.fixture
def run(tmp_path):
    r = _Run(tmp_path)
    yield r
    r.close()


def _register(run) -> str:
    run.agent.send_multipart(P.encode(P.Register(protocol_version=P.PROTOCOL_VERSION, node_id="spot-a", gpus=[0])))
    mtype, body, _ = run.recv(run.agent)
    assert mtype == P.MsgType.REGISTERED, body
    return body.session


def _wait(cond, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _fetch_with_agent_cache(run, session, version, cache_dir, window=3):
    """The agent's fetch loop (agent/main.py's handlers around WeightCache) against the coordinator."""
    cache = WeightCache(cache_dir, window_chunks=window)

    def send(reqs):
        for q in reqs:
            q.node_id, q.session = "spot-a", session
            run.agent.send_multipart(P.encode(q))

    send(cache.fetch(version, time.monotonic()))
    in_flight = 0
    while True:
        mtype, body, payload = run.recv(run.agent)
        if mtype == P.MsgType.WEIGHTS:
            reqs, not_found = cache.on_weights(body, time.monotonic())
            assert not not_found
            send(reqs)
        elif mtype == P.MsgType.WEIGHTS_CHUNK:
            reqs, done = cache.on_chunk(body, payload[0], time.monotonic())
            d = cache.downloads.get(version)
            in_flight = max(in_flight, len(d.asked) if d else 0)
            send(reqs)
            if done is not None:
                assert in_flight <= window  # the pull window bounds what is queued for this node
                return cache, done
        elif mtype != P.MsgType.HEARTBEAT:
            pytest.fail(f"unexpected {mtype.name}: {body}")


@pytest.mark.parametrize("chunk", [CHUNK, 1 << 20], ids=["64KiB", "1MiB"])
def test_version_larger_than_max_message_bytes_travels_bit_identical(tmp_path, chunk):
    """1 MiB chunks are as large as the trainer socket's limit allows (plus CURVE's overhead)."""
    run = _Run(tmp_path, **{"cluster.weight_chunk_bytes": chunk})
    try:
        _round_trip(run, tmp_path, chunk)
    finally:
        run.close()


def _round_trip(run, tmp_path, chunk):
    sd = _state_dict()
    size, digest = save_version(sd, tmp_path / "v0.safetensors")
    assert size > 2 * run.coord.cfg.cluster.max_message_bytes  # could never be one frame
    run.trainer.send_multipart(P.encode(P.TrainReady(rank=0, world_size=1, version=0)))
    n = send_version(run.trainer, 0, tmp_path / "v0.safetensors", digest, chunk, unlink=True)
    assert n == num_chunks(size, chunk) >= 3 and not (tmp_path / "v0.safetensors").exists()
    _wait(lambda: run.coord.store.latest_version == 0)
    assert run.coord.control.rejected == 0
    store = run.coord.store
    assert store.stats()["weights_in_memory"] == [] and store._upload is None  # never assembled in memory
    assert file_digest(run.coord.run_dir / "tensor_store" / "weights" / "v0.safetensors") == digest

    session = _register(run)
    cache, done = _fetch_with_agent_cache(run, session, 0, tmp_path / "agent-cache")
    assert (done.version, done.size_bytes, done.digest, done.num_chunks) == (0, size, digest, n)
    assert store.stats()["weights_mapped"] == [0]  # served from the file's memory map
    got = mmap_state_dict(cache.path(0))  # what a worker loads
    assert set(got) == set(sd) and all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in sd.items())
    assert cache.ready(0) == done and cache.fetch(0, time.monotonic()) == []  # cached: no second fetch

    # ranges: a window in the middle, clipped at the end; a first chunk past the end is an error
    run.agent.send_multipart(
        P.encode(
            P.FetchWeights(node_id="spot-a", session=session, version=0, header=False, first_chunk=n - 2, num_chunks=5)
        )
    )
    got = [run.recv(run.agent) for _ in range(2)]
    assert [(m, b.index) for m, b, _ in got] == [(P.MsgType.WEIGHTS_CHUNK, n - 2), (P.MsgType.WEIGHTS_CHUNK, n - 1)]
    assert bytes(got[1][2][0]) == cache.path(0).read_bytes()[(n - 1) * chunk :]
    run.agent.send_multipart(
        P.encode(
            P.FetchWeights(node_id="spot-a", session=session, version=0, header=False, first_chunk=n, num_chunks=1)
        )
    )
    mtype, body, _ = run.recv(run.agent)
    assert mtype == P.MsgType.ERROR and body.code == "bad_request"
    run.agent.send_multipart(P.encode(P.FetchWeights(node_id="spot-a", session=session, version=5, num_chunks=4)))
    mtype, body, payload = run.recv(run.agent)
    assert mtype == P.MsgType.WEIGHTS and not body.found and body.version == 5 and not payload


def _expect_error(run, frames, code="bad_request", match=""):
    before = run.coord.control.rejected
    run.trainer.send_multipart(frames)
    mtype, body, _ = run.recv(run.trainer)
    assert mtype == P.MsgType.ERROR and body.code == code and match in body.message, body
    assert run.coord.control.rejected == before + 1


def test_bad_chunks_are_rejected_with_one_error_and_change_nothing(run, tmp_path):
    size, digest = save_version(_state_dict(100_000), tmp_path / "v0.safetensors")
    blob = (tmp_path / "v0.safetensors").read_bytes()
    n = num_chunks(size, CHUNK)

    def chunk(i, *, version=0, data=None, offset=None):
        off, length = chunk_span(min(i, n - 1), size, CHUNK)
        data = blob[off : off + length] if data is None else data
        return P.encode(
            P.WeightsChunk(version=version, index=i, offset=off if offset is None else offset, size_bytes=len(data)),
            [data],
        )

    header = P.encode(P.Weights(version=0, size_bytes=size, chunk_bytes=CHUNK, num_chunks=n, digest=digest))
    _expect_error(run, header, "unknown_session")  # no TRAIN_READY on this connection yet
    run.trainer.send_multipart(P.encode(P.TrainReady(rank=0, world_size=1, version=0)))
    _expect_error(run, chunk(0), match="no upload")
    _expect_error(
        run,
        P.encode(P.Weights(version=1, size_bytes=size, chunk_bytes=CHUNK, num_chunks=n, digest=digest)),
        match="announce version 0",
    )
    _expect_error(
        run,
        P.encode(
            P.Weights(
                version=0, size_bytes=size, chunk_bytes=2 * CHUNK, num_chunks=-(-size // (2 * CHUNK)), digest=digest
            )
        ),
        match="chunks must be",
    )
    _expect_error(
        run,
        P.encode(P.Weights(version=0, size_bytes=size, chunk_bytes=CHUNK, num_chunks=n + 1, digest=digest)),
        match="cover the version",
    )
    _expect_error(
        run,
        P.encode(P.Weights(version=0, size_bytes=size, chunk_bytes=CHUNK, num_chunks=n, digest="sha256:xyz")),
        match="digest",
    )
    _expect_error(
        run, P.encode(P.Weights(version=0, size_bytes=3, num_chunks=1, chunk_bytes=3), [b"abc"]), match="WEIGHTS_CHUNK"
    )  # the v2 one-frame form
    run.trainer.send_multipart(header)
    run.trainer.send_multipart(chunk(0))
    run.trainer.send_multipart(chunk(1))
    _wait(lambda: (run.coord.store.stats()["weights_upload"] or {}).get("received_bytes") == 2 * CHUNK)
    store_state = lambda: (run.coord.store.stats(), sorted(os.listdir(run.coord.run_dir / "tensor_store" / "weights")))
    before = store_state()
    _expect_error(run, chunk(1), match="twice")  # duplicate
    _expect_error(run, chunk(n), match="out of range")
    _expect_error(run, chunk(2, data=blob[2 * CHUNK : 3 * CHUNK] + b"x"), match="expected")  # oversized
    _expect_error(run, chunk(2, offset=0), match="expected")
    _expect_error(run, chunk(2, version=1), match="no upload of weight version 1")
    _expect_error(
        run, P.encode(P.WeightsChunk(version=0, index=2, offset=2 * CHUNK, size_bytes=CHUNK)), match="one frame"
    )
    assert store_state() == before
    # a chunk frame over the trainer socket's limit: libzmq drops the connection, nothing changes
    big = run._dealer(run.coord.server.trainer_endpoint, ephemeral_client(run.coord.keys, "trainer", "big"))
    big.send_multipart(
        P.encode(
            P.WeightsChunk(version=0, index=2, offset=2 * CHUNK, size_bytes=2 * P.MAX_BODY_BYTES),
            [bytes(2 * P.MAX_BODY_BYTES)],
        )
    )
    time.sleep(0.5)
    big.close(0)
    assert store_state() == before
    # corrupted bytes: the digest catches it on the last chunk; the whole upload is discarded
    for i in range(2, n - 1):
        run.trainer.send_multipart(chunk(i))
    off, length = chunk_span(n - 1, size, CHUNK)
    bad = bytearray(blob[off:])
    bad[-1] ^= 0xFF
    _expect_error(run, chunk(n - 1, data=bytes(bad)), match="digest mismatch")
    assert run.coord.store.latest_version == -1 and run.coord.store.stats()["weights_upload"] is None
    assert os.listdir(run.coord.run_dir / "tensor_store" / "weights") == []
    # the trainer sends the version again, intact: published
    run.trainer.send_multipart(header)
    for i in range(n):
        run.trainer.send_multipart(chunk(i))
    _wait(lambda: run.coord.store.latest_version == 0)
    assert run.coord.store.get_weights(0) == blob


def test_served_version_answers_an_agent_cache(tmp_path):
    """ServedVersion (the stand-in coordinators' server: the coordinator's fetch_replies over a
    memory map) gives an agent's WeightCache the version bit-identical, a window at a time."""
    sd = _state_dict(numel=200_000)
    size, digest = save_version(sd, tmp_path / "v3.safetensors")
    served = ServedVersion(tmp_path / "v3.safetensors", 3, CHUNK)  # digest computed
    assert (served.size_bytes, served.digest) == (size, digest)
    cache = WeightCache(tmp_path / "cache", window_chunks=2)
    pending, done, most_asked = list(cache.fetch(3, 0.0)), None, 0
    while pending:
        replies = served.replies(pending.pop(0))
        for msg, frames in replies:
            if isinstance(msg, P.Weights):
                assert msg.found and not frames
                reqs, not_found = cache.on_weights(msg, 0.0)
                assert not not_found
            else:
                [frame] = frames
                assert isinstance(frame, memoryview)  # a slice of the map, not a copy
                reqs, got = cache.on_chunk(msg, frame, 0.0)
                done = done or got
            most_asked = max(most_asked, len(cache.downloads[3].asked) if 3 in cache.downloads else 0)
            pending += reqs
    assert (
        done is not None
        and (done.size_bytes, done.digest, done.num_chunks) == (size, digest, num_chunks(size, CHUNK))
        and done.num_chunks >= 3
    )
    assert most_asked <= 2
    assert cache.path(3).read_bytes() == (tmp_path / "v3.safetensors").read_bytes()
    # another version: not found; a first chunk past the end: refused before anything is read
    [(msg, frames)] = served.replies(P.FetchWeights(version=4, num_chunks=2))
    assert isinstance(msg, P.Weights) and not msg.found and msg.version == 4 and frames == []
    with pytest.raises(WeightSyncError, match="does not exist"):
        served.replies(P.FetchWeights(version=3, header=False, first_chunk=done.num_chunks, num_chunks=1))
    # a version pruned while being served: WEIGHTS(found=False) ends the stream
    reads = []
    gone = fetch_replies(
        P.FetchWeights(version=3, header=True, num_chunks=3),
        size,
        CHUNK,
        digest,
        lambda off, n: reads.append(off) or (b"x" * n if off == 0 else None),
    )
    assert [(type(m).__name__, getattr(m, "found", None)) for m, _ in gone] == [
        ("Weights", True),
        ("WeightsChunk", None),
        ("Weights", False),
    ]
    assert reads == [0, CHUNK]


def test_agent_cache_retries_and_restarts(tmp_path):
    """WeightCache without a coordinator: a lost chunk is asked again after retry_s; a chunk
    that does not fit the plan restarts the version from its header; old versions are evicted."""
    data = os.urandom(5 * 1000)
    cache = WeightCache(tmp_path, window_chunks=2, retry_s=5.0, keep_versions=1)
    [first] = cache.fetch(7, now=0.0)
    assert (first.version, first.header, first.first_chunk, first.num_chunks) == (7, True, 0, 2)
    assert cache.fetch(7, now=1.0) == []  # one fetch per version
    hdr = P.Weights(version=7, size_bytes=len(data), chunk_bytes=1000, num_chunks=5, digest=_digest(data))
    assert cache.on_weights(hdr, 0.1) == ([], False)
    ck = lambda i: P.WeightsChunk(version=7, index=i, offset=i * 1000, size_bytes=1000)
    reqs, done = cache.on_chunk(ck(0), data[:1000], 0.2)
    assert done is None and [(q.first_chunk, q.num_chunks, q.header) for q in reqs] == [(2, 1, False)]
    # chunk 1 is lost; chunk 2 arrives; after retry_s, 1 is asked again
    reqs, _ = cache.on_chunk(ck(2), data[2000:3000], 0.3)
    assert [q.first_chunk for q in reqs] == [3]
    assert cache.overdue(now=2.0) == []
    assert sorted(q.first_chunk for q in cache.overdue(now=6.0)) == [1, 3]
    # a chunk that does not fit the plan: start over from the header
    reqs, _ = cache.on_chunk(P.WeightsChunk(version=7, index=1, offset=1000, size_bytes=999), data[1000:1999], 6.1)
    assert [(q.header, q.first_chunk, q.num_chunks) for q in reqs] == [(True, 0, 2)]
    cache.on_weights(hdr, 6.2)
    done = None
    for i in range(5):
        reqs, done = cache.on_chunk(ck(i), data[i * 1000 : (i + 1) * 1000], 6.3)
    assert done == P.Weights(version=7, size_bytes=len(data), chunk_bytes=1000, num_chunks=5, digest=_digest(data))
    assert cache.path(7).read_bytes() == data and cache.ready(7) == done
    # retries without any progress (a coordinator that refuses our ranges): back to the header
    cache.fetch(10, 7.0)
    cache.on_weights(
        P.Weights(version=10, size_bytes=len(data), chunk_bytes=1000, num_chunks=5, digest=_digest(data)), 7.0
    )
    for k in range(3):
        assert all(not q.header for q in cache.overdue(now=20.0 + 10 * k))
    [again] = cache.overdue(now=60.0)
    assert again.header and again.first_chunk == 0 and cache.downloads[10].receiver is None
    del cache.downloads[10]
    # not found: the fetch is dropped and the waiters are to be told
    cache.fetch(8, 7.0)
    assert (
        cache.on_weights(P.Weights(version=8, size_bytes=0, found=False), 7.1) == ([], True)
        and 8 not in cache.downloads
    )
    # keep_versions=1: a newer version evicts v7's file
    small = b"abc"
    cache.fetch(9, 8.0)
    cache.on_weights(P.Weights(version=9, size_bytes=3, chunk_bytes=1000, num_chunks=1, digest=_digest(small)), 8.1)
    assert cache.on_chunk(P.WeightsChunk(version=9, index=0, offset=0, size_bytes=3), small, 8.2)[1] is not None
    assert cache.ready(7) is None and not cache.path(7).exists() and cache.latest() == 9
    cache.clear()
    assert not list(tmp_path.iterdir())
