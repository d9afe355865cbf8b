"""Preemption-aware, pull-based Request Scheduler (paper §4.5, §5; docs/architecture.md §4).

Owns every rollout and exploration request of the run, from submission until it
is Done or Cancelled, and decides which requests a Rollout Worker gets when it
asks for work. It never pushes work: a worker that does not pull gets nothing.

State kept (all in memory, all in this object):

- one ``Request`` per request id, with its status, a timestamped history
  ``[(status, now, detail), ...]`` (latency metrics and the status view read
  it), its current ``Lease`` if in flight, and the Tensor Store commit it
  resumes from if a worker committed it before preemption;
- a ready queue ordered by priority then submission order: RECOMPUTE requests
  first, then PENDING rollouts, then PENDING explorations. A ready request is
  the int code ``priority << 48 | seq`` (smaller is served first) in the bucket
  of its batch key (kind, iteration, weight_version, params): a FIFO of codes
  that came in increasing order plus a min-heap of the ones that came late
  (re-enqueued, RECOMPUTE). Two global heaps, one for ROLLOUT-kind and one for
  EXPLORE-kind keys, hold (at least) the smallest code of every bucket and find
  the head of the queue. A code is current while it is in ``_ready``; others
  are stale and skipped when they surface (lazy deletion; a structure more than
  half stale is compacted). A pull costs O(batch * log n) amortized (O(batch)
  for requests leased in submission order), however long the queue and however
  many queued requests the puller may not take;
- the in-flight leases, indexed by worker and by expiry time (a heap, so
  ``expire`` looks only at leases that fell due), each with an expiry time
  that the worker's heartbeats (``renew``) push forward;
- the request ids of each iteration (``requests``/``counts``/``cancel``/``forget``
  by iteration touch only that iteration's requests).

Request lifecycle (``VALID_TRANSITIONS`` below is the single source of truth)::

    PENDING --pull--> IN_FLIGHT --complete--> DONE
       ^                 |  \\--commit--> RECOMPUTE --pull--> IN_FLIGHT (resume)
       |                 |--fail / expire / release_worker--> ABORTED --(max_failures fail()s)--> PARKED
       +-----------re-enqueue (full re-execution)-------------/
    any non-terminal --cancel--> CANCELLED

PARKED is terminal: a request that ``max_failures`` workers gave back with an error is
not run again (it would make every worker fail in turn, forever); it keeps its last error
(``Request.error``) and its last worker for the shell to report.

Who calls it: the coordinator's ZeroMQ shell, single-threaded. It forwards
worker pulls, results, commits, failures and heartbeats, calls ``expire(now)``
on a timer, ``release_worker`` when the Instance Manager learns that a worker or
its agent died, ``set_training_active`` around each training step (exploration
goes only to spot workers while training runs, docs/architecture.md §3-§4), and ``cancel`` /
``forget`` at iteration boundaries. This module is pure logic: no sockets,
threads, clocks or torch; every method that needs time takes ``now`` (seconds,
any monotonic origin, as long as the caller is consistent).

"Done exactly once" (docs/architecture.md §3): a result is accepted only with the request's
current lease id (and, when the caller passes ``worker_id``, only from the
worker holding that lease). A presumed-dead worker that reports late holds a
stale lease and is rejected, so each request is counted Done at most once;
every non-cancelled request is re-enqueued until someone completes it.

Coordinator crash and resume: ``state_dict()`` is a JSON-able snapshot taken
between iterations; ``load_state_dict(d, epoch=k, now=...)`` restores it in a
new process whose restart count is ``k``. Every lease of the dead process is
void: requests IN_FLIGHT in the snapshot go IN_FLIGHT -> ABORTED -> PENDING.
Lease ids are partitioned by epoch (``k * LEASE_EPOCH_STRIDE`` upwards), so
no lease id the crashed process issued -- even after the snapshot -- can be
issued again, and its late reports are rejected as stale.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush, heapreplace
from typing import Any, Iterable

from spotlight.errors import SpotlightError

__all__ = [
    "LEASE_EPOCH_STRIDE",
    "InvalidTransition",
    "Lease",
    "Request",
    "RequestKind",
    "RequestScheduler",
    "RequestStatus",
    "VALID_TRANSITIONS",
]


class InvalidTransition(SpotlightError):
    """A request was asked to move along an edge not in ``VALID_TRANSITIONS``."""


class RequestKind(str, enum.Enum):
    ROLLOUT = "rollout"  # on-policy samples for the GRPO update (weights v_n, full fidelity)
    EXPLORE = "explore"  # candidate seeds scored with stale weights; never trained on


class RequestStatus(str, enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    RECOMPUTE = "recompute"
    ABORTED = "aborted"
    DONE = "done"
    CANCELLED = "cancelled"
    PARKED = "parked"  # given back with an error by max_failures workers: never run again

    def is_terminal(self) -> bool:
        """True for DONE, CANCELLED and PARKED: no outgoing edges."""
        return self is _DONE or self is _CANCELLED or self is _PARKED


_S = RequestStatus
VALID_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.PENDING: frozenset(
        {
            _S.IN_FLIGHT,  # a worker pulled it: lease granted
            _S.CANCELLED,  # its iteration/phase was cancelled
        }
    ),
    _S.IN_FLIGHT: frozenset(
        {
            _S.DONE,  # the current leaseholder returned a result
            _S.RECOMPUTE,  # worker committed in-flight state to the Tensor Store before preemption
            _S.ABORTED,  # lease expired / worker or agent died / worker reported failure; nothing committed
            _S.CANCELLED,  # its iteration/phase was cancelled while running
        }
    ),
    _S.RECOMPUTE: frozenset(
        {
            _S.IN_FLIGHT,  # leased again; resumes from the committed step on another worker
            _S.CANCELLED,  # its iteration/phase was cancelled before anyone resumed it
        }
    ),
    _S.ABORTED: frozenset(
        {
            _S.PENDING,  # re-enqueued for full re-execution
            _S.PARKED,  # its max_failures-th reported failure: it makes workers fail, not run again
        }
    ),
    _S.DONE: frozenset(),  # terminal
    _S.CANCELLED: frozenset(),  # terminal
    _S.PARKED: frozenset(),  # terminal
}
del _S

LEASE_EPOCH_STRIDE = 2**40
"""Lease ids of a process restored with ``epoch=k`` start at ``k * LEASE_EPOCH_STRIDE``
(the first process, epoch 0, starts at 1). One process would need 2**40 leases to
spill into the next epoch's range; ids stay below 2**63 for epochs < 2**23."""

_STATE_VERSION = 1

# Ready-queue priority classes (lower is served first), paper §4.5: resuming
# committed work first wastes the least, and rollouts are on the critical path.
_PRIO_RECOMPUTE, _PRIO_ROLLOUT, _PRIO_EXPLORE = 0, 1, 2

# A heap is compacted (its stale entries dropped) once it holds more than
# 2 * live + _COMPACT_SLACK entries, so stale entries cost O(1) amortized each.
_COMPACT_SLACK = 64

