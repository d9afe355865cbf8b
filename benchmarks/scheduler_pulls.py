"""Request Scheduler pulls per second vs queue length: indexed ready queue vs the old linear scan.

Pure core (``spotlight.core.request_scheduler``, no sockets, one thread). Workload, per
queue length N:

- training is active; N EXPLORE requests are queued (one batch key) and kept at N:
  every completed exploration is replaced by a new submission;
- every third round 3 ROLLOUT requests are submitted (fewer than a batch, so a
  pull that takes them must look for more of their key);
- pullers take turns: spot, reserved, spot, reserved, ... each pulls a batch of 8
  (``max_requests=8``) and completes all it got. Reserved pullers may take only
  ROLLOUT work while training runs (asserted); with no rollout queued they get
  nothing -- the case where the old scan walked the whole queue.

Columns: ``pulls/s`` is pulls per second of (wall) time spent inside ``pull``
only; ``cycles/s`` is rounds per second of the whole loop (pull + complete + the
submissions that replenish the queue). Each is the median over chunks of 600
rounds (on a shared machine other processes only ever add time; a chunk they
hit does not move the median); "(best chunk)" is the fastest chunk, what the
code does when nothing else runs on the core or its hyperthread sibling. An average pull leases about 3.7 requests (a
full batch of 8 on spot pulls of exploration, 3 on rollout pulls, none on
reserved pulls that find no rollout). "old" is ``LinearScanScheduler``: the
previous ready queue (a sorted list of ``(priority, seq, id)`` kept with
``bisect``, ``pull`` scanning it from the front; copied from git history) on top
of this module's other code, so only the ready queue differs (its ``submit`` adds
one request at a time through that list, as the scheduler's once did).

Usage: ``python benchmarks/scheduler_pulls.py [--rounds 30000] [--old-seconds 3] [--lengths 100 1000]``
(about a minute on one core).
"""

from __future__ import annotations

import argparse
import bisect
import gc
import os
import statistics
import time

from spotlight.core.request_scheduler import (
    Lease,
    Request,
    RequestKind,
    RequestScheduler,
    RequestStatus,
    _freeze,
)

QUEUE_LENGTHS = (100, 1_000, 10_000, 100_000)
BATCH = 8


class LinearScanScheduler(RequestScheduler):
    """The previous ready queue: one sorted list scanned from the front on every pull."""

    def _reset_indexes(self) -> None:
        super()._reset_indexes()
        self._sorted_ready: list[tuple[int, int, str]] = []  # sorted (priority, seq, request_id)

    @staticmethod
    def _ready_entry(req: Request) -> tuple[int, int, str]:
        if req.status is RequestStatus.RECOMPUTE:
            prio = 0
        else:
            prio = 1 if req.kind is RequestKind.ROLLOUT else 2
        return (prio, req.seq, req.request_id)

    def _ready_add(self, req: Request) -> None:
        bisect.insort(self._sorted_ready, self._ready_entry(req))

    def submit(self, kind, iteration, items, *, weight_version, params, now):
        """One request at a time through ``_ready_add`` (``RequestScheduler.submit`` fills
        its own indexed queue in bulk, which this class replaces by the sorted list)."""
        kind = RequestKind(kind)
        params = dict(params or {})
        key = (kind, iteration, weight_version, _freeze(params))
        in_iter = self._by_iter.setdefault(iteration, {})
        ids = []
        for prompt_index, seed, group in items:
            n = self._id_counters.get((kind, iteration), 0)
            self._id_counters[(kind, iteration)] = n + 1
            req = Request(
                request_id=f"{kind.value[0]}{iteration}-{n}",
                kind=kind,
                iteration=iteration,
                prompt_index=int(prompt_index),
                seed=int(seed),
                weight_version=weight_version,
                params=params,
                group=int(group),
                history=[(RequestStatus.PENDING, now, "submitted")],
                seq=self._next_seq,
            )
            self._next_seq += 1
            self._requests[req.request_id] = req
            in_iter[req.request_id] = None
            self._keys[req.request_id] = key
            self._outstanding[(iteration, kind)] = self._outstanding.get((iteration, kind), 0) + 1
            self._outstanding_kind[kind] += 1
            self._ready_add(req)
            ids.append(req.request_id)
        return ids

    def _ready_remove(self, req: Request) -> None:
        entry = self._ready_entry(req)
        i = bisect.bisect_left(self._sorted_ready, entry)
        assert self._sorted_ready[i] == entry, entry
        del self._sorted_ready[i]

    def pull(self, worker_id: str, *, is_spot: bool, max_requests: int, now: float) -> list[Lease]:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        explore_ok = is_spot or not self._training_active
        picked: list[Request] = []
        key = None
        for _, _, rid in self._sorted_ready:
            req = self._requests[rid]
            if req.kind is RequestKind.EXPLORE and not explore_ok:
                continue
            if key is None:
                key = req.batch_key
            elif req.batch_key != key:
                continue
            picked.append(req)
            if len(picked) == max_requests:
                break
        leases = []
        for req in picked:
            lease = Lease(
                lease_id=self._next_lease_id,
                request_id=req.request_id,
                worker_id=worker_id,
                granted_at=now,
                expires_at=now + self.lease_timeout_s,
                resume_step=req.committed_step,
                commit_key=req.commit_key,
            )
            self._next_lease_id += 1
            detail = f"leased to {worker_id} (lease {lease.lease_id})"
            if lease.resume_step is not None:
                detail += f", resume from step {lease.resume_step}"
            self._transition(req, RequestStatus.IN_FLIGHT, now, detail, lease=lease)
            leases.append(lease)
        return leases


