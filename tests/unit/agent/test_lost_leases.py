"""Leases that arrive for a worker that is gone (agent/main.py ``AgentDaemon.on_coordinator``),
against a stand-in coordinator socket in this process."""

from __future__ import annotations

import time

from agent.main import AgentDaemon
from spotlight import protocol as P
from spotlight.net.security import load_client_keys
from tests.factories import make_keys, make_lease_item
from tests.fakes import CoordinatorSocket


def test_agent_gives_back_leases_of_a_worker_that_died_before_they_arrived(tmp_path, monkeypatch):
    """kill -9 between a worker's PULL and the LEASES answering it: the respawned worker
    (same id, no hello yet) never asked for them, so the agent returns them with FAIL
    instead of holding them forever (its heartbeats would renew them indefinitely)."""
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path))
    keys = make_keys(tmp_path / "keys", agents=["n1"])
    with CoordinatorSocket(keys) as coord:
        d = AgentDaemon(coord.endpoint, [0], node_id="n1", keys=load_client_keys(keys, role="agent"))
        try:
            d.coord.connect(d.endpoint)
            d.session = "s1"
            # the agent queues nothing for a coordinator it is not connected to (ZMQ_IMMEDIATE):
            # wait for the CURVE handshake by sending until a message gets through
            deadline = time.monotonic() + 60
            while not d._to_coord(P.Heartbeat(node_id="n1", session="s1")):
                assert time.monotonic() < deadline, "the agent never connected"
                time.sleep(0.05)
            coord.recv()
            wid = d.sched.add_worker([0]).worker_id
            d.sched.hello(wid, 1234)
            d.on_worker([wid.encode(), *P.encode(P.Pull(worker_id=wid, max_requests=1))])
            assert coord.recv()[1] == P.MsgType.PULL
            # the worker dies; the agent respawns it (what check_workers does)
            assert d.sched.exited(wid) == []
            d.sched.add_worker([0])
            item = make_lease_item("r0-1", lease_id=7, seed=1)
            d.on_coordinator(P.encode(P.Leases(worker_id=wid, items=[item])))
            assert d.sched.in_flight() == []
            _, mtype, body, _ = coord.recv()
            assert mtype == P.MsgType.FAIL
            assert (body.request_ids, body.lease_ids, body.node_id, body.session) == (["r0-1"], [7], "n1", "s1")
        finally:
            d._detector_thread.stop_event.set()
            for sock in (d.coord, d.workers_sock, d.control):
                sock.close(linger=0)
