"""The indexed Request Scheduler against the old linear-scan one.

``LinearScan`` below is the previous implementation of every method the indexes
changed (``pull``, ``expire``, ``renew``, ``cancel``, ``requests``, ``num_outstanding``,
``forget``), written over ``_requests`` and the in-flight dicts the old code had, so it
ignores the new indexes; its ``pull`` leases through ``_transition``, the new one inline.
Both schedulers run the same seeded random operations in lockstep; every return value
(the leases of every pull: same request ids in the same order) and, periodically, the
whole ``state_dict`` (statuses, histories, leases) must be identical.
"""

import dataclasses
import json
import random

import pytest

import spotlight.core.request_scheduler as rs
from spotlight.core.request_scheduler import Lease, RequestKind, RequestScheduler, RequestStatus

S = RequestStatus
R, E = RequestKind.ROLLOUT, RequestKind.EXPLORE
READY = (S.PENDING, S.RECOMPUTE)


class LinearScan(RequestScheduler):
    """The old algorithms (git history: ``spotlight/core/request_scheduler.py`` before its ready queue was indexed)."""

    def pull(self, worker_id, *, is_spot, max_requests, now):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        prio = lambda r: 0 if r.status is S.RECOMPUTE else 1 if r.kind is R else 2  # noqa: E731
        ready = sorted((r for r in self._requests.values() if r.status in READY), key=lambda r: (prio(r), r.seq))
        explore_ok = is_spot or not self._training_active
        picked, key = [], None
        for req in ready:
            if req.kind is E and not explore_ok:
                continue
            if key is None:
                key = req.batch_key
            elif req.batch_key != key:
                continue
            picked.append(req)
            if len(picked) == max_requests or picked[0].failures:  # a suspect is leased alone
                break
        leases = []
        for req in picked:
            lease = Lease(
                self._next_lease_id,
                req.request_id,
                worker_id,
                now,
                now + self.lease_timeout_s,
                req.committed_step,
                req.commit_key,
            )
            self._next_lease_id += 1
            detail = f"leased to {worker_id} (lease {lease.lease_id})"
            if lease.resume_step is not None:
                detail += f", resume from step {lease.resume_step}"
            self._transition(req, S.IN_FLIGHT, now, detail, lease=lease)
            leases.append(lease)
        return leases

    def renew(self, worker_id, now):
        rids = self._by_worker.get(worker_id, {})
        for rid in rids:
            req = self._in_flight[rid]
            req.lease = dataclasses.replace(req.lease, expires_at=now + self.lease_timeout_s)
        return len(rids)

    def expire(self, now):
        expired = [r for r in self._in_flight.values() if r.lease.expires_at <= now]
        for req in expired:
            self._abort(req, now, f"lease {req.lease.lease_id} of {req.worker_id} expired", requeue=True)
        return [r.request_id for r in expired]

    def cancel(self, *, iteration, kind=None, now, reason="cancelled"):
        hit = [
            r
            for r in self._requests.values()
            if r.iteration == iteration and (kind is None or r.kind is kind) and not r.status.is_terminal()
        ]
        for req in hit:
            self._transition(req, S.CANCELLED, now, reason)
        return [r.request_id for r in hit]

    def requests(self, *, iteration=None, kind=None, status=None):
        return [
            r
            for r in self._requests.values()
            if (iteration is None or r.iteration == iteration)
            and (kind is None or r.kind is kind)
            and (status is None or r.status is status)
        ]

    def num_outstanding(self, *, kind=None):
        return sum(
            1 for r in self._requests.values() if not r.status.is_terminal() and (kind is None or r.kind is kind)
        )

    def forget(self, *, before_iteration):
        drop = [rid for rid, r in self._requests.items() if r.iteration < before_iteration and r.status.is_terminal()]
        for rid in drop:
            r = self._requests.pop(rid)
            self._forgotten[(r.kind, r.status)] = self._forgotten.get((r.kind, r.status), 0) + 1
        return len(drop)


