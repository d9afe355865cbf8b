"""node Scheduler core: what one spot node runs, and how it reacts to GPUs coming and going
(paper §4.4, docs/architecture.md §5).

It owns, for one node:

* the worker table (:class:`WorkerSlot`): one Rollout Worker process per GPU, its status
  (:class:`WorkerStatus`, transitions in :data:`VALID_WORKER_TRANSITIONS`) and the leases it holds;
* the node's GPU set and its SP groups (:class:`SPGroup`: members with the leader first,
  generation, serving);
* what a change of the GPU set does: an *elastic* reconfiguration (only the worker of a
  revoked GPU stops; the survivors of its group re-form a smaller group from the weights in
  their memory; a granted GPU gets a new worker that joins a group that lacks a member) or a
  *restart* reconfiguration (the baselines' engine restart: every worker stops, fresh ones start
  once all have exited);
* live migration (a stopped worker that holds a batch commits it to the Tensor Store first) and
  the drain on a node-wide preemption notice;
* the warm spare's schedule (:class:`SpareBook`): when the next spare starts, which spawn it
  becomes, when spares are given up.

Pure: no sockets, processes, threads or clocks. The agent daemon (``agent/main.py``) calls one
method per event -- GPUs revoked or added, a worker's hello, exit or GROUP_FORMED, leases
granted, results or commits forwarded, a preemption notice, the coordinator's SHUTDOWN --
passing ``now`` (its monotonic clock, seconds) where time matters, and carries out the returned
actions (the frozen dataclasses below) in order. Because the scheduler lives in the persistent
agent, in-flight request state survives any change of the worker set.

Example: SP 2 on GPUs 0 and 1 with live migration, then GPU 0 (the leader's) is revoked::

    ns = NodeScheduler("n", [0, 1], grace_s=20.0)
    ns.configure(sp_degree=2)
    ns.start(now=0.0)               # [SpawnWorker("n/gpu0", (0,), cause="start"),
                                    #  SpawnWorker("n/gpu1", (1,), cause="start")]
    ns.worker_hello("n/gpu0", pid=10, now=1.0)   # []: its group waits for n/gpu1
    ns.worker_hello("n/gpu1", pid=11, now=1.2)   # [FormGroup(("n/gpu0", "n/gpu1"), generation=1)]
    ns.revoke([0], grace_s=20.0, now=5.0)
        # [StopWorker("n/gpu0", commit=True, reason="gpu revoked"),   the leader commits its batch
        #  FormGroup(("n/gpu1",), generation=2),                        the survivor re-forms at SP 1
        #  ReportGpus(gpus=(1,), revoked=(0,))]                         and the coordinator is told
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal, Protocol

from spotlight.workers.sp.degrees import split_into_usable

# Warm spare timing (spotlight/workers/rollout/spare.py), seconds: the first spare starts once the
# initial workers said hello (or after SPARE_FIRST_WAIT_S), so its imports do not slow the node's
# cold start; a taken spare is replaced as soon as the worker it became is serving (its group
# reported GROUP_FORMED; at SP 1 its hello), at the latest SPARE_REPLACE_MAX_WAIT_S after the
# take, so the replacement's imports do not compete with the join for CPU; a spare that dies
# unused is restarted after SPARE_RETRY_S × failures, and spares are given up after
# SPARE_MAX_FAILURES such deaths in a row.
SPARE_FIRST_WAIT_S = 120.0
SPARE_REPLACE_MAX_WAIT_S = 60.0
SPARE_RETRY_S = 5.0
SPARE_MAX_FAILURES = 3
# A worker that exits with an error before its hello, WORKER_MAX_START_FAILURES times in a row
# on the same GPUs, is not started there again (the node reports it): a fault that fails every
# start (a broken install, a driver error) must not restart forever in silence.
WORKER_MAX_START_FAILURES = 5


# ---------------------------------------------------------------- worker table
class WorkerStatus(str, enum.Enum):
    STARTING = "starting"  # process spawned, no hello yet
    READY = "ready"  # said hello; pulls work
    STOPPING = "stopping"  # told to commit and exit
    EXITED = "exited"  # process gone

    def is_live(self) -> bool:
        """Starting or ready: a worker that is not on its way out."""
        return self in (WorkerStatus.STARTING, WorkerStatus.READY)


VALID_WORKER_TRANSITIONS: dict[WorkerStatus, frozenset[WorkerStatus]] = {
    WorkerStatus.STARTING: frozenset(
        {
            WorkerStatus.READY,  # its hello
            WorkerStatus.STOPPING,  # revoked, drained or restarted before its hello
            WorkerStatus.EXITED,  # died before its hello
        }
    ),
    WorkerStatus.READY: frozenset(
        {
            WorkerStatus.STOPPING,  # revoked, drained, restarted or the coordinator's SHUTDOWN
            WorkerStatus.EXITED,  # died
        }
    ),
    WorkerStatus.STOPPING: frozenset({WorkerStatus.EXITED}),  # left (after its commit, or killed)
    WorkerStatus.EXITED: frozenset(),  # a restart is a new slot with a new id
}


class InvalidTransition(ValueError):
    """A worker status change that :data:`VALID_WORKER_TRANSITIONS` does not allow."""


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


# ---------------------------------------------------------------- SP groups
@dataclasses.dataclass(eq=False)
class SPGroup:
    """One sequence-parallel group of this node's workers (paper §4.4): its members denoise one
    batch together. ``members[0]`` leads: it pulls the work, holds the weights and commits.

    Compared by identity: two groups with the same members are still two groups.
    """

    members: list[str]
    """Worker ids, leader first."""
    generation: int = 0
    """Number of GROUP_FORMs sent; a member's GROUP_FORMED names the generation it formed."""
    formed: bool = False
    """A GROUP_FORM was sent (the group waits for all its members' hellos before the first)."""
    formed_by: set[str] = dataclasses.field(default_factory=set)
    """Members that reported GROUP_FORMED for the current generation."""
    serving: bool = False
    """Every member formed the current generation."""
    reform_s: float = 0.0
    """Slowest member's time from GROUP_FORM to formed (``GroupFormed.took_s``), seconds."""
    form_sent_at: float | None = None
    """``now`` of the current generation's GROUP_FORM."""

    @property
    def leader(self) -> str:
        return self.members[0]

    def status(self) -> dict[str, Any]:
        """The group as ``spotlight-agent agent-status`` shows it (JSON)."""
        return {
            "members": list(self.members),
            "generation": self.generation,
            "serving": self.serving,
            "reform_s": round(self.reform_s, 3),
        }


