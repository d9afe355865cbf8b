"""Attacks on a live coordinator's port, each as its own regression test, and a fuzz run.

One ``spotlight up`` process (no local agents) serves every test in this module. The
tests speak to it over real CURVE-encrypted ZeroMQ sockets with keys from its keys
directory: a ``victim`` agent that registers and holds leases, and attackers with their
own (allow-listed) keys, no keys, or the wrong keys. After every attack the coordinator
must be alive, must still serve the victim, and must not have changed the victim's state
(docs/architecture.md §9: no frame, from anyone, may stop, block or corrupt the run).
"""

from __future__ import annotations

import json
import pathlib
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import zmq

from spotlight import protocol as P
from spotlight.net.security import ClientKeys, apply_client, load_client_keys, read_client_file
from tests.factories import make_keys, write_config
from tests.integration.runs import up_command, up_env
from tests.integration.waiting import wait_until

REPO = pathlib.Path(__file__).resolve().parents[2]
WAIT_S = 120.0
SEND_TIMEOUT_S = WAIT_S  # a send that finds no peer for this long fails instead of hanging


class Client:
    """A DEALER to the coordinator with a given key (or none)."""

    def __init__(self, endpoint: str, keys: ClientKeys | None, *, hwm: int = 1000):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        # a DEALER whose handshake failed has no pipe, and a blocking send waits for one forever
        self.sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        if keys is not None:
            apply_client(self.sock, keys)
        self.sock.connect(endpoint)

    def send(self, frames: list, *, may_drop: bool = False) -> None:
        """Send ``frames``; raises ``zmq.Again`` after ``SEND_TIMEOUT_S`` without a peer, unless
        ``may_drop`` (a client the server refuses may have no connection to queue on)."""
        try:
            self.sock.send_multipart(frames)
        except zmq.Again:
            if not may_drop:
                raise

    def recv(self, timeout_s: float = WAIT_S):
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no reply")
        return P.decode(self.sock.recv_multipart(), max_body_bytes=64 << 20)

    def ask(self, msg_or_frames, timeout_s: float = WAIT_S):
        self.send(msg_or_frames if isinstance(msg_or_frames, list) else P.encode(msg_or_frames))
        return self.recv(timeout_s)

    def sync(self) -> tuple[list, dict]:
        """Send STATUS_REQUEST; return (replies received before it, the snapshot)."""
        self.send(P.encode(P.StatusRequest()))
        before = []
        while True:
            mtype, body, payload = self.recv()
            if mtype == P.MsgType.STATUS:
                return before, body.snapshot
            before.append((mtype, body))

    def close(self) -> None:
        self.sock.close(linger=0)