# Equal-as-dicts params in different spellings must batch together; unequal ones must not.
PARAMS = [
    None,
    {},
    {"s": 1},
    {"s": 1.0},
    {"s": True},
    {"s": 2},
    {"a": [1, 2], "b": "x"},
    {"b": "x", "a": [1, 2]},
    {"a": [1, 2, 3], "b": "x"},
    {"a": [[1], {"z": 1, "y": [None]}]},
    {"a": [[1], {"y": [None], "z": 1}]},
    {"a": [[1], {"z": 1}]},
]
WORKERS = ["s0", "s1", "r0", "r1", "x"]


def check_indexes(s: RequestScheduler) -> None:
    """The new scheduler's indexes agree with its requests (internal invariants)."""
    ready = {r.request_id for r in s._requests.values() if r.status in READY}
    assert {r.request_id for r in s._ready.values()} == ready == set(s._ready_at)
    assert set(s._keys) == {rid for rid, r in s._requests.items() if not r.status.is_terminal()}
    for key, b in s._buckets.items():
        codes = list(b.fifo) + b.late
        assert b.key == key and b.live == sum(1 for c in codes if c in s._ready) > 0
        assert all(x < y for x, y in zip(b.fifo, list(b.fifo)[1:]))  # fifo increasing
        assert all(part[0] in s._ready for part in (b.fifo, b.late) if part)  # fronts current
        assert b.top() == min(c for c in codes if c in s._ready) and b.top() in s._heads[b.head]  # published
        assert all(s._ready_at[s._ready[c].request_id][1] is b for c in codes if c in s._ready)
    assert s._num_buckets == [sum(1 for b in s._buckets.values() if b.head == i) for i in (0, 1)]
    for code, req in s._ready.items():
        prio = 0 if req.status is S.RECOMPUTE else 1 if req.kind is R else 2
        assert code == prio << rs._SEQ_BITS | req.seq
    due = {(t, lease.request_id) for t, _, leases in s._expiry for lease in leases}
    assert all((r.lease.expires_at, rid) in due for rid, r in s._in_flight.items())  # expire will see it
    assert s._expiry_ids == sum(len(leases) for _, _, leases in s._expiry)
    assert {rid for rid, r in s._requests.items() if r.status is S.IN_FLIGHT} == set(s._in_flight)
    for it, ids in s._by_iter.items():
        assert all(s._requests[rid].iteration == it for rid in ids)
    assert sum(map(len, s._by_iter.values())) == len(s._requests)
    for k in (R, E):
        assert s._outstanding_kind[k] == sum(
            1 for r in s._requests.values() if r.kind is k and not r.status.is_terminal()
        )


