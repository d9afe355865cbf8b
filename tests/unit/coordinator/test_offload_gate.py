"""The coordinator's side of a reserved GPU shared by a Rollout Worker and a Train Worker
(spotlight/core/offload.py): the control plane tells the shared worker to release its device
while training runs and to reclaim it afterwards, records where its weights are and what the
moves cost; the update is held until the worker released (or the timeout)."""

from __future__ import annotations

import types

import pytest

from spotlight import protocol as P
from spotlight.config import load_config
from spotlight.coordinator.coordinator import Coordinator
from spotlight.coordinator.server import PUBLIC, Inbound
from spotlight.core.events import EventLog
from spotlight.core.offload import RELEASE_TIMEOUT_S, Residency
from spotlight.net.security import Principal
from tests.factories import PullingRun, control_plane


class _Server:
    def __init__(self):
        self.sent = []

    def send(self, channel, identity, msg, frames=None):
        self.sent.append((identity, msg))
        return True


def _plane(tmp_path, **overrides):
    cfg = load_config(overrides={"train.num_train_workers": 1, **overrides})
    workers = types.SimpleNamespace(worker_seen=lambda *a: None, lease_started=lambda *a: None)
    return control_plane(tmp_path, cfg, run=PullingRun(), workers=workers, server=_Server())


def _handle(cp, identity, principal, msg):
    cp.handle(Inbound(PUBLIC, identity, principal, P.MsgType[type(msg).__name__.upper()], msg, []))
    return cp.server.sent[-1][1]


def _join(cp, node_id, gpus, *, reserved):
    principal = Principal("reserved" if reserved else "agent", node_id)
    reg = P.Register(protocol_version=P.PROTOCOL_VERSION, node_id=node_id, gpus=gpus, is_spot=not reserved)
    session = _handle(cp, node_id.encode(), principal, reg).session
    return principal, session


def _pull(cp, node_id, principal, session, worker, residency="resident", moves=()):
    body = P.Pull(
        node_id=node_id,
        session=session,
        worker_id=worker,
        max_requests=4,
        residency=residency,
        moves=list(moves),
    )
    return _handle(cp, node_id.encode(), principal, body)


def test_registered_carries_the_setting(tmp_path):
    cp = _plane(tmp_path, **{"cluster.offload_rollout_while_training": True})
    principal = Principal("reserved", "r")
    reg = P.Register(protocol_version=P.PROTOCOL_VERSION, node_id="reserved-0", gpus=[0], is_spot=False)
    assert _handle(cp, b"r", principal, reg).offload_rollout_while_training is True


def test_only_the_shared_worker_is_told_to_release_while_training_and_to_reclaim_after(tmp_path):
    cp = _plane(tmp_path)
    res, rs = _join(cp, "reserved-0", [0, 1], reserved=True)
    spot, ss = _join(cp, "spot-0", [0], reserved=False)
    cp.instances.heartbeat("reserved-0", 0.0, workers={"reserved-0/gpu0": [0], "reserved-0/gpu1": [1]})
    assert _pull(cp, "reserved-0", res, rs, "reserved-0/gpu0").device == "reclaim"  # not training: keep it
    cp.sched.set_training_active(True)
    assert _pull(cp, "reserved-0", res, rs, "reserved-0/gpu0").device == "release"
    assert _pull(cp, "reserved-0", res, rs, "reserved-0/gpu1").device == ""  # GPU 1 trains nothing
    assert _pull(cp, "spot-0", spot, ss, "spot-0/gpu0").device == ""  # another machine's GPU 0
    cp.sched.set_training_active(False)
    assert _pull(cp, "reserved-0", res, rs, "reserved-0/gpu0", residency="released").device == "reclaim"


def test_turned_off_nobody_is_told_anything(tmp_path):
    cp = _plane(tmp_path, **{"cluster.offload_rollout_while_training": False})
    res, rs = _join(cp, "reserved-0", [0], reserved=True)
    cp.sched.set_training_active(True)
    assert _pull(cp, "reserved-0", res, rs, "reserved-0/gpu0").device == ""