# ---------------------------------------------------------------- warm spare
@dataclasses.dataclass(frozen=True)
class SpareTiming:
    """When warm spares start and are given up (seconds; the module constants are the defaults)."""

    first_wait_s: float = SPARE_FIRST_WAIT_S
    replace_max_wait_s: float = SPARE_REPLACE_MAX_WAIT_S
    retry_s: float = SPARE_RETRY_S
    max_failures: int = SPARE_MAX_FAILURES


@dataclasses.dataclass
class SpareBook:
    """The node Scheduler's view of the warm spare (the daemon holds the process itself)."""

    enabled: bool
    """Keep a spare (``--warm-spare``); off for good once spares are given up."""
    running: bool = False
    """A spare process exists (started, neither handed over nor stopped)."""
    due_at: float | None = None
    """``now`` from which the next spare starts (None: none due)."""
    first_deadline: float | None = None
    """The first spare starts once the initial workers said hello, at the latest at this ``now``."""
    failures: int = 0
    """Spares in a row that died before they were ready."""
    replace: tuple[str, float] | None = None
    """(worker id a spare became, latest ``now``): the next spare starts once it serves."""
    used: int = 0
    """Spares that became workers."""


# ---------------------------------------------------------------- actions
@dataclasses.dataclass(frozen=True)
class SpawnWorker:
    """Start worker ``worker_id`` on ``gpus``: the warm spare becomes it when ``from_spare`` (the
    daemon starts it cold if the spare cannot take it), else a fresh process starts.

    ``cause``: ``start`` (the node's first workers), ``grant`` (a GPU was added), ``replace`` (its
    predecessor on these GPUs died) or ``restart`` (a restart reconfiguration's fresh workers).
    """

    worker_id: str
    gpus: tuple[int, ...]
    from_spare: bool = False
    cause: Literal["start", "grant", "replace", "restart"] = "start"