def run_lockstep(seed: int, steps: int) -> dict:
    rng = random.Random(seed)
    new, ref = RequestScheduler(lease_timeout_s=5.0), LinearScan(lease_timeout_s=5.0)
    issued: list[Lease] = []  # every lease ever granted (most go stale)
    stats = dict(pulls=0, leased=0, multi=0, gated=0, resumed=0, skipped=0)
    now, epoch = 0.0, 0

    def pick() -> Lease:  # mostly a recent lease (likely current), sometimes any (likely stale)
        return rng.choice(issued[-30:] if rng.random() < 0.8 else issued)

    def both(name, *args, **kw):
        a, b = getattr(new, name)(*args, **kw), getattr(ref, name)(*args, **kw)
        assert a == b, (seed, step, name, args, kw, a, b)
        return a

    for step in range(steps):
        now += rng.choice([0.0, 0.1, 0.5, 1.0, 2.0])
        op = rng.random()
        if op < 0.16:
            kind = rng.choice([R, E])
            items = [(rng.randrange(8), rng.randrange(100), rng.randrange(3)) for _ in range(rng.randint(1, 6))]
            both(
                "submit",
                kind,
                rng.randrange(4),
                items,
                weight_version=rng.randrange(2),
                params=rng.choice(PARAMS),
                now=now,
            )
        elif op < 0.45:
            w, spot, m = rng.choice(WORKERS), rng.random() < 0.5, rng.randint(1, 9)
            ready_e = sum(1 for r in ref._requests.values() if r.status in READY and r.kind is E)
            eligible = [
                r.request_id
                for r in sorted(
                    (
                        r
                        for r in ref._requests.values()
                        if r.status in READY and (spot or not ref.training_active or r.kind is R)
                    ),
                    key=lambda r: (0 if r.status is S.RECOMPUTE else 1 if r.kind is R else 2, r.seq),
                )
            ]
            got = both("pull", w, is_spot=spot, max_requests=m, now=now)  # equal leases, so equal ids in order
            stats["pulls"] += 1
            stats["skipped"] += [l.request_id for l in got] != eligible[: len(got)]  # fill skipped other keys
            stats["leased"] += len(got)
            stats["multi"] += len(got) > 1
            stats["gated"] += ready_e > 0 and not spot and new.training_active
            stats["resumed"] += any(l.resume_step is not None for l in got)
            issued += got
        elif op < 0.62 and issued:
            l = pick()
            wid = rng.choice([None, l.worker_id, l.worker_id, rng.choice(WORKERS)])
            both("complete", l.request_id, l.lease_id, now, worker_id=wid)
        elif op < 0.70 and issued:
            l = pick()
            both(
                "commit",
                l.request_id,
                l.lease_id,
                committed_step=rng.randrange(10),
                commit_key=f"k{step}",
                now=now,
                worker_id=rng.choice([None, l.worker_id]),
            )
        elif op < 0.75 and issued:
            l = pick()
            both("fail", l.request_id, l.lease_id, reason="boom", now=now, worker_id=rng.choice([None, l.worker_id]))
        elif op < 0.81:
            both("renew", rng.choice(WORKERS), now)
        elif op < 0.86:
            both("expire", now)
        elif op < 0.89:
            both("release_worker", rng.choice(WORKERS), reason="gone", now=now)
        elif op < 0.92:
            both("cancel", iteration=rng.randrange(4), kind=rng.choice([None, R, E]), now=now, reason="over")
        elif op < 0.96:
            new.set_training_active(not new.training_active)
            ref.set_training_active(new.training_active)
        elif op < 0.975:
            both("forget", before_iteration=rng.randrange(3))
        elif op < 0.979:  # coordinator crash and resume, through JSON
            epoch += 1
            st = json.loads(json.dumps(new.state_dict()))
            assert st == json.loads(json.dumps(ref.state_dict()))
            new, ref = RequestScheduler(lease_timeout_s=5.0), LinearScan(lease_timeout_s=5.0)
            both("load_state_dict", st, epoch=epoch, now=now)
        else:
            for it in range(4):
                for k in (R, E):
                    both("is_finished", iteration=it, kind=k)
                    both("counts", iteration=it, kind=k)
                both("requests", iteration=it, status=rng.choice(list(S)))
            both("num_outstanding", kind=rng.choice([None, R, E]))
            for w in WORKERS:
                both("leases", w)
        if step % 50 == 0:
            check_indexes(new)
        if step % 500 == 0:
            assert new.state_dict() == ref.state_dict()
    # Drain: training over, everything expires and is pulled to the end, still in lockstep.
    new.set_training_active(False)
    ref.set_training_active(False)
    while True:
        now += 100.0
        both("expire", now)
        got = both("pull", "drain", is_spot=False, max_requests=8, now=now)
        if not got:
            break
        for l in got:
            assert both("complete", l.request_id, l.lease_id, now)
    assert new.state_dict() == ref.state_dict()
    check_indexes(new)
    assert not new._ready and not new._buckets and not new._in_flight
    return stats


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pulls_match_the_linear_scan(seed):
    stats = run_lockstep(seed, 3000)
    # The run exercised what the indexes must get right.
    assert stats["pulls"] > 500 and stats["leased"] > 1000
    assert stats["multi"] > 100  # batch fill by key
    assert stats["gated"] > 20  # reserved pulls while exploration is queued and training runs
    assert stats["resumed"] > 10  # RECOMPUTE first, with its commit
    assert stats["skipped"] > 50  # batches that are not a prefix of the eligible order


@pytest.mark.parametrize("seed", [10, 11])
def test_pulls_match_with_constant_compaction(seed, monkeypatch):
    """Compact the heaps at every chance, so the compaction paths run all the time."""
    monkeypatch.setattr(rs, "_COMPACT_SLACK", 0)
    run_lockstep(seed, 1500)


