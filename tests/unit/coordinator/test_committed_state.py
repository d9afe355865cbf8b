"""Committed rollout state (paper §4.5): a preempted worker's state lives in the Tensor Store on
disk only, and a state that cannot be read back whole makes the next lease start the request over
from step 0 instead of failing the worker that resumes it."""

from __future__ import annotations

import types

import torch

from spotlight import protocol as P
from spotlight.config import load_config
from spotlight.coordinator.server import PUBLIC, Inbound
from spotlight.core.request_scheduler import RequestKind
from spotlight.net.security import Principal
from spotlight.store.tensor_wire import pack_tensors
from tests.factories import PullingRun, control_plane


class _Server:
    def __init__(self):
        self.sent = []

    def send(self, channel, identity, msg, frames=None):
        self.sent.append((msg, list(frames or [])))
        return True


def _handle(cp, principal, msg, frames=()):
    cp.handle(Inbound(PUBLIC, b"n", principal, P.MsgType[type(msg).__name__.upper()], msg, list(frames)))
    return cp.server.sent[-1]


def _plane_with_committed_request(tmp_path):
    """A control plane whose one rollout request was leased to a spot worker that committed its
    state at step 3 (the state: a 2 × 4 latent of ones)."""
    cfg = load_config(overrides={"train.num_train_workers": 1})
    workers = types.SimpleNamespace(
        worker_seen=lambda *a: None, lease_started=lambda *a: None, lease_ended=lambda *a: None
    )
    cp = control_plane(tmp_path, cfg, run=PullingRun(), workers=workers, server=_Server())
    cp.store.open()
    principal = Principal("agent", "spot-0")
    reg = P.Register(protocol_version=P.PROTOCOL_VERSION, node_id="spot-0", gpus=[0], is_spot=True)
    session = _handle(cp, principal, reg)[0].session
    [rid] = cp.sched.submit(RequestKind.ROLLOUT, 0, [(0, 11, 0)], weight_version=0, params={}, now=0.0)
    pull = P.Pull(node_id="spot-0", session=session, worker_id="spot-0/gpu0", max_requests=4)
    leases, _ = _handle(cp, principal, pull)
    [item] = leases.items
    metas, frames = pack_tensors({"state.0.latents": torch.ones(2, 4)})
    commit = P.Commit(
        node_id="spot-0",
        session=session,
        worker_id="spot-0/gpu0",
        items=[P.CommitItem(request_id=rid, lease_id=item.lease_id, step=3, seed=11, weight_version=0)],
        tensors=metas,
    )
    _handle(cp, principal, commit, frames)
    key = cp.sched.get(rid).commit_key
    assert key and cp.sched.get(rid).committed_step == 3
    return cp, principal, pull, rid, key


def test_the_next_lease_resumes_from_the_committed_state(tmp_path):
    cp, principal, pull, rid, key = _plane_with_committed_request(tmp_path)
    leases, frames = _handle(cp, principal, pull)
    [item] = leases.items
    assert item.resume_step == 3
    assert [m.name for m in leases.tensors] == ["state.0.latents"]
    assert bytes(frames[0]) == torch.ones(2, 4).numpy().tobytes()


def test_committed_state_is_held_on_disk_not_in_memory(tmp_path):
    """Before, the Tensor Store kept every committed state's frames in memory as well as on
    disk: with many spot GPUs preempted at once, every in-flight state twice. Now a state gone
    from disk is gone: the store holds only its size."""
    cp, principal, pull, rid, key = _plane_with_committed_request(tmp_path)
    assert cp.store.stats()["committed_states"] == 1 and cp.store.stats()["state_bytes"] == 32
    assert cp.store.get_state(key) is not None
    for f in (cp.store.root / "state" / key).iterdir():
        f.unlink()
    assert cp.store.get_state(key) is None


def test_an_unreadable_committed_state_starts_the_request_over(tmp_path):
    """A committed frame cut short on disk: before, the resuming lease raised in the
    coordinator's PULL handler (the frame does not match its meta) on every pull of the request.
    Now the lease runs the request from step 0 and the request forgets its commit."""
    cp, principal, pull, rid, key = _plane_with_committed_request(tmp_path)
    frame = cp.store.root / "state" / key / "0.bin"
    frame.write_bytes(frame.read_bytes()[:5])
    leases, frames = _handle(cp, principal, pull)
    [item] = leases.items
    assert item.request_id == rid and item.resume_step is None
    assert leases.tensors == [] and frames == []
    req = cp.sched.get(rid)
    assert req.committed_step is None and req.commit_key is None and req.lease.resume_step is None
    assert not (cp.store.root / "state" / key).exists()


def test_a_missing_committed_state_starts_the_request_over(tmp_path):
    cp, principal, pull, rid, key = _plane_with_committed_request(tmp_path)
    cp.store.delete_state(key)
    leases, _ = _handle(cp, principal, pull)
    assert leases.items[0].resume_step is None and leases.tensors == []


def test_the_state_of_a_cancelled_request_is_deleted(tmp_path):
    """Was: a committed state was deleted only when its request finished; one whose request was
    cancelled (exploration left over when training ended, an iteration's leftovers) stayed on
    the reserved node's disk until the run ended, and a run is preempted all the time."""
    cp, principal, pull, rid, key = _plane_with_committed_request(tmp_path)
    cp.sched.cancel(iteration=0, now=1.0, reason="training ended")
    assert (cp.store.root / "state" / key).is_dir()
    cp.housekeeping(2.0)
    assert cp.store.state_keys() == [] and cp.store.stats()["committed_states"] == 0
