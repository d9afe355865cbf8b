"""Instance Manager: membership of agents (nodes) and their GPUs, liveness, cost.

Pure logic (paper §4.1 Fig. 7; docs/architecture.md §2): the coordinator feeds it registrations,
heartbeats and notices with ``now`` and asks it who is dead; no sockets or clocks here.
It also integrates the GPUs the run holds over time for the cost meter (cost = ∫ GPU
count dt × hourly price, paper §6.2 / Appendix A): every live agent node's GPUs (spot and
reserved rollout workers) and every GPU held outside an agent -- the Train Workers' GPUs,
which the coordinator :meth:`InstanceManager.hold` s from its start to its end. A GPU is
billed once however many processes share it: a reserved node's GPU that runs both a
trainer rank and a colocated Rollout Worker (paper §6.1) is keyed by ``(host, gpu)``
when both name the same ``host``.

Node status::

    ALIVE ──notice──▶ DRAINING ──bye / missed heartbeats──▶ DEAD
      └──────────────── missed heartbeats / bye ───────────▶ DEAD
"""

from __future__ import annotations

import dataclasses
import enum


class NodeStatus(str, enum.Enum):
    ALIVE = "alive"  # registered and heartbeating
    DRAINING = "draining"  # a preemption notice arrived; no new work, commits expected
    DEAD = "dead"  # said goodbye or missed heartbeats; its leases were re-enqueued


VALID_NODE_TRANSITIONS: dict[NodeStatus, frozenset[NodeStatus]] = {
    NodeStatus.ALIVE: frozenset({NodeStatus.DRAINING, NodeStatus.DEAD}),  # notice; bye or timeout
    NodeStatus.DRAINING: frozenset({NodeStatus.DEAD}),  # bye after commit, or timeout
    NodeStatus.DEAD: frozenset(),  # a node that comes back registers as a new session
}


@dataclasses.dataclass
class NodeRecord:
    node_id: str
    session: str
    gpus: list[int]
    is_spot: bool
    registered_at: float
    last_seen: float
    status: NodeStatus = NodeStatus.ALIVE
    workers: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """worker id → GPUs, from the latest heartbeat."""
    detector_healthy: bool = True
    detector_error: str = ""
    workers_error: str = ""
    """Why some of its GPUs get no workers any more (the agent gave them up); empty when none."""
    gpus_given_up: list[int] = dataclasses.field(default_factory=list)
    """Those GPUs: billed while the node lives, but no rollout capacity."""
    notices: list[dict] = dataclasses.field(default_factory=list)
    history: list[tuple[NodeStatus, float, str]] = dataclasses.field(default_factory=list)
    host: str = ""
    """Billing host ("" = the node is its own host): GPUs of nodes and holds that name the
    same host and index are one GPU, billed once."""
    instance_id: str = ""
    """The agent process's random id from REGISTER ("" = an agent that sends none)."""

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    @property
    def num_serving_gpus(self) -> int:
        """GPUs that can serve rollouts: the node's, less those its agent gave up."""
        return len(set(self.gpus) - set(self.gpus_given_up))


@dataclasses.dataclass(frozen=True)
class Claim:
    """What :meth:`InstanceManager.claim` decided about a REGISTER for a node id.

    ``decision``:

    * ``"new"`` -- no live session holds the node id;
    * ``"same"`` -- the holder is the same agent process (same instance id, or one side sent
      none: agents that predate instance ids re-register as before): it reconnects;
    * ``"replaces_silent"`` -- another agent process, but the holder has not been heard from for
      longer than the heartbeat timeout: it is gone, the claimant takes the node id;
    * ``"in_use"`` -- another agent process while the holder is alive: refuse the claimant.

    ``alive_since`` / ``silent_s`` describe the holder (registration time on the caller's clock,
    seconds since it was last heard from; 0 without a holder); ``retry_after_s`` (``in_use``
    only) is how long the holder must stay silent before a claim would succeed.
    """

    decision: str
    holder_instance: str = ""
    alive_since: float = 0.0
    silent_s: float = 0.0
    retry_after_s: float = 0.0

    @property
    def accepted(self) -> bool:
        return self.decision != "in_use"


SPOT_EVENT_KEYS = ("notices", "revocations", "additions")
"""Keys of :meth:`InstanceManager.take_spot_counts`."""


