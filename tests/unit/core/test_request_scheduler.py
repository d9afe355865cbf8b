"""CPU tests for the Request Scheduler state machine and pull policy (paper §4.5, docs/architecture.md §4)."""

import itertools
import json
import random

import pytest

from spotlight.core.request_scheduler import (
    VALID_TRANSITIONS,
    InvalidTransition,
    RequestKind,
    RequestScheduler,
    RequestStatus,
)
from spotlight.errors import SpotlightError

S = RequestStatus
R, E = RequestKind.ROLLOUT, RequestKind.EXPLORE


def make(lease_timeout_s=10.0, **kw):
    return RequestScheduler(lease_timeout_s=lease_timeout_s, **kw)


def submit(sched, kind=R, iteration=0, n=1, *, weight_version=0, params=None, now=0.0, seed0=0):
    items = [(i, seed0 + i, i // 2) for i in range(n)]
    return sched.submit(kind, iteration, items, weight_version=weight_version, params=params, now=now)


def statuses(sched, rid):
    return [s for s, _, _ in sched.get(rid).history]


# --------------------------------------------------------------- the table


def test_transition_table_is_exactly_the_documented_graph():
    assert VALID_TRANSITIONS == {
        S.PENDING: {S.IN_FLIGHT, S.CANCELLED},
        S.IN_FLIGHT: {S.DONE, S.RECOMPUTE, S.ABORTED, S.CANCELLED},
        S.RECOMPUTE: {S.IN_FLIGHT, S.CANCELLED},
        S.ABORTED: {S.PENDING, S.PARKED},
        S.DONE: set(),
        S.CANCELLED: set(),
        S.PARKED: set(),
    }
    assert set(VALID_TRANSITIONS) == set(RequestStatus)
    assert {s for s in RequestStatus if s.is_terminal()} == {S.DONE, S.CANCELLED, S.PARKED}
    assert all(not VALID_TRANSITIONS[s] for s in RequestStatus if s.is_terminal())


def test_invalid_transition_is_a_spotlight_error():
    assert issubclass(InvalidTransition, SpotlightError)


@pytest.mark.parametrize(
    "old,new",
    [(a, b) for a, b in itertools.product(RequestStatus, RequestStatus) if b not in VALID_TRANSITIONS[a]],
)
def test_every_illegal_edge_raises_and_changes_nothing(old, new):
    sched = make()
    (rid,) = submit(sched)
    req = sched.get(rid)
    req.status = old  # force the starting point; _transition must validate before touching anything
    history = list(req.history)
    with pytest.raises(InvalidTransition, match=f"{rid}: {old.value} -> {new.value} is not allowed"):
        sched._transition(req, new, 1.0, "illegal")
    assert req.status is old
    assert req.history == history


def _walk_pending_to_in_flight(sched, rid):
    (lease,) = sched.pull("w", is_spot=False, max_requests=1, now=1.0)
    assert lease.request_id == rid
    return lease


def test_legal_edges_through_public_api():
    walked = set()

    def note(rid, sched):
        st = statuses(sched, rid)
        for a, b in zip(st, st[1:]):
            assert b in VALID_TRANSITIONS[a]
            walked.add((a, b))

    # PENDING -> IN_FLIGHT -> DONE
    sched = make()
    (rid,) = submit(sched)
    lease = _walk_pending_to_in_flight(sched, rid)
    assert sched.complete(rid, lease.lease_id, now=2.0)
    assert sched.get(rid).history == [
        (S.PENDING, 0.0, "submitted"),
        (S.IN_FLIGHT, 1.0, "leased to w (lease 1)"),
        (S.DONE, 2.0, "done by w (lease 1)"),
    ]
    note(rid, sched)

    # PENDING -> CANCELLED
    sched = make()
    (rid,) = submit(sched)
    assert sched.cancel(iteration=0, now=1.0, reason="phase over") == [rid]
    assert sched.get(rid).history[-1] == (S.CANCELLED, 1.0, "phase over")
    note(rid, sched)

    # IN_FLIGHT -> RECOMPUTE -> IN_FLIGHT, then RECOMPUTE -> CANCELLED
    sched = make()
    (rid,) = submit(sched)
    lease = _walk_pending_to_in_flight(sched, rid)
    assert sched.commit(rid, lease.lease_id, committed_step=4, commit_key="ts/k", now=2.0)
    (lease2,) = sched.pull("w2", is_spot=True, max_requests=1, now=3.0)
    assert sched.commit(rid, lease2.lease_id, committed_step=6, commit_key="ts/k2", now=4.0)
    sched.cancel(iteration=0, now=5.0)
    assert statuses(sched, rid) == [S.PENDING, S.IN_FLIGHT, S.RECOMPUTE, S.IN_FLIGHT, S.RECOMPUTE, S.CANCELLED]
    assert sched.get(rid).history[3] == (S.IN_FLIGHT, 3.0, "leased to w2 (lease 2), resume from step 4")
    note(rid, sched)

    # IN_FLIGHT -> ABORTED -> PENDING (fail), and IN_FLIGHT -> CANCELLED
    sched = make()
    (rid,) = submit(sched)
    lease = _walk_pending_to_in_flight(sched, rid)
    assert sched.fail(rid, lease.lease_id, reason="oom", now=2.0)
    assert sched.get(rid).history[-2:] == [
        (S.ABORTED, 2.0, "failed on w: oom"),
        (S.PENDING, 2.0, "re-enqueued for full re-execution"),
    ]
    lease = _walk_pending_to_in_flight(sched, rid)
    sched.cancel(iteration=0, now=3.0)
    assert statuses(sched, rid) == [S.PENDING, S.IN_FLIGHT, S.ABORTED, S.PENDING, S.IN_FLIGHT, S.CANCELLED]
    note(rid, sched)

    # ABORTED -> PARKED: a request given back with an error max_failures times
    sched = make(max_failures=1)
    (rid,) = submit(sched)
    lease = _walk_pending_to_in_flight(sched, rid)
    assert sched.fail(rid, lease.lease_id, reason="ValueError: bad prompt", now=2.0)
    assert sched.get(rid).status is S.PARKED and sched.get(rid).error == "ValueError: bad prompt"
    assert sched.pull("w", is_spot=True, max_requests=1, now=2.5) == []
    assert sched.cancel(iteration=0, now=3.0) == []  # terminal: cancel leaves it
    assert statuses(sched, rid) == [S.PENDING, S.IN_FLIGHT, S.ABORTED, S.PARKED]
    note(rid, sched)

    legal = {(a, b) for a, outs in VALID_TRANSITIONS.items() for b in outs}
    assert walked == legal


# ----------------------------------------------------------------- pulling


def test_pull_priority_recompute_then_rollout_then_explore_fifo():
    sched = make()
    e = submit(sched, E, iteration=1, n=2, now=0.0)
    r = submit(sched, R, iteration=1, n=3, now=0.0)
    # Make the newest rollout RECOMPUTE and send the older two back to PENDING.
    l0, l1, l2 = sched.pull("a", is_spot=False, max_requests=3, now=1.0)
    assert [l0.request_id, l1.request_id, l2.request_id] == r
    sched.commit(r[2], l2.lease_id, committed_step=3, commit_key="k", now=1.5)
    sched.fail(r[0], l0.lease_id, reason="x", now=1.5)
    sched.fail(r[1], l1.lease_id, reason="x", now=1.5)
    got = [sched.pull("b", is_spot=True, max_requests=1, now=2.0)[0].request_id for _ in range(5)]
    assert got == [r[2], r[0], r[1], e[0], e[1]]
    assert sched.pull("b", is_spot=True, max_requests=1, now=2.0) == []


def test_requeued_request_keeps_its_submission_place():
    sched = make()
    a, b, c = submit(sched, n=3)
    (la,) = sched.pull("w", is_spot=False, max_requests=1, now=1.0)
    sched.fail(a, la.lease_id, reason="worker stopping", now=2.0, counts=False)
    leases = sched.pull("w", is_spot=False, max_requests=3, now=3.0)
    assert [l.request_id for l in leases] == [a, b, c]


def test_a_request_that_failed_keeps_its_place_and_is_leased_alone():
    sched = make()
    a, b, c = submit(sched, n=3)
    (la,) = sched.pull("w", is_spot=False, max_requests=1, now=1.0)
    sched.fail(a, la.lease_id, reason="RuntimeError: x", now=2.0)
    assert [l.request_id for l in sched.pull("w", is_spot=False, max_requests=3, now=3.0)] == [a]
    assert [l.request_id for l in sched.pull("w", is_spot=False, max_requests=3, now=3.0)] == [b, c]


def test_pull_batches_only_same_key_and_respects_max_requests():
    sched = make()
    r0 = submit(sched, R, iteration=0, n=2, params={"cache_threshold": 0.0})
    r1 = submit(sched, R, iteration=1, n=2, weight_version=1)
    rp = submit(sched, R, iteration=0, n=2, params={"cache_threshold": 0.1})
    r0b = submit(sched, R, iteration=0, n=3, params={"cache_threshold": 0.0})
    rv = submit(sched, R, iteration=0, n=1, weight_version=7, params={"cache_threshold": 0.0})

    first = sched.pull("w", is_spot=False, max_requests=4, now=1.0)
    assert [l.request_id for l in first] == r0 + r0b[:2]
    # The oldest remaining request fixes the next key, even if older-key leftovers exist.
    assert [l.request_id for l in sched.pull("w", is_spot=False, max_requests=10, now=1.0)] == r1
    assert [l.request_id for l in sched.pull("w", is_spot=False, max_requests=10, now=1.0)] == rp
    assert [l.request_id for l in sched.pull("w", is_spot=False, max_requests=10, now=1.0)] == r0b[2:]
    assert [l.request_id for l in sched.pull("w", is_spot=False, max_requests=10, now=1.0)] == rv
    with pytest.raises(ValueError):
        sched.pull("w", is_spot=False, max_requests=0, now=1.0)


def test_recompute_batches_with_same_key_and_carries_resume_info():
    sched = make()
    a, b, c = submit(sched, n=3)
    (la,) = sched.pull("w1", is_spot=True, max_requests=1, now=1.0)
    assert la.resume_step is None and la.commit_key is None
    sched.commit(a, la.lease_id, committed_step=5, commit_key="ts/a", now=2.0)
    leases = sched.pull("w2", is_spot=False, max_requests=3, now=3.0)
    assert [(l.request_id, l.resume_step, l.commit_key) for l in leases] == [
        (a, 5, "ts/a"),
        (b, None, None),
        (c, None, None),
    ]
    assert sched.get(a).attempts == 2 and sched.get(a).worker_id == "w2"


def test_exploration_gated_to_spot_while_training():
    sched = make()
    (e,) = submit(sched, E, iteration=1)
    sched.set_training_active(True)
    assert sched.training_active
    assert sched.pull("reserved", is_spot=False, max_requests=4, now=1.0) == []
    (lease,) = sched.pull("spot", is_spot=True, max_requests=4, now=1.0)
    assert lease.request_id == e
    sched.release_worker("spot", reason="preempted", now=2.0)
    sched.set_training_active(False)
    assert not sched.training_active
    assert [l.request_id for l in sched.pull("reserved", is_spot=False, max_requests=4, now=3.0)] == [e]


def test_gating_skips_explore_recompute_but_reserved_still_gets_rollouts_behind_it():
    sched = make()
    sched.set_training_active(True)
    (e,) = submit(sched, E, iteration=0)
    (le,) = sched.pull("spot", is_spot=True, max_requests=1, now=1.0)
    sched.commit(e, le.lease_id, committed_step=2, commit_key="ts/e", now=2.0)
    (r,) = submit(sched, R, iteration=1, now=3.0)
    # The RECOMPUTE exploration outranks the rollout, but not for a reserved worker during training.
    assert [l.request_id for l in sched.pull("res", is_spot=False, max_requests=4, now=4.0)] == [r]
    assert sched.pull("res", is_spot=False, max_requests=4, now=4.0) == []
    (le,) = sched.pull("spot2", is_spot=True, max_requests=4, now=5.0)
    assert (le.request_id, le.resume_step, le.commit_key) == (e, 2, "ts/e")


def test_no_work_for_anyone_who_did_not_ask():
    sched = make()
    ids = submit(sched, n=4)
    sched.pull("a", is_spot=False, max_requests=2, now=1.0)
    assert sched.leases("b") == [] and sched.renew("b", now=2.0) == 0
    assert [l.request_id for l in sched.leases("a")] == ids[:2]
    assert sched.counts()[S.PENDING] == 2


def test_lease_ids_strictly_increase_and_expiry_uses_timeout():
    sched = make(lease_timeout_s=7.5)
    submit(sched, n=3)
    leases = sched.pull("a", is_spot=False, max_requests=2, now=1.0)
    leases += sched.pull("b", is_spot=True, max_requests=2, now=2.0)
    assert [l.lease_id for l in leases] == [1, 2, 3]
    assert [(l.granted_at, l.expires_at) for l in leases] == [(1.0, 8.5), (1.0, 8.5), (2.0, 9.5)]


# ----------------------------------------------------------- exactly once


def test_late_completion_from_presumed_dead_worker_is_rejected():
    sched = make(lease_timeout_s=5.0)
    ids = submit(sched, n=2)
    la = sched.pull("A", is_spot=True, max_requests=2, now=0.0)
    assert sched.expire(now=4.9) == []
    assert sched.expire(now=5.0) == ids
    assert all(sched.get(i).status is S.PENDING for i in ids)
    lb = sched.pull("B", is_spot=False, max_requests=2, now=6.0)
    assert [l.request_id for l in lb] == ids
    for l in la:  # A was only slow: its late reports must not count
        assert not sched.complete(l.request_id, l.lease_id, now=7.0)
        assert not sched.commit(l.request_id, l.lease_id, committed_step=1, commit_key="k", now=7.0)
        assert not sched.fail(l.request_id, l.lease_id, reason="late", now=7.0)
    assert all(sched.get(i).worker_id == "B" for i in ids)
    for l in lb:
        assert sched.complete(l.request_id, l.lease_id, now=8.0)
        assert not sched.complete(l.request_id, l.lease_id, now=8.5)  # duplicate
    assert sched.counts()[S.DONE] == len(ids)
    assert sum(1 for i in ids for s in statuses(sched, i) if s is S.DONE) == len(ids)


def test_reports_for_unknown_or_cancelled_requests_are_rejected():
    sched = make()
    (rid,) = submit(sched)
    (l,) = sched.pull("w", is_spot=False, max_requests=1, now=1.0)
    sched.cancel(iteration=0, now=2.0)
    assert not sched.complete(rid, l.lease_id, now=3.0)
    assert not sched.complete("nope", 1, now=3.0)
    assert sched.get(rid).status is S.CANCELLED and sched.get(rid).lease is None
    assert sched.leases("w") == []


# --------------------------------------------------------- commit / clear


def test_fail_and_expire_clear_commit_info():
    sched = make(lease_timeout_s=5.0)
    a, b = submit(sched, n=2)
    for l in sched.pull("w", is_spot=True, max_requests=2, now=0.0):
        sched.commit(l.request_id, l.lease_id, committed_step=3, commit_key=f"k{l.request_id}", now=1.0)
    la, lb = sched.pull("v", is_spot=True, max_requests=2, now=2.0)
    assert (la.resume_step, lb.resume_step) == (3, 3)
    sched.fail(a, la.lease_id, reason="nccl", now=3.0, counts=False)
    assert sched.expire(now=100.0) == [b]
    for rid in (a, b):
        req = sched.get(rid)
        assert (req.status, req.committed_step, req.commit_key) == (S.PENDING, None, None)
    leases = sched.pull("u", is_spot=True, max_requests=2, now=101.0)
    assert [(l.resume_step, l.commit_key) for l in leases] == [(None, None), (None, None)]


def test_commit_rejects_negative_step():
    sched = make()
    (rid,) = submit(sched)
    (l,) = sched.pull("w", is_spot=False, max_requests=1, now=0.0)
    with pytest.raises(ValueError):
        sched.commit(rid, l.lease_id, committed_step=-1, commit_key="k", now=1.0)
    assert sched.get(rid).status is S.IN_FLIGHT


def test_max_failures_counts_only_reported_failures():
    sched = make(lease_timeout_s=1.0, max_failures=2)
    (rid,) = submit(sched)
    (l,) = sched.pull("w", is_spot=True, max_requests=1, now=0.0)
    sched.expire(now=5.0)  # preemption: not the request's fault
    (l,) = sched.pull("w", is_spot=True, max_requests=1, now=6.0)
    sched.fail(rid, l.lease_id, reason="x", now=6.5)
    assert sched.get(rid).status is S.PENDING
    (l,) = sched.pull("v", is_spot=True, max_requests=1, now=7.0)
    sched.fail(rid, l.lease_id, reason="y", now=7.5)
    req = sched.get(rid)
    assert req.status is S.PARKED and req.failures == 2 and req.error == "y" and req.worker_id == "v"
    assert req.failed_on == ["w", "v"]
    assert sched.is_finished(iteration=0, kind=R) and sched.num_outstanding() == 0
    assert sched.counts(iteration=0)[S.PARKED] == 1


def test_parked_request_ends_the_loop_of_an_always_failing_request():
    """The loop this guards against: a request every worker fails on is re-enqueued forever
    (the sd3 + First Block Cache case gave 37,975 give-backs in 90 s). With max_failures = 3
    it is leased exactly 3 times, to 3 different workers, then parked."""
    sched = make(max_failures=3)
    (bad,) = submit(sched, E, n=1)
    pulls = 0
    for k in range(1000):
        got = sched.pull(f"w{k % 4}", is_spot=True, max_requests=1, now=float(k))
        if not got:
            break
        pulls += 1
        sched.fail(bad, got[0].lease_id, reason=f"RuntimeError: boom on w{k % 4}", now=float(k))
    assert pulls == 3 and sched.get(bad).status is S.PARKED
    assert sched.get(bad).error == "RuntimeError: boom on w2" and sched.get(bad).worker_id == "w2"
    assert sched.is_finished(iteration=0, kind=E)


def test_parked_requests_are_retired_and_counted_after_they_leave_memory():
    sched = make(max_failures=1)
    a, b = submit(sched, n=2)
    (la, lb) = sched.pull("w", is_spot=True, max_requests=2, now=0.0)
    sched.fail(a, la.lease_id, reason="x", now=1.0)
    sched.complete(b, lb.lease_id, 1.0)
    assert [r.request_id for r in sched.take_terminal(before_iteration=1)] == [a, b]
    assert sched.counts()[S.PARKED] == 1 and sched.counts()[S.DONE] == 1


# ----------------------------------------------- release / renew / cancel


def test_release_worker_requeues_only_that_workers_leases():
    sched = make()
    ids = submit(sched, n=4)
    sched.pull("a", is_spot=True, max_requests=2, now=0.0)
    sched.pull("b", is_spot=True, max_requests=2, now=0.0)
    assert sched.release_worker("a", reason="agent died", now=1.0) == ids[:2]
    assert sched.release_worker("a", reason="again", now=1.0) == []
    assert [sched.get(i).status for i in ids] == [S.PENDING, S.PENDING, S.IN_FLIGHT, S.IN_FLIGHT]
    assert sched.get(ids[0]).history[-2] == (S.ABORTED, 1.0, "a released: agent died")


def test_renew_extends_all_of_a_workers_leases():
    sched = make(lease_timeout_s=10.0)
    ids = submit(sched, n=3)
    sched.pull("a", is_spot=True, max_requests=2, now=0.0)
    sched.pull("b", is_spot=True, max_requests=1, now=0.0)
    assert sched.renew("a", now=8.0) == 2
    assert [l.expires_at for l in sched.leases("a")] == [18.0, 18.0]
    assert sched.expire(now=10.0) == [ids[2]]
    assert sched.expire(now=17.9) == []
    assert sched.expire(now=18.0) == ids[:2]


def test_cancel_by_iteration_and_kind():
    sched = make()
    r0 = submit(sched, R, iteration=0, n=2)
    e0 = submit(sched, E, iteration=0, n=2)
    e1 = submit(sched, E, iteration=1, n=1)
    (l,) = sched.pull("w", is_spot=False, max_requests=1, now=0.0)
    sched.complete(l.request_id, l.lease_id, now=1.0)
    assert sched.cancel(iteration=0, kind=E, now=2.0, reason="exploration window closed") == e0
    assert [sched.get(i).status for i in r0 + e1] == [S.DONE, S.PENDING, S.PENDING]
    assert sched.cancel(iteration=0, now=3.0) == r0[1:]
    assert sched.cancel(iteration=0, now=4.0) == []


# ---------------------------------------------------------------- queries


def test_counts_is_finished_num_outstanding_and_forget():
    sched = make()
    assert sched.is_finished(iteration=0, kind=R)
    assert sched.counts() == dict.fromkeys(RequestStatus, 0)
    r0 = submit(sched, R, iteration=0, n=2)
    submit(sched, E, iteration=0, n=1)
    r1 = submit(sched, R, iteration=1, n=1)
    leases = sched.pull("w", is_spot=False, max_requests=2, now=0.0)
    assert sched.counts(iteration=0, kind=R) == {**dict.fromkeys(RequestStatus, 0), S.IN_FLIGHT: 2}
    assert sched.num_outstanding() == 4 and sched.num_outstanding(kind=E) == 1
    sched.complete(r0[0], leases[0].lease_id, now=1.0)
    assert not sched.is_finished(iteration=0, kind=R)
    sched.complete(r0[1], leases[1].lease_id, now=1.0)
    assert sched.is_finished(iteration=0, kind=R)
    assert not sched.is_finished(iteration=0, kind=E)
    sched.cancel(iteration=0, kind=E, now=2.0)
    assert sched.is_finished(iteration=0, kind=E)
    assert sched.num_outstanding() == 1
    assert [r.request_id for r in sched.requests(status=S.DONE)] == r0
    assert [r.request_id for r in sched.requests(iteration=1)] == r1

    assert sched.forget(before_iteration=2) == 3  # r1 is still pending, kept
    with pytest.raises(KeyError):
        sched.get(r0[0])
    assert sched.get(r1[0]).status is S.PENDING
    # forgotten requests still count in the run's totals, not in their iteration's
    assert sched.counts() == {**dict.fromkeys(RequestStatus, 0), S.PENDING: 1, S.DONE: 2, S.CANCELLED: 1}
    assert sched.counts(kind=E) == {**dict.fromkeys(RequestStatus, 0), S.CANCELLED: 1}
    assert sched.counts(iteration=0) == dict.fromkeys(RequestStatus, 0)
    assert sched.is_finished(iteration=0, kind=R)
    assert not sched.complete(r0[0], leases[0].lease_id, now=3.0)


def test_take_terminal_returns_what_it_drops_and_the_totals_survive_a_restore():
    """The coordinator's retention rule: terminal requests of old iterations leave memory
    (and the checkpoint) for requests.jsonl; ids are never reused; totals are kept."""
    sched = make()
    r0 = submit(sched, R, iteration=0, n=3)
    leases = sched.pull("w", is_spot=False, max_requests=2, now=0.0)
    for lease in leases:
        sched.complete(lease.request_id, lease.lease_id, now=1.0)
    dropped = sched.take_terminal(before_iteration=1)
    assert [r.request_id for r in dropped] == r0[:2] and all(r.status is S.DONE for r in dropped)
    assert [r.request_id for r in sched.requests()] == r0[2:]  # the pending one stays
    state = sched.state_dict()
    assert len(state["requests"]) == 1
    restored = make()
    restored.load_state_dict(json.loads(json.dumps(state)), epoch=1, now=2.0)
    assert restored.counts() == {**dict.fromkeys(RequestStatus, 0), S.DONE: 2, S.PENDING: 1}
    new = submit(restored, R, iteration=0, n=1)
    assert new[0] not in r0  # the id counters were kept


def test_submit_ids_params_and_validation():
    sched = make()
    params = {"cache_threshold": 0.1}
    ids = sched.submit(E, 3, [(5, 42, 1), (6, 43, 2)], weight_version=2, params=params, now=9.0)
    assert ids == ["e3-0", "e3-1"]
    assert submit(sched, E, iteration=3) == ["e3-2"]
    assert submit(sched, R, iteration=3) == ["r3-0"]
    params["cache_threshold"] = 0.5
    req = sched.get("e3-1")
    assert (req.prompt_index, req.seed, req.group, req.weight_version) == (6, 43, 2, 2)
    assert req.params == {"cache_threshold": 0.1}  # copied at submit
    assert req.history == [(S.PENDING, 9.0, "submitted")]
    assert sched.get("r3-0").params == {}
    with pytest.raises(ValueError):
        submit(sched, R, iteration=-1)
    with pytest.raises(ValueError):
        make(lease_timeout_s=0)


# ------------------------------------------------------------- property


def _check_invariants(sched):
    active = {}
    for req in sched.requests():
        st = [s for s, _, _ in req.history]
        assert st[0] is S.PENDING and st[-1] is req.status
        for a, b in zip(st, st[1:]):
            assert b in VALID_TRANSITIONS[a], (req.request_id, st)
        if req.status is S.IN_FLIGHT:
            assert req.lease is not None and req.lease.request_id == req.request_id
            assert req.lease.lease_id not in active
            active[req.lease.lease_id] = req.request_id
            assert req.attempts == st.count(S.IN_FLIGHT)
        else:
            assert req.lease is None
    held = [l for w in {r.worker_id for r in sched.requests()} if w for l in sched.leases(w)]
    assert {l.lease_id: l.request_id for l in held} == active  # one lease per in-flight request, nothing else


def test_randomized_operations_end_done_exactly_once():
    rng = random.Random(1234)
    sched = make(lease_timeout_s=5.0)
    workers = {"r0": False, "r1": False, "s0": True, "s1": True, "s2": True}
    believed = {w: [] for w in workers}  # leases each worker thinks it holds (may be stale)
    accepted = {}  # request id -> number of accepted completions
    submitted = []
    committed, released = set(), []  # commit keys accepted; keys released for deletion
    now = 0.0
    for step in range(2000):
        now += rng.uniform(0.0, 1.0)
        op = rng.random()
        w = rng.choice(list(workers))
        if op < 0.08:
            kind = rng.choice([R, E])
            it = rng.randrange(4)
            items = [(rng.randrange(8), rng.randrange(100), 0) for _ in range(rng.randint(1, 4))]
            submitted += sched.submit(kind, it, items, weight_version=it, params={"s": rng.choice([10, 20])}, now=now)
        elif op < 0.35:
            got = sched.pull(w, is_spot=workers[w], max_requests=rng.randint(1, 3), now=now)
            keys = [sched.get(l.request_id).batch_key for l in got]
            assert all(k == keys[0] for k in keys)
            if sched.training_active and not workers[w]:
                assert all(sched.get(l.request_id).kind is R for l in got)
            believed[w] += got
        elif op < 0.6 and believed[w]:
            l = believed[w].pop(rng.randrange(len(believed[w])))
            current = sched.get(l.request_id).lease
            ok = sched.complete(l.request_id, l.lease_id, now=now)
            assert ok == (current is not None and current.lease_id == l.lease_id)
            if ok:
                accepted[l.request_id] = accepted.get(l.request_id, 0) + 1
        elif op < 0.68 and believed[w]:
            l = believed[w].pop(rng.randrange(len(believed[w])))
            if sched.commit(l.request_id, l.lease_id, committed_step=rng.randrange(10), commit_key=f"k{step}", now=now):
                committed.add(f"k{step}")
        elif op < 0.72 and believed[w]:
            l = believed[w].pop(rng.randrange(len(believed[w])))
            sched.fail(l.request_id, l.lease_id, reason="random", now=now)
        elif op < 0.82:
            sched.renew(w, now=now)
        elif op < 0.9:
            sched.expire(now=now)
        elif op < 0.93:
            sched.release_worker(w, reason="preempted", now=now)
            if rng.random() < 0.5:
                believed[w] = []  # the worker really died; otherwise it reports late
        elif op < 0.96:
            sched.set_training_active(not sched.training_active)
        _check_invariants(sched)
        released += sched.take_released_commits()
        assert sched.commit_keys().isdisjoint(released)

    # Drain: training over, one reserved worker pulls and completes until nothing is left.
    sched.set_training_active(False)
    for _ in range(10_000):
        now += 100.0
        sched.expire(now=now)  # whatever the random phase left in flight is presumed dead
        got = sched.pull("drain", is_spot=False, max_requests=4, now=now)
        if not got:
            break
        for l in got:
            assert sched.complete(l.request_id, l.lease_id, now=now)
            accepted[l.request_id] = accepted.get(l.request_id, 0) + 1
    _check_invariants(sched)
    released += sched.take_released_commits()
    # every committed state is released exactly once, when no request resumes from it any more
    assert len(committed) > 20 and sorted(released) == sorted(committed) and sched.commit_keys() == set()
    assert sched.num_outstanding() == 0
    assert len(submitted) > 100
    assert accepted == {rid: 1 for rid in submitted}
    assert sched.counts()[S.DONE] == len(submitted)
    for rid in submitted:
        assert statuses(sched, rid).count(S.DONE) == 1


# ------------------------------------------------- lease holder check (worker_id)


def test_only_the_leaseholder_can_complete_commit_or_fail():
    sched = make()
    a, b, c = submit(sched, n=3)
    la, lb, lc = sched.pull("w1", is_spot=True, max_requests=3, now=0.0)
    assert sched.holder(a, la.lease_id) == "w1"
    assert sched.holder(a, lb.lease_id) is None  # lease of another request
    assert sched.holder("nope", la.lease_id) is None
    # another worker presenting the right lease id is rejected and changes nothing
    assert not sched.complete(a, la.lease_id, 1.0, worker_id="w2")
    assert not sched.commit(b, lb.lease_id, committed_step=3, commit_key="k", now=1.0, worker_id="w2")
    assert not sched.fail(c, lc.lease_id, reason="x", now=1.0, worker_id="w2")
    assert [sched.get(r).status for r in (a, b, c)] == [S.IN_FLIGHT] * 3
    assert sched.get(c).failures == 0
    # the holder succeeds; worker_id=None keeps the old unchecked behaviour
    assert sched.complete(a, la.lease_id, 1.0, worker_id="w1")
    assert sched.commit(b, lb.lease_id, committed_step=3, commit_key="k", now=1.0, worker_id="w1")
    assert sched.fail(c, lc.lease_id, reason="x", now=1.0)
    assert [sched.get(r).status for r in (a, b, c)] == [S.DONE, S.RECOMPUTE, S.PENDING]
    assert sched.holder(a, la.lease_id) is None  # no longer current


# ------------------------------------------------------- crash and resume


def _busy_scheduler():
    """A scheduler with requests in every status, the gate closed and one parked request."""
    import json

    sched = make(max_failures=1)
    sched.set_training_active(True)
    rids = submit(sched, R, iteration=0, n=6, params={"steps": 4}, now=0.0)
    exp = submit(sched, E, iteration=1, n=2, params={"steps": 2}, now=0.5)
    leases = {l.request_id: l for l in sched.pull("w1", is_spot=True, max_requests=6, now=1.0)}
    sched.complete(rids[0], leases[rids[0]].lease_id, 2.0)  # DONE
    sched.commit(rids[1], leases[rids[1]].lease_id, committed_step=2, commit_key="c1", now=2.0)  # RECOMPUTE
    sched.fail(rids[2], leases[rids[2]].lease_id, reason="oom", now=2.0)  # PARKED (max_failures=1)
    (l1,) = sched.pull("w2", is_spot=True, max_requests=1, now=2.5)  # resumes rids[1] from the commit
    assert l1.request_id == rids[1] and l1.resume_step == 2
    sched.cancel(iteration=1, kind=E, now=3.0)  # CANCELLED
    # still IN_FLIGHT: rids[1] (w2, resumed), rids[3..5] (w1)
    state = json.loads(json.dumps(sched.state_dict(), allow_nan=False))
    return sched, state, rids, exp, leases, l1


def test_state_dict_round_trip_without_in_flight():
    import json

    sched = make()
    sched.set_training_active(True)
    rids = submit(sched, R, iteration=2, n=3, params={"a": 1}, now=0.0)
    (l0,) = sched.pull("w", is_spot=False, max_requests=1, now=1.0)
    sched.commit(rids[0], l0.lease_id, committed_step=1, commit_key="k0", now=2.0)
    state = json.loads(json.dumps(sched.state_dict()))
    fresh = make()
    assert fresh.load_state_dict(state, epoch=1, now=5.0) == []
    got = fresh.state_dict()
    assert got["requests"] == state["requests"]
    assert got["id_counters"] == state["id_counters"] and got["next_seq"] == state["next_seq"]
    assert got["training_active"] is True and got["epoch"] == 1
    # the restored queue serves the same order: RECOMPUTE first (with its commit), then FIFO
    order = [l.request_id for l in fresh.pull("w", is_spot=False, max_requests=3, now=6.0)]
    assert order == rids
    assert fresh.get(rids[0]).status is S.IN_FLIGHT and fresh.leases("w")[0].commit_key == "k0"
    assert fresh.submit(R, 2, [(9, 9, 9)], weight_version=0, params={"a": 1}, now=7.0) == ["r2-3"]


def test_load_voids_in_flight_leases_and_keeps_everything_else():
    sched, state, rids, exp, leases, l1 = _busy_scheduler()
    fresh = make(max_failures=1)
    voided = fresh.load_state_dict(state, epoch=1, now=100.0)
    assert voided == [rids[1], rids[3], rids[4], rids[5]]
    st = {r: fresh.get(r).status for r in rids + exp}
    assert st == {
        rids[0]: S.DONE,
        rids[1]: S.PENDING,
        rids[2]: S.PARKED,
        rids[3]: S.PENDING,
        rids[4]: S.PENDING,
        rids[5]: S.PENDING,
        exp[0]: S.CANCELLED,
        exp[1]: S.CANCELLED,
    }
    for r in voided:
        req = fresh.get(r)
        assert statuses(fresh, r)[-2:] == [S.ABORTED, S.PENDING]
        assert "coordinator restarted" in req.history[-2][2] and req.history[-2][1] == 100.0
        assert req.lease is None and req.commit_key is None and req.committed_step is None
    # full history, attempts and failures survive
    assert fresh.get(rids[1]).attempts == 2
    assert statuses(fresh, rids[1])[:4] == [S.PENDING, S.IN_FLIGHT, S.RECOMPUTE, S.IN_FLIGHT]
    assert fresh.get(rids[2]).failures == 1
    assert fresh.leases("w1") == [] and fresh.leases("w2") == []
    assert fresh.training_active is True
    assert fresh.num_outstanding() == 4  # 4 re-enqueued (the parked one is terminal)
    assert fresh.get(rids[2]).error == "oom"
    assert not fresh.is_finished(iteration=0, kind=R) and fresh.is_finished(iteration=1, kind=E)
    # every old lease is stale now
    assert not fresh.complete(rids[3], leases[rids[3]].lease_id, 101.0)
    assert not fresh.commit(rids[1], l1.lease_id, committed_step=3, commit_key="c2", now=101.0)
    # the re-enqueued requests run again, in submission order
    order = [l.request_id for l in fresh.pull("w3", is_spot=True, max_requests=8, now=102.0)]
    assert order == [rids[1], rids[3], rids[4], rids[5]]


def test_load_keeps_recompute_with_its_commit():
    sched = make()
    (rid,) = submit(sched)
    (l,) = sched.pull("w", is_spot=True, max_requests=1, now=1.0)
    sched.commit(rid, l.lease_id, committed_step=5, commit_key="ck", now=2.0)
    fresh = make()
    assert fresh.load_state_dict(sched.state_dict(), epoch=1, now=3.0) == []
    req = fresh.get(rid)
    assert req.status is S.RECOMPUTE and (req.committed_step, req.commit_key) == (5, "ck")
    (l2,) = fresh.pull("w9", is_spot=True, max_requests=1, now=4.0)
    assert (l2.resume_step, l2.commit_key) == (5, "ck")


def test_stale_result_after_resume_is_rejected_even_for_post_checkpoint_leases():
    """Checkpoint between iterations; the dead coordinator then submitted iteration 1 and
    granted leases (after the snapshot); the resumed one re-submits iteration 1 and gets
    the same request ids. A late RESULT with a lease of the dead process is stale."""
    from spotlight.core.request_scheduler import LEASE_EPOCH_STRIDE

    old = make()
    done = submit(old, R, iteration=0, n=2, now=0.0)
    for l in old.pull("w", is_spot=False, max_requests=2, now=1.0):
        assert old.complete(l.request_id, l.lease_id, 2.0)
    state = old.state_dict()  # checkpoint after iteration 0
    # post-checkpoint work of the process that is about to crash
    ids_old = submit(old, R, iteration=1, n=3, now=3.0)
    old_leases = old.pull("w", is_spot=False, max_requests=3, now=4.0)
    assert ids_old == ["r1-0", "r1-1", "r1-2"]
    # crash; resume with epoch 1
    new = make()
    new.load_state_dict(state, epoch=1, now=10.0)
    assert [new.get(r).status for r in done] == [S.DONE, S.DONE]
    ids_new = submit(new, R, iteration=1, n=3, now=11.0)
    assert ids_new == ids_old  # same ids: the counters are from before iteration 1
    new_leases = new.pull("w", is_spot=False, max_requests=3, now=12.0)
    old_ids = {l.lease_id for l in old_leases}
    assert all(l.lease_id >= LEASE_EPOCH_STRIDE for l in new_leases)
    assert old_ids.isdisjoint(l.lease_id for l in new_leases)
    stale = old_leases[0]
    fresh_lease = next(l for l in new_leases if l.request_id == stale.request_id)
    assert not new.complete(stale.request_id, stale.lease_id, 13.0)
    assert not new.fail(stale.request_id, stale.lease_id, reason="late", now=13.0)
    assert new.get(stale.request_id).status is S.IN_FLIGHT
    assert new.complete(stale.request_id, fresh_lease.lease_id, 14.0)
    assert new.get(stale.request_id).status is S.DONE


def test_without_epoch_offset_lease_ids_would_collide():
    """The guard the epoch gives: a plain restore of the counters re-issues old ids."""
    old = make()
    state = old.state_dict()
    submit(old, R, iteration=0, n=1)
    (ol,) = old.pull("w", is_spot=False, max_requests=1, now=1.0)
    naive = make()
    naive._next_lease_id = state["next_lease_id"]  # what a restore without epoch would do
    submit(naive, R, iteration=0, n=1)
    (nl,) = naive.pull("w", is_spot=False, max_requests=1, now=1.0)
    assert nl.lease_id == ol.lease_id  # collision: a stale RESULT would be accepted
    resumed = make()
    resumed.load_state_dict(state, epoch=1, now=0.0)
    submit(resumed, R, iteration=0, n=1)
    (rl,) = resumed.pull("w", is_spot=False, max_requests=1, now=1.0)
    assert rl.lease_id != ol.lease_id
    assert not resumed.complete(rl.request_id, ol.lease_id, 2.0)


def test_load_rejects_bad_epoch_version_and_malformed_state():
    sched, state, *_ = _busy_scheduler()
    fresh = make()
    with pytest.raises(ValueError, match="epoch must be greater"):
        fresh.load_state_dict(state, epoch=0, now=0.0)
    resumed = make()
    resumed.load_state_dict(state, epoch=2, now=0.0)
    with pytest.raises(ValueError, match="epoch must be greater"):
        make().load_state_dict(resumed.state_dict(), epoch=2, now=0.0)
    with pytest.raises(ValueError, match="version"):
        fresh.load_state_dict({**state, "version": 99}, epoch=1, now=0.0)
    bad = dict(state, requests=[dict(state["requests"][0], status="bogus")])
    with pytest.raises(ValueError, match="malformed"):
        fresh.load_state_dict(bad, epoch=1, now=0.0)
    no_lease = dict(
        state, requests=[dict(r, lease=None) if r["status"] == "in_flight" else r for r in state["requests"]]
    )
    with pytest.raises(ValueError, match="malformed"):
        fresh.load_state_dict(no_lease, epoch=1, now=0.0)
    dup = dict(state, requests=state["requests"] + state["requests"][:1])
    with pytest.raises(ValueError, match="duplicate"):
        fresh.load_state_dict(dup, epoch=1, now=0.0)
    # failed loads left the fresh scheduler empty and usable
    assert fresh.requests() == [] and fresh.epoch == 0


def test_submit_with_a_malformed_item_keeps_what_came_before_it():
    """Requests are enqueued one by one: an item that fails part way leaves the earlier ones
    queued and counted, and its id used up (so ids are never reused)."""
    sched = RequestScheduler()
    with pytest.raises(ValueError):
        sched.submit(E, 0, [(1, 1, 0), (2, 2, 0), ("x", 3, 0), (4, 4, 0)], weight_version=0, params={"a": 1}, now=1.0)
    with pytest.raises(TypeError):
        sched.submit(R, 1, iter([(1, 1, 0), None]), weight_version=0, params=None, now=1.0)
    assert [r.request_id for r in sched.requests()] == ["e0-0", "e0-1", "r1-0"]
    assert sched.num_ready() == sched.num_outstanding() == 3 and sched.num_ready(kind=R) == 1
    assert sched.submit(E, 0, [(5, 5, 0)], weight_version=0, params={"a": 1}, now=2.0) == ["e0-3"]
    assert [l.request_id for l in sched.pull("w", is_spot=True, max_requests=10, now=3.0)] == ["r1-0"]
    assert [l.request_id for l in sched.pull("w", is_spot=True, max_requests=10, now=3.0)] == ["e0-0", "e0-1", "e0-3"]


def test_load_of_a_snapshot_that_parked_in_aborted_restores_parked():
    """Snapshots written before PARKED existed kept parked requests in ABORTED."""
    sched, state, rids, *_ = _busy_scheduler()
    for r in state["requests"]:
        if r["request_id"] == rids[2]:
            r["status"] = "aborted"
            r["history"] = r["history"][:-1]
            del r["error"]
    fresh = make(max_failures=1)
    fresh.load_state_dict(state, epoch=1, now=50.0)
    assert fresh.get(rids[2]).status is S.PARKED and fresh.get(rids[2]).history[-1][1] == 50.0
    assert fresh.num_outstanding() == 4


def test_fail_that_is_not_the_requests_fault_never_parks():
    """A worker that was stopped (or whose process died) gives its leases back with
    counts=False: re-enqueued every time, failures and error untouched."""
    sched = make(max_failures=1)
    (rid,) = submit(sched)
    for k in range(5):
        (l,) = sched.pull("w", is_spot=True, max_requests=1, now=float(k))
        assert sched.fail(rid, l.lease_id, reason="worker stopping", now=float(k), counts=False)
    req = sched.get(rid)
    assert req.status is S.PENDING and req.failures == 0 and req.error == ""


def test_a_batch_that_raised_is_rerun_one_by_one_so_only_the_culprit_is_parked():
    """Every request of a batch that raised counts a failure; its requests then run alone, so
    its innocent members complete and only the request that makes workers fail is parked."""
    sched = make(max_failures=3)
    ids = submit(sched, n=6)
    bad = ids[2]
    batch = sched.pull("w0", is_spot=True, max_requests=4, now=0.0)
    assert [l.request_id for l in batch] == ids[:4]
    for l in batch:
        sched.fail(l.request_id, l.lease_id, reason="RuntimeError: boom", now=0.0)
    k = 1
    while True:
        got = sched.pull(f"w{k % 3}", is_spot=True, max_requests=4, now=float(k))
        if not got:
            break
        if any(l.request_id == bad for l in got):
            assert len(got) == 1
            sched.fail(bad, got[0].lease_id, reason="RuntimeError: boom", now=float(k))
        else:
            for l in got:
                sched.complete(l.request_id, l.lease_id, float(k))
        k += 1
    st = {r: sched.get(r).status for r in ids}
    assert st == {r: (S.PARKED if r == bad else S.DONE) for r in ids}


def test_one_broken_worker_does_not_park_what_it_fails_on():
    """max_failures counts distinct workers: a request one worker fails on again and again runs
    on another; only 2 * max_failures failures park it without that many workers."""
    sched = make(max_failures=3)
    (a, b) = submit(sched, n=2)
    for k in range(5):
        (l,) = sched.pull("broken", is_spot=True, max_requests=1, now=float(k))
        assert l.request_id == a
        sched.fail(a, l.lease_id, reason="CUDA error", now=float(k))
    assert sched.get(a).status is S.PENDING and sched.get(a).failed_on == ["broken"]
    (l,) = sched.pull("good", is_spot=True, max_requests=1, now=9.0)
    assert l.request_id == a and sched.complete(a, l.lease_id, 9.5)
    for k in range(6):  # a run with one worker: the loop still ends, at 2 * max_failures
        (l,) = sched.pull("only", is_spot=True, max_requests=1, now=10.0 + k)
        sched.fail(b, l.lease_id, reason="boom", now=10.0 + k)
    assert sched.get(b).status is S.PARKED and sched.get(b).failures == 6


def test_committed_states_no_request_resumes_from_are_released():
    """Was: only a request that finished had its committed state deleted (by the control plane,
    under the request's last key); a state superseded by a later commit, or left by a request
    that was cancelled, parked or aborted, stayed in the Tensor Store for good."""
    sched = make(max_failures=1)
    a, b, c, d = submit(sched, n=4)
    for lease in sched.pull("w", is_spot=True, max_requests=4, now=0.0):
        sched.commit(lease.request_id, lease.lease_id, committed_step=2, commit_key=f"{lease.request_id}.L1", now=1.0)
    assert sched.take_released_commits() == [] and sched.commit_keys() == {f"{r}.L1" for r in (a, b, c, d)}
    la, lb, lc, ld = sched.pull("v", is_spot=True, max_requests=4, now=2.0)
    assert sched.commit(a, la.lease_id, committed_step=5, commit_key=f"{a}.L2", now=3.0)
    assert sched.take_released_commits() == [f"{a}.L1"]  # superseded by the later commit
    assert sched.complete(b, lb.lease_id, now=3.0)
    assert sched.fail(c, lc.lease_id, reason="oom", now=3.0)  # parked: max_failures 1
    assert sched.get(c).status is S.PARKED
    assert sched.release_worker("v", reason="preempted", now=3.0) == [d]  # aborted: re-runs from 0
    assert sched.take_released_commits() == [f"{b}.L1", f"{c}.L1", f"{d}.L1"]
    assert sched.commit_keys() == {f"{a}.L2"}
    sched.cancel(iteration=0, now=4.0)
    assert sched.take_released_commits() == [f"{a}.L2"] and sched.commit_keys() == set()
    assert sched.take_released_commits() == []