class Run:
    def __init__(self, tmp: pathlib.Path):
        self.rd = tmp / "run"
        self.keys = make_keys(
            self.rd / "keys",
            agents=("victim", "attacker", "attacker2", "restarter", "holder", "fuzz"),
            status=["local"],
        )
        cfg = write_config(
            tmp / "config.toml",
            "jpeg-toy",
            {
                "run.iterations": 2,
                "data.prompts_per_iteration": 4,
                "data.num_control_prompts": 2,
                "explore.planner": "fixed",
                "explore.num_candidates": 8,
                "run.sample_grid_every": 0,
                "cluster.heartbeat_timeout_s": 3600.0,
                "cluster.lease_timeout_s": 3600.0,
                "cluster.max_message_bytes": 4 << 20,
            },
        )
        self.err_path = tmp / "up.stderr"
        self.err = open(self.err_path, "w")
        self.out = open(tmp / "up.stdout", "w")
        cmd = up_command(
            "--config",
            str(cfg),
            "--run-dir",
            str(self.rd),
            "--reserved",
            "127.0.0.1:0",
            "--log-level",
            "INFO",
            "--timeout-s",
            "1800",
        )
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=up_env(), stdout=self.out, stderr=self.err)
        self.status = None
        try:
            self._wait_started()
        except BaseException:
            self.close()  # a failed start leaves no `spotlight up` (and no children) behind
            raise

    def _wait_started(self) -> None:
        deadline = time.monotonic() + 300
        info = self.rd / "coordinator.json"
        wait_until(
            lambda: info.is_file() and info.read_text(),
            "the coordinator to start (coordinator.json)",
            timeout_s=300,
            alive=self.alive,
            logs=self.logs,
        )
        meta = json.loads(info.read_text())
        self.endpoint = meta["endpoint"]
        self.trainer_endpoint = meta["trainer_endpoint"]
        self.status = Client(self.endpoint, load_client_keys(self.keys, role="status"))
        # wait for the train worker's v0, so the run is in a steady "starting" state
        wait_until(
            lambda: self.status.sync()[1]["version"] >= 0,
            "the train worker to publish v0",
            timeout_s=deadline - time.monotonic(),
            interval_s=0.2,
            alive=self.alive,
            logs=self.logs,
        )

    def key(self, name: str) -> ClientKeys:
        return load_client_keys(self.keys, name=name)

    def logs(self) -> str:
        self.err.flush()
        return self.err_path.read_text()[-5000:]

    def rejections(self) -> int:
        self.err.flush()
        return self.err_path.read_text().count("rejected message from")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.status is not None:
            self.status.close()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for p in psutil.Process(self.proc.pid).children(recursive=True) + [psutil.Process(self.proc.pid)]:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                self.proc.wait(timeout=60)
        self.err.close()
        self.out.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("security"))
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def victim(run):
    """A registered agent holding leases of iteration 0 (it never finishes them)."""
    c = Client(run.endpoint, run.key("victim"))
    mtype, body, _ = c.ask(P.Register(protocol_version=P.PROTOCOL_VERSION, node_id="victim", gpus=[0]))
    assert mtype == P.MsgType.REGISTERED, body
    session = body.session
    mtype, body, _ = c.ask(
        P.Heartbeat(node_id="victim", session=session, workers=[P.WorkerInfo(worker_id="victim/gpu0", gpus=[0])])
    )
    assert mtype == P.MsgType.HEARTBEAT, body

    def pull() -> list:
        mtype, body, _ = c.ask(P.Pull(node_id="victim", session=session, worker_id="victim/gpu0", max_requests=4))
        assert mtype == P.MsgType.LEASES, body
        return body.items

    c.session, c.leases = (
        session,
        wait_until(pull, "leases for the victim", timeout_s=WAIT_S, alive=run.alive, logs=run.logs),
    )
    yield c
    c.close()


def _victim_state(snap: dict) -> dict:
    return {
        "victim": [n for n in snap["nodes"] if n["node_id"] == "victim"][0] | {"last_seen_s_ago": None},
        "requests": snap["requests"],
        "phase": snap["phase"],
        "iteration": snap["iteration"],
        "version": snap["version"],
        "committed_states": snap["tensor_store"]["committed_states"],
    }


def _assert_unharmed(run: Run, victim: Client, before: dict) -> None:
    assert run.alive(), run.logs()
    mtype, body, _ = victim.ask(
        P.Heartbeat(node_id="victim", session=victim.session, workers=[P.WorkerInfo(worker_id="victim/gpu0", gpus=[0])])
    )
    assert mtype == P.MsgType.HEARTBEAT, body  # the serve loop still answers the victim
    _, snap = run.status.sync()
    assert _victim_state(snap) == before


def _registered(run: Run, name: str, node_id: str | None = None) -> Client:
    c = Client(run.endpoint, run.key(name))
    mtype, body, _ = c.ask(P.Register(protocol_version=P.PROTOCOL_VERSION, node_id=node_id or name, gpus=[0]))
    assert mtype == P.MsgType.REGISTERED, body
    c.session = body.session
    return c


def _expect_error(c: Client, frames, code: str) -> None:
    mtype, body, _ = c.ask(frames)
    assert mtype == P.MsgType.ERROR, (mtype, body)
    assert body.code == code, body


# ---------------------------------------------------------------- transport


def test_clients_without_an_allowed_key_get_nothing(run, victim):
    """Plain TCP, a CURVE key not on the allow-list, and the wrong server key: no message
    reaches the coordinator (the handshake fails), and it keeps serving the victim."""
    before = _victim_state(run.status.sync()[1])
    plain = Client(run.endpoint, None)
    pub, sec = zmq.curve_keypair()
    stranger = Client(run.endpoint, ClientKeys(run.key("victim").server_public, pub, sec, run.key("victim").principal))
    spub, _ = zmq.curve_keypair()
    k = run.key("attacker")
    wrong_server = Client(run.endpoint, ClientKeys(spub, k.public, k.secret, k.principal))
    try:
        for c in (plain, stranger, wrong_server):
            c.sock.setsockopt(zmq.SNDTIMEO, 2000)  # refused by the handshake: the frames may have nowhere to queue
            # a REGISTER with a non-ASCII "auth" field: the frame that exited v1 coordinators
            c.send([bytes([int(P.MsgType.REGISTER)]), json.dumps({"auth": "é"}).encode()], may_drop=True)
            c.send(P.encode(P.StatusRequest()), may_drop=True)
            assert not c.sock.poll(1500), "an unauthenticated client got an answer"
        _assert_unharmed(run, victim, before)
    finally:
        for c in (plain, stranger, wrong_server):
            c.close()


