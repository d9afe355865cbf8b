"""The agent's side of a node id clash (AgentDaemon.register against a stand-in coordinator):
a refused agent retries once after the holder's heartbeats would have timed out (a crashed
agent restarted by systemd gets in), then exits with status 78 and one line."""

from __future__ import annotations

import threading

import pytest
import zmq

from agent.main import EXIT_NODE_ID_IN_USE, AgentDaemon, NodeIdInUse
from spotlight import protocol as P
from spotlight.net.security import add_client, init_keys, load_client_keys, load_server_keys

IN_USE = "node id n is in use by another live agent (registered since 12:00:00 UTC, 30s; last heard from 0.4s ago)"


def _registered() -> P.Registered:
    return P.Registered(
        node_id="n",
        heartbeat_interval_s=1.0,
        lease_timeout_s=10.0,
        worker_batch_size=1,
        torch_threads=1,
        model={},
        sampler={},
        latest_version=0,
        session="s1",
    )


@pytest.fixture
def coordinator(tmp_path, monkeypatch):
    """A CURVE ROUTER that answers the i-th REGISTER with ``replies[i]``; records the REGISTERs."""
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "state"))
    init_keys(tmp_path / "keys")
    add_client(tmp_path / "keys", "agent", "spot-a")
    sk = load_server_keys(tmp_path / "keys")
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, sk.secret)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    seen: list[P.Register] = []
    replies: list = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if not sock.poll(50):
                continue
            ident, *frames = sock.recv_multipart()
            mtype, body, _ = P.decode(frames)
            if mtype == P.MsgType.REGISTER:
                seen.append(body)
                if len(seen) <= len(replies):
                    sock.send_multipart([ident, *P.encode(replies[len(seen) - 1])])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    daemons = []

    def make(register_timeout_s: float = 30.0) -> AgentDaemon:
        d = AgentDaemon(
            f"127.0.0.1:{port}",
            [0],
            keys=load_client_keys(tmp_path / "keys", role="agent"),
            node_id="n",
            warm_spare=False,
            register_timeout_s=register_timeout_s,
        )
        daemons.append(d)
        return d

    make.state = tmp_path / "state" / "n"
    yield make, replies, seen
    stop.set()
    t.join()
    sock.close(linger=0)
    for d in daemons:
        for s in (d.coord, d.workers_sock, d.control):
            s.close(linger=0)


def test_refused_then_holder_timed_out_gets_in(coordinator):
    make, replies, seen = coordinator
    replies += [P.ErrorMsg(code="node_id_in_use", message=IN_USE, retry_after_s=0.3), _registered()]
    d = make()
    assert d.register().session == "s1"
    assert len(seen) == 2 and seen[0].instance_id == seen[1].instance_id == d.instance_id != ""


def test_refused_twice_exits_78_with_one_line(coordinator):
    make, replies, seen = coordinator
    replies += [P.ErrorMsg(code="node_id_in_use", message=IN_USE, retry_after_s=0.3)] * 2
    # the live agent's files on this host (same node id, same state dir)
    (make.state / "weights").mkdir(parents=True)
    (make.state / "weights" / "v3.safetensors").write_bytes(b"w")
    (make.state / "control.sock").write_bytes(b"")
    with pytest.raises(NodeIdInUse) as exc:
        make().register()
    assert (make.state / "weights" / "v3.safetensors").read_bytes() == b"w"  # the refused agent left them alone
    assert (make.state / "control.sock").exists()
    assert exc.value.code == EXIT_NODE_ID_IN_USE == 78 and len(seen) == 2
    assert str(exc.value) == (
        "node id n is in use by another live agent (registered since 12:00:00 UTC, 30s; last heard from 0.4s ago); "
        "pick another --node-id"
    )


def test_no_retry_when_the_holder_cannot_time_out_within_the_register_timeout(coordinator):
    make, replies, seen = coordinator
    replies += [P.ErrorMsg(code="node_id_in_use", message=IN_USE, retry_after_s=3600.0), _registered()]
    with pytest.raises(NodeIdInUse):
        make(register_timeout_s=20.0).register()
    assert len(seen) == 1


def test_each_agent_process_draws_its_own_instance_id(coordinator):
    make, _, _ = coordinator
    a, b = make(), make()
    assert a.instance_id != b.instance_id and a._register_msg().instance_id == a.instance_id


def test_running_agent_whose_node_id_was_taken_stops_instead_of_reregistering(coordinator):
    """This agent was silent past the timeout, another process took the node id, and its
    re-registration is refused: it drains and exits 78 rather than retry forever."""
    make, _, _ = coordinator
    d = make()
    d.registered = _registered()
    d.reconnecting = True
    d.on_coordinator(P.encode(P.ErrorMsg(code="node_id_in_use", message=IN_USE, retry_after_s=9.0)))
    assert d.draining and not d.reconnecting and d.exit_code == EXIT_NODE_ID_IN_USE