# Tags of frozen containers in batch keys (see ``_freeze``); unique objects, so a
# frozen list never equals a frozen tuple, set or dict, nor any user value.
_LIST, _TUPLE, _DICT, _SET = (object() for _ in range(4))
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _freeze(v: Any) -> Any:
    """A hashable stand-in for ``v`` with ``_freeze(a) == _freeze(b)`` iff ``a == b``.

    Dicts become tagged frozensets of items (key order does not matter, as for
    ``dict ==``), lists and tuples tagged tuples, sets tagged frozensets; other
    values (JSON scalars) are kept, so ``1``, ``1.0`` and ``True`` stay equal as
    they are in ``params == params``.

    Raises:
        TypeError: a value that is neither hashable nor one of those containers.
    """
    if type(v) in _SCALARS:
        return v
    if isinstance(v, dict):
        return (_DICT, frozenset([(k, _freeze(x)) for k, x in v.items()]))
    if isinstance(v, list):
        return (_LIST, tuple([_freeze(x) for x in v]))
    if isinstance(v, tuple):
        return (_TUPLE, tuple([_freeze(x) for x in v]))
    if isinstance(v, (set, frozenset)):
        return (_SET, frozenset([_freeze(x) for x in v]))
    hash(v)  # TypeError for anything else unhashable
    return v


# Ready-queue code of a request: ``priority << _SEQ_BITS | seq``; ints compare
# (and so heaps sift) several times faster than (priority, seq, id) tuples.
_SEQ_BITS = 48  # room for 2.8e14 submissions

# Module-level aliases of the enum members used on hot paths: ``RequestKind.X`` looks X up
# through the enum metaclass's ``__getattr__`` hook, many times slower than a global.
_ROLLOUT, _EXPLORE = RequestKind.ROLLOUT, RequestKind.EXPLORE
_PENDING, _IN_FLIGHT, _RECOMPUTE = RequestStatus.PENDING, RequestStatus.IN_FLIGHT, RequestStatus.RECOMPUTE
_ABORTED, _DONE, _CANCELLED = RequestStatus.ABORTED, RequestStatus.DONE, RequestStatus.CANCELLED
_PARKED = RequestStatus.PARKED
# ``pull`` moves ready requests to IN_FLIGHT and ``complete`` moves IN_FLIGHT requests to
# DONE inline (not through ``_transition``).
assert all(_IN_FLIGHT in VALID_TRANSITIONS[s] for s in (RequestStatus.PENDING, RequestStatus.RECOMPUTE))
assert _DONE in VALID_TRANSITIONS[_IN_FLIGHT]


class _Bucket:
    """The ready requests of one batch key, as their codes in two parts.

    ``fifo`` is a deque of increasing codes: requests enqueued in submission
    order, the common case, cost O(1) to add and to take. ``late`` is a min-heap
    of the codes that arrived smaller than ``fifo[-1]`` (requests re-enqueued
    after a failure or expiry, RECOMPUTE requests): O(log n). The bucket's
    smallest code is the smaller of the two fronts.

    ``live`` counts the current codes (those in ``RequestScheduler._ready``);
    the rest are stale. Invariant: while ``live > 0`` each non-empty part's
    front is current, and the global heap ``head`` (0 ROLLOUT, 1 EXPLORE)
    holds the smallest (``top()``).
    """

    __slots__ = ("key", "head", "fifo", "late", "live")

    def __init__(self, key: tuple, head: int):
        self.key = key  # (kind, iteration, weight_version, _freeze(params))
        self.head = head
        self.fifo: deque[int] = deque()
        self.late: list[int] = []
        self.live = 0

    def top(self) -> int:
        """The smallest code (current, by the invariant). Needs ``live > 0``."""
        fifo, late = self.fifo, self.late
        if late and (not fifo or late[0] < fifo[0]):
            return late[0]
        return fifo[0]

    def drop_stale_fronts(self, ready: dict[int, Request]) -> None:
        """Pop stale codes off both fronts (restores the invariant after a front was taken)."""
        fifo, late = self.fifo, self.late
        while fifo and fifo[0] not in ready:
            fifo.popleft()
        while late and late[0] not in ready:
            heappop(late)


@dataclass(frozen=True)
class Lease:
    """The right of one worker to run one request until ``expires_at`` (seconds)."""

    lease_id: int  # unique, strictly increasing across the scheduler
    request_id: str
    worker_id: str
    granted_at: float
    expires_at: float
    resume_step: int | None  # committed denoising step to resume from, else None
    commit_key: str | None  # Tensor Store key of the committed state, else None


MAX_ABORTED_KEPT = 100_000
"""Aborted leases :meth:`RequestScheduler.take_aborted` keeps between two calls."""


@dataclass(frozen=True)
class AbortedLease:
    """A lease that ended without a result or a commit (its worker failed, was released or
    went silent): the request re-runs from step 0."""

    resume_step: int  # denoising steps committed before this lease, now discarded (0 if none)
    granted_at: float  # when the lease was granted (the scheduler's clock, seconds)
    ended_at: float  # the worker's last sign of life: the abort, or the lease's last renewal if earlier (same clock)


def lost_steps(aborted: Iterable[AbortedLease], *, step_wall_s: float | None, total_steps: int) -> float:
    """Denoising steps (summed over sequences) lost with ``aborted`` leases: for each, the
    committed steps its abort discards (exact) plus an estimate of the steps the lease ran,
    ``(ended_at - granted_at) / step_wall_s``, the whole at most ``total_steps`` (a
    request's step count). The coordinator does not see in-flight progress, so the second
    part is an estimate from the last observed wall seconds per denoising step of a batch
    (``step_wall_s``; ``None`` before any result: only the discarded commits count).
    Source: paper §4.5 (full re-execution after a worker dies without committing)."""
    total = 0.0
    for a in aborted:
        ran = (a.ended_at - a.granted_at) / step_wall_s if step_wall_s and step_wall_s > 0 else 0.0
        total += min(float(total_steps), a.resume_step + max(0.0, ran))
    return total


# ``pull`` builds leases as ``_object_new(Lease)`` plus one ``_object_setattr(lease,
# "__dict__", {...all 7 fields...})``: an object equal to ``Lease(...)``, about twice
# as fast as the frozen dataclass ``__init__`` (one ``object.__setattr__`` per field).
_object_new, _object_setattr = object.__new__, object.__setattr__
_LEASE_FIELDS = dict.fromkeys(f.name for f in dataclasses.fields(Lease))  # all None, in field order