def test_replayed_or_inflated_registration_is_refused(run, victim):
    """An agent key cannot claim a reserved node or 5,000 GPUs, and cannot take the victim's
    node id (bound to the key that registered it)."""
    before = _victim_state(run.status.sync()[1])
    c = Client(run.endpoint, run.key("attacker"))
    try:
        reg = lambda **kw: P.encode(
            P.Register(**({"protocol_version": P.PROTOCOL_VERSION, "node_id": "attacker", "gpus": [0]} | kw))
        )
        _expect_error(c, reg(is_spot=False), "forbidden")
        _expect_error(c, reg(gpus=list(range(5000))), "malformed")
        _expect_error(c, reg(gpus=list(range(100))), "bad_request")
        _expect_error(c, reg(gpus=[0, 0]), "bad_request")
        _expect_error(c, reg(node_id="../../etc"), "bad_request")
        _expect_error(c, reg(node_id="victim"), "node_id_taken")
        _expect_error(c, reg(protocol_version=1), "version")
        _assert_unharmed(run, victim, before)
    finally:
        c.close()


def test_only_trainer_keys_speak_for_trainers(run, victim):
    """TRAIN_READY / TRAIN_DONE / WEIGHTS from an agent key are refused; on the trainer socket,
    a trainer-keyed client that never said TRAIN_READY cannot publish weights (even without a
    payload: the frame that exited v1 coordinators), and a second rank-0 is refused."""
    before = _victim_state(run.status.sync()[1])
    c = Client(run.endpoint, run.key("attacker"))
    t = Client(run.trainer_endpoint, read_client_file(run.keys / "trainer.json"))
    a = Client(run.trainer_endpoint, run.key("attacker"))
    try:
        _expect_error(c, P.encode(P.TrainReady(rank=0, world_size=1, version=0)), "forbidden")
        _expect_error(c, P.encode(P.TrainDone(rank=0, iteration=0, new_version=1)), "forbidden")
        _expect_error(c, P.encode(P.Weights(version=1, size_bytes=3), [b"abc"]), "forbidden")
        _expect_error(t, P.encode(P.Weights(version=1, size_bytes=0)), "unknown_session")
        _expect_error(t, P.encode(P.TrainReady(rank=0, world_size=1, version=0)), "forbidden")
        _expect_error(t, P.encode(P.TrainReady(rank=3, world_size=1, version=0)), "bad_request")
        _expect_error(a, P.encode(P.TrainReady(rank=0, world_size=1, version=0)), "forbidden")
        _assert_unharmed(run, victim, before)
    finally:
        for x in (c, t, a):
            x.close()


def test_pathological_frames_get_errors(run, victim):
    """Deep nesting, bodies over the size limit, a retired message type, a frame over MAXMSGSIZE."""
    before = _victim_state(run.status.sync()[1])
    c = _registered(run, "attacker2")
    try:
        deep = b"\x81\xa8snapshot\x81\xa1a" + b"\x91" * 100_000 + b"\xc0"
        _expect_error(c, [bytes([int(P.MsgType.STATUS)]), deep], "malformed")
        _expect_error(c, [bytes([int(P.MsgType.HEARTBEAT)]), b"\x80" * (P.MAX_BODY_BYTES + 1)], "malformed")
        # type 11 was a state fetch that was never served: now an unknown type
        _expect_error(
            c,
            [bytes([11]), P.encode(P.FetchWeights(node_id="attacker2", session=c.session, version=0))[1]],
            "malformed",
        )
        rss0 = psutil.Process(run.proc.pid).memory_info().rss
        big = Client(run.endpoint, run.key("attacker2"))
        big.send(
            [bytes([int(P.MsgType.HEARTBEAT)]), b"\x80", b"\0" * (256 << 20)]
        )  # 256 MiB > max_message_bytes (4 MiB)
        big.sync()  # the connection was dropped at the frame header; the client reconnects
        big.close()
        assert psutil.Process(run.proc.pid).memory_info().rss - rss0 < 64 << 20  # the frame was never allocated
        _assert_unharmed(run, victim, before)
    finally:
        c.close()


