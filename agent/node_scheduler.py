"""node Scheduler core: request state and worker table of one spot node (paper §4.4.1).

Pure logic, no sockets or processes: the agent daemon (``agent/main.py``) feeds it what
happened (worker hello/exit, leases granted, results, commits) and asks it what to do.
Because it lives in the persistent agent, in-flight request state survives any change
of the worker set (docs/architecture.md §5 "Elastic SP").
"""

from __future__ import annotations

import dataclasses
import enum


class WorkerStatus(str, enum.Enum):
    STARTING = "starting"  # process spawned, no hello yet
    READY = "ready"  # said hello; pulls work
    STOPPING = "stopping"  # told to commit and exit
    EXITED = "exited"  # process gone


@dataclasses.dataclass
class WorkerSlot:
    worker_id: str
    gpus: list[int]
    status: WorkerStatus = WorkerStatus.STARTING
    pid: int = 0
    in_flight: dict[str, int] = dataclasses.field(default_factory=dict)
    """request id → lease id currently held by this worker."""
    busy_since: float | None = None
    restarts: int = 0
    spare_pid: int = 0
    """pid of the warm spare process that became this worker (0: started cold)."""


class NodeScheduler:
    """Tracks this node's workers and the requests they hold.

    Args:
        node_id: the node's id (prefix of worker ids).
    """

    def __init__(self, node_id: str):
        self.node_id = node_id
        self.workers: dict[str, WorkerSlot] = {}
        self._incarnations: dict[str, int] = {}

    @staticmethod
    def worker_id_for(node_id: str, gpus: list[int]) -> str:
        return f"{node_id}/gpu{'+'.join(map(str, gpus))}"

    def plan_workers(self, gpus: list[int], sp_degree: int = 1) -> list[list[int]]:
        """Group the node's GPUs into SP groups of ``sp_degree`` (leftovers form a smaller group)."""
        gpus = sorted(gpus)
        groups = [gpus[i : i + sp_degree] for i in range(0, len(gpus), sp_degree)]
        return [g for g in groups if g]

    def add_worker(self, gpus: list[int]) -> WorkerSlot:
        """A new worker process for ``gpus``. Every process gets its own id: a restart or a
        re-granted GPU is ``<node>/gpu1.r1``, ``.r2``… so a late message or exit of an old
        process can never be mistaken for the new one's."""
        base = self.worker_id_for(self.node_id, gpus)
        n = self._incarnations.get(base, 0)
        self._incarnations[base] = n + 1
        wid = base if n == 0 else f"{base}.r{n}"
        slot = WorkerSlot(wid, list(gpus), restarts=n)
        self.workers[wid] = slot
        return slot

    def hello(self, worker_id: str, pid: int) -> None:
        slot = self.workers.get(worker_id)
        if slot is not None:
            slot.status = WorkerStatus.READY
            slot.pid = pid

    def leased(self, worker_id: str, items: list[tuple[str, int]], now: float) -> None:
        slot = self.workers[worker_id]
        for rid, lid in items:
            slot.in_flight[rid] = lid
        if items:
            slot.busy_since = now

    def finished(self, worker_id: str, request_ids: list[str]) -> None:
        slot = self.workers.get(worker_id)
        if slot is None:
            return
        for rid in request_ids:
            slot.in_flight.pop(rid, None)
        if not slot.in_flight:
            slot.busy_since = None

    def exited(self, worker_id: str) -> list[tuple[str, int]]:
        """Worker process is gone; returns the (request id, lease id) pairs it still held."""
        slot = self.workers.get(worker_id)
        if slot is None:
            return []
        held = list(slot.in_flight.items())
        slot.in_flight.clear()
        slot.busy_since = None
        slot.status = WorkerStatus.EXITED
        return held

    def in_flight(self) -> list[str]:
        return [rid for s in self.workers.values() for rid in s.in_flight]

    def live_workers(self) -> list[WorkerSlot]:
        return [s for s in self.workers.values() if s.status in (WorkerStatus.STARTING, WorkerStatus.READY)]