PARAMS_E = {"steps": 10, "guidance": 4.5, "size": [512, 512]}
PARAMS_R = {"steps": 10, "guidance": 4.5, "size": [512, 512], "cache_threshold": 0.0}
PULLERS = (("spot-0", True), ("res-0", False), ("spot-1", True), ("res-1", False))


CHUNK = 600  # rounds per measurement chunk (a multiple of the 12-round pattern)


def run(cls: type[RequestScheduler], n_queue: int, rounds: int, seconds: float) -> tuple[float, float, float]:
    """Run the workload for ``rounds`` rounds or until ``seconds`` of wall time pass.

    Returns (median pulls/s inside pull, best chunk's pulls/s inside pull, median
    rounds/s of the whole loop) over chunks of ``CHUNK`` rounds (the whole run
    when it is shorter than one chunk).
    """
    s = cls(lease_timeout_s=600.0)
    s.set_training_active(True)
    now = 0.0
    for start in range(0, n_queue, 1000):
        s.submit(
            RequestKind.EXPLORE,
            1,
            [(i, i, i // 16) for i in range(start, min(n_queue, start + 1000))],
            weight_version=0,
            params=PARAMS_E,
            now=now,
        )
    gc.collect()
    nseed = n_queue
    clock = time.perf_counter
    chunks: list[tuple[int, float, float]] = []  # (rounds, seconds inside pull, seconds in all)
    t_start = t_chunk = clock()
    t_pull, k, k_chunk = 0.0, 0, 0
    while k < rounds:
        now += 0.001
        if k % 3 == 0:
            s.submit(
                RequestKind.ROLLOUT,
                2,
                [(k, k, 0), (k, k + 1, 0), (k, k + 2, 0)],
                weight_version=1,
                params=PARAMS_R,
                now=now,
            )
        worker, spot = PULLERS[k % len(PULLERS)]
        t0 = clock()
        leases = s.pull(worker, is_spot=spot, max_requests=BATCH, now=now)
        t_pull += clock() - t0
        n_explore = 0
        for lease in leases:
            if lease.request_id[0] == "e":
                assert spot, "a reserved worker got exploration while training"
                n_explore += 1
            s.complete(lease.request_id, lease.lease_id, now, worker_id=worker)
        if n_explore:
            s.submit(
                RequestKind.EXPLORE,
                1,
                [(nseed + i, nseed + i, 0) for i in range(n_explore)],
                weight_version=0,
                params=PARAMS_E,
                now=now,
            )
            nseed += n_explore
        k += 1
        if k % CHUNK == 0 or k == rounds or clock() - t_start > seconds:
            t = clock()
            chunks.append((k - k_chunk, t_pull, t - t_chunk))
            t_pull, k_chunk, t_chunk = 0.0, k, t
            if t - t_start > seconds:
                break
    assert s.num_outstanding(kind=RequestKind.EXPLORE) == n_queue
    full = [c for c in chunks if c[0] == CHUNK] or chunks
    pulls = [n / p for n, p, _ in full]
    return statistics.median(pulls), max(pulls), statistics.median(n / t for n, _, t in full)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30_000, help="rounds per queue length (new scheduler)")
    ap.add_argument("--old-seconds", type=float, default=3.0, help="wall-time cap per queue length, old scan")
    ap.add_argument("--lengths", type=int, nargs="*", default=list(QUEUE_LENGTHS))
    args = ap.parse_args()
    print(
        f"batch {BATCH}, pullers spot/reserved alternating, training active, 3 rollouts every 3rd round; "
        f"median over chunks of {CHUNK} rounds; load average {os.getloadavg()[0]:.2f} at start\n"
    )
    print("| queue length | new pulls/s | (best chunk) | old pulls/s | ratio | new cycles/s | old cycles/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.lengths:
        pn, bn, cn = run(RequestScheduler, n, args.rounds, 1e9)
        po, _, co = run(LinearScanScheduler, n, args.rounds, args.old_seconds)
        print(f"| {n:,} | {pn:,.0f} | {bn:,.0f} | {po:,.0f} | {pn / po:,.1f}x | {cn:,.0f} | {co:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