def test_a_client_that_never_reads_cannot_block_the_serve_loop(run, victim):
    before = _victim_state(run.status.sync()[1])
    c = Client(run.endpoint, run.key("attacker"), hwm=10)
    c.sock.setsockopt(zmq.RCVBUF, 4096)
    try:
        for _ in range(3000):  # never reads the STATUS replies
            try:
                c.sock.send_multipart(P.encode(P.StatusRequest()), flags=zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)
        _assert_unharmed(run, victim, before)
    finally:
        c.close()


def test_an_agent_cannot_touch_another_agents_leases_or_the_filesystem(run, victim):
    """RESULT / COMMIT / FAIL naming the victim's leases, RESULT without tensors, an
    overflowing shape, COMMIT with step -1 or a path as request id, heartbeats for the
    victim's workers: each refused or ignored, nothing written outside the Tensor Store."""
    before = _victim_state(run.status.sync()[1])
    c = _registered(run, "attacker")
    lease = victim.leases[0]
    mine = dict(node_id="attacker", session=c.session, worker_id="attacker/gpu0")
    try:
        import numpy as np

        img = np.zeros((1, 3, 32, 32), np.uint8).tobytes()
        c.send(
            P.encode(
                P.Result(
                    **mine,
                    batch_id="b",
                    items=[P.ResultItem(request_id=lease.request_id, lease_id=lease.lease_id)],
                    tensors=[P.TensorMeta("images", "uint8", [1, 3, 32, 32])],
                ),
                [img],
            )
        )
        c.send(P.encode(P.Fail(**mine, request_ids=[lease.request_id], lease_ids=[lease.lease_id], reason="x")))
        c.send(
            P.encode(
                P.Commit(
                    **mine,
                    items=[
                        P.CommitItem(
                            request_id=lease.request_id, lease_id=lease.lease_id, step=1, seed=0, weight_version=0
                        )
                    ],
                )
            )
        )
        _expect_error(
            c,
            P.encode(
                P.Result(
                    **(mine | {"worker_id": "victim/gpu0"}),
                    batch_id="b",
                    items=[P.ResultItem(request_id=lease.request_id, lease_id=lease.lease_id)],
                )
            ),
            "forbidden",
        )
        _expect_error(
            c,
            P.encode(
                P.Result(
                    **mine, batch_id="b", items=[P.ResultItem(request_id=lease.request_id, lease_id=lease.lease_id)]
                )
            ),
            "bad_request",
        )
        _expect_error(
            c,
            P.encode(
                P.Result(
                    **mine,
                    batch_id="b",
                    items=[P.ResultItem(request_id="r0-0", lease_id=1)],
                    tensors=[P.TensorMeta("images", "uint8", [1 << 39, 1 << 39, 0])],
                ),
                [b""],
            ),
            "malformed",
        )
        _expect_error(
            c,
            P.encode(
                P.Result(
                    **mine,
                    batch_id="b",
                    items=[P.ResultItem(request_id="r0-0", lease_id=1)],
                    tensors=[P.TensorMeta("images", "uint8", [1 << 41])],
                ),
                [b""],
            ),
            "malformed",
        )
        _expect_error(
            c,
            [
                bytes([int(P.MsgType.COMMIT)]),
                __import__("msgspec").msgpack.encode(
                    {
                        **mine,
                        "items": [
                            {
                                "request_id": lease.request_id,
                                "lease_id": lease.lease_id,
                                "step": -1,
                                "seed": 0,
                                "weight_version": 0,
                            }
                        ],
                    }
                ),
            ],
            "malformed",
        )
        c.send(
            P.encode(
                P.Commit(
                    **mine,
                    items=[P.CommitItem(request_id="../../../escaped", lease_id=1, step=1, seed=0, weight_version=0)],
                    tensors=[P.TensorMeta("state.0.latents", "uint8", [4])],
                ),
                [b"evil"],
            )
        )
        _expect_error(
            c,
            P.encode(
                P.Heartbeat(
                    node_id="attacker", session=c.session, workers=[P.WorkerInfo(worker_id="victim/gpu0", gpus=[0])]
                )
            ),
            "forbidden",
        )
        _expect_error(c, P.encode(P.Heartbeat(node_id="victim", session=victim.session)), "unknown_session")
        _expect_error(
            c,
            P.encode(P.Pull(node_id="victim", session=victim.session, worker_id="victim/gpu0", max_requests=8)),
            "unknown_session",
        )
        c.sync()
        assert not list(run.rd.rglob("escaped*")) and not list(run.rd.parent.rglob("escaped*"))
        _assert_unharmed(run, victim, before)
        # the victim itself can still finish its lease: nothing was corrupted
        _, snap = run.status.sync()
        assert snap["requests"]["rollout"]["in_flight"] == len(victim.leases)
    finally:
        c.close()