@dataclass
class Request:
    request_id: str
    kind: RequestKind
    iteration: int  # the training iteration this request belongs to
    prompt_index: int
    seed: int
    weight_version: int  # the policy version it must run with
    params: dict  # opaque sampler params; requests pulled together have equal params
    group: int = 0  # index of the prompt group within the iteration
    status: RequestStatus = RequestStatus.PENDING
    history: list[tuple[RequestStatus, float, str]] = field(default_factory=list)
    lease: Lease | None = None
    attempts: int = 0  # number of leases granted
    failures: int = 0  # failures reported by workers via fail(counts=True) (expiry/release not counted)
    committed_step: int | None = None  # denoising step index of the committed state
    commit_key: str | None = None  # Tensor Store key of that state
    worker_id: str | None = None  # last/current leaseholder
    seq: int = 0  # submission order across the scheduler (FIFO tie-break)
    error: str = ""  # the reason of the last fail() (a worker's exception line)
    failed_on: list[str] = field(default_factory=list)  # the distinct workers whose fail() counted

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can share one worker batch.

        Not hashable (``params`` is a dict); the scheduler indexes the equivalent
        ``(kind, iteration, weight_version, _freeze(params))``, taken at submit.
        """
        return (self.kind, self.iteration, self.weight_version, self.params)


# ``submit`` constructs requests positionally (faster than keywords) in this order.
_REQUEST_FIELDS = (
    "request_id",
    "kind",
    "iteration",
    "prompt_index",
    "seed",
    "weight_version",
    "params",
    "group",
    "status",
    "history",
    "lease",
    "attempts",
    "failures",
    "committed_step",
    "commit_key",
    "worker_id",
    "seq",
    "error",
    "failed_on",
)
assert tuple(f.name for f in dataclasses.fields(Request)) == _REQUEST_FIELDS


class RequestScheduler:
    """Central request queue that Rollout Workers pull from (paper §4.5).

    Args:
        lease_timeout_s: seconds a lease lives without a ``renew``; a worker
            silent for longer is presumed dead and its requests re-run.
        max_failures: once this many distinct workers reported a ``fail()`` for one
            request (or it failed ``2 * max_failures`` times, for a run with fewer
            workers) it is PARKED (terminal, not re-enqueued), so a request that
            crashes every worker cannot keep the fleet busy failing, while one broken
            worker cannot park the requests it fails on (``cluster.max_request_failures``).
            ``None`` (default) re-enqueues forever. Expiry and worker release
            never count: preemption is not the request's fault.
    """

    def __init__(self, lease_timeout_s: float = 60.0, *, max_failures: int | None = None):
        if not lease_timeout_s > 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {lease_timeout_s}")
        if max_failures is not None and max_failures < 1:
            raise ValueError(f"max_failures must be >= 1 or None, got {max_failures}")
        self.lease_timeout_s = float(lease_timeout_s)
        self.max_failures = max_failures
        self._requests: dict[str, Request] = {}
        self._reset_indexes()
        self._id_counters: dict[tuple[RequestKind, int], int] = {}  # next id number per (kind, iteration)
        self._next_seq = 0
        self._aborted: deque[AbortedLease] = deque(maxlen=MAX_ABORTED_KEPT)
        self._released_commits: deque[str] = deque(maxlen=MAX_ABORTED_KEPT)  # see take_released_commits
        self._next_lease_id = 1
        self._training_active = False
        self.epoch = 0  # restart count of the coordinator process (see load_state_dict)

    def _reset_indexes(self) -> None:
        """Empty every index derived from ``_requests`` (``load_state_dict`` rebuilds them)."""
        # Ready queue (PENDING and RECOMPUTE requests), see the module docstring.
        self._ready: dict[int, Request] = {}  # current code -> request
        self._ready_at: dict[str, tuple[int, _Bucket]] = {}  # request id -> (its code, its bucket)
        self._buckets: dict[tuple, _Bucket] = {}  # hashable batch key -> bucket
        self._heads: tuple[list[int], list[int]] = ([], [])  # codes: [0] ROLLOUT-kind, [1] EXPLORE-kind keys
        self._num_buckets = [0, 0]  # buckets per global heap
        self._keys: dict[str, tuple] = {}  # non-terminal request id -> hashable batch key
        # In flight.
        self._in_flight: dict[str, Request] = {}  # in lease-grant (= lease id) order
        self._by_worker: dict[str, dict[str, None]] = {}  # worker -> ordered set of request ids
        # Heap of (expires_at, tiebreak, leases): "look at these leases' requests at
        # expires_at"; every in-flight request has its current lease's expires_at in one.
        self._expiry: list[tuple[float, int, tuple[Lease, ...]]] = []
        self._expiry_ids = 0  # leases in all entries (current or not)
        self._expiry_tick = 0  # tiebreak, so entries never compare their leases
        # Counts and per-iteration ids.
        # (Plain dicts, not Counters: ``Counter`` defines ``__delitem__`` in Python, which
        # sends every ``c[k] = v`` through a slow generic slot.)
        self._outstanding: dict[tuple[int, RequestKind], int] = {}  # non-terminal counts
        self._outstanding_kind: dict[RequestKind, int] = dict.fromkeys(RequestKind, 0)  # the same, per kind
        self._by_iter: dict[int, dict[str, None]] = {}  # iteration -> ordered set of request ids
        self._forgotten: dict[tuple[RequestKind, RequestStatus], int] = {}  # terminal requests dropped by take_terminal

    # ------------------------------------------------------------------ submit

    def submit(
        self,
        kind: RequestKind,
        iteration: int,
        items: Iterable[tuple[int, int, int]],
        *,
        weight_version: int,
        params: dict | None,
        now: float,
    ) -> list[str]:
        """Enqueue one PENDING request per ``(prompt_index, seed, group)`` item.

        Ids are ``f"{kind.value[0]}{iteration}-{n}"`` with ``n`` counting per
        (kind, iteration) from 0 and never reused. ``params`` is copied. Returns
        the new ids in submission (= FIFO) order. Source: paper §4.5, docs/architecture.md §4.

        Raises:
            ValueError: negative ``iteration`` or ``weight_version``.
            TypeError: a ``params`` value that is unhashable and not a dict, list,
                tuple or set (the batch key must be hashable; JSON values are fine).
        """
        kind = RequestKind(kind)
        if iteration < 0 or weight_version < 0:
            raise ValueError(f"iteration and weight_version must be >= 0, got {iteration}, {weight_version}")
        params = dict(params or {})
        key = (kind, iteration, weight_version, _freeze(params))
        in_iter = self._by_iter.setdefault(iteration, {})
        counter, prefix = (kind, iteration), f"{kind.value[0]}{iteration}-"
        # The ready-queue side of ``_ready_add``, once per call: every request of the call
        # has the same batch key (one bucket) and a larger seq than any code in that bucket,
        # so each code goes to the back of the bucket's FIFO, and only a new bucket
        # publishes a top. Counters are written back in ``finally`` (also when an item
        # raises part way, as the per-item code did).
        bucket = self._buckets.get(key)
        new_bucket = bucket is None
        if new_bucket:
            bucket = _Bucket(key, 0 if kind is _ROLLOUT else 1)
        base = (_PRIO_ROLLOUT if kind is _ROLLOUT else _PRIO_EXPLORE) << _SEQ_BITS
        fifo_append = bucket.fifo.append
        requests, keys, ready, ready_at = self._requests, self._keys, self._ready, self._ready_at
        entry = (_PENDING, now, "submitted")  # immutable: shared by the call's histories
        pending = _PENDING
        n0 = n = self._id_counters.get(counter, 0)
        seq0 = seq = self._next_seq
        ids = []
        try:
            for prompt_index, seed, group in items:
                rid = f"{prefix}{n}"
                n += 1  # the id is used up even if the item's values are malformed (as one at a time)
                # positional, in ``_REQUEST_FIELDS`` order (checked at import)
                req = Request(
                    rid,
                    kind,
                    iteration,
                    int(prompt_index),
                    int(seed),
                    weight_version,
                    params,
                    int(group),
                    pending,
                    [entry],
                    None,
                    0,
                    0,
                    None,
                    None,
                    None,
                    seq,
                )
                requests[rid] = req
                in_iter[rid] = None
                keys[rid] = key
                code = base | seq
                fifo_append(code)
                ready[code] = req
                ready_at[rid] = (code, bucket)
                ids.append(rid)
                seq += 1
        finally:
            if n != n0:
                self._id_counters[counter] = n
            added = seq - seq0
            if added:
                self._next_seq = seq
                okey = (iteration, kind)
                self._outstanding[okey] = self._outstanding.get(okey, 0) + added
                self._outstanding_kind[kind] += added
                bucket.live += added
                if new_bucket:
                    self._buckets[key] = bucket
                    self._num_buckets[bucket.head] += 1
                    self._push_head(bucket.head, base | seq0)
        if not in_iter:
            del self._by_iter[iteration]
        return ids

    # ------------------------------------------------------------- training gate

    @property
    def training_active(self) -> bool:
        """While True, EXPLORE requests go only to spot workers (docs/architecture.md §3-§4)."""
        return self._training_active

    def set_training_active(self, active: bool) -> None:
        """Open (False) or close (True) exploration to reserved workers (paper §4.3.4, docs/architecture.md §4)."""
        self._training_active = bool(active)

    # -------------------------------------------------------------------- pull

    def pull(self, worker_id: str, *, is_spot: bool, max_requests: int, now: float) -> list[Lease]:
        """Lease up to ``max_requests`` requests that one batch can run together.

        Priority: RECOMPUTE (any kind), then PENDING ROLLOUT, then PENDING
        EXPLORE, each FIFO by submission. EXPLORE requests are eligible only for
        spot workers while ``training_active``. The first eligible request fixes
        the batch key (kind, iteration, weight_version, params); the rest are
        filled from eligible requests with that key in the same order. RECOMPUTE
        leases carry ``resume_step`` / ``commit_key``. Each lease expires at
        ``now + lease_timeout_s`` (seconds). Returns ``[]`` when nothing is
        eligible. A head request that failed before (``failures > 0``) is leased
        alone: the requests of a batch that raised all count a failure, and
        re-running them one by one (they keep their places, ahead of the rest of
        their key) lets only the one that makes workers fail reach ``max_failures``.
        Source: paper §4.5 (pull-based), docs/architecture.md §4.

        Cost: O(max_requests * log n) amortized for n queued requests, whatever
        their kinds: the head is the smaller top of the ROLLOUT-kind heap and
        (when EXPLORE is eligible) the EXPLORE-kind heap; every request with
        the head's batch key is eligible (the key includes the kind), so the
        batch is the first ``max_requests`` codes of that key's bucket.

        Raises:
            ValueError: ``max_requests < 1``.
        """
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        head = self._head(is_spot)
        if head is None:
            return []
        ready = self._ready
        # Lease the batch: the PENDING/RECOMPUTE -> IN_FLIGHT edge of ``_transition``
        # (and ``_ready_remove``) inlined for speed, with the same index and history
        # updates; the bucket's new top and the batch's expiry are recorded once.
        ready_at, requests_in_flight = self._ready_at, self._in_flight
        ready_pop = ready.pop
        bucket = ready_at[ready[head].request_id][1]
        fifo, late = bucket.fifo, bucket.late
        popleft = fifo.popleft
        held = self._by_worker.get(worker_id)
        if held is None:
            held = self._by_worker[worker_id] = {}
        expires_at = now + self.lease_timeout_s
        first_id = self._next_lease_id
        leases: list[Lease] = []
        n = bucket.live
        if n > max_requests:
            n = max_requests
        if ready[head].failures:  # a suspect is leased alone, so its failures are its own
            n = 1
        bucket.live -= n
        # Every lease of the batch differs from this one only in lease_id and request_id
        # (and, resuming committed work, resume_step / commit_key): copying a 7-entry dict
        # is cheaper than building one.
        fields = _LEASE_FIELDS.copy()
        fields["worker_id"] = worker_id
        fields["granted_at"] = now
        fields["expires_at"] = expires_at
        copy_fields = fields.copy
        detail_prefix = f"leased to {worker_id} (lease "
        for lease_id in range(first_id, first_id + n):
            # the bucket's smallest current code (stale codes are skipped)
            if late:
                while True:
                    if late and (not fifo or late[0] < fifo[0]):
                        req = ready_pop(heappop(late), None)
                    else:
                        req = ready_pop(popleft(), None)
                    if req is not None:
                        break
            else:
                req = ready_pop(popleft(), None)
                while req is None:
                    req = ready_pop(popleft(), None)
            rid = req.request_id
            del ready_at[rid]
            d = copy_fields()
            d["lease_id"] = lease_id
            d["request_id"] = rid
            step = req.committed_step
            if step is None:
                detail = f"{detail_prefix}{lease_id})"
            else:
                d["resume_step"] = step
                d["commit_key"] = req.commit_key
                detail = f"{detail_prefix}{lease_id}), resume from step {step}"
            lease = _object_new(Lease)  # = Lease(...), see _object_new
            _object_setattr(lease, "__dict__", d)
            req.status = _IN_FLIGHT
            req.lease = lease
            req.worker_id = worker_id
            req.attempts += 1
            requests_in_flight[rid] = req
            held[rid] = None
            req.history.append((_IN_FLIGHT, now, detail))
            leases.append(lease)
        self._next_lease_id = first_id + n
        self._leased_from(bucket, expires_at, leases)
        return leases

    def _head(self, is_spot: bool) -> int | None:
        """The head of the queue for a pull: the smallest current code of the ROLLOUT-kind heap
        and, if EXPLORE is eligible, of the EXPLORE-kind heap (stale tops popped). It is the
        smallest code of all eligible ready requests: every bucket's top is in its global heap
        (``_Bucket`` invariant) and every current code there is >= its bucket's top."""
        ready = self._ready
        heads = self._heads[0]
        while heads and heads[0] not in ready:
            heappop(heads)
        head = heads[0] if heads else None
        if is_spot or not self._training_active:
            heads = self._heads[1]
            while heads and heads[0] not in ready:
                heappop(heads)
            if heads and (head is None or heads[0] < head):
                head = heads[0]
        return head

    def _leased_from(self, bucket: _Bucket, expires_at: float, leases: list[Lease]) -> None:
        """After a batch was leased from ``bucket``: drop the bucket if it is empty, else publish
        its new top; record the batch's expiry."""
        ready, fifo, late = self._ready, bucket.fifo, bucket.late
        if not bucket.live:  # whatever is left in it is stale
            del self._buckets[bucket.key]
            self._num_buckets[bucket.head] -= 1
        else:
            # = bucket.drop_stale_fronts(ready) and bucket.top(), without the calls
            while fifo and fifo[0] not in ready:
                fifo.popleft()
            while late and late[0] not in ready:
                heappop(late)
            top = late[0] if late and (not fifo or late[0] < fifo[0]) else fifo[0]
            # Publish the new top. The head is this bucket's old top and still the top of
            # its global heap (nothing pushed since it was found), now stale: replace it.
            heapreplace(self._heads[bucket.head], top)
        n = len(leases)
        if self._expiry_ids + n <= 2 * len(self._in_flight) + _COMPACT_SLACK:
            self._expiry_tick += 1  # = _push_expiry, without the call
            heappush(self._expiry, (expires_at, self._expiry_tick, tuple(leases)))
            self._expiry_ids += n
        else:
            self._push_expiry(expires_at, tuple(leases))

    def _push_head(self, i: int, code: int) -> None:
        """Publish a bucket's top in global heap ``i``; rebuild it from the tops once mostly stale."""
        heap = self._heads[i]
        heappush(heap, code)
        if len(heap) > 2 * self._num_buckets[i] + _COMPACT_SLACK:
            heap[:] = [b.top() for b in self._buckets.values() if b.head == i]
            heapify(heap)

    # --------------------------------------------------------- worker reports

    def complete(self, request_id: str, lease_id: int, now: float, *, worker_id: str | None = None) -> bool:
        """Mark a request DONE if ``lease_id`` is its current lease.

        Returns False and changes nothing for a stale lease (the request was
        re-leased after expiry, or the lease was issued by a coordinator process
        that crashed), a duplicate completion, a DONE/CANCELLED request, an
        unknown/forgotten id, or -- when ``worker_id`` is given -- a reporter that
        is not the leaseholder: this is how "Done exactly once" holds when a
        presumed-dead worker reports late. ``worker_id=None`` skips the holder
        check. Source: docs/architecture.md §3-§4.
        """
        # = ``_current`` + ``_transition(req, DONE, ...)``, inlined: this runs once per result
        req = self._requests.get(request_id)
        if req is None or req.status is not _IN_FLIGHT:
            return False
        lease = req.lease
        holder = lease.worker_id
        if lease.lease_id != lease_id or (worker_id is not None and holder != worker_id):
            return False
        del self._in_flight[request_id]
        held = self._by_worker[holder]
        del held[request_id]
        if not held:
            del self._by_worker[holder]
        req.lease = None
        req.status = _DONE
        kind = req.kind
        okey = (req.iteration, kind)
        self._outstanding[okey] -= 1
        self._outstanding_kind[kind] -= 1
        del self._keys[request_id]
        if req.commit_key is not None:
            self._release_commit(req)
        req.history.append((_DONE, now, f"done by {req.worker_id} (lease {lease_id})"))
        return True

    def commit(
        self,
        request_id: str,
        lease_id: int,
        *,
        committed_step: int,
        commit_key: str,
        now: float,
        worker_id: str | None = None,
    ) -> bool:
        """IN_FLIGHT -> RECOMPUTE: the leaseholder committed its state before preemption.

        ``committed_step`` is the denoising step index to resume at and
        ``commit_key`` the Tensor Store key; the next lease carries both so
        another worker resumes instead of starting over. Returns False (no
        change) on a stale lease or a ``worker_id`` that does not hold it, like
        ``complete``. Source: paper §4.5.

        Raises:
            ValueError: ``committed_step < 0``.
        """
        if committed_step < 0:
            raise ValueError(f"committed_step must be >= 0, got {committed_step}")
        req = self._current(request_id, lease_id, worker_id)
        if req is None:
            return False
        if req.commit_key != commit_key:  # the state it resumed from is superseded
            self._release_commit(req)
        req.committed_step, req.commit_key = committed_step, commit_key
        self._transition(
            req,
            _RECOMPUTE,
            now,
            f"{req.worker_id} committed step {committed_step} at {commit_key!r}",
        )
        return True

    def commit_lost(self, request_id: str, lease_id: int) -> bool:
        """The committed state that lease ``lease_id`` of ``request_id`` was to resume from cannot
        be read back (lost or damaged on disk): the request forgets its commit and this lease runs
        it from step 0. Returns False (no change) when ``lease_id`` is not the request's current
        lease or it resumes nothing."""
        req = self._current(request_id, lease_id, None)
        if req is None or req.lease.resume_step is None:
            return False
        _object_setattr(req.lease, "resume_step", None)
        _object_setattr(req.lease, "commit_key", None)
        self._release_commit(req)
        return True

    def fail(
        self,
        request_id: str,
        lease_id: int,
        *,
        reason: str,
        now: float,
        worker_id: str | None = None,
        counts: bool = True,
    ) -> bool:
        """The leaseholder reports failure: IN_FLIGHT -> ABORTED -> PENDING.

        Commit info is cleared, so the request re-runs from scratch; ``reason`` is kept as
        ``Request.error``. With ``max_failures`` set, a request that reached it goes
        ABORTED -> PARKED (terminal) instead. ``counts=False``: the leases come back for a
        reason that is not the request's (its worker was stopped or its process died): it is
        re-enqueued and neither ``failures`` nor ``error`` changes. Returns False (no change)
        on a stale lease or a ``worker_id`` that does not hold it. Source: paper §4.5.
        """
        req = self._current(request_id, lease_id, worker_id)
        if req is None:
            return False
        if not counts:
            self._abort(req, now, f"given back by {req.worker_id}: {reason}", requeue=True)
            return True
        req.failures += 1
        req.error = reason
        if req.worker_id not in req.failed_on:
            req.failed_on.append(req.worker_id)
        limit = self.max_failures
        park = limit is not None and (len(req.failed_on) >= limit or req.failures >= 2 * limit)
        self._abort(req, now, f"failed on {req.worker_id}: {reason}", requeue=not park)
        if park:
            detail = f"parked: failed {req.failures} times on {len(req.failed_on)} workers (max_failures)"
            self._transition(req, _PARKED, now, detail)
        return True

    def renew(self, worker_id: str, now: float) -> int:
        """Heartbeat: push every lease of ``worker_id`` to expire at ``now + lease_timeout_s``.

        A lease past its expiry that ``expire`` has not reaped yet is revived
        (the worker is evidently alive). Returns how many leases were renewed.
        Costs O(k log n) for the worker's k leases. Source: paper §4.5 (lifetime monitoring).
        """
        rids = self._by_worker.get(worker_id, {})
        expires_at = now + self.lease_timeout_s
        moved = []
        for rid in rids:
            req = self._in_flight[rid]
            old = req.lease.expires_at
            req.lease = dataclasses.replace(req.lease, expires_at=expires_at)
            if old != expires_at:
                moved.append(req.lease)
        if moved:
            self._push_expiry(expires_at, tuple(moved))
        return len(rids)

    def expire(self, now: float) -> list[str]:
        """Reap leases with ``expires_at <= now`` (seconds): IN_FLIGHT -> ABORTED -> PENDING.

        Expiry means the worker died without committing, so commit info is
        cleared and the request re-runs in full. Returns the affected ids in
        lease-grant order. Costs O(k log k + e log n) for the k expired leases and
        the e expiry entries (one per pull or renewal) that fall due. Source: paper §4.5
        ("lifetime monitoring ... full re-execution").
        """
        heap, in_flight = self._expiry, self._in_flight
        hit: dict[str, Request] = {}
        while heap and heap[0][0] <= now:
            leases = heappop(heap)[2]
            self._expiry_ids -= len(leases)
            for lease in leases:
                req = in_flight.get(lease.request_id)
                # Still in flight and expired (a renewal to a later time pushed a later entry).
                if req is not None and req.lease.expires_at <= now:
                    hit[req.request_id] = req
        expired = sorted(hit.values(), key=lambda r: r.lease.lease_id)
        for req in expired:
            self._abort(req, now, f"lease {req.lease.lease_id} of {req.worker_id} expired", requeue=True)
        return [r.request_id for r in expired]

    def release_worker(self, worker_id: str, *, reason: str, now: float) -> list[str]:
        """A worker or its agent is known dead: all its leases -> ABORTED -> PENDING.

        Same effect as early expiry (full re-execution). Returns affected ids
        (empty for a worker holding nothing). Source: paper §4.5, docs/architecture.md §4-§5.
        """
        rids = list(self._by_worker.get(worker_id, {}))
        for rid in rids:
            self._abort(self._in_flight[rid], now, f"{worker_id} released: {reason}", requeue=True)
        return rids

    def cancel(
        self, *, iteration: int, kind: RequestKind | None = None, now: float, reason: str = "cancelled"
    ) -> list[str]:
        """Move every non-terminal request of ``iteration`` (and ``kind``) to CANCELLED.

        Leases of cancelled requests die with them, so their holders' later
        completions are rejected. Returns the affected ids in submission order.
        Costs O(requests of ``iteration``). Source: docs/architecture.md §3 (leftover exploration), §4.
        """
        reqs = self._requests
        hit = [
            r
            for r in (reqs[rid] for rid in self._by_iter.get(iteration, ()))
            if (kind is None or r.kind is kind) and not r.status.is_terminal()
        ]
        for req in hit:
            self._transition(req, _CANCELLED, now, reason)
        return [r.request_id for r in hit]

    def cancel_requests(self, request_ids: Iterable[str], *, now: float, reason: str = "cancelled") -> list[str]:
        """Move the given non-terminal requests to CANCELLED (unknown or terminal ids are
        skipped). Their leases die with them, so late results are rejected as stale. Used to
        abandon streamed extra exploration candidates when training ends.
        Returns the ids cancelled, in the order given."""
        out = []
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is not None and not req.status.is_terminal():
                self._transition(req, _CANCELLED, now, reason)
                out.append(rid)
        return out

    def num_ready(self, *, kind: RequestKind | None = None) -> int:
        """Requests waiting to be pulled (PENDING or RECOMPUTE), optionally of one kind.
        O(number of batch keys queued), independent of the queue length."""
        if kind is None:
            return len(self._ready_at)
        if kind.__class__ is not RequestKind:
            kind = RequestKind(kind)
        i = 0 if kind is _ROLLOUT else 1
        n = 0
        for b in self._buckets.values():
            if b.head == i:
                n += b.live
        return n

    # ----------------------------------------------------------------- queries

    def get(self, request_id: str) -> Request:
        """The live ``Request`` object (do not mutate). Raises KeyError if unknown or forgotten."""
        return self._requests[request_id]

    def requests(
        self,
        *,
        iteration: int | None = None,
        kind: RequestKind | None = None,
        status: RequestStatus | None = None,
    ) -> list[Request]:
        """Requests matching every given filter, in submission order (docs/architecture.md §4 status view).

        Costs O(requests of ``iteration``) when it is given, else O(all requests).
        """
        if iteration is None:
            pool: Iterable[Request] = self._requests.values()
        else:
            reqs = self._requests
            pool = (reqs[rid] for rid in self._by_iter.get(iteration, ()))
        return [r for r in pool if (kind is None or r.kind is kind) and (status is None or r.status is status)]

    def holder(self, request_id: str, lease_id: int) -> str | None:
        """The worker id holding ``lease_id`` on ``request_id``, or None if that lease is not current."""
        req = self._current(request_id, lease_id)
        return None if req is None else req.lease.worker_id

    def leases(self, worker_id: str) -> list[Lease]:
        """Current leases held by ``worker_id`` (empty if none)."""
        return [self._in_flight[rid].lease for rid in self._by_worker.get(worker_id, {})]

    def counts(self, *, iteration: int | None = None, kind: RequestKind | None = None) -> dict[RequestStatus, int]:
        """Number of requests per status (every status a key, zeros included). Without
        ``iteration`` the requests dropped by :meth:`take_terminal` / :meth:`forget` count too."""
        out = dict.fromkeys(RequestStatus, 0)
        for r in self.requests(iteration=iteration, kind=kind):
            out[r.status] += 1
        if iteration is None:
            for (k, st), n in self._forgotten.items():
                if kind is None or k is kind:
                    out[st] += n
        return out

    def is_finished(self, *, iteration: int, kind: RequestKind) -> bool:
        """True when every request of ``iteration`` and ``kind`` is DONE, CANCELLED or PARKED (or none exist)."""
        if kind.__class__ is not RequestKind:
            kind = RequestKind(kind)
        return self._outstanding.get((iteration, kind), 0) == 0

    def num_outstanding(self, *, kind: RequestKind | None = None) -> int:
        """Number of non-terminal requests (optionally of one kind)."""
        if kind is None:
            return sum(self._outstanding_kind.values())
        return self._outstanding_kind[RequestKind(kind)]

    def forget(self, *, before_iteration: int) -> int:
        """Drop terminal requests of iterations ``< before_iteration`` to bound memory.

        Non-terminal requests are kept. Later reports for dropped ids are
        rejected by ``complete``/``commit``/``fail``. Returns the number dropped.
        Costs O(number of iterations + requests of the iterations looked at).
        """
        return len(self.take_terminal(before_iteration=before_iteration))

    def take_terminal(self, *, before_iteration: int) -> list[Request]:
        """Drop the terminal (DONE, CANCELLED or PARKED) requests of iterations ``< before_iteration``
        and return them, in submission order within each iteration (for a log that keeps
        them; the coordinator appends them to ``requests.jsonl``).

        The retention rule of a long run: without it every request of every iteration, with
        its history, stays in memory and in each checkpoint. Dropped requests still count in
        :meth:`counts` (``iteration=None``); request ids are never reused (the id counters
        are kept). Later reports for dropped ids are rejected by ``complete``/``commit``/``fail``.
        Costs O(number of iterations + requests of the iterations looked at).
        """
        dropped: list[Request] = []
        live, requests, forgotten = self._keys, self._requests, self._forgotten  # _keys: exactly the non-terminal ids
        for it in [i for i in self._by_iter if i < before_iteration]:
            ids = self._by_iter[it]
            gone = [rid for rid in ids if rid not in live]
            for rid in gone:
                del ids[rid]
                r = requests.pop(rid)
                key = (r.kind, r.status)
                forgotten[key] = forgotten.get(key, 0) + 1
                dropped.append(r)
            if not ids:
                del self._by_iter[it]
        for key in [k for k, n in self._outstanding.items() if n == 0 and k[0] < before_iteration]:
            del self._outstanding[key]
        return dropped

    # ----------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """JSON-able snapshot of the whole queue, for the coordinator's run checkpoint.

        Holds every (not forgotten) request with its status, full history
        (``[status, now, detail]`` triples, times as passed in), current lease,
        attempts, failures, commit info, last worker and submission seq; the id
        counters per (kind, iteration); the counts of forgotten requests per (kind,
        status); the next seq and lease id; the training
        gate; and the ``epoch`` of this process. ``params`` must be JSON-able.
        The configuration (``lease_timeout_s``, ``max_failures``) is recorded for
        reference only; ``load_state_dict`` keeps the new process's own.
        Source: docs/architecture.md, "Crash and resume".
        """
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "lease_timeout_s": self.lease_timeout_s,
            "max_failures": self.max_failures,
            "next_seq": self._next_seq,
            "next_lease_id": self._next_lease_id,
            "training_active": self._training_active,
            "id_counters": [
                [k.value, it, n]
                for (k, it), n in sorted(self._id_counters.items(), key=lambda x: (x[0][0].value, x[0][1]))
            ],
            "requests": [_request_to_json(r) for r in self._requests.values()],
            "forgotten": [
                [k.value, st.value, n]
                for (k, st), n in sorted(self._forgotten.items(), key=lambda x: (x[0][0].value, x[0][1].value))
            ],
        }

    def start_epoch(self, epoch: int) -> None:
        """A fresh scheduler in a process that is the ``epoch``-th start of its run (a run
        resumed without any checkpoint): lease ids start at ``epoch * LEASE_EPOCH_STRIDE``,
        so none equals a lease of a crashed earlier process.

        Raises:
            ValueError: negative ``epoch``, or leases were already granted.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._next_lease_id != 1:
            raise ValueError("start_epoch must be called before any lease is granted")
        self.epoch = int(epoch)
        self._next_lease_id = max(1, self.epoch * LEASE_EPOCH_STRIDE)

    def load_state_dict(self, d: dict[str, Any], *, epoch: int, now: float) -> list[str]:
        """Replace this scheduler's state with a ``state_dict`` of a crashed coordinator.

        ``epoch`` is the restart count of the new process: strictly greater than the
        epoch of every process that ever ran this run (the caller keeps a durable
        counter, e.g. :func:`spotlight.store.checkpoint.next_epoch`; the snapshot's own
        epoch is checked, later crashes cannot be seen from here). The next lease id
        becomes ``max(saved, epoch * LEASE_EPOCH_STRIDE)``, so no lease id of an
        earlier process -- including leases it granted after the snapshot was
        taken -- is ever granted again, and their late reports are rejected.

        Every lease of the snapshot is void (its worker talked to the dead process):
        each request IN_FLIGHT in the snapshot goes IN_FLIGHT -> ABORTED -> PENDING
        (history detail "coordinator restarted", commit info cleared, ``failures``
        unchanged), like an expiry. RECOMPUTE requests stay RECOMPUTE with their
        commit (the Tensor Store is on disk); PENDING, DONE, CANCELLED and PARKED requests
        are restored as they were (an ABORTED one, parked by an older version, as PARKED).
        The ready queue and indexes are rebuilt. Request ids keep counting from the saved counters. ``now`` is
        the timestamp of the new history entries (seconds).

        Returns:
            ids of the requests whose leases were voided, in submission order.

        Raises:
            ValueError: unknown state version, ``epoch`` not greater than the
                snapshot's, or a malformed snapshot (this scheduler is then left
                unchanged).
        """
        if d.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported request scheduler state version {d.get('version')!r}")
        epoch = int(epoch)
        if epoch <= int(d["epoch"]):
            raise ValueError(f"epoch must be greater than the snapshot's epoch {d['epoch']}, got {epoch}")
        try:
            reqs = [_request_from_json(r) for r in d["requests"]]
            counters = {(RequestKind(k), int(it)): int(n) for k, it, n in d["id_counters"]}
            forgotten = {(RequestKind(k), RequestStatus(st)): int(n) for k, st, n in d.get("forgotten", [])}
            next_seq, next_lease = int(d["next_seq"]), int(d["next_lease_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed request scheduler state: {exc!r}") from exc
        for r in reqs:
            if (r.status is _IN_FLIGHT) != (r.lease is not None):
                raise ValueError(
                    f"malformed request scheduler state: {r.request_id} is {r.status.value} with lease {r.lease}"
                )
            if r.seq >= next_seq or (r.lease is not None and r.lease.lease_id >= next_lease):
                raise ValueError(f"malformed request scheduler state: {r.request_id} has seq/lease beyond the counters")
        if len({r.request_id for r in reqs}) != len(reqs):
            raise ValueError("malformed request scheduler state: duplicate request ids")
        for r in reqs:  # a snapshot from before PARKED existed kept parked requests in ABORTED
            if r.status is _ABORTED:
                r.status = _PARKED
                r.history.append((_PARKED, now, "parked (restored from an ABORTED snapshot)"))
        self._requests = {r.request_id: r for r in reqs}
        self._reset_indexes()
        for r in reqs:
            self._by_iter.setdefault(r.iteration, {})[r.request_id] = None
            if not r.status.is_terminal():
                okey = (r.iteration, r.kind)
                self._outstanding[okey] = self._outstanding.get(okey, 0) + 1
                self._outstanding_kind[r.kind] += 1
                self._keys[r.request_id] = (r.kind, r.iteration, r.weight_version, _freeze(r.params))
            if r.status in (_PENDING, _RECOMPUTE):
                self._ready_add(r)
            elif r.status is _IN_FLIGHT:
                self._in_flight[r.request_id] = r
                self._by_worker.setdefault(r.lease.worker_id, {})[r.request_id] = None
                self._push_expiry(r.lease.expires_at, (r.lease,))
        self._id_counters = counters
        self._forgotten = forgotten
        self._next_seq = next_seq
        self._next_lease_id = max(next_lease, epoch * LEASE_EPOCH_STRIDE)
        self._training_active = bool(d["training_active"])
        self.epoch = epoch
        voided = [r for r in reqs if r.status is _IN_FLIGHT]
        for r in voided:
            self._abort(
                r,
                now,
                f"lease {r.lease.lease_id} of {r.lease.worker_id} void: coordinator restarted (epoch {epoch})",
                requeue=True,
            )
        return [r.request_id for r in voided]

    # ---------------------------------------------------------------- internals

    def _current(self, request_id: str, lease_id: int, worker_id: str | None = None) -> Request | None:
        """The request if it is IN_FLIGHT under ``lease_id`` (held by ``worker_id`` when given), else None."""
        req = self._requests.get(request_id)
        if req is None or req.status is not _IN_FLIGHT or req.lease.lease_id != lease_id:
            return None
        if worker_id is not None and req.lease.worker_id != worker_id:
            return None
        return req

    def take_released_commits(self) -> list[str]:
        """Tensor Store keys of committed states that no request will resume from any more, since
        the previous call: the request finished, was cancelled, parked or aborted (it re-runs from
        step 0), committed again under another key, or its state was lost. The record is then
        emptied; the caller deletes the states (paper §4.5: a committed state lives until its
        request no longer needs it). At most :data:`MAX_ABORTED_KEPT` are kept between calls (a
        caller that never asks, like the simulator, keeps no more)."""
        out = list(self._released_commits)
        self._released_commits.clear()
        return out

    def commit_keys(self) -> set[str]:
        """The Tensor Store keys of every committed state a request may still resume from."""
        return {r.commit_key for r in self._requests.values() if r.commit_key is not None}

    def _release_commit(self, req: Request) -> None:
        if req.commit_key is not None:
            self._released_commits.append(req.commit_key)
        req.committed_step = req.commit_key = None

    def take_aborted(self) -> list[AbortedLease]:
        """Leases aborted (worker failed, released or expired: the work was not committed)
        since the previous call, oldest first; the record is then emptied. At most
        :data:`MAX_ABORTED_KEPT` are kept between calls (the oldest are dropped)."""
        out = list(self._aborted)
        self._aborted.clear()
        return out

    def _abort(self, req: Request, now: float, detail: str, *, requeue: bool) -> None:
        """IN_FLIGHT -> ABORTED (-> PENDING if ``requeue``), clearing commit info."""
        if req.lease is not None:
            lease = req.lease
            self._aborted.append(
                AbortedLease(
                    lease.resume_step or 0,
                    lease.granted_at,
                    max(lease.granted_at, min(now, lease.expires_at - self.lease_timeout_s)),
                )
            )
        self._release_commit(req)
        self._transition(req, _ABORTED, now, detail)
        if requeue:
            self._transition(req, _PENDING, now, "re-enqueued for full re-execution")

    def _ready_add(self, req: Request) -> None:
        """Put a PENDING/RECOMPUTE request in the ready queue: O(1) in submission order, else O(log n)."""
        key = self._keys[req.request_id]
        bucket = self._buckets.get(key)
        if bucket is None:
            i = 0 if req.kind is _ROLLOUT else 1
            bucket = self._buckets[key] = _Bucket(key, i)
            self._num_buckets[i] += 1
        if req.status is _RECOMPUTE:
            prio = _PRIO_RECOMPUTE
        else:
            prio = _PRIO_ROLLOUT if bucket.head == 0 else _PRIO_EXPLORE
        code = prio << _SEQ_BITS | req.seq
        top = bucket.top() if bucket.live else None
        fifo = bucket.fifo
        if not fifo or code > fifo[-1]:
            fifo.append(code)
        else:
            heappush(bucket.late, code)
        bucket.live += 1
        self._ready[code] = req
        self._ready_at[req.request_id] = (code, bucket)
        if top is None or code < top:  # the bucket's new smallest
            self._push_head(bucket.head, code)

    def _ready_remove(self, req: Request) -> None:
        """Take a request out of the ready queue: O(log n) amortized.

        Its code goes stale. If it was at a front of its bucket, the stale
        fronts are dropped, and if it was the smallest, the new smallest is
        published in the global heap. (``pull`` does the same inline.)
        """
        code, bucket = self._ready_at.pop(req.request_id)
        ready = self._ready
        del ready[code]
        bucket.live -= 1
        if not bucket.live:  # whatever is left in it is stale
            del self._buckets[bucket.key]
            self._num_buckets[bucket.head] -= 1
            return
        fifo, late = bucket.fifo, bucket.late
        if (fifo and fifo[0] == code) or (late and late[0] == code):
            bucket.drop_stale_fronts(ready)
            top = bucket.top()
            if code < top:  # it was the smallest
                self._push_head(bucket.head, top)
        elif len(fifo) + len(late) > 2 * bucket.live + _COMPACT_SLACK:
            bucket.fifo = deque(c for c in fifo if c in ready)  # still increasing
            late[:] = [c for c in late if c in ready]
            heapify(late)  # the fronts were current and stay

    def _push_expiry(self, expires_at: float, leases: tuple[Lease, ...]) -> None:
        """Have ``expire`` look at the requests of these leases once ``now >= expires_at`` (seconds).

        Rebuilds the heap from the in-flight leases (O(in flight)) once it holds
        more than twice as many leases as are in flight (superseded by renewals
        or finished), so each lease pushed costs O(1) amortized besides the push.
        """
        self._expiry_tick += 1
        heappush(self._expiry, (expires_at, self._expiry_tick, leases))
        self._expiry_ids += len(leases)
        if self._expiry_ids > 2 * len(self._in_flight) + _COMPACT_SLACK:
            by_time: dict[float, list[Lease]] = {}
            for r in self._in_flight.values():
                by_time.setdefault(r.lease.expires_at, []).append(r.lease)
            self._expiry[:] = [(t, i, tuple(ls)) for i, (t, ls) in enumerate(by_time.items(), self._expiry_tick + 1)]
            heapify(self._expiry)
            self._expiry_tick += len(by_time)
            self._expiry_ids = len(self._in_flight)

    def _transition(
        self, req: Request, new_status: RequestStatus, now: float, detail: str, *, lease: Lease | None = None
    ) -> None:
        """The only place a status changes: validate, update indexes, append history.

        (Except ``pull``, which does the PENDING/RECOMPUTE -> IN_FLIGHT edge of
        this method inline for speed, ``complete``, which does IN_FLIGHT -> DONE
        inline, and ``submit``, which enqueues new PENDING requests in bulk, all
        with the same effects; the table allowing those edges is asserted at
        import.) ``lease`` is required when entering IN_FLIGHT and ignored otherwise.

        Raises:
            InvalidTransition: ``req.status -> new_status`` is not in ``VALID_TRANSITIONS``
                (nothing is changed).
        """
        old = req.status
        if new_status not in VALID_TRANSITIONS[old]:
            raise InvalidTransition(f"{req.request_id}: {old.value} -> {new_status.value} is not allowed")
        if new_status is _IN_FLIGHT and lease is None:
            raise ValueError(f"{req.request_id}: entering in_flight needs a lease")
        # Leave the old status's index.
        if old is _PENDING or old is _RECOMPUTE:
            self._ready_remove(req)
        elif old is _IN_FLIGHT:  # its expiry-heap entries go stale
            del self._in_flight[req.request_id]
            held = self._by_worker[req.lease.worker_id]
            del held[req.request_id]
            if not held:
                del self._by_worker[req.lease.worker_id]
            req.lease = None
        # Enter the new one.
        req.status = new_status
        if new_status is _PENDING or new_status is _RECOMPUTE:
            self._ready_add(req)
        elif new_status is _IN_FLIGHT:
            req.lease, req.worker_id = lease, lease.worker_id
            req.attempts += 1
            self._in_flight[req.request_id] = req
            held = self._by_worker.get(lease.worker_id)
            if held is None:
                held = self._by_worker[lease.worker_id] = {}
            held[req.request_id] = None
            self._push_expiry(lease.expires_at, (lease,))
        elif new_status is _DONE or new_status is _CANCELLED or new_status is _PARKED:
            self._outstanding[(req.iteration, req.kind)] -= 1
            self._outstanding_kind[req.kind] -= 1
            del self._keys[req.request_id]
            self._release_commit(req)
        req.history.append((new_status, now, detail))


def _request_to_json(r: Request) -> dict[str, Any]:
    """A ``Request`` as plain JSON types (enums by value, history as lists)."""
    return {
        "request_id": r.request_id,
        "kind": r.kind.value,
        "iteration": r.iteration,
        "prompt_index": r.prompt_index,
        "seed": r.seed,
        "weight_version": r.weight_version,
        "params": dict(r.params),
        "group": r.group,
        "status": r.status.value,
        "history": [[st.value, t, detail] for st, t, detail in r.history],
        "lease": None if r.lease is None else dataclasses.asdict(r.lease),
        "attempts": r.attempts,
        "failures": r.failures,
        "error": r.error,
        "failed_on": list(r.failed_on),
        "committed_step": r.committed_step,
        "commit_key": r.commit_key,
        "worker_id": r.worker_id,
        "seq": r.seq,
    }


def _request_from_json(d: dict[str, Any]) -> Request:
    """Inverse of :func:`_request_to_json`. Raises KeyError/TypeError/ValueError when malformed."""
    lease = d["lease"]
    return Request(
        request_id=str(d["request_id"]),
        kind=RequestKind(d["kind"]),
        iteration=int(d["iteration"]),
        prompt_index=int(d["prompt_index"]),
        seed=int(d["seed"]),
        weight_version=int(d["weight_version"]),
        params=dict(d["params"]),
        group=int(d["group"]),
        status=RequestStatus(d["status"]),
        history=[(RequestStatus(st), float(t), str(detail)) for st, t, detail in d["history"]],
        lease=None if lease is None else Lease(**lease),
        attempts=int(d["attempts"]),
        failures=int(d["failures"]),
        error=str(d.get("error", "")),
        failed_on=[str(w) for w in d.get("failed_on", [])],
        committed_step=None if d["committed_step"] is None else int(d["committed_step"]),
        commit_key=d["commit_key"],
        worker_id=d["worker_id"],
        seq=int(d["seq"]),
    )