def test_residency_and_moves_are_recorded_and_only_managing_shared_workers_are_awaited(tmp_path):
    cp = _plane(tmp_path, **{"train.num_train_workers": 2})
    res, rs = _join(cp, "reserved-0", [0, 1, 2], reserved=True)
    cp.instances.heartbeat(
        "reserved-0", 0.0, workers={"reserved-0/gpu0": [0], "reserved-0/gpu1": [1], "reserved-0/gpu2": [2]}
    )
    _pull(cp, "reserved-0", res, rs, "reserved-0/gpu0")
    _pull(cp, "reserved-0", res, rs, "reserved-0/gpu1", residency="")  # never releases (an older worker)
    _pull(cp, "reserved-0", res, rs, "reserved-0/gpu2")  # GPU 2 trains nothing
    assert cp.awaited_release() == {"reserved-0/gpu0": Residency.RESIDENT}
    move = P.DeviceMove(kind="offload", seconds=1.5, size_bytes=1 << 30)
    _pull(cp, "reserved-0", res, rs, "reserved-0/gpu0", residency="released", moves=[move])
    assert cp.awaited_release() == {"reserved-0/gpu0": Residency.RELEASED}
    row = cp.offload.take()
    assert row["time/offload_s"] == 1.5 and row["device/offloads"] == 1.0
    cp.instances.heartbeat("reserved-0", 1.0, workers={"reserved-0/gpu1": [1]})  # gpu0's worker is gone
    assert cp.awaited_release() == {}


@pytest.fixture
def held(tmp_path):
    """A coordinator's update, held for the release (the real control plane; the Train Workers
    record what they are sent)."""
    cp = _plane(tmp_path)
    res, rs = _join(cp, "reserved-0", [0], reserved=True)
    cp.instances.heartbeat("reserved-0", 0.0, workers={"reserved-0/gpu0": [0]})
    _pull(cp, "reserved-0", res, rs, "reserved-0/gpu0")
    sent = []
    coord = types.SimpleNamespace(
        control=cp,
        trainers=types.SimpleNamespace(train=lambda n, batches, **kw: sent.append((n, batches))),
        _held_update=(4, "batches", 100.0),
        _rollback_for_update=lambda n: (-1, 1.0),  # no collapse-guard rollback planned
        _kept_train_versions=lambda: (),
    )
    pull = lambda **kw: _pull(cp, "reserved-0", res, rs, "reserved-0/gpu0", **kw)  # noqa: E731
    return coord, sent, pull


def test_the_update_waits_for_the_release(held):
    coord, sent, pull = held
    Coordinator._send_update_once_released(coord, 101.0)
    assert sent == [] and coord._held_update is not None
    pull(residency="released", moves=[P.DeviceMove(kind="offload", seconds=0.5)])
    Coordinator._send_update_once_released(coord, 102.5)
    assert sent == [(4, "batches")] and coord._held_update is None
    assert coord.control.offload.take()["time/offload_wait_s"] == 2.5


def test_the_update_goes_anyway_after_the_timeout(held, caplog):
    coord, sent, _ = held
    Coordinator._send_update_once_released(coord, 100.0 + RELEASE_TIMEOUT_S - 1)
    assert sent == []
    Coordinator._send_update_once_released(coord, 100.0 + RELEASE_TIMEOUT_S)
    assert sent == [(4, "batches")]
    assert "reserved-0/gpu0 still hold their GPU memory" in caplog.text


def test_the_row_gets_the_largest_peak_and_the_slowest_step_of_the_ranks(tmp_path):
    from spotlight.coordinator.trainer_group import TrainerGroup

    group = TrainerGroup(load_config(), tmp_path, None, EventLog(), phase=lambda: "train", iteration=lambda: 0)
    for rank, (peak, step, loss) in enumerate([(4e9, 2.0, 1.0), (6e9, 1.0, 3.0)]):
        metrics = {"train/peak_memory_bytes": peak, "train/step_s": step, "train/loss": loss}
        group.done[rank] = P.TrainDone(rank=rank, iteration=0, new_version=1, metrics=metrics)
    assert group.metrics() == {"train/peak_memory_bytes": 6e9, "train/step_s": 2.0, "train/loss": 2.0}


def test_a_cpu_trainer_reports_its_resident_high_water_mark():
    import torch

    from spotlight.workers.train.train_worker import _step_memory_metrics

    got = _step_memory_metrics(torch.device("cpu"), 1.25)
    assert got["train/step_s"] == 1.25 and got["train/peak_memory_bytes"] > 50e6  # torch alone is more
