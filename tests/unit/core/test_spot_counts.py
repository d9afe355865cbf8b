"""Per-iteration spot event counts for metrics.jsonl: the Instance
Manager counts notices, GPU revocations and additions; the Request Scheduler records
leases that ended uncommitted, priced in denoising steps by ``lost_steps``."""

from __future__ import annotations

import pytest

from spotlight.core.instance_manager import InstanceManager
from spotlight.core.request_scheduler import AbortedLease, RequestKind, RequestScheduler, lost_steps


def test_instance_manager_counts_spot_events_and_resets():
    im = InstanceManager(heartbeat_timeout_s=10.0)
    im.register("spot-0", "s0", [0, 1], True, now=0.0)
    im.register("spot-1", "s1", [0], True, now=0.0)
    im.register("reserved-0", "r0", [0, 1, 2], False, now=0.0)  # reserved: not counted
    assert im.take_spot_counts() == {"notices": 0, "revocations": 0, "additions": 3}
    assert im.take_spot_counts() == {"notices": 0, "revocations": 0, "additions": 0}  # read and reset
    im.heartbeat("spot-0", 1.0, gpus=[0])  # a per-GPU revocation
    im.heartbeat("spot-0", 2.0, gpus=[0, 3])  # a GPU granted back
    im.notice("spot-0", {"scope": "gpu:3", "source": "revoke"}, 2.5)
    im.notice("spot-1", {"scope": "node", "source": "aws", "is_hint": True}, 3.0)  # a rebalance hint
    im.notice("spot-1", {"scope": "node", "source": "aws"}, 3.0)
    im.goodbye("spot-1", 4.0, "preempted")
    assert im.take_spot_counts() == {"notices": 2, "revocations": 2, "additions": 1}
    im.reap(100.0)  # spot-0 (2 GPUs) and reserved-0 went silent
    assert im.take_spot_counts() == {"notices": 0, "revocations": 2, "additions": 0}


def test_scheduler_records_uncommitted_leases_once():
    s = RequestScheduler(lease_timeout_s=30.0)
    ids = s.submit(RequestKind.ROLLOUT, 0, [(0, 1, 0), (0, 2, 0), (0, 3, 0)], weight_version=0, params={}, now=0.0)
    leases = s.pull("w1", is_spot=True, max_requests=3, now=10.0)
    assert s.complete(ids[0], leases[0].lease_id, now=12.0)  # done: nothing lost
    assert s.commit(ids[1], leases[1].lease_id, committed_step=4, commit_key="k", now=13.0)  # committed: nothing lost
    s.renew("w1", now=18.0)  # the agent's last heartbeat
    s.release_worker("w1", reason="agent dead", now=20.0)  # ids[2] dies uncommitted
    again = s.pull("w2", is_spot=True, max_requests=3, now=21.0)  # ids[1] resumes at step 4, ids[2] from 0
    assert {l.request_id: l.resume_step for l in again} == {ids[1]: 4, ids[2]: None}
    assert s.take_aborted() == [AbortedLease(0, 10.0, 18.0)]  # it ran from the grant to the last sign of life
    assert s.take_aborted() == []
    s.expire(now=60.0)  # w2 went silent (never renewed): its resumed lease loses the 4 committed steps too
    assert sorted(s.take_aborted(), key=lambda a: a.resume_step) == [
        AbortedLease(0, 21.0, 21.0),
        AbortedLease(4, 21.0, 21.0),
    ]  # last sign of life: the grant


def test_lost_steps_estimate():
    aborted = [AbortedLease(0, 10.0, 20.0), AbortedLease(4, 0.0, 2.0), AbortedLease(0, 0.0, 1000.0)]
    # 10 s at 2 s/step = 5 steps; 4 committed + 1 step; capped at the request's 10 steps
    assert lost_steps(aborted, step_wall_s=2.0, total_steps=10) == pytest.approx(5 + 5 + 10)
    # no step time observed yet: only the discarded commits count
    assert lost_steps(aborted, step_wall_s=None, total_steps=10) == 4
    assert lost_steps([], step_wall_s=1.0, total_steps=10) == 0
