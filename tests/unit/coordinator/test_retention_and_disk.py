"""The coordinator's side of disk retention: the weight versions kept for live workers (what each
worker said it holds in its last PULL, while its node is not dead: ``ControlPlane.versions_in_use``),
and an upload that cannot fit the disk stopping the run with the numbers (``TrainerGroup.fatal``)."""

from __future__ import annotations

import time
import types

import pytest

from spotlight import protocol as P
from spotlight.config import load_config
from spotlight.coordinator.server import PUBLIC, Inbound
from spotlight.core.events import EventLog
from spotlight.net.security import Principal
from spotlight.store.tensor_store import TensorStore
from tests.factories import control_plane


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
    cp = control_plane(
        tmp_path,
        cfg,
        run=types.SimpleNamespace(accepts_pulls=lambda: False),
        workers=types.SimpleNamespace(worker_seen=lambda *a: None, worker_gone=lambda *a: None),
        server=_Server(),
    )
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


def test_a_version_upload_that_cannot_fit_stops_the_run_naming_the_disk(tmp_path, monkeypatch):
    from spotlight import protocol as P
    from spotlight.config import load_config
    from spotlight.coordinator import trainer_group
    from spotlight.coordinator.server import Rejected

    store = TensorStore(tmp_path / "tensor_store").open()
    group = trainer_group.TrainerGroup(
        load_config(), tmp_path, store, EventLog(), phase=lambda: "train", iteration=lambda: 0
    )
    monkeypatch.setattr(trainer_group, "free_bytes", lambda path: 999)
    header = P.Weights(version=0, size_bytes=1000, chunk_bytes=1000, num_chunks=1, digest="sha256:" + "0" * 64)
    with pytest.raises(Rejected):
        group._on_weights(header, [])
    assert group.fatal == (
        f"disk full at {store.root / 'weights'}: 1000 bytes (0.00 GiB) needed for weight version v0, "
        "999 bytes (0.00 GiB) free"
    )
