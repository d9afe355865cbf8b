"""The control plane: who may send what, validation, and one handler per message type.

Every inbound message (already authenticated, size-checked and decoded by
:class:`~spotlight.coordinator.server.ControlServer`) goes through :meth:`ControlPlane.handle`:

    role check ─▶ session check (REGISTER excepted) ─▶ handler: validate everything ─▶ change state

Anything wrong with a message — bad frames, a role that may not send it, a foreign node id,
session or lease, an impossible value — is answered with one ERROR and one log line and
changes nothing (docs/architecture.md §9). Handlers use the pure cores directly (Request
Scheduler, Instance Manager) and the Tensor Store; whatever belongs to the run — may workers
pull now, the prompts' conditioning, what an accepted result becomes, the status snapshot —
they ask of a :class:`RunPort`, and they report what workers do to :class:`WorkerEvents`. The
coordinator is the real run; :class:`spotlight.coordinator.fixed_run.FixedRun` is a run of one
weight version that never ends, for tests and benchmarks that exercise agents and workers
against the real control plane.
Trainer-channel messages go to the :class:`~spotlight.coordinator.trainer_group.TrainerGroup`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
import secrets
import time
from typing import Protocol

import msgspec
import torch

from spotlight import protocol as P
from spotlight.config import SpotlightConfig
from spotlight.coordinator.server import PUBLIC, TRAINER, ControlServer, Inbound, Rejected
from spotlight.core.events import EventLog
from spotlight.core.instance_manager import InstanceManager
from spotlight.core.offload import OffloadMeter, Residency, device_word, shares_trainer_gpu, trainer_gpus
from spotlight.core.request_scheduler import RequestScheduler, RequestStatus
from spotlight.errors import SpotlightError
from spotlight.models.lora import lora_spec
from spotlight.net.security import Principal, ServerKeys, reload_allow_list
from spotlight.rl.batch import keeps_window
from spotlight.store.tensor_store import TensorStore, check_key
from spotlight.store.tensor_wire import pack_tensors, unpack_tensors
from spotlight.store.weight_sync import WeightSyncError, fetch_replies

log = logging.getLogger("spotlight.coordinator")

__all__ = ["AGENT_MESSAGES", "ControlPlane", "Peer", "RunPort", "WorkerEvents"]

AGENT_MESSAGES = frozenset(
    {
        P.MsgType.REGISTER,
        P.MsgType.HEARTBEAT,
        P.MsgType.PULL,
        P.MsgType.RESULT,
        P.MsgType.COMMIT,
        P.MsgType.FAIL,
        P.MsgType.FETCH_WEIGHTS,
        P.MsgType.NOTICE,
        P.MsgType.BYE,
    }
)
"""What an ``agent`` / ``reserved`` key may send (besides STATUS_REQUEST, open to every role)."""
TRAINER_MESSAGES = frozenset(
    {
        P.MsgType.TRAIN_HELLO,
        P.MsgType.TRAIN_HEARTBEAT,
        P.MsgType.TRAIN_READY,
        P.MsgType.TRAIN_DONE,
        P.MsgType.WEIGHTS,
        P.MsgType.WEIGHTS_CHUNK,
    }
)
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
STATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
MAX_GPUS_PER_NODE = P.MAX_GPUS_PER_NODE


@dataclasses.dataclass
class Peer:
    """An authenticated connection (keyed by its routing id) and the node it registered."""

    principal: Principal
    node_id: str | None = None


class WorkerEvents(Protocol):
    """Where the control plane reports what workers do (the iteration core's busy meter)."""

    def worker_seen(self, worker_id: str, is_spot: bool, now: float) -> None: ...

    def worker_gone(self, worker_id: str, now: float) -> None: ...

    def lease_started(self, worker_id: str, now: float) -> None: ...

    def lease_ended(self, worker_id: str, now: float) -> None: ...


class RunPort(Protocol):
    """What the control plane asks of the run it serves."""

    def accepts_pulls(self) -> bool:
        """Workers may be leased requests now (a phase with work to hand out)."""

    def conditioning(self, prompt_indices: list[int]) -> dict[str, torch.Tensor]:
        """The text conditioning of these prompts, one row each (``cond.*`` tensors)."""

    def on_results(self, body: P.Result, completed: list[tuple[int, object]], tensors: dict, now: float) -> None:
        """Requests a RESULT completed: ``(row in the result's tensors, Request)`` each."""

    def snapshot(self) -> dict:
        """What ``spotlight status`` shows (:mod:`spotlight.coordinator.status`)."""


class ControlPlane:
    """Authorization, validation and the message handlers of one run.

    Args:
        cfg: the run config (cluster limits and the facts a REGISTERED reply carries).
        sched, instances, store: the run's Request Scheduler, Instance Manager and Tensor Store.
        events: the run's event log (joins, notices, revocations, commits, …).
        run: the run this control plane serves (:class:`RunPort`).
        workers: where worker events go (:class:`WorkerEvents`; the coordinator's iteration core).
        keys: the coordinator's keys (their allow-list is reloaded when it changes on disk).
        trainers: handler of trainer-channel messages (None: trainer messages are refused).
    """

    def __init__(
        self,
        cfg: SpotlightConfig,
        sched: RequestScheduler,
        instances: InstanceManager,
        store: TensorStore,
        events: EventLog,
        run: RunPort,
        workers: WorkerEvents,
        *,
        keys: ServerKeys | None = None,
        trainers=None,
    ):
        self.cfg, self.sched, self.instances, self.store, self.events = cfg, sched, instances, store, events
        self.run, self.workers, self.keys, self.trainers = run, workers, keys, trainers
        self.server: ControlServer | None = None
        self.peers: dict[bytes, Peer] = {}
        self.node_route: dict[str, bytes] = {}  # node id -> routing id of its current connection
        self.node_owner: dict[str, str] = {}  # node id -> principal that first registered it
        self.worker_node: dict[str, str] = {}  # worker id -> its node
        self.max_gpus_per_node = MAX_GPUS_PER_NODE
        self.rejected = 0
        self.handler_errors = 0
        self.requests_done = 0  # rollout + exploration requests completed
        self.requests_parked = 0  # requests parked after cluster.max_request_failures reported failures
        self.weight_chunks_served = 0
        self.worker_versions: dict[str, tuple[int, ...]] = {}  # worker id → versions it holds (its last PULL)
        self.residency: dict[str, Residency] = {}  # worker id → where its weights are (its last PULL)
        self.offload = OffloadMeter()
        """What giving device memory back to the Train Workers cost (``spotlight/core/offload.py``)."""
        self._train_gpus = trainer_gpus(cfg.train.ranks_per_node)  # the GPUs of the reserved node's ranks
        self._clashes: set[tuple[str, str, str]] = set()  # (node, holder's, claimant's instance id) refused
        self._allow_list_mtime = 0.0

    # ------------------------------------------------------------ wire
    def attach(self, server: ControlServer) -> None:
        """Serve on ``server``'s sockets (the coordinator's start)."""
        self.server = server
        server.describe_peer = self.peer_name

    def peer_name(self, identity: bytes, *, principal: Principal | None = None, claimed_node: str = "") -> str:
        """The peer behind a connection as a log line names it: by node id and key (``node spot-0
        (agent.local)``), a train worker by rank, else by key and the node it claims; never by
        its ZeroMQ routing id, which means nothing to a person."""
        peer = self.peers.get(identity)
        if peer is not None and peer.node_id:
            return f"node {peer.node_id} ({peer.principal.id})"
        ranks = getattr(self.trainers, "ids", {})
        rank = next((r for r, i in ranks.items() if i == identity), None)
        if rank is not None:
            return f"train worker rank {rank}"
        key = peer.principal if peer is not None else principal
        who = key.id if key is not None else "an unauthenticated peer"
        if claimed_node:  # the sender's word, not checked yet: quoted unless it is a valid node id
            node = claimed_node if NODE_ID.match(claimed_node) else repr(claimed_node[:64])
            return f"{who} for node {node} (not registered on this connection)"  # a REGISTER, or a stale session
        return f"{who} (no registered node)"

    def serve_once(self, timeout_ms: int = 50) -> int:
        """Handle whatever arrives within ``timeout_ms``; returns how many messages."""
        msgs = self.server.poll(timeout_ms)
        for msg in msgs:
            self.handle(msg)
        return len(msgs)

    def send(self, identity: bytes, msg, frames=None) -> bool:
        """Reply to a public peer (agent, status client); never blocks (see ControlServer.send)."""
        return self.server.send(PUBLIC, identity, msg, frames)

    def error_to(
        self,
        identity: bytes,
        code: str,
        message: str,
        channel: str = PUBLIC,
        *,
        retry_after_s: float = 0.0,
        principal: Principal | None = None,
        claimed_node: str = "",
    ) -> None:
        """One log line and an ERROR reply; nothing else changes (docs/architecture.md §9).
        ``principal`` and ``claimed_node`` (the message's key and ``node_id``) name a peer that
        has no registered node on this connection (:meth:`peer_name`)."""
        self.rejected += 1
        who = self.peer_name(identity, principal=principal, claimed_node=claimed_node)
        # an agent of an earlier coordinator (resume) or a forgotten session heartbeats until it
        # re-registers, which the ERROR reply makes it do: expected, so INFO; the rest is ERROR
        # node_id_in_use: on_register logs each clash once at WARNING, not each refused REGISTER
        level = logging.INFO if code in ("unknown_session", "node_id_in_use") else logging.ERROR
        log.log(level, "rejected message from %s: %s: %s", who, code, message[:300])
        self.server.send(channel, identity, P.ErrorMsg(code=code, message=message[:1000], retry_after_s=retry_after_s))

    # ------------------------------------------------------------ dispatch
    def handle(self, msg: Inbound) -> None:
        """Authorize and dispatch one inbound message; a refusal is one ERROR reply."""
        rid = msg.routing_id
        claimed = getattr(msg.body, "node_id", "")
        named = {"principal": msg.principal, "claimed_node": claimed if isinstance(claimed, str) else ""}
        if msg.error is not None:
            self.error_to(rid, "malformed", msg.error, msg.channel, **named)
            return
        try:
            self._dispatch(msg, time.monotonic())
            self.drop_released_states()
        except Rejected as exc:
            self.error_to(rid, exc.code, str(exc), msg.channel, retry_after_s=exc.retry_after_s, **named)
        except Exception as exc:  # a handler bug must not stop the run: report and carry on
            self.handler_errors += 1
            log.error(
                "internal error handling %s from %s: %s: %s",
                msg.mtype.name,
                self.peer_name(rid, **named),
                type(exc).__name__,
                exc,
                exc_info=self.handler_errors <= 3,
            )
            self.server.send(
                msg.channel, rid, P.ErrorMsg(code="internal", message=f"{type(exc).__name__}: {exc}"[:1000])
            )

    def _dispatch(self, msg: Inbound, now: float) -> None:
        mtype, body, principal = msg.mtype, msg.body, msg.principal
        if principal is None:
            raise Rejected("auth", "no authenticated principal on this connection")
        role = principal.role
        if msg.channel == TRAINER:
            if role != "trainer" or mtype not in TRAINER_MESSAGES or self.trainers is None:
                raise Rejected("forbidden", f"{principal.id} may not send {mtype.name} on the trainer socket")
            self.trainers.handle(msg.routing_id, mtype, body, msg.payload, now)
            return
        if mtype == P.MsgType.STATUS_REQUEST:
            self.send(msg.routing_id, P.Status(snapshot=self.run.snapshot()))
            return
        if role not in ("agent", "reserved") or mtype not in AGENT_MESSAGES:
            raise Rejected("forbidden", f"{principal.id} ({role}) may not send {mtype.name}")
        if mtype == P.MsgType.REGISTER:
            self.on_register(msg.routing_id, principal, body, now)
            return
        node_id = getattr(body, "node_id", "")
        if not self._session_ok(msg.routing_id, node_id, getattr(body, "session", "")):
            raise Rejected("unknown_session", f"{mtype.name} from an unregistered or stale session (node {node_id!r})")
        wid = getattr(body, "worker_id", None)
        if wid and not wid.startswith(node_id + "/"):
            raise Rejected("forbidden", f"worker {wid!r} does not belong to node {node_id!r}")
        handler = getattr(self, f"on_{mtype.name.lower()}")
        handler(msg.routing_id, body, msg.payload, now)  # validates fully before it changes anything
        if mtype not in (P.MsgType.HEARTBEAT, P.MsgType.BYE):
            self.instances.heartbeat(node_id, now)

    def _session_ok(self, identity: bytes, node_id: str, session: str) -> bool:
        peer = self.peers.get(identity)
        return (
            peer is not None
            and peer.node_id is not None
            and node_id == peer.node_id
            and self.node_route.get(node_id) == identity
            and self.instances.session_ok(node_id, session)
        )

    def release_node(self, node_id: str, worker_ids, reason: str, now: float) -> None:
        """Give back every request held by ``worker_ids`` and by any other worker seen on
        ``node_id`` (they are re-enqueued, or resume from a commit); the workers are gone."""
        gone = list(worker_ids) + [w for w, node in self.worker_node.items() if node == node_id]
        for wid in dict.fromkeys(gone):
            self.sched.release_worker(wid, reason=reason, now=now)
            self.workers.worker_gone(wid, now)

    # ------------------------------------------------------------ membership
    def on_register(self, identity: bytes, principal: Principal, body: P.Register, now: float) -> None:
        self._check_register(identity, principal, body)
        claim = self.instances.claim(body.node_id, body.instance_id, now)
        if not claim.accepted:
            self._refuse_clash(principal, body, claim, now)
        # ---- accepted: from here on state changes
        self.node_owner[body.node_id] = principal.id
        old_route = self.node_route.get(body.node_id)
        if claim.decision == "replaces_silent":
            log.warning(
                "node %s registered by a new agent process: the previous one was silent for %.1fs "
                "(over cluster.heartbeat_timeout_s) and is replaced",
                body.node_id,
                claim.silent_s,
            )
        if old_route is not None and old_route != identity:
            self.peers.pop(old_route, None)  # a restarted agent: its old connection speaks no more
            if claim.decision != "replaces_silent":
                log.warning(
                    "node %s re-registered from a new connection: its previous session is replaced", body.node_id
                )
        self.peers[identity] = Peer(principal, body.node_id)
        self.node_route[body.node_id] = identity
        session = secrets.token_hex(8)
        host = "" if body.is_spot else body.hostname
        stale = self.instances.register(
            body.node_id, session, body.gpus, body.is_spot, now, host=host, instance_id=body.instance_id
        )
        self.release_node(body.node_id, stale, "agent re-registered", now)
        n, kind = len(body.gpus), "spot" if body.is_spot else "reserved"
        log.info("agent %s joined as %s (%d GPUs, spot=%s)", body.node_id, principal.id, n, body.is_spot)
        again = " (re-registered)" if old_route is not None else ""
        self.events.append(now, "join", body.node_id, f"{n} {kind} GPU{'s' if n != 1 else ''}{again}")
        self.send(identity, self._registered(body, session))

    def _check_register(self, identity: bytes, principal: Principal, body: P.Register) -> None:
        if body.protocol_version != P.PROTOCOL_VERSION:
            raise Rejected(
                "version",
                f"protocol version {body.protocol_version} not supported (coordinator speaks {P.PROTOCOL_VERSION})",
            )
        if not NODE_ID.match(body.node_id):
            raise Rejected("bad_request", f"node_id {body.node_id!r}: use letters, digits, '.', '_', '-' (at most 128)")
        gpus = body.gpus
        if not gpus or len(set(gpus)) != len(gpus) or len(gpus) > self.max_gpus_per_node:
            raise Rejected("bad_request", f"gpus must be 1-{self.max_gpus_per_node} distinct indices, got {len(gpus)}")
        if not body.is_spot and principal.role != "reserved":
            raise Rejected(
                "forbidden", f"{principal.id} may register only spot nodes (is_spot=false needs a 'reserved' key)"
            )
        if body.is_spot and not self.cfg.cluster.use_spot:
            raise Rejected(
                "forbidden", f"this run uses no spot GPUs (run.mode = {self.cfg.run.mode!r}, cluster.use_spot = false)"
            )
        owner = self.node_owner.get(body.node_id)
        if owner is not None and owner != principal.id:
            raise Rejected("node_id_taken", f"node id {body.node_id!r} belongs to another key ({owner})")
        old_peer = self.peers.get(identity)
        if old_peer is not None and old_peer.node_id not in (None, body.node_id):
            raise Rejected("bad_request", f"this connection is already node {old_peer.node_id!r}")

    def _refuse_clash(self, principal: Principal, body: P.Register, claim, now: float) -> None:
        """A second live agent claims a node id in use: refused, logged once per clash."""
        since = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() - (now - claim.alive_since)))
        text = (
            f"node id {body.node_id} is in use by another live agent (registered since {since}, "
            f"{now - claim.alive_since:.0f}s; last heard from {claim.silent_s:.1f}s ago)"
        )
        clash = (body.node_id, claim.holder_instance, body.instance_id)
        if clash not in self._clashes:  # once per clash, however often the claimant retries
            self._clashes.add(clash)
            who = f"{body.hostname or '?'} pid {body.pid}" if body.pid else (body.hostname or "?")
            log.warning(
                "refused a second agent (%s, key %s) claiming %s; the running agent keeps the node",
                who,
                principal.id,
                text,
            )
            self.events.append(now, "refused", body.node_id, f"node id in use: a second agent ({who}) was refused")
        raise Rejected("node_id_in_use", text, retry_after_s=claim.retry_after_s + 0.5)

    def _usable_sp_degrees(self, degree: int) -> list[int]:
        """The SP degrees up to ``degree`` the run's model can be split by (read once from the
        checkpoint's configs; :func:`spotlight.workers.sp.degrees.usable_degrees`)."""
        cache = self.__dict__.setdefault("_sp_degrees", {})
        if degree not in cache:
            if degree <= 1:
                cache[degree] = [1]
            else:
                from spotlight.models.families import get_family
                from spotlight.workers.sp.degrees import sp_shape, usable_degrees

                try:
                    shape = sp_shape(get_family(self.cfg.model))
                    cache[degree] = usable_degrees(shape, degree, cfg_parallel=self.cfg.cluster.sp_cfg_parallel)
                except Exception as exc:  # checked before the run started; never stop registrations for it
                    log.warning("cannot read the model's SP shape (%s): every SP degree up to %d is used", exc, degree)
                    cache[degree] = list(range(1, degree + 1))
        return cache[degree]

    def _registered(self, body: P.Register, session: str) -> P.Registered:
        c = self.cfg.cluster
        return P.Registered(
            node_id=body.node_id,
            heartbeat_interval_s=c.heartbeat_interval_s,
            lease_timeout_s=c.lease_timeout_s,
            worker_batch_size=c.worker_batch_size,
            torch_threads=c.torch_threads,
            sp_degree=c.sp_degree if body.is_spot else c.reserved_sp_degree,
            sp_degrees=self._usable_sp_degrees(c.sp_degree if body.is_spot else c.reserved_sp_degree),
            sp_cfg_parallel=c.sp_cfg_parallel,
            sp_backend=c.sp_backend,
            reconfiguration=c.reconfiguration,
            live_migration=c.live_migration,
            offload_rollout_while_training=c.offload_rollout_while_training,
            model=msgspec.to_builtins(self.cfg.model),
            sampler=msgspec.to_builtins(self.cfg.sampler),
            lora=lora_spec(self.cfg.train),
            latest_version=self.store.latest_version,
            session=session,
            weight_window_chunks=c.weight_window_chunks,
        )

    def on_heartbeat(self, identity, body: P.Heartbeat, payload, now) -> None:
        node_id = body.node_id
        for w in body.workers:
            if not w.worker_id.startswith(node_id + "/"):
                raise Rejected("forbidden", f"heartbeat names worker {w.worker_id!r} of another node")
        if body.gpus is not None and (len(set(body.gpus)) != len(body.gpus) or len(body.gpus) > self.max_gpus_per_node):
            raise Rejected("bad_request", f"gpus must be at most {self.max_gpus_per_node} distinct indices")
        self._heartbeat_events(node_id, body, now)
        self.instances.heartbeat(
            node_id,
            now,
            workers={w.worker_id: list(w.gpus) for w in body.workers},
            detector_healthy=body.detector_healthy,
            detector_error=body.detector_error,
            workers_error=body.workers_error,
            gpus_given_up=body.gpus_given_up,
            gpus=body.gpus,
        )
        is_spot = self.instances.nodes[node_id].is_spot
        for w in body.workers:
            self.worker_node[w.worker_id] = node_id
            self.workers.worker_seen(w.worker_id, is_spot, now)
            self.sched.renew(w.worker_id, now)
        self.send(identity, P.Heartbeat(node_id=node_id))  # ack: lets the agent detect a dead coordinator

    def _heartbeat_events(self, node_id: str, body: P.Heartbeat, now: float) -> None:
        """Event-log what a validated heartbeat changes: GPUs added or gone, workers re-formed
        (an SP group), the preemption detector turning unhealthy or recovering."""
        rec = self.instances.nodes[node_id]
        if body.gpus is not None and sorted(body.gpus) != sorted(rec.gpus):
            added, gone = sorted(set(body.gpus) - set(rec.gpus)), sorted(set(rec.gpus) - set(body.gpus))
            for kind, sign, which in (("add", "+", added), ("remove", "-", gone)):
                if which:
                    index = ",".join(map(str, which))
                    detail = f"{sign}{_plural(len(which), 'GPU')} (index {index}): {len(body.gpus)} now"
                    self.events.append(now, kind, node_id, detail)
        workers = {w.worker_id: sorted(w.gpus) for w in body.workers}
        if rec.workers and workers and workers != {k: sorted(v) for k, v in rec.workers.items()}:
            sizes = ", ".join(_plural(len(g), "GPU") for g in workers.values())
            self.events.append(now, "reform", node_id, f"{_plural(len(workers), 'worker')}: {sizes}")
        if body.detector_healthy != rec.detector_healthy:
            detail = f"unhealthy: {body.detector_error}" if not body.detector_healthy else "healthy again"
            self.events.append(now, "detector", node_id, detail)
        if body.workers_error and body.workers_error != rec.workers_error:
            self.events.append(now, "gave-up", node_id, body.workers_error[:300])
            log.error("node %s: %s", node_id, body.workers_error)

    def on_notice(self, identity, body: P.Notice, payload, now) -> None:
        if not math.isfinite(body.deadline_unix_s):
            raise Rejected("bad_request", "notice deadline must be a finite unix time")
        self.instances.notice(body.node_id, msgspec.to_builtins(body), now)
        left_s = body.deadline_unix_s - time.time()
        if body.kind == "revoke":
            source = f" ({body.source})" if body.source != "revoke" else ""
            self.events.append(now, "revoke", body.node_id, f"{body.scope}, {left_s:.0f}s grace{source}")
            what = f"GPU revocation ({body.scope})"
        else:
            hint = " (hint)" if body.is_hint else ""
            scope = f" for {body.scope}" if body.scope != "node" else ""
            detail = f"{body.source} {body.kind}{hint}{scope}, deadline in {left_s:.0f}s"
            self.events.append(now, "notice", body.node_id, detail)
            what = f"preemption notice ({body.source} {body.kind}{', hint' if body.is_hint else ''})"
        log.info("%s from %s: deadline in %.1fs", what, body.node_id, left_s)  # expected on spot nodes: INFO

    def on_bye(self, identity, body: P.Bye, payload, now) -> None:
        if self.instances.nodes[body.node_id].status.value != "dead":
            self.events.append(now, "leave", body.node_id, body.reason or "goodbye")
        gone = self.instances.goodbye(body.node_id, now, body.reason)
        self.release_node(body.node_id, gone, f"agent left: {body.reason}", now)

    # ------------------------------------------------------------ requests
    def versions_in_use(self) -> set[int]:
        """Weight versions the workers of live (not dead) nodes said they hold in their last PULL."""
        nodes = self.instances.nodes
        return {
            v
            for wid, versions in self.worker_versions.items()
            if (node := nodes.get(self.worker_node.get(wid, ""))) is not None and node.status.value != "dead"
            for v in versions
        }

    def shares_trainer_gpu(self, worker_id: str) -> bool:
        """True for a worker of a reserved node on a GPU a Train Worker also uses (its GPUs as its
        node's last heartbeat listed them, else the node's)."""
        node = self.instances.nodes.get(self.worker_node.get(worker_id, ""))
        if node is None:
            return False
        gpus = node.workers.get(worker_id, node.gpus)
        return shares_trainer_gpu(is_spot=node.is_spot, worker_gpus=gpus, train_gpus=self._train_gpus)

    def awaited_release(self) -> dict[str, Residency]:
        """The workers an update waits for before it trains (``spotlight/core/offload.py``):
        alive, sharing a Train Worker's GPU and managing where their weights are; each with its
        last reported residency."""
        out = {}
        for wid, residency in self.residency.items():
            node = self.instances.nodes.get(self.worker_node.get(wid, ""))
            if residency is Residency.UNMANAGED or node is None or node.status.value != "alive":
                continue
            if wid in node.workers or not node.workers:  # a worker its node no longer lists is gone
                if self.shares_trainer_gpu(wid):
                    out[wid] = residency
        return out

    def on_pull(self, identity, body: P.Pull, payload, now) -> None:
        node = self.instances.nodes[body.node_id]
        self.worker_node[body.worker_id] = body.node_id
        self.worker_versions[body.worker_id] = tuple(body.versions)
        self.residency[body.worker_id] = Residency(body.residency)
        for move in body.moves:
            self.offload.moved(body.worker_id, move.kind, move.seconds)
        self.workers.worker_seen(body.worker_id, node.is_spot, now)
        leases = []
        if self.run.accepts_pulls() and node.status.value == "alive":
            most = max(1, min(body.max_requests, self.cfg.cluster.worker_batch_size * 4))
            leases = self.sched.pull(body.worker_id, is_spot=node.is_spot, max_requests=most, now=now)
        word = device_word(
            enabled=self.cfg.cluster.offload_rollout_while_training is not False,
            shares_gpu=not node.is_spot and self.shares_trainer_gpu(body.worker_id),
            training_active=self.sched.training_active,
            leased=bool(leases),
        )
        items, tensors, prompt_indices = [], {}, []
        for i, lease in enumerate(leases):
            req = self.sched.get(lease.request_id)
            resume_step, state = lease.resume_step, None
            if resume_step is not None:
                state = self._committed_state(lease.commit_key)
                if state is None:  # lost or unreadable: the worker starts this request over
                    self.sched.commit_lost(req.request_id, lease.lease_id)  # its key is released
                    log.warning(
                        "committed state of %s (step %d) is missing or unreadable: it starts over from step 0",
                        req.request_id,
                        resume_step,
                    )
                    resume_step = None
                else:
                    tensors.update({f"state.{i}.{name}": t for name, t in state.items()})
            items.append(
                P.LeaseItem(
                    lease_id=lease.lease_id,
                    request_id=req.request_id,
                    kind=req.kind.value,
                    iteration=req.iteration,
                    prompt_index=req.prompt_index,
                    seed=req.seed,
                    weight_version=req.weight_version,
                    params=dict(req.params),
                    resume_step=resume_step,
                )
            )
            prompt_indices.append(req.prompt_index)
        if items:
            tensors.update(self.run.conditioning(prompt_indices))
            self.workers.lease_started(body.worker_id, now)
        metas, frames = pack_tensors(tensors) if tensors else ([], [])
        self.send(identity, P.Leases(worker_id=body.worker_id, items=items, tensors=metas, device=word.value), frames)

    def _committed_state(self, commit_key: str | None) -> dict[str, torch.Tensor] | None:
        """The committed state under ``commit_key`` as tensors, or None when there is none or it
        cannot be read back whole (a frame whose size does not match its meta)."""
        got = self.store.get_state(commit_key) if commit_key else None
        if got is None:
            return None
        try:
            return unpack_tensors(*got)
        except P.ProtocolError:
            return None

    def _held(self, worker_id: str, request_id: str, lease_id: int) -> bool:
        """True iff ``worker_id`` holds the current lease ``lease_id`` of ``request_id``."""
        return self.sched.holder(request_id, lease_id) == worker_id

    @staticmethod
    def _check_unique(ids: list[str]) -> None:
        if len(set(ids)) != len(ids):
            raise Rejected("bad_request", "a request id appears twice in one message")

    def on_result(self, identity, body: P.Result, payload, now) -> None:
        self._check_unique([it.request_id for it in body.items])
        try:
            tensors = unpack_tensors(body.tensors, payload) if body.items else {}
        except P.ProtocolError as exc:
            raise Rejected("malformed", f"result tensors: {exc}") from None
        B, S = len(body.items), self.cfg.model.image_size
        if body.items:
            img = tensors.get("images")
            if img is None or img.dtype != torch.uint8 or tuple(img.shape) != (B, 3, S, S):
                got = None if img is None else (tuple(img.shape), str(img.dtype))
                raise Rejected("bad_request", f"RESULT needs images [{B}, 3, {S}, {S}] uint8, got {got}")
        mine = [(i, it) for i, it in enumerate(body.items) if self._held(body.worker_id, it.request_id, it.lease_id)]
        if any(keeps_window(self.sched.get(it.request_id)) for _, it in mine):
            for name in ("window_latents", "log_probs"):
                t = tensors.get(name)
                if t is None or t.dtype != torch.float32 or t.ndim < 2 or t.shape[0] != B:
                    raise Rejected(
                        "bad_request",
                        f"a rollout RESULT (or an exploration reused as the rollout) needs {name} [{B}, ...] float32",
                    )
        # ---- validated: from here on state changes
        self.workers.lease_ended(body.worker_id, now)
        completed = []
        for i, item in mine:
            if not self.sched.complete(item.request_id, item.lease_id, now):
                continue
            self.requests_done += 1
            req = self.sched.get(item.request_id)
            completed.append((i, req))
        if len(completed) < len(body.items):
            ignored = len(body.items) - len(completed)
            log.info("ignored %d stale/duplicate/foreign results from %s", ignored, body.worker_id)
        self.run.on_results(body, completed, tensors, now)

    def on_commit(self, identity, body: P.Commit, payload, now) -> None:
        self._check_unique([it.request_id for it in body.items])
        try:
            unpack_tensors(body.tensors, payload)  # frames match their metas
        except P.ProtocolError as exc:
            raise Rejected("malformed", f"commit tensors: {exc}") from None
        by_item: dict[int, list[int]] = collections.defaultdict(list)
        for j, meta in enumerate(body.tensors):
            parts = meta.name.split(".", 2)
            if (
                len(parts) != 3
                or parts[0] != "state"
                or not parts[1].isdigit()
                or int(parts[1]) >= len(body.items)
                or not STATE_NAME.match(parts[2])
            ):
                raise Rejected("bad_request", f"commit tensor name {meta.name!r}: expected state.<item index>.<name>")
            by_item[int(parts[1])].append(j)
        mine = [(i, it) for i, it in enumerate(body.items) if self._held(body.worker_id, it.request_id, it.lease_id)]
        # ---- validated: from here on state changes
        self.workers.lease_ended(body.worker_id, now)
        for i, item in mine:
            key = check_key(f"{item.request_id}.L{item.lease_id}")
            sel = by_item.get(i, [])
            metas = [
                P.TensorMeta(body.tensors[j].name.split(".", 2)[2], body.tensors[j].dtype, body.tensors[j].shape)
                for j in sel
            ]
            self.store.put_state(key, metas, [payload[j] for j in sel])
            if not self.sched.commit(item.request_id, item.lease_id, committed_step=item.step, commit_key=key, now=now):
                self.store.delete_state(key)
        if mine:
            n, step = len(mine), max(it.step for _, it in mine)
            detail = f"{body.worker_id}: {n} request{'s' if n != 1 else ''} at step {step}"
            self.events.append(now, "commit", body.node_id, detail)
        if len(mine) < len(body.items):
            log.info("ignored %d stale/foreign commits from %s", len(body.items) - len(mine), body.worker_id)

    def on_fail(self, identity, body: P.Fail, payload, now) -> None:
        if len(body.request_ids) != len(body.lease_ids):
            raise Rejected(
                "bad_request",
                f"FAIL lists {len(body.request_ids)} request ids but {len(body.lease_ids)} lease ids",
            )
        self._check_unique(list(body.request_ids))
        mine = [(r, lid) for r, lid in zip(body.request_ids, body.lease_ids) if self._held(body.worker_id, r, lid)]
        self.workers.lease_ended(body.worker_id, now)
        parked = []
        for rid, lid in mine:
            # only a batch that raised counts toward cluster.max_request_failures (Fail.consecutive_failures)
            if self.sched.fail(rid, lid, reason=body.reason, now=now, counts=body.consecutive_failures > 0):
                req = self.sched.get(rid)
                if req.status is RequestStatus.PARKED:
                    parked.append(req)
        node = self.instances.nodes.get(body.node_id)
        preempted = node is not None and (
            node.status.value != "alive" or any(n.get("deadline_unix_s", 0.0) > time.time() - 120 for n in node.notices)
        )
        (log.info if preempted else log.warning)(
            "worker %s gave back %d requests: %s%s",
            body.worker_id,
            len(mine),
            body.reason,
            " (preempted)" if preempted else "",
        )
        if body.unhealthy:
            self.events.append(
                now,
                "unhealthy",
                body.node_id,
                f"{body.worker_id}: {body.consecutive_failures} batches in a row failed, backing off; "
                f"last: {body.reason}"[:300],
            )
        for req in parked:
            self.requests_parked += 1
            detail = (
                f"{req.request_id} ({req.kind.value}) after {req.failures} failures on "
                f"{len(req.failed_on)} workers, last on {req.worker_id}"
            )
            self.events.append(now, "parked", body.node_id, f"{detail}: {req.error}"[:300])
            log.warning("request %s parked: %s", detail, req.error)

    def on_fetch_weights(self, identity, body: P.FetchWeights, payload, now) -> None:
        """Serve a version in chunks: its WEIGHTS header (if asked) and the WEIGHTS_CHUNK
        replies ``first_chunk`` … ``first_chunk + num_chunks - 1``, clipped to the version.

        Every chunk is a zero-copy slice of the Tensor Store's memory map of the file (or of
        its in-memory bytes for a small version), and the agent asks for at most
        ``cluster.weight_window_chunks`` at a time, so what is queued for a slow agent is a
        few references into the page cache, never a copy of the version. A version not
        published (yet) gets WEIGHTS(found=False). ``first_chunk`` past the version's end is
        rejected (one ERROR) before anything is sent."""
        info = self.store.weights_info(body.version) if body.version >= 0 else None
        if info is None:
            self.send(identity, P.Weights(version=body.version, size_bytes=0, found=False))
            return
        try:
            replies = fetch_replies(
                body,
                info.size_bytes,
                self.cfg.cluster.weight_chunk_bytes,
                info.digest,
                lambda off, length: self.store.read_weights(body.version, off, length),
            )
        except WeightSyncError as exc:
            raise Rejected("bad_request", str(exc)) from None
        for msg, frames in replies:  # a pruned version ends with WEIGHTS(found=False)
            sent = self.send(identity, msg, frames or None)
            if isinstance(msg, P.WeightsChunk):
                if not sent:
                    return  # the agent's queue is full or it is gone: it asks again
                self.weight_chunks_served += 1

    # ------------------------------------------------------------ liveness
    def housekeeping(self, now: float) -> None:
        """Reload the allow-list if it changed, re-enqueue the requests of agents that missed
        their heartbeats, and expire overdue leases."""
        self._reload_allow_list()
        for node_id, workers in self.instances.reap(now).items():
            # a spot node that goes silent is what spot capacity does (preempted without a
            # notice, or its agent stopped): expected, INFO; a reserved node should not
            node = self.instances.nodes[node_id]
            (log.info if node.is_spot else log.warning)(
                "%s node %s missed heartbeats for %.0fs: re-enqueueing its requests",
                "spot" if node.is_spot else "reserved",
                node_id,
                self.instances.heartbeat_timeout_s,
            )
            self.events.append(now, "dead", node_id, self.instances.nodes[node_id].history[-1][2])
            self.release_node(node_id, workers, "agent dead", now)
        for rid in self.sched.expire(now):
            log.warning("lease of %s expired: re-enqueued", rid)
        self.drop_released_states()

    def drop_released_states(self) -> None:
        """Delete the committed states no request will resume from any more (finished,
        cancelled, parked, aborted or superseded: :meth:`RequestScheduler.take_released_commits`)."""
        for key in self.sched.take_released_commits():
            self.store.delete_state(key)

    def _reload_allow_list(self) -> None:
        """Pick up keys added or revoked with ``spotlight keys`` while the run is live."""
        d = self.keys.directory if self.keys is not None else None
        if d is None:
            return
        try:
            mtime = (d / "clients").stat().st_mtime
        except OSError:
            return
        if mtime != self._allow_list_mtime:
            self._allow_list_mtime = mtime
            try:
                reload_allow_list(self.keys)
            except SpotlightError as exc:
                log.error("allow-list not reloaded: %s", exc)

    def shutdown_agents(self, reason: str = "run finished") -> None:
        """Ask every live agent to stop (``reason`` is logged by them)."""
        for rec in self.instances.nodes.values():
            if rec.status.value in ("alive", "draining") and rec.node_id in self.node_route:
                self.send(self.node_route[rec.node_id], P.Shutdown(reason=reason))


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"
