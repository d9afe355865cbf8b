"""The weight versions the retention keeps for live workers: what each worker said it holds in
its last PULL, for as long as its node is not dead (``ControlPlane.versions_in_use``)."""

from __future__ import annotations

import time
import types

from spotlight import protocol as P
from spotlight.config import load_config
from spotlight.coordinator.control_plane import ControlPlane
from spotlight.coordinator.server import PUBLIC, Inbound
from spotlight.core.events import EventLog
from spotlight.core.instance_manager import InstanceManager
from spotlight.core.request_scheduler import RequestScheduler
from spotlight.net.security import Principal
from spotlight.store.tensor_store import TensorStore


class _Server:
    def __init__(self):
        self.sent = []

    def send(self, socket, identity, msg, frames=None):
        self.sent.append((identity, msg))
        return True

    def describe_peer(self, identity):
        return repr(identity)

    def set_peer_name(self, identity, name):
        pass


def _inbound(identity, principal, msg):
    return Inbound(PUBLIC, identity, principal, P.MsgType[type(msg).__name__.upper()], msg, [])


def test_versions_held_by_live_workers_only(tmp_path):
    cfg = load_config()
    cp = ControlPlane(
        cfg,
        RequestScheduler(cfg.cluster.lease_timeout_s),
        InstanceManager(cfg.cluster.heartbeat_timeout_s),
        TensorStore(tmp_path / "store", memory_max_bytes=0),
        EventLog(),
        run=types.SimpleNamespace(accepts_pulls=lambda: False),
        workers=types.SimpleNamespace(worker_seen=lambda *a: None, worker_gone=lambda *a: None),
    )
    cp.attach(_Server())
    agent = Principal("agent", "local")
    reg = P.Register(protocol_version=P.PROTOCOL_VERSION, node_id="spot-0", gpus=[0], is_spot=True)
    cp.handle(_inbound(b"a", agent, reg))
    session = cp.server.sent[-1][1].session
    assert cp.versions_in_use() == set()
    pull = P.Pull(node_id="spot-0", session=session, worker_id="spot-0/gpu0", max_requests=1, versions=[1, 4])
    cp.handle(_inbound(b"a", agent, pull))
    assert cp.versions_in_use() == {1, 4}
    cp.handle(
        _inbound(
            b"a",
            agent,
            P.Pull(node_id="spot-0", session=session, worker_id="spot-0/gpu0", max_requests=1, versions=[4]),
        )
    )
    assert cp.versions_in_use() == {4}  # its last word
    cp.housekeeping(time.monotonic() + 3600)  # the node missed its heartbeats: dead
    assert cp.versions_in_use() == set()