@dataclasses.dataclass(frozen=True)
class StopWorker:
    """Send the worker STOP: with ``commit`` it commits its in-flight state (live migration),
    else it gives its leases back; then it exits."""

    worker_id: str
    commit: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class KillWorker:
    """SIGKILL the worker's process if it still runs (``reason``: why now)."""

    worker_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FormGroup:
    """Send GROUP_FORM of generation ``generation`` to every one of ``members`` (leader first)."""

    members: tuple[str, ...]
    generation: int


@dataclasses.dataclass(frozen=True)
class GroupServing:
    """Every member formed ``generation``: the reconfiguration is over (``after_s`` since its
    GROUP_FORM). Nothing to do but report it."""

    members: tuple[str, ...]
    generation: int
    after_s: float


@dataclasses.dataclass(frozen=True)
class RestartNode:
    """A restart reconfiguration begins (``reason``): the StopWorker actions that follow stop every
    worker; fresh workers start on ``gpus`` once all have exited."""

    reason: str
    gpus: tuple[int, ...]
    grace_s: float


@dataclasses.dataclass(frozen=True)
class Drain:
    """The node drains (``reason``): no more pulls, every worker is stopped (the StopWorker actions
    that follow); the agent exits once they are gone or ``grace_s`` has passed."""

    reason: str
    grace_s: float


@dataclasses.dataclass(frozen=True)
class ReportGpus:
    """The node's GPU set changed: tell the coordinator now (a heartbeat carries ``gpus``)."""

    gpus: tuple[int, ...]
    revoked: tuple[int, ...] = ()
    added: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReportNotice:
    """Tell the coordinator about ``notice``; with ``acknowledge`` approve it with the cloud
    once the drain is over (Azure Scheduled Events, docs/preemption-notices.md §3.3)."""

    notice: Any
    acknowledge: bool = False


@dataclasses.dataclass(frozen=True)
class DeliverLeases:
    """Forward the coordinator's LEASES to the worker that pulled them."""

    worker_id: str


@dataclasses.dataclass(frozen=True)
class ReturnLeases:
    """Tell the coordinator (FAIL) that these leases will not be run (``reason``)."""

    worker_id: str
    request_ids: tuple[str, ...]
    lease_ids: tuple[int, ...]
    reason: str


@dataclasses.dataclass(frozen=True)
class StartSpare:
    """Start the warm spare process."""


@dataclasses.dataclass(frozen=True)
class StopSpare:
    """Kill the idle warm spare, if any. ``give_up`` (non-empty): why the node keeps no spares any
    more (an error to report)."""

    give_up: str = ""


@dataclasses.dataclass(frozen=True)
class GiveUpGpus:
    """Workers on ``gpus`` failed ``failures`` starts in a row (the last with ``exit_code``) and
    are not started there again: report it (the node's heartbeat carries it to the coordinator)."""

    gpus: tuple[int, ...]
    failures: int
    exit_code: int


Action = (
    SpawnWorker
    | StopWorker
    | KillWorker
    | FormGroup
    | GroupServing
    | RestartNode
    | Drain
    | ReportGpus
    | ReportNotice
    | DeliverLeases
    | ReturnLeases
    | StartSpare
    | StopSpare
    | GiveUpGpus
)


class Notice(Protocol):
    """What the scheduler reads of a preemption notice (``agent.preemption.PreemptionNotice``)."""

    source: str
    scope: str
    kind: str
    is_hint: bool