def test_restarted_agent_with_the_same_node_id_takes_over(run, victim):
    """An agent restarted while its old connection is still open: the new registration wins,
    the old session is refused (v1 ignored the new connection silently)."""
    old = _registered(run, "restarter")
    new = _registered(run, "restarter")
    try:
        _expect_error(old, P.encode(P.Heartbeat(node_id="restarter", session=old.session)), "unknown_session")
        mtype, _, _ = new.ask(P.Heartbeat(node_id="restarter", session=new.session))
        assert mtype == P.MsgType.HEARTBEAT
        _, snap = run.status.sync()
        assert [n["status"] for n in snap["nodes"] if n["node_id"] == "restarter"] == ["alive"]
    finally:
        old.close()
        new.close()


def test_a_second_live_agent_is_refused_the_node_id_and_the_first_keeps_it(run, victim, tmp_path):
    """A second agent process started with the node id of a live agent (same key): every
    REGISTER it sends is refused with node_id_in_use, logged and recorded once per clash, while
    the live agent keeps its session (before, each took the node from the other every second);
    a real `spotlight-agent join` refused so exits with one error line and status 78. The live
    agent reconnecting from a new connection (same instance id) is still accepted."""
    from agent.main import EXIT_NODE_ID_IN_USE

    def reg(instance_id: str) -> P.Register:
        return P.Register(
            protocol_version=P.PROTOCOL_VERSION,
            node_id="holder",
            gpus=[0],
            hostname="h",
            pid=4242,
            instance_id=instance_id,
        )

    first, second, back = (Client(run.endpoint, run.key("holder")) for _ in range(3))
    try:
        mtype, body, _ = first.ask(reg("a" * 16))
        assert mtype == P.MsgType.REGISTERED, body
        session = body.session
        for _ in range(3):  # the second agent retries: refused each time, the holder untouched
            mtype, body, _ = second.ask(reg("b" * 16))
            assert mtype == P.MsgType.ERROR and body.code == "node_id_in_use", body
            assert (
                "node id holder is in use by another live agent" in body.message and "registered since" in body.message
            ), body
            assert body.retry_after_s > 0
            mtype, body, _ = first.ask(P.Heartbeat(node_id="holder", session=session))
            assert mtype == P.MsgType.HEARTBEAT, body
        env = up_env(SPOTLIGHT_AGENT_STATE=str(tmp_path / "agent-state"))
        held = tmp_path / "agent-state" / "holder"  # the live agent's files, were it on this host
        (held / "weights").mkdir(parents=True)
        (held / "weights" / "v0.safetensors").write_bytes(b"w")
        (held / "control.sock").write_bytes(b"")
        cmd = [
            sys.executable,
            "-m",
            "agent.main",
            "join",
            "--coordinator",
            run.endpoint,
            "--keys",
            str(run.keys),
            "--key",
            "holder",
            "--node-id",
            "holder",
            "--gpus",
            "0",
            "--no-warm-spare",
            "--register-timeout-s",
            "60",
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == EXIT_NODE_ID_IN_USE, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("spotlight-agent:")]
        assert len(lines) == 1 and lines[0].startswith(
            "spotlight-agent: error: node id holder is in use by another live agent (registered since "
        ), proc.stderr[-3000:]
        assert lines[0].endswith("; pick another --node-id"), lines
        assert (held / "weights" / "v0.safetensors").exists() and (held / "control.sock").exists()  # left alone
        mtype, body, _ = first.ask(P.Heartbeat(node_id="holder", session=session))
        assert mtype == P.MsgType.HEARTBEAT, body  # still the holder's session
        _, snap = run.status.sync()
        assert [n["status"] for n in snap["nodes"] if n["node_id"] == "holder"] == ["alive"]
        refused = [e for e in snap["events"] if e["node"] == "holder" and e["kind"] == "refused"]
        assert len(refused) == 2, snap["events"]  # one per clash: the 3 REGISTERs above, the agent process
        assert [e["kind"] for e in snap["events"] if e["node"] == "holder"].count("join") == 1
        run.err.flush()
        assert run.err_path.read_text().count("refused a second agent") == 2
        # the holder itself reconnecting (lost connection, coordinator restart): accepted as before
        mtype, body, _ = back.ask(reg("a" * 16))
        assert mtype == P.MsgType.REGISTERED, body
        mtype, body, _ = back.ask(P.Heartbeat(node_id="holder", session=body.session))
        assert mtype == P.MsgType.HEARTBEAT, body
    finally:
        for c in (first, second, back):
            c.close()