class InstanceManager:
    """Args:
    heartbeat_timeout_s: silence after which a node is declared dead.
    """

    def __init__(self, heartbeat_timeout_s: float):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.nodes: dict[str, NodeRecord] = {}
        self._gpu_seconds = {True: 0.0, False: 0.0}
        self._held: dict[str, tuple[str, tuple[int, ...]]] = {}  # holder -> (host, GPUs): reserved GPUs outside agents
        self._last_integrate: float | None = None
        self._counts = dict.fromkeys(SPOT_EVENT_KEYS, 0)

    def take_spot_counts(self) -> dict[str, int]:
        """Spot events since the previous call (then reset), for one ``metrics.jsonl`` row:

        * ``notices`` -- preemption notices received (node or per-GPU scope; hints such as
          AWS rebalance recommendations not counted);
        * ``revocations`` -- spot GPUs that left: dropped from a heartbeat's GPU list, or
          still held by a spot node that said goodbye or missed its heartbeats;
        * ``additions`` -- spot GPUs that arrived: a spot node's registration (its GPUs)
          or GPUs added to a heartbeat's list.

        Reserved nodes are not counted. Counts are ints >= 0; nothing is checkpointed.
        """
        out, self._counts = self._counts, dict.fromkeys(SPOT_EVENT_KEYS, 0)
        return out

    def _set(self, rec: NodeRecord, status: NodeStatus, now: float, detail: str) -> None:
        if status not in VALID_NODE_TRANSITIONS[rec.status]:
            raise ValueError(f"node {rec.node_id}: {rec.status.value} -> {status.value} is not allowed")
        rec.status = status
        rec.history.append((status, now, detail))

    def _gpu_keys(self) -> tuple[set[tuple[bool, str, int]], set[tuple[bool, str, int]]]:
        """``(node GPUs, held GPUs)`` as ``(is_spot, billing host, index)`` keys: the GPUs of
        non-dead nodes (draining ones included: they are held until they leave) and of
        :meth:`hold` s (always reserved)."""
        nodes: set[tuple[bool, str, int]] = set()
        for rec in self.nodes.values():
            if rec.status != NodeStatus.DEAD:
                host = rec.host or f"node:{rec.node_id}"
                nodes.update((rec.is_spot, host, g) for g in rec.gpus)
        held = {(False, host or f"hold:{holder}", g) for holder, (host, gpus) in self._held.items() for g in gpus}
        return nodes, held

    def billed_gpus(self) -> dict[bool, int]:
        """GPUs billed right now, ``{is_spot: count}``: the distinct GPUs of non-dead nodes
        (draining ones included: they are held until they leave) and of :meth:`hold` s."""
        nodes, held = self._gpu_keys()
        out = {True: 0, False: 0}
        for is_spot, _, _ in nodes | held:
            out[is_spot] += 1
        return out

    def gpu_counts(self) -> dict[str, int]:
        """The GPUs of :meth:`billed_gpus` for ``spotlight status``: ``spot`` and ``reserved``
        (distinct GPUs, exactly those the cost meter bills), and the reserved ones by use:
        ``train`` (held outside agents: the Train Workers' GPUs) and ``reserved_rollout`` (GPUs
        of non-dead reserved agent nodes). A trainer's GPU that also hosts a reserved Rollout
        Worker is in both, and once in ``reserved``."""
        nodes, held = self._gpu_keys()
        billed = self.billed_gpus()
        return {
            "spot": billed[True],
            "reserved": billed[False],
            "train": len(held),
            "reserved_rollout": sum(1 for k in nodes if not k[0]),
        }

    def integrate(self, now: float) -> None:
        """Accumulate billed GPU-seconds (spot and reserved, :meth:`billed_gpus`) up to ``now``."""
        if self._last_integrate is not None and now <= self._last_integrate:
            return  # out-of-order timestamp: never count an interval twice
        if self._last_integrate is not None:
            dt = now - self._last_integrate
            for is_spot, n in self.billed_gpus().items():
                self._gpu_seconds[is_spot] += dt * n
        self._last_integrate = now

    def hold(self, holder: str, gpus: list[int], now: float, *, host: str = "") -> None:
        """Bill reserved ``gpus`` that no agent reports, from ``now`` until :meth:`release`
        (the coordinator holds the Train Workers' GPUs, ``"trainers"``, for the whole run).

        Args:
            holder: name of the hold; holding it again replaces its GPUs from ``now``.
            gpus: GPU indices on ``host``.
            host: billing host; a reserved node registered with the same host and a GPU of
                the same index shares that GPU (billed once). "" = the hold's own GPUs.

        Raises:
            ValueError: repeated GPU indices or a negative one.
        """
        if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
            raise ValueError(f"hold {holder!r}: GPUs must be distinct indices >= 0, got {gpus}")
        self.integrate(now)
        self._held[holder] = (host, tuple(gpus))

    def release(self, holder: str, now: float) -> None:
        """End a :meth:`hold` at ``now`` (no-op for an unknown holder)."""
        self.integrate(now)
        self._held.pop(holder, None)

    def claim(self, node_id: str, instance_id: str, now: float) -> Claim:
        """May the agent process ``instance_id`` register as ``node_id`` at ``now``? Changes
        nothing (see :class:`Claim`). A live holder is one heard from within the heartbeat
        timeout, the same bound :meth:`reap` uses: a crashed agent's node id is free again once
        its heartbeats time out, while a second live agent with the same id is refused."""
        rec = self.nodes.get(node_id)
        if rec is None or rec.status == NodeStatus.DEAD:
            return Claim("new")
        silent_s = max(0.0, now - rec.last_seen)
        held = dict(holder_instance=rec.instance_id, alive_since=rec.registered_at, silent_s=silent_s)
        if not instance_id or not rec.instance_id or instance_id == rec.instance_id:
            return Claim("same", **held)
        if silent_s > self.heartbeat_timeout_s:
            return Claim("replaces_silent", **held)
        return Claim("in_use", retry_after_s=self.heartbeat_timeout_s - silent_s, **held)

    def register(
        self,
        node_id: str,
        session: str,
        gpus: list[int],
        is_spot: bool,
        now: float,
        *,
        host: str = "",
        instance_id: str = "",
    ) -> list[str]:
        """Add (or replace) a node. Returns worker ids of a previous session of the same
        node id, which the caller must treat as dead (their leases are re-enqueued).
        ``host``: billing host (see :class:`NodeRecord`; "" = its own). ``instance_id``: the
        agent process's id (:meth:`claim` decides whether it may replace a live holder)."""
        self.integrate(now)
        old = self.nodes.get(node_id)
        stale = list(old.workers) if old is not None and old.status != NodeStatus.DEAD else []
        if old is not None and old.status != NodeStatus.DEAD and old.is_spot:
            self._counts["revocations"] += old.num_gpus  # the previous session's GPUs are gone
        rec = NodeRecord(node_id, session, list(gpus), is_spot, now, now, host=host, instance_id=instance_id)
        rec.history.append((NodeStatus.ALIVE, now, "registered"))
        if is_spot:
            self._counts["additions"] += len(rec.gpus)
        self.nodes[node_id] = rec
        return stale

    def session_ok(self, node_id: str, session: str) -> bool:
        rec = self.nodes.get(node_id)
        return rec is not None and rec.session == session and rec.status != NodeStatus.DEAD

    def heartbeat(
        self,
        node_id: str,
        now: float,
        *,
        workers: dict[str, list[int]] | None = None,
        detector_healthy: bool | None = None,
        detector_error: str | None = None,
        workers_error: str | None = None,
        gpus_given_up: list[int] | None = None,
        gpus: list[int] | None = None,
    ) -> None:
        """Liveness (and, when given, the node's current workers, GPUs, given-up GPUs and
        detector health)."""
        self.integrate(now)
        rec = self.nodes[node_id]
        rec.last_seen = now
        if gpus is not None:
            if rec.is_spot:
                before, after = set(rec.gpus), set(gpus)
                self._counts["revocations"] += len(before - after)
                self._counts["additions"] += len(after - before)
            rec.gpus = list(gpus)
        if workers is not None:
            rec.workers = workers
        if detector_healthy is not None:
            rec.detector_healthy = detector_healthy
        if detector_error is not None:
            rec.detector_error = detector_error
        if workers_error is not None:
            rec.workers_error = workers_error
        if gpus_given_up is not None:
            rec.gpus_given_up = sorted(set(gpus_given_up) & set(rec.gpus))

    def notice(self, node_id: str, notice: dict, now: float) -> None:
        """A preemption notice for the node (scope "node") or some of its GPUs."""
        rec = self.nodes[node_id]
        rec.notices.append(notice)
        if rec.is_spot and not notice.get("is_hint"):
            self._counts["notices"] += 1
        rec.last_seen = now
        if notice.get("scope", "node") == "node" and not notice.get("is_hint") and rec.status == NodeStatus.ALIVE:
            self._set(rec, NodeStatus.DRAINING, now, f"notice from {notice.get('source')}")

    def goodbye(self, node_id: str, now: float, reason: str) -> list[str]:
        """Node left cleanly; returns its worker ids (leases to release)."""
        self.integrate(now)
        rec = self.nodes.get(node_id)
        if rec is None or rec.status == NodeStatus.DEAD:
            return []
        self._set(rec, NodeStatus.DEAD, now, f"bye: {reason}")
        if rec.is_spot:
            self._counts["revocations"] += rec.num_gpus
        return list(rec.workers)

    def reap(self, now: float) -> dict[str, list[str]]:
        """Declare nodes silent for longer than the timeout dead.

        Returns:
            node id → its worker ids, for each node newly declared dead.
        """
        self.integrate(now)
        dead = {}
        for rec in self.nodes.values():
            if rec.status != NodeStatus.DEAD and now - rec.last_seen > self.heartbeat_timeout_s:
                self._set(rec, NodeStatus.DEAD, now, f"no heartbeat for {now - rec.last_seen:.1f}s")
                if rec.is_spot:
                    self._counts["revocations"] += rec.num_gpus
                dead[rec.node_id] = list(rec.workers)
        return dead

    def live(self, *, spot: bool | None = None) -> list[NodeRecord]:
        return [r for r in self.nodes.values() if r.status == NodeStatus.ALIVE and (spot is None or r.is_spot == spot)]

    def num_spot_gpus(self) -> int:
        """N_spot for the Planner: GPUs of live, non-draining spot nodes that can serve (a GPU
        the agent gave up is billed but plans no work)."""
        return sum(r.num_serving_gpus for r in self.live(spot=True))

    def gpu_seconds(self, *, spot: bool) -> float:
        return self._gpu_seconds[spot]

    def state_dict(self) -> dict:
        """JSON-able cost state for the run checkpoint: accumulated GPU-seconds (seconds × GPUs)
        of spot and reserved nodes. Nodes are not saved: after a coordinator restart every
        agent registers again."""
        return {"version": 1, "gpu_seconds": {"spot": self._gpu_seconds[True], "reserved": self._gpu_seconds[False]}}

    def load_state_dict(self, d: dict) -> None:
        """Restore the GPU-seconds of :meth:`state_dict` (nodes and the integration clock are
        untouched: time the coordinator was down is not billed here).

        Raises:
            ValueError: unknown state version or negative GPU-seconds.
        """
        if d.get("version") != 1:
            raise ValueError(f"unsupported instance manager state version {d.get('version')!r}")
        spot, reserved = float(d["gpu_seconds"]["spot"]), float(d["gpu_seconds"]["reserved"])
        if not (spot >= 0 and reserved >= 0):
            raise ValueError(f"GPU-seconds must be >= 0, got spot={spot}, reserved={reserved}")
        self._gpu_seconds = {True: spot, False: reserved}

    def cost_usd(self, spot_usd_per_gpu_hour: float, reserved_usd_per_gpu_hour: float) -> float:
        return (
            self._gpu_seconds[True] * spot_usd_per_gpu_hour + self._gpu_seconds[False] * reserved_usd_per_gpu_hour
        ) / 3600.0