# ---------------------------------------------------------------- the scheduler
class NodeScheduler:
    """One node's workers, SP groups and warm spare, driven by events (see the module docstring).

    Args:
        node_id: the node's id (prefix of worker ids).
        gpus: GPU indices of this node that Spotlight may use.
        grace_s: seconds a stopped worker gets to commit when the event names no deadline (a GPU
            added in restart mode, a drain without one); a notice's workers get at most this
            much, less when its deadline is nearer.
        warm_spare: keep one pre-started spare worker process (:class:`SpareBook`).
        spare_timing: when spares start and are given up.
    """

    def __init__(
        self,
        node_id: str,
        gpus: list[int] | tuple[int, ...] = (),
        *,
        grace_s: float = 20.0,
        warm_spare: bool = False,
        spare_timing: SpareTiming = SpareTiming(),
    ):
        self.node_id = node_id
        self.start_failures: dict[tuple[int, ...], int] = {}
        """GPUs → workers on them that exited with an error before their hello, in a row."""
        self.gpus: list[int] = list(gpus)
        self.grace_s = grace_s
        self.workers: dict[str, WorkerSlot] = {}
        self._incarnations: dict[str, int] = {}
        self.groups: list[SPGroup] = []
        self.revoking: dict[str, float] = {}
        """Worker id → ``now`` by which its process must be gone (revoked or restarted)."""
        self.done_when_serving: dict[str, SPGroup] = {}
        """Revoked follower → the group that re-forms without it (it holds nothing to commit)."""
        self.restart_pending = False
        """Restart reconfiguration: fresh workers start once every old one exited."""
        self.restarts = 0
        """Restart reconfigurations so far."""
        self.draining = False
        self.stop_reason = ""
        self.stop_deadline: float | None = None
        """``now`` after which a draining agent exits whatever its workers do."""
        self.spare = SpareBook(enabled=warm_spare)
        self.spare_timing = spare_timing
        self.configured = False
        """The coordinator's registration reply set the mode (:meth:`configure`)."""
        self.sp_degree = 1
        self.sp_degrees: list[int] = [1]
        """Group sizes that can run the model (``spotlight.workers.sp.degrees``): no group of
        another size is ever formed."""
        self.restart_mode = False
        self.live_migration = True

    def configure(
        self,
        *,
        sp_degree: int = 1,
        sp_degrees: list[int] | tuple[int, ...] = (),
        reconfiguration: Literal["elastic", "restart"] = "elastic",
        live_migration: bool = True,
    ) -> None:
        """The coordinator's choices (REGISTERED): SP degree of the node's groups, the smaller
        degrees the model can also run at (``sp_degrees``; empty = every degree up to
        ``sp_degree``), how a GPU change reconfigures the node, and whether stopped workers commit
        their batch."""
        self.sp_degree = sp_degree
        usable = {d for d in sp_degrees if 1 <= d <= sp_degree} if sp_degrees else set(range(1, sp_degree + 1))
        self.sp_degrees = sorted(usable | {1, sp_degree})
        self.restart_mode = reconfiguration == "restart"
        self.live_migration = live_migration
        self.configured = True

    # ------------------------------------------------------------ worker table bookkeeping
    @staticmethod
    def worker_id_for(node_id: str, gpus: list[int]) -> str:
        return f"{node_id}/gpu{'+'.join(map(str, gpus))}"

    def plan_workers(self, gpus: list[int], sp_degree: int = 1) -> list[list[int]]:
        """Group the node's GPUs into SP groups of ``sp_degree``; leftovers form smaller groups of
        sizes the model can run at (:attr:`sp_degrees`)."""
        gpus = sorted(gpus)
        full = len(gpus) - len(gpus) % sp_degree
        groups = [gpus[i : i + sp_degree] for i in range(0, full, sp_degree)]
        usable = [d for d in self.sp_degrees if d <= sp_degree] if sp_degree > 1 else [1]
        return [g for g in groups if g] + split_into_usable(gpus[full:], usable)

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

    def _set(self, slot: WorkerSlot, status: WorkerStatus) -> None:
        if status not in VALID_WORKER_TRANSITIONS[slot.status]:
            raise InvalidTransition(f"worker {slot.worker_id}: {slot.status.value} -> {status.value} is not allowed")
        slot.status = status

    def hello(self, worker_id: str, pid: int) -> bool:
        """A worker said hello (its process is ``pid``). True when that made a starting worker
        ready; False for an unknown or gone worker, a repeated hello, or a worker stopped before
        its hello (a hello cannot undo a stop; its pid is still recorded)."""
        slot = self.workers.get(worker_id)
        if slot is None or slot.status is WorkerStatus.EXITED:
            return False
        slot.pid = pid
        if slot.status is not WorkerStatus.STARTING:
            return False
        self._set(slot, WorkerStatus.READY)
        self.start_failures.pop(tuple(slot.gpus), None)  # it started: earlier failures no longer count
        return True

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
        if slot is None or slot.status is WorkerStatus.EXITED:
            return []
        held = list(slot.in_flight.items())
        slot.in_flight.clear()
        slot.busy_since = None
        self._set(slot, WorkerStatus.EXITED)
        return held

    def in_flight(self) -> list[str]:
        return [rid for s in self.workers.values() for rid in s.in_flight]

    def given_up_gpus(self) -> list[int]:
        """The node's GPUs that get no workers any more: their workers failed
        :data:`WORKER_MAX_START_FAILURES` starts in a row (:class:`GiveUpGpus`)."""
        failed = {g for key, n in self.start_failures.items() if n >= WORKER_MAX_START_FAILURES for g in key}
        return sorted(g for g in self.gpus if g in failed)

    def live_workers(self) -> list[WorkerSlot]:
        return [s for s in self.workers.values() if s.status.is_live()]

    def group_of(self, worker_id: str) -> SPGroup | None:
        return next((g for g in self.groups if worker_id in g.members), None)

    def serving(self, worker_id: str) -> bool:
        """True when ``worker_id``'s SP group has formed its current generation on every member."""
        group = self.group_of(worker_id)
        return group is not None and group.serving

    # ------------------------------------------------------------ spawning and stopping
    def spawn(self, gpus: list[int], cause: str = "grant") -> SpawnWorker:
        """A new worker on ``gpus``; the warm spare becomes it if there is one."""
        slot = self.add_worker(list(gpus))
        from_spare = self.spare.running
        self.spare.running = False  # handed over (or, if it cannot take it, stopped)
        return SpawnWorker(slot.worker_id, tuple(slot.gpus), from_spare=from_spare, cause=cause)

    def worker_spawned(self, worker_id: str, spare_pid: int, now: float) -> None:
        """The daemon started ``worker_id``: in the warm spare ``spare_pid``, or cold (0)."""
        slot = self.workers[worker_id]
        slot.spare_pid = spare_pid
        if spare_pid:
            self.spare.used += 1
            self.spare.replace = (worker_id, now + self.spare_timing.replace_max_wait_s)

    def _start_workers(self, gpus: list[int], cause: str) -> list[Action]:
        """One worker per GPU; with SP > 1 they are grouped into SP groups of ``sp_degree``,
        each formed once all its members said hello."""
        spawns = [self.spawn(group, cause) for group in self.plan_workers(gpus, 1)]
        by_gpu = {a.gpus[0]: a.worker_id for a in spawns}
        if self.sp_degree > 1:
            for group in self.plan_workers(gpus, self.sp_degree):
                self.groups.append(SPGroup([by_gpu[g] for g in group]))
        return list(spawns)

    def start(self, now: float) -> list[Action]:
        """The node is registered: start its workers; the first warm spare follows them. Restart
        reconfiguration keeps no spare (its workers restart cold)."""
        if self.restart_mode:
            self.spare.enabled = False
        actions = self._start_workers(self.gpus, "start")
        self.spare.first_deadline = now + self.spare_timing.first_wait_s
        return actions

    def _stop(self, slot: WorkerSlot, commit: bool, reason: str) -> StopWorker:
        self._set(slot, WorkerStatus.STOPPING)
        return StopWorker(slot.worker_id, commit=commit, reason=reason)

    def _restart_node(self, reason: str, grace_s: float, now: float) -> list[Action]:
        """Restart reconfiguration (the RLBoost / veRL-omni baselines): every worker of the node
        stops (committing its batch when live migration is on, else giving it back) and, once
        all have exited, fresh workers start cold on the GPUs the node has then; they load the
        weights as any fresh worker does."""
        deadline = now + grace_s
        actions: list[Action] = [RestartNode(reason, tuple(self.gpus), grace_s)]
        for slot in self.live_workers():
            actions.append(self._stop(slot, self.live_migration, reason))
            self.revoking[slot.worker_id] = min(self.revoking.get(slot.worker_id, deadline), deadline)
        self.groups = []
        self.done_when_serving.clear()
        self.restart_pending = True
        self.restarts += 1
        return actions + self._finish_restart(now)

    def _finish_restart(self, now: float) -> list[Action]:
        """Fresh workers once every old one has exited (restart reconfiguration)."""
        if not self.restart_pending or self.draining:
            return []
        if any(s.status is not WorkerStatus.EXITED for s in self.workers.values()):
            return []
        self.restart_pending = False
        return self._start_workers(self.gpus, "restart") if self.gpus else []

    # ------------------------------------------------------------ SP groups
    def _reform(self, group: SPGroup, now: float) -> FormGroup:
        """(Re)form ``group``: a new generation that every member must report formed."""
        group.generation += 1
        group.formed_by, group.serving, group.reform_s, group.form_sent_at = set(), False, 0.0, now
        group.formed = True
        return FormGroup(tuple(group.members), group.generation)

    def _group_hello(self, worker_id: str, now: float) -> list[Action]:
        group = self.group_of(worker_id)
        if group is None:  # a new GPU: join a group that lost a member (to a size that runs), else start one
            group = next(
                (g for g in self.groups if len(g.members) < self.sp_degree and len(g.members) + 1 in self.sp_degrees),
                None,
            )
            if group is None:
                group = SPGroup([])
                self.groups.append(group)
            group.members.append(worker_id)
        ready = {s.worker_id for s in self.workers.values() if s.status is WorkerStatus.READY}
        return [self._reform(group, now)] if all(m in ready for m in group.members) else []

    def _group_leave(self, worker_id: str, now: float) -> list[Action]:
        """A member goes (revoked or died): the survivors re-form at a lower degree."""
        group = self.group_of(worker_id)
        if group is None:
            return []
        group.members.remove(worker_id)
        if not group.members:
            self.groups.remove(group)
            return []
        # a surviving member leads next (it keeps its weights in memory): re-form now; a
        # blocked follower reads this after the old leader releases it. Survivors whose count
        # the model cannot run at (e.g. 3 of 4 with 4 heads) split into groups that it can.
        parts = split_into_usable(group.members, self.sp_degrees)
        group.members = parts[0]
        actions: list[Action] = [self._reform(group, now)]
        for members in parts[1:]:
            extra = SPGroup(list(members))
            self.groups.append(extra)
            actions.append(self._reform(extra, now))
        return actions

    def _end_revoked(self, worker_id: str, why: str) -> list[Action]:
        """Kill a revoked worker whose part is provably over (its commit reached the agent, or the
        survivors re-formed without it), instead of waiting for its own teardown: the revoked
        GPU is free at once."""
        self.done_when_serving.pop(worker_id, None)
        return [KillWorker(worker_id, f"revoked and done ({why})")] if worker_id in self.revoking else []

    # ------------------------------------------------------------ events from workers
    def worker_hello(self, worker_id: str, pid: int, now: float) -> list[Action]:
        """WORKER_HELLO: the worker is ready; with SP > 1 its group forms once all members are."""
        if not self.hello(worker_id, pid) or self.sp_degree <= 1:
            return []
        return self._group_hello(worker_id, now)

    def group_formed(self, worker_id: str, generation: int, took_s: float, now: float) -> list[Action]:
        """GROUP_FORMED: a member formed ``generation``; the group serves once all did, and a
        revoked follower it left behind is done."""
        group = self.group_of(worker_id)
        if self.sp_degree <= 1 or group is None or generation != group.generation:
            return []  # a late report of an older generation
        group.formed_by.add(worker_id)
        group.reform_s = max(group.reform_s, float(took_s))
        if group.serving or not group.formed_by >= set(group.members):
            return []
        group.serving = True
        after_s = now - group.form_sent_at if group.form_sent_at is not None else 0.0
        actions: list[Action] = [GroupServing(tuple(group.members), group.generation, after_s)]
        for revoked, left in list(self.done_when_serving.items()):
            if left is group:
                actions += self._end_revoked(revoked, "its group re-formed without it")
        return actions

    def may_pull(self, worker_id: str) -> bool:
        """Forward this worker's PULL to the coordinator (not while draining, not for strangers)."""
        return not self.draining and worker_id in self.workers

    def leases_granted(self, worker_id: str, items: list[tuple[str, int]], now: float) -> list[Action]:
        """LEASES for ``worker_id`` (``items``: request id, lease id). If the worker that pulled
        them died before the answer (a respawned one has not said hello yet), nobody will run
        them and heartbeats would renew them forever: they go back to the coordinator."""
        slot = self.workers.get(worker_id)
        if items and (slot is None or slot.status in (WorkerStatus.STARTING, WorkerStatus.EXITED)):
            rids, lids = zip(*items)
            return [ReturnLeases(worker_id, rids, lids, "worker exited before its leases arrived")]
        if slot is not None:
            self.leased(worker_id, items, now)
        return [DeliverLeases(worker_id)]

    def work_finished(self, worker_id: str, request_ids: list[str], *, committed: bool) -> list[Action]:
        """RESULT, FAIL or (``committed``) COMMIT forwarded for these requests; a revoked worker
        whose commit went out is done."""
        self.finished(worker_id, request_ids)
        return self._end_revoked(worker_id, "its commit was forwarded") if committed else []

    def worker_exited(self, worker_id: str, exit_code: int, now: float, *, spare_refused: bool = False) -> list[Action]:
        """The worker's process is gone (``exit_code``). Its group re-forms without it, its leases
        go back, and unless it was stopped on purpose it is replaced on the same GPUs, except
        after :data:`WORKER_MAX_START_FAILURES` exits with an error before a hello in a row
        there (:class:`GiveUpGpus`).
        ``spare_refused``: it was to be a warm spare that could not become a worker (it had
        initialised CUDA early), so the node keeps no spares any more."""
        slot = self.workers.get(worker_id)
        if slot is None or slot.status is WorkerStatus.EXITED:
            return []
        failed_start = slot.status is WorkerStatus.STARTING and exit_code != 0 and not spare_refused
        held = self.exited(worker_id)
        actions: list[Action] = []
        revoked = worker_id in self.revoking
        if self.sp_degree > 1 and not self.draining and not revoked:
            actions += self._group_leave(worker_id, now)
        if held:
            rids, lids = zip(*held)
            actions.append(ReturnLeases(worker_id, rids, lids, f"worker exited with code {exit_code}"))
        if spare_refused and slot.spare_pid and self.spare.enabled:
            self.spare.enabled = False
            self.spare.running = False
            actions.append(
                StopSpare(give_up=f"the warm spare that was to become {worker_id} had initialised CUDA early")
            )
        if revoked:
            del self.revoking[worker_id]
            self.done_when_serving.pop(worker_id, None)
        elif not self.draining:
            key = tuple(slot.gpus)
            failures = self.start_failures.get(key, 0) + 1 if failed_start else 0
            self.start_failures[key] = failures
            if failures >= WORKER_MAX_START_FAILURES:
                actions.append(GiveUpGpus(key, failures, exit_code))
            else:
                actions.append(self.spawn(slot.gpus, "replace"))
        return actions + self._finish_restart(now)

    def overdue(self, now: float) -> list[Action]:
        """Stopped workers still there past their deadline: kill them (the coordinator re-runs
        what they had not committed)."""
        return [
            KillWorker(wid, "still running at its commit deadline (the coordinator re-runs what it had not committed)")
            for wid, deadline in self.revoking.items()
            if now > deadline and self.workers[wid].status is not WorkerStatus.EXITED
        ]

    # ------------------------------------------------------------ GPU changes
    def revoke(self, gpus: list[int], grace_s: float, now: float) -> list[Action]:
        """Per-GPU revocation: only the workers using those GPUs commit and exit; the node stays.

        With SP groups the survivors of the affected group re-form at a lower degree from the
        weights in their memory (paper §4.4); a revoked leader commits its batch first, a revoked
        follower holds nothing (it is killed once the survivors serve). In restart mode the whole
        node restarts on the remaining GPUs.
        """
        self.gpus = [g for g in self.gpus if g not in gpus]
        report = ReportGpus(tuple(self.gpus), revoked=tuple(gpus))
        if self.restart_mode:
            return self._restart_node(f"GPUs {list(gpus)} revoked", grace_s, now) + [report]
        actions: list[Action] = []
        for slot in [s for s in self.live_workers() if set(s.gpus) & set(gpus)]:
            group = self.group_of(slot.worker_id) if self.sp_degree > 1 else None
            is_leader = group is None or group.leader == slot.worker_id
            actions.append(self._stop(slot, is_leader and self.live_migration, "gpu revoked"))
            self.revoking[slot.worker_id] = now + grace_s
            if group is not None:
                if not is_leader:  # holds nothing: done once the survivors re-formed without it
                    self.done_when_serving[slot.worker_id] = group
                actions += self._group_leave(slot.worker_id, now)
        return actions + [report]

    def add(self, gpus: list[int], now: float) -> list[Action]:
        """GPUs granted to this node: a worker on each (the first may be the warm spare); in
        restart mode the whole node restarts on the larger GPU set."""
        new = [g for g in gpus if g not in self.gpus]
        self.gpus = sorted(self.gpus + new)
        report = ReportGpus(tuple(self.gpus), added=tuple(new))
        if self.restart_mode and new:
            return self._restart_node(f"GPUs {new} added", self.grace_s, now) + [report]
        return [self.spawn(group, "grant") for group in self.plan_workers(new, 1)] + [report]

    # ------------------------------------------------------------ notices and stops
    def notice(self, notice: Notice, *, remaining_s: float, now: float) -> list[Action]:
        """A preemption notice from any source (``remaining_s`` to its deadline): report it, then
        act on its scope -- drain the node, or revoke the GPUs of a ``gpu:<ids>`` scope. A hint
        is only reported. Empty when it is ignored: a SIGTERM while the agent already stops for
        another reason (``spotlight up`` stopping a slow agent after the coordinator's
        SHUTDOWN is not a preemption)."""
        stopping_for_another_reason = bool(self.stop_reason) and not self.stop_reason.startswith("sigterm")
        if notice.source == "sigterm" and self.draining and stopping_for_another_reason:
            return []
        node = notice.scope == "node"
        actions: list[Action] = [ReportNotice(notice, acknowledge=node and not notice.is_hint)]
        if notice.is_hint:
            return actions
        grace_s = max(0.5, min(self.grace_s, remaining_s - 1.0))
        if node:
            actions += self.drain(f"{notice.source} {notice.kind}", grace_s, now)
        elif notice.scope.startswith("gpu:"):
            actions += self.revoke([int(g) for g in notice.scope[4:].split(",") if g], grace_s, now)
        return actions

    def drain(self, reason: str, grace_s: float | None, now: float) -> list[Action]:
        """Stop pulling; ask every worker to commit in-flight state (with live migration) and
        exit; no worker starts any more, so the spare goes. Nothing if already draining."""
        if self.draining:
            return []
        grace_s = self.grace_s if grace_s is None else grace_s
        self.draining, self.stop_reason, self.stop_deadline = True, reason, now + grace_s
        self.spare.running = False
        actions: list[Action] = [Drain(reason, grace_s), StopSpare()]
        return actions + [self._stop(s, self.live_migration, reason) for s in self.live_workers()]

    def shutdown(self, reason: str, now: float, grace_s: float = 5.0) -> list[Action]:
        """The coordinator's SHUTDOWN: every worker stops without committing (the run is over)."""
        self.stop_reason = reason or "shutdown"
        actions: list[Action] = [self._stop(s, False, "shutdown") for s in self.live_workers()]
        self.draining, self.stop_deadline = True, now + grace_s
        self.spare.running = False
        return actions + [StopSpare()]

    # ------------------------------------------------------------ warm spare
    def spare_started(self) -> None:
        """The daemon started a spare process."""
        self.spare.running = True

    def spare_ready(self) -> None:
        """The spare wrote ``ready``: it warmed up, so earlier failures no longer count."""
        self.spare.failures = 0

    def spare_died(self, now: float) -> float | None:
        """The spare exited before it was needed. Returns the delay (seconds) until the next one
        starts, or None when that was one failure too many: spares are given up."""
        self.spare.running = False
        self.spare.failures += 1
        if self.spare.failures >= self.spare_timing.max_failures:
            self.spare.enabled = False
            return None
        delay_s = self.spare_timing.retry_s * self.spare.failures
        self.spare.due_at = now + delay_s
        return delay_s

    def spare_unusable(self, now: float) -> None:
        """The spare to hand over had died or was started for an older configuration: the daemon
        killed it; a spare of the current configuration follows at once."""
        self.spare.running = False
        self.spare.due_at = now

    def spare_tick(self, now: float) -> list[Action]:
        """Main-loop housekeeping while no spare runs: start one when it is due -- the first once
        every initial worker said hello, the next once the worker the last one became is
        serving (or died, or took too long), or after a failure's backoff."""
        book = self.spare
        if book.running or not book.enabled or not self.configured or self.draining:
            return []
        if book.replace is not None:
            wid, deadline = book.replace
            slot = self.workers.get(wid)
            ready = slot is not None and slot.status is WorkerStatus.READY
            serving = ready and (self.sp_degree == 1 or self.serving(wid))
            gone = slot is None or slot.status in (WorkerStatus.EXITED, WorkerStatus.STOPPING)
            if gone or serving or now > deadline:
                book.replace, book.due_at = None, now
        if book.due_at is None and book.first_deadline is not None:
            starting = any(s.status is WorkerStatus.STARTING for s in self.live_workers())
            if not starting or now > book.first_deadline:
                book.first_deadline, book.due_at = None, now
        if book.due_at is not None and now >= book.due_at:
            book.due_at = None
            return [StartSpare()]
        return []