# ---------------------------------------------------------------- fuzz


def _mutations(rng: random.Random, victim: Client, fuzz_session: str) -> list[list[bytes]]:
    """Seeded mutated frames: random bytes, truncated and re-typed valid frames, huge and
    negative numbers, and frames carrying the victim's node id, session, worker and leases."""
    import msgspec

    lease = victim.leases[0]
    ids = [
        ("fuzz", fuzz_session, "fuzz/gpu0"),
        ("victim", victim.session, "victim/gpu0"),
        ("fuzz", victim.session, "victim/gpu0"),
    ]
    nums = [0, -1, 1, 2**31, -(2**63), 2**64 - 1, 10**30, float("nan"), float("inf"), -1e308]

    def valid(node, session, wid):
        return [
            P.encode(
                P.Heartbeat(node_id=node, session=session, workers=[P.WorkerInfo(worker_id=wid, gpus=[0])], gpus=[0])
            ),
            P.encode(P.Pull(node_id=node, session=session, worker_id=wid, max_requests=4)),
            P.encode(
                P.Result(
                    node_id=node,
                    session=session,
                    worker_id=wid,
                    batch_id="b",
                    items=[P.ResultItem(request_id=lease.request_id, lease_id=lease.lease_id, computed_steps=3)],
                    tensors=[P.TensorMeta("images", "uint8", [1, 3, 32, 32])],
                ),
                [bytes(3 * 32 * 32)],
            ),
            P.encode(
                P.Commit(
                    node_id=node,
                    session=session,
                    worker_id=wid,
                    items=[
                        P.CommitItem(
                            request_id=lease.request_id, lease_id=lease.lease_id, step=2, seed=1, weight_version=0
                        )
                    ],
                    tensors=[P.TensorMeta("state.0.latents", "float32", [2])],
                ),
                [bytes(8)],
            ),
            P.encode(
                P.Fail(
                    node_id=node,
                    session=session,
                    worker_id=wid,
                    request_ids=[lease.request_id],
                    lease_ids=[lease.lease_id],
                    reason="fuzz",
                )
            ),
            P.encode(P.FetchWeights(node_id=node, session=session, worker_id=wid, version=0)),
            P.encode(
                P.Notice(
                    node_id=node,
                    session=session,
                    source="aws",
                    scope="node",
                    deadline_unix_s=time.time() + 60,
                    key="k",
                    kind="terminate",
                )
            ),
            P.encode(P.TrainDone(rank=0, iteration=0, new_version=1)),
            P.encode(P.Weights(version=1, size_bytes=4), [b"abcd"]),
        ]

    out = []
    for _ in range(2000):
        op = rng.randrange(6)
        base = [bytes(f) for f in rng.choice(valid(*rng.choice(ids)))]
        if op == 0:  # random bytes
            out.append(
                [bytes([rng.randrange(256)]), rng.randbytes(rng.randrange(0, 64))]
                + ([rng.randbytes(rng.randrange(64))] if rng.random() < 0.3 else [])
            )
        elif op == 1:  # truncated body or missing frames
            if rng.random() < 0.5:
                base[1] = base[1][: rng.randrange(len(base[1]))]
            else:
                base = base[: rng.randrange(1, len(base))]
            out.append(base)
        elif op == 2:  # re-typed (never as REGISTER or BYE: the fuzz node must stay registered)
            base[0] = bytes([rng.choice([t for t in P.MsgType if t not in (P.MsgType.REGISTER, P.MsgType.BYE)])])
            out.append(base)
        elif op == 3:  # huge / negative / non-finite numbers in a valid message
            body = msgspec.msgpack.decode(base[1])
            if isinstance(body, dict):
                ints = [k for k, v in body.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
                lists = [k for k, v in body.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
                if ints:
                    body[rng.choice(ints)] = rng.choice(nums)
                elif lists:
                    item = body[rng.choice(lists)][0]
                    k = rng.choice([k for k, v in item.items() if isinstance(v, int)] or list(item))
                    item[k] = rng.choice(nums)
                try:
                    base[1] = msgspec.msgpack.encode(body)
                except (OverflowError, TypeError):
                    pass
            out.append(base)
        elif op == 4:  # frames carrying other peers' tokens, otherwise valid
            out.append(base)
        else:  # bit flips
            b = bytearray(base[1])
            for _ in range(rng.randrange(1, 4)):
                if b:
                    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            base[1] = bytes(b)
            out.append(base)
    return out


def test_fuzz_2000_frames(run, victim):
    """2,000 seeded mutated frames from an authenticated agent: no crash, no hang, the
    victim's state unchanged, and every ERROR reply matched by one log line."""
    before = _victim_state(run.status.sync()[1])
    fuzz = _registered(run, "fuzz")
    # the fuzz node drains: even a mutated frame that happens to be a valid PULL gets no work
    fuzz.send(
        P.encode(
            P.Notice(
                node_id="fuzz",
                session=fuzz.session,
                source="test",
                scope="node",
                deadline_unix_s=time.time() + 3600,
                key="k",
                kind="terminate",
            )
        )
    )
    fuzz.sync()
    logged0 = run.rejections()
    frames = _mutations(random.Random(1234), victim, fuzz.session)
    errors = 0
    for i in range(0, len(frames), 50):
        for f in frames[i : i + 50]:
            fuzz.send(f)
        # FIFO on one connection: when the answer to this uniquely numbered request arrives,
        # every frame before it has been handled and answered
        marker = 10**6 + i
        fuzz.send(P.encode(P.FetchWeights(node_id="fuzz", session=fuzz.session, worker_id="fuzz/gpu0", version=marker)))
        while True:
            mtype, body, _ = fuzz.recv()
            if mtype == P.MsgType.WEIGHTS and body.version == marker:
                break
            errors += mtype == P.MsgType.ERROR
        _, snap = run.status.sync()
        assert run.alive(), run.logs()
        assert _victim_state(snap) == before, f"frames {i}..{i + 49} changed the victim's state"
    assert errors > 1000, f"only {errors} of 2000 mutated frames were rejected"
    # each ERROR reply's log line may reach up.stderr after the reply itself
    wait_until(
        lambda: run.rejections() - logged0 >= errors,
        f"one 'rejected message from' log line per ERROR reply ({errors})",
        timeout_s=WAIT_S,
        interval_s=0.2,
        alive=run.alive,
        logs=run.logs,
    )
    assert run.rejections() - logged0 == errors
    _assert_unharmed(run, victim, before)
    fuzz.close()


def test_fuzz_tensor_frame_decoder():
    """The tensor-frame decoder raises only ProtocolError, whatever metas and frames it gets."""
    from spotlight.store.tensor_wire import unpack_tensors

    rng = random.Random(99)
    dtypes = ["float32", "uint8", "bfloat16", "int64", "bool", "complex128", "", "float32\x00"]
    ok = bad = 0
    for _ in range(3000):
        n = rng.randrange(0, 4)
        metas = []
        for k in range(n):
            shape = [rng.choice([0, 1, 2, 3, 7, 2**31, 2**39, 2**62, -1]) for _ in range(rng.randrange(0, 5))]
            metas.append(P.TensorMeta(f"t{k}", rng.choice(dtypes), shape))
        frames = [rng.randbytes(rng.choice([0, 1, 4, 8, 12, 24, 96])) for _ in range(rng.randrange(0, n + 2))]
        try:
            unpack_tensors(metas, frames)
            ok += 1
        except P.ProtocolError:
            bad += 1
    assert ok and bad
