"""The control plane's FAIL handler (spotlight/coordinator/control_plane.py ``on_fail``): only a
batch that raised counts toward ``cluster.max_request_failures``; a parked request is counted and
written to the event log; a worker that says it is unhealthy gets an ``unhealthy`` event."""

from __future__ import annotations

from spotlight import protocol as P
from spotlight.config import load_config
from spotlight.coordinator.control_plane import ControlPlane
from spotlight.core.events import EventLog
from spotlight.core.instance_manager import InstanceManager
from spotlight.core.request_scheduler import RequestKind, RequestScheduler, RequestStatus


class _Workers:
    def lease_ended(self, worker_id, now):
        pass


def _plane(max_failures=2):
    cfg = load_config(overrides={"cluster.max_request_failures": max_failures})
    sched = RequestScheduler(60.0, max_failures=cfg.cluster.max_request_failures)
    events = EventLog()
    plane = ControlPlane(cfg, sched, InstanceManager(10.0), None, events, run=None, workers=_Workers())
    return plane, sched, events


def _fail(plane, sched, worker, *, raised: bool, unhealthy: bool = False, now: float = 1.0):
    leases = sched.pull(worker, is_spot=True, max_requests=8, now=now)
    body = P.Fail(
        node_id="spot-0",
        worker_id=worker,
        request_ids=[l.request_id for l in leases],
        lease_ids=[l.lease_id for l in leases],
        reason="RuntimeError: boom" if raised else "worker stopping",
        consecutive_failures=1 if raised else 0,
        unhealthy=unhealthy,
    )
    plane.on_fail(b"id", body, [], now)
    return [l.request_id for l in leases]


def test_fails_of_stopped_workers_never_park_and_raised_batches_park_on_distinct_workers():
    plane, sched, events = _plane(max_failures=2)
    (rid,) = sched.submit(RequestKind.EXPLORE, 0, [(0, 1, 0)], weight_version=0, params={}, now=0.0)
    for _ in range(5):
        assert _fail(plane, sched, "spot-0/gpu0", raised=False) == [rid]
    assert sched.get(rid).status is RequestStatus.PENDING and plane.requests_parked == 0
    _fail(plane, sched, "spot-0/gpu0", raised=True)
    _fail(plane, sched, "spot-0/gpu1", raised=True, unhealthy=True)
    req = sched.get(rid)
    assert req.status is RequestStatus.PARKED and req.error == "RuntimeError: boom"
    assert plane.requests_parked == 1
    kinds = [(e["kind"], e["detail"]) for e in events.to_list()]
    assert kinds[0][0] == "unhealthy" and "spot-0/gpu1" in kinds[0][1]
    assert kinds[1][0] == "parked" and rid in kinds[1][1] and kinds[1][1].endswith("RuntimeError: boom")