def cost_metrics(
    spot_gpu_s: float,
    reserved_gpu_s: float,
    spot_usd_per_gpu_hour: float,
    reserved_usd_per_gpu_hour: float,
    *,
    requests_total: int,
    requests_in_iteration: int,
    iteration_s: float,
) -> dict[str, float]:
    """The cost and throughput columns of a ``metrics.jsonl`` row (paper §6.2, §6.7 Fig. 15).

    Args:
        spot_gpu_s, reserved_gpu_s: billed GPU-seconds so far (:meth:`InstanceManager.gpu_seconds`;
            reserved includes the Train Workers' GPUs).
        spot_usd_per_gpu_hour, reserved_usd_per_gpu_hour: prices (``[cost]``).
        requests_total: rollout + exploration requests completed so far in the run.
        requests_in_iteration: those completed during this iteration.
        iteration_s: the iteration's wall seconds.

    Returns:
        ``cost/usd`` (total), ``cost/spot_usd``, ``cost/reserved_usd`` (USD so far),
        ``cost/usd_per_1k_requests`` (run cost so far per 1,000 completed requests; NaN
        before any), ``throughput/requests_per_s`` (this iteration's requests per wall
        second; NaN for a zero-length iteration) and ``requests/completed``
        (``requests_in_iteration``).
    """
    spot_usd = spot_gpu_s / 3600.0 * spot_usd_per_gpu_hour
    reserved_usd = reserved_gpu_s / 3600.0 * reserved_usd_per_gpu_hour
    total = spot_usd + reserved_usd
    return {
        "cost/usd": total,
        "cost/spot_usd": spot_usd,
        "cost/reserved_usd": reserved_usd,
        "cost/usd_per_1k_requests": 1000.0 * total / requests_total if requests_total > 0 else float("nan"),
        "throughput/requests_per_s": requests_in_iteration / iteration_s if iteration_s > 0 else float("nan"),
        "requests/completed": float(requests_in_iteration),
    }