def test_freeze_equal_iff_equal():
    values = [p for p in PARAMS if p is not None] + [
        [1, 2],
        (1, 2),
        {1, 2},
        frozenset({1, 2}),
        {"a": (1, 2)},
        {"a": [1, 2]},
        "x",
        1,
        1.0,
        True,
        0,
        False,
        None,
        {"a": {"b": [1, {"c": 2}]}},
        {"a": {"b": [1, {"c": 2.0}]}},
        {"a": {"b": [1, {"c": 3}]}},
    ]
    for a in values:
        for b in values:
            assert (rs._freeze(a) == rs._freeze(b)) == (a == b), (a, b)
            if a == b:
                assert hash(rs._freeze(a)) == hash(rs._freeze(b))
    with pytest.raises(TypeError):
        rs._freeze({"a": bytearray(b"x")})
    sched = RequestScheduler()
    with pytest.raises(TypeError):
        sched.submit(R, 0, [(0, 0, 0)], weight_version=0, params={"a": bytearray(b"x")}, now=0.0)
    assert sched.requests() == []  # nothing was enqueued


def test_pull_leases_are_real_leases():
    sched = RequestScheduler(lease_timeout_s=3.0)
    (rid,) = sched.submit(R, 0, [(0, 0, 0)], weight_version=0, params=None, now=0.0)
    (lease,) = sched.pull("w", is_spot=False, max_requests=1, now=1.0)
    assert lease == Lease(1, rid, "w", 1.0, 4.0, None, None) and type(lease) is Lease
    assert hash(lease) == hash(Lease(**dataclasses.asdict(lease)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.expires_at = 9.0
    assert dataclasses.replace(lease, expires_at=9.0).expires_at == 9.0


def test_pull_does_not_scan_ineligible_work():
    """Reserved pulls during training with 50,000 explorations queued get the rollouts and
    nothing else (speed is measured side by side in benchmarks/scheduler_pulls.py, not here)."""
    sched = RequestScheduler()
    sched.submit(E, 1, [(i, i, 0) for i in range(50_000)], weight_version=0, params={"steps": [1, 2]}, now=0.0)
    sched.set_training_active(True)
    for i in range(2000):
        sched.submit(R, 2, [(i, i, 0)], weight_version=1, params=None, now=1.0)
        (lease,) = sched.pull("reserved", is_spot=False, max_requests=8, now=1.0)
        assert lease.request_id.startswith("r")
        assert sched.pull("reserved", is_spot=False, max_requests=8, now=1.0) == []
        sched.complete(lease.request_id, lease.lease_id, 1.0)
    assert len(sched.pull("spot", is_spot=True, max_requests=8, now=2.0)) == 8


def test_lazy_heaps_stay_bounded():
    """Stale heap entries are compacted away even where nothing ever pops them: exploration
    submitted and cancelled every iteration while only a reserved worker pulls during
    training, and a worker that heartbeats often while ``expire`` never runs."""
    sched = RequestScheduler(lease_timeout_s=5.0)
    sched.set_training_active(True)
    now = 0.0
    for it in range(400):
        sched.submit(E, it, [(i, i, 0) for i in range(10)], weight_version=0, params={"p": it % 3}, now=now)
        sched.submit(R, it, [(i, i, 0) for i in range(4)], weight_version=0, params=None, now=now)
        held = sched.pull("res", is_spot=False, max_requests=8, now=now)
        assert [l.request_id[0] for l in held] == ["r"] * 4
        for _ in range(10):
            now += 0.1
            assert sched.renew("res", now) == 4
        for l in held:
            assert sched.complete(l.request_id, l.lease_id, now)
        assert sched.cancel(iteration=it, kind=E, now=now) != []
        sched.forget(before_iteration=it)
        assert len(sched._heads[1]) <= 2 * 1 + rs._COMPACT_SLACK + 1  # at most one live bucket at a push
        assert sched._expiry_ids <= 2 * 4 + rs._COMPACT_SLACK + 4
    assert sched.num_outstanding() == 0 and not sched._buckets and not sched._ready
    assert len(sched._requests) <= 14 * 2
