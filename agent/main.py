"""``spotlight-agent``: the persistent per-node daemon on a spot (or reserved) node.

It registers with the coordinator over ZeroMQ (DEALER → ROUTER, identity = node id),
heartbeats, and spawns one Rollout Worker process per GPU. Workers talk only to the agent (a
local ROUTER socket); the agent relays their pulls, results and commits to the coordinator and
caches weight versions so a new worker gets them locally (paper §4.4, docs/architecture.md §5):
each version is pulled once per node, in chunks, into a file (:mod:`agent.weight_cache`) that the
workers map.

Every decision -- SP groups, what a revoked or added GPU does, live migration, the drain, the
warm spare -- is the node Scheduler's (:mod:`agent.node_scheduler`, pure). :class:`AgentDaemon` is
its thin shell: it owns the sockets, the worker and spare processes, the detector thread and the
control socket, feeds the scheduler each event and carries out the actions it returns
(:meth:`AgentDaemon._execute`).

The daemon never imports torch (``tests`` check it): GPU work happens in child
processes; tensor frames are relayed as opaque bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Annotated, Optional

import msgspec
import typer
import zmq

from agent.node_scheduler import (
    Action,
    DeliverLeases,
    Drain,
    FormGroup,
    GiveUpGpus,
    GroupServing,
    KillWorker,
    NodeScheduler,
    ReportGpus,
    ReportNotice,
    RestartNode,
    ReturnLeases,
    SpawnWorker,
    StartSpare,
    StopSpare,
    StopWorker,
)
from agent.preemption import (
    Detector,
    NoticeLedger,
    NullDetector,
    PollResult,
    PreemptionNotice,
    active_node_notice,
    make_detector,
    revoke_notice,
    sigterm_notice,
)
from agent.revocations import revocation_changes
from agent.visibility import visibility_error, worker_nccl_env, worker_visible_devices
from agent.weight_cache import WeightCache
from spotlight import protocol as P
from spotlight.net.agent_paths import control_endpoint, state_dir
from spotlight.net.ipc import ipc_endpoint, ipc_path
from spotlight.net.ports import listen_port
from spotlight.net.security import ClientKeys, KeysError, apply_client, load_client_keys
from spotlight.util.cli_paths import path_option
from spotlight.util.procs import ChildExit, LogMark, configure_logging, log_mark, scrubbed_env, spawn_logged
from spotlight.workers.rollout.spare import EXIT_SPARE_UNUSABLE

log = logging.getLogger("spotlight.agent")

app = typer.Typer(
    help="Spotlight node agent: joins a coordinator and runs Rollout Workers on this node's GPUs.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)  # plain help: readable at 80 columns

MAX_CACHED_WEIGHTS = 3
EXIT_NODE_PREEMPTED = P.EXIT_NODE_PREEMPTED  # (spotlight/protocol.py: the reserved side reads it too)
# Exit status of an agent refused because another live agent holds its node id (EX_CONFIG):
# a configuration error (two agents started with the same --node-id) that a restart cannot fix,
# so the systemd unit lists it in RestartPreventExitStatus too.
EXIT_NODE_ID_IN_USE = 78
# Exit status of an agent that heard nothing from the coordinator for --coordinator-timeout-s.
EXIT_COORDINATOR_LOST = 4
# shutdown(): after the drain, workers get SIGTERM and together at most SHUTDOWN_TERM_WAIT_S to
# exit, then SIGKILL and at most SHUTDOWN_KILL_WAIT_S to be reaped, whatever their number.
SHUTDOWN_TERM_WAIT_S = 4.0
SHUTDOWN_KILL_WAIT_S = 1.0
# Upper bound of shutdown() (seconds): Azure acknowledgement (detector timeout 2 s, at most twice
# that with spotlight.net.http_limits) + both waits + 1 s ZeroMQ linger for the Bye.  The systemd
# unit's TimeoutStopSec must exceed --grace-s + this (tests/unit/scripts/test_systemd_units.py).
SHUTDOWN_BOUND_S = 2 * 2.0 + SHUTDOWN_TERM_WAIT_S + SHUTDOWN_KILL_WAIT_S + 1.0
# Seconds a draining agent gives its workers when the coordinator is lost, the node id was taken,
# or the coordinator sent SHUTDOWN.
SHORT_STOP_S = 5.0


class _ExitWithLine(SystemExit):
    """An exit with a fixed status (``status``) and a one-line reason (``str()``)."""

    status = 1

    def __init__(self, message: str):
        super().__init__(self.status)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NodePreempted(_ExitWithLine):
    """The agent refuses to join: this VM has an active preemption notice (exit status 75)."""

    status = EXIT_NODE_PREEMPTED


class NodeIdInUse(_ExitWithLine):
    """The coordinator refused this agent: another live agent holds its node id (exit status 78)."""

    status = EXIT_NODE_ID_IN_USE


def node_id_in_use_line(node_id: str, message: str) -> str:
    """The refused agent's one error line (``message``: the coordinator's ERROR text)."""
    detail = (
        message.split("is in use by another live agent", 1)[-1].strip()
        if "is in use by another live agent" in message
        else message
    )
    return f"node id {node_id} is in use by another live agent {detail}; pick another --node-id"


class StoppedWaiting(SystemExit):
    """SIGTERM or SIGINT arrived while the agent waited for the coordinator: it exits at once
    (nothing was started), with status 128 + the signal number."""

    def __init__(self, message: str, code: int):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


REGISTER_PROGRESS_S = 5.0
"""Seconds between the 'waiting for coordinator' lines while the agent registers."""


@app.callback()
def _root() -> None:
    """Spotlight node agent."""


@dataclasses.dataclass
class Spare:
    """The node's warm spare process (``python -m spotlight.workers.rollout.spare``)."""

    proc: subprocess.Popen
    ready_fd: int
    """Read end of the pipe on which the spare writes ``ready`` once warm (non-blocking)."""
    conf_json: str
    """The worker configuration it was started with (it can only become such a worker)."""
    started_at: float
    ready: bool = False


class DetectorThread(threading.Thread):
    """Polls a preemption detector off the main loop (HTTP calls block; GCP long-polls).

    Results go to ``out`` as :class:`agent.preemption.PollResult`; errors are a state
    ("unhealthy"), never a silent "no notice".
    """

    def __init__(self, detector: Detector, out: "queue.Queue", interval_s: float):
        super().__init__(daemon=True, name="preemption-detector")
        self.detector = detector
        self.out = out
        self.interval_s = interval_s
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                res = self.detector.poll(time.time())
            except Exception as exc:  # a detector bug must not look like "no notice"
                res = PollResult([], False, f"detector crashed: {type(exc).__name__}: {exc}")
            self.out.put(res)
            self.stop_event.wait(self.interval_s)


class AgentDaemon:
    """One node's agent: the I/O shell around its :class:`agent.node_scheduler.NodeScheduler`.

    Args:
        coordinator: ``HOST:PORT`` or a ZeroMQ endpoint of the coordinator.
        gpus: GPU indices of this node that Spotlight may use.
        node_id: unique node id (default: hostname-pid).
        is_spot: False for the reserved node's own rollout workers.
        keys: this node's CURVE keys and the coordinator's public key
            (:func:`spotlight.net.security.load_client_keys`); every byte to the coordinator is
            encrypted and authenticated with them.
        register_timeout_s: give up if the coordinator does not answer the first REGISTER.
        grace_s: seconds workers get to commit in-flight state on a notice or SIGTERM.
        coordinator_timeout_s: after this long without a word from the coordinator, stop the
            workers and exit (code 4). Before that, a silent coordinator (or one that forgot
            this node's session, e.g. after a crash and ``--resume``) is re-registered with
            exponential backoff (1 s … 30 s) while the workers keep running.
        warm_spare: keep one pre-started spare worker process (torch, diffusers and the worker
            modules imported, no GPU touched) that becomes the next worker when a GPU is
            granted or a worker must be replaced, so that costs no process start (paper
            §4.4; ``spotlight.workers.rollout.spare``). It dies with the agent.
        weights_dir: the node's weight-version cache (one file per version, emptied at start;
            default ``<state dir>/weights``): a local disk with room for
            :data:`MAX_CACHED_WEIGHTS` versions.
        revoked_gpus_file: the scheduler's revoked-GPUs file, read on SIGUSR1
            (:mod:`agent.revocations`; default ``<state dir>/revoked-gpus``).
        visible_devices: the agent's own ``CUDA_VISIBLE_DEVICES`` (default: read from its
            environment); ``gpus`` are indices into it, and each worker gets its own device
            (:mod:`agent.visibility`).
    """

    def __init__(
        self,
        coordinator: str,
        gpus: list[int],
        *,
        keys: ClientKeys,
        node_id: str | None = None,
        is_spot: bool = True,
        register_timeout_s: float = 60.0,
        grace_s: float = 20.0,
        detector: Detector | None = None,
        poll_interval_s: float = 1.0,
        nice: int = 0,
        coordinator_timeout_s: float = 600.0,
        warm_spare: bool = True,
        weights_dir: pathlib.Path | None = None,
        visible_devices: str | None = None,
        revoked_gpus_file: pathlib.Path | None = None,
    ):
        self.visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices is None else visible_devices
        self.endpoint = coordinator if "://" in coordinator else f"tcp://{coordinator}"
        self.node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
        self.is_spot = is_spot
        self.keys = keys
        self.register_timeout_s = register_timeout_s
        self.grace_s = grace_s
        self.nice = nice
        self.sched = NodeScheduler(self.node_id, gpus, grace_s=grace_s, warm_spare=warm_spare)
        # first: a directory that cannot be made leaves no socket or temporary directory behind
        self.wcache = WeightCache(
            weights_dir or state_dir(self.node_id) / "weights", keep_versions=MAX_CACHED_WEIGHTS, clear=False
        )  # emptied once registered
        self._registered: P.Registered | None = None
        self.ctx = zmq.Context.instance()
        self.coord = self._coordinator_socket()
        # drawn once per process: a re-registration of this process (coordinator restart, lost
        # connection) is the same agent; another process with the same node id is not
        self.instance_id = secrets.token_hex(8)
        self.session = ""
        self.reconnecting = False
        self._next_register = 0.0
        self._register_backoff_s = 1.0
        self.reconnect_after_s = 5.0
        self.dropped_to_coord = 0
        self._last_heartbeat = 0.0
        self._last_coord_msg = time.monotonic()
        self.coordinator_timeout_s = coordinator_timeout_s
        self.exit_code = 0
        self._ipc_dir = tempfile.mkdtemp(prefix="spotlight-agent-")
        # a deep $TMPDIR gives a path too long for a Unix socket: ipc_endpoint shortens it
        self.worker_endpoint = ipc_endpoint(f"{self._ipc_dir}/workers.sock")
        self.workers_sock = self._workers_socket()
        self.procs: dict[str, subprocess.Popen] = {}
        self.worker_logs: dict[str, LogMark | None] = {}  # where each worker's output goes
        self._spare_log: LogMark | None = None  # the current warm spare's
        self.weight_waiters: dict[int, list[str]] = {}
        self.spare: Spare | None = None
        self._spares_started = 0  # names the spares' logs until one becomes a worker
        self.detector = detector or NullDetector()
        self.detector_healthy = True
        self.detector_error = ""
        self.workers_error = ""  # GPUs given up after failed worker starts (heartbeat)
        self._detector_q: queue.Queue = queue.Queue()
        self._detector_thread = DetectorThread(self.detector, self._detector_q, poll_interval_s)
        self._pending_ack: list[PreemptionNotice] = []
        self._signal_notices: queue.Queue = queue.Queue()
        self.shutting_down = False  # in shutdown(): a second SIGTERM changes nothing then
        self.stopped_by = 0  # the signal that stopped the agent at once (a second SIGTERM), if any
        self.revoked_gpus_file = revoked_gpus_file or state_dir(self.node_id, create=False) / "revoked-gpus"
        self.revocations_due = threading.Event()  # set by SIGUSR1: read revoked_gpus_file
        self._file_revoked: set[int] = set()  # GPUs taken back through that file
        self.control = self.ctx.socket(zmq.REP)
        self.control.setsockopt(zmq.LINGER, 0)
        self._control_file: tuple[int, int, int] | None = None  # the control socket file it bound: _file_id

    def _workers_socket(self) -> zmq.Socket:
        """The local ROUTER the node's workers connect to (identity = worker id)."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.worker_endpoint)
        return sock

    def _coordinator_socket(self) -> zmq.Socket:
        """The DEALER to the coordinator (CURVE client); connected by :meth:`register`."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        # queue nothing while the coordinator is unreachable: stale heartbeats and pulls would
        # arrive in a burst after it restarts; a re-registration follows instead
        sock.setsockopt(zmq.IMMEDIATE, 1)
        apply_client(sock, self.keys)
        return sock

    # ------------------------------------------------------------ the scheduler's state
    @property
    def registered(self) -> P.Registered | None:
        """The coordinator's REGISTERED reply (None before); setting it configures the scheduler."""
        return self._registered

    @registered.setter
    def registered(self, reg: P.Registered | None) -> None:
        self._registered = reg
        if reg is not None:
            self.sched.configure(
                sp_degree=reg.sp_degree,
                sp_degrees=reg.sp_degrees,
                reconfiguration=reg.reconfiguration,
                live_migration=reg.live_migration,
            )

    @property
    def gpus(self) -> list[int]:
        """The node's GPUs now (after revocations and additions)."""
        return self.sched.gpus

    @gpus.setter
    def gpus(self, gpus: list[int]) -> None:
        self.sched.gpus = list(gpus)

    @property
    def sp_degree(self) -> int:
        return self.sched.sp_degree

    @property
    def restart_mode(self) -> bool:
        """True when the coordinator asked for restart reconfiguration (``cluster.reconfiguration``)."""
        return self.sched.restart_mode

    @property
    def live_migration(self) -> bool:
        """False when stopped workers must give their requests back instead of committing them."""
        return self.sched.live_migration

    @property
    def draining(self) -> bool:
        return self.sched.draining

    @property
    def stop_reason(self) -> str:
        return self.sched.stop_reason

    @property
    def restarts(self) -> int:
        """Node restarts (restart reconfiguration) so far."""
        return self.sched.restarts

    @property
    def warm_spare(self) -> bool:
        """The node keeps a warm spare (off for good once spares were given up)."""
        return self.sched.spare.enabled

    @warm_spare.setter
    def warm_spare(self, on: bool) -> None:
        self.sched.spare.enabled = on

    @property
    def spares_used(self) -> int:
        return self.sched.spare.used

    def _take_node_state(self) -> None:
        """Once registered: empty the node's weight cache and bind its control socket. Not
        before: an agent refused because another live agent holds the node id (same host, same
        state dir) must leave that agent's cached weights and control socket alone."""
        self.wcache.remove_stale()
        ctl = control_endpoint(self.node_id)
        try:
            os.unlink(ipc_path(ctl))
        except OSError:
            pass
        self.control.bind(ctl)
        try:
            self._control_file = _file_id(ipc_path(ctl))
        except OSError:
            pass

    # ------------------------------------------------------------ wire helpers
    def _to_coord(self, msg, frames=None) -> bool:
        """Send to the coordinator without blocking; a full queue (coordinator down) drops it."""
        try:
            self.coord.send_multipart(P.encode(msg, frames), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self.dropped_to_coord += 1
            if self.registered is not None and self.dropped_to_coord % 100 == 1:
                log.warning(
                    "coordinator unreachable: dropped %s (%d messages dropped so far)",
                    type(msg).__name__,
                    self.dropped_to_coord,
                )
            return False

    def _register_msg(self) -> P.Register:
        return P.Register(
            protocol_version=P.PROTOCOL_VERSION,
            node_id=self.node_id,
            gpus=self.gpus,
            is_spot=self.is_spot,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            instance_id=self.instance_id,
        )

    def _fetch_weights(self, requests: list[P.FetchWeights]) -> None:
        """Send the weight cache's chunk requests to the coordinator (stamped with our session)."""
        for req in requests:
            req.node_id, req.session = self.node_id, self.session
            self._to_coord(req)

    def _to_worker(self, worker_id: str, msg, frames=None) -> None:
        self.workers_sock.send_multipart([worker_id.encode(), *P.encode(msg, frames)], copy=False)

    # ------------------------------------------------------------ registration
    def register(self) -> P.Registered:
        """Handshake; raises SystemExit with a clear message on refusal or timeout."""
        try:
            self.coord.connect(self.endpoint)
        except zmq.ZMQError as exc:
            raise SystemExit(f"bad coordinator address {self.endpoint[:80]!r}: {exc} (expected HOST:PORT)") from None
        log.info(
            "registering with %s as %s (giving up after %gs)…",
            self.endpoint,
            self.keys.principal.id,
            self.register_timeout_s,
        )
        deadline = time.monotonic() + self.register_timeout_s
        self._await_first_reply(deadline)
        return self._await_registered(deadline)

    def _await_first_reply(self, deadline: float) -> None:
        """Send REGISTER until the connection is up and the coordinator answers; a refused CURVE
        key raises at once, a failing handshake is named in the timeout's message."""
        monitor = self.coord.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        sent = self._to_coord(self._register_msg())  # fails (dropped) until the connection is up
        started = time.monotonic()
        next_progress, attempt = started + REGISTER_PROGRESS_S, 1
        handshake_error = ""
        try:
            while time.monotonic() < deadline:
                self._check_stop_while_waiting()
                if time.monotonic() >= next_progress:
                    attempt += 1
                    next_progress += REGISTER_PROGRESS_S
                    log.warning(
                        "waiting for coordinator at %s (attempt %d, %.0f s; giving up after %g s)",
                        self.endpoint,
                        attempt,
                        time.monotonic() - started,
                        self.register_timeout_s,
                    )
                if not sent:
                    sent = self._to_coord(self._register_msg())
                handshake_error = self._handshake_error(monitor) or handshake_error
                if self.coord.poll(200):
                    return
        finally:
            self.coord.disable_monitor()
            monitor.close(linger=0)
        raise SystemExit(
            f"no answer from coordinator at {self.endpoint} within {self.register_timeout_s:g}s"
            f"{unresolved_host_hint(self.endpoint)}{handshake_error}"
        )

    def _handshake_error(self, monitor: zmq.Socket) -> str:
        """The CURVE handshake's failures so far: raises SystemExit if the coordinator refused this
        node's key; returns a hint for the timeout message if the handshake keeps failing."""
        from zmq.utils.monitor import recv_monitor_message

        hint = ""
        while monitor.poll(0):
            ev = recv_monitor_message(monitor)
            if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise SystemExit(
                    f"coordinator at {self.endpoint} refused this node's key {self.keys.principal.id}: it is not "
                    "on the coordinator's allow-list (add it with `spotlight keys add`)"
                )
            if ev["event"] in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                hint = " (encrypted handshake failing: is server.key the coordinator's public key?)"
        return hint

    def _await_registered(self, deadline: float) -> P.Registered:
        """Read the coordinator's answers to REGISTER until REGISTERED, a refusal or ``deadline``."""
        waited_for_holder = False
        while time.monotonic() < deadline:
            self._check_stop_while_waiting()
            if not self.coord.poll(200):
                continue
            try:
                mtype, body, _ = P.decode(self.coord.recv_multipart())
            except P.ProtocolError as exc:
                log.error("malformed reply from coordinator: %s", exc)
                continue
            if mtype == P.MsgType.REGISTERED:
                self.registered = body
                self.session = body.session
                self.wcache.window_chunks = body.weight_window_chunks
                log.info(
                    "registered with %s as %s (%d GPUs, spot=%s)",
                    self.endpoint,
                    self.node_id,
                    len(self.gpus),
                    self.is_spot,
                )
                return body
            if mtype == P.MsgType.ERROR and body.code == "node_id_in_use":
                if 0 < body.retry_after_s < deadline - time.monotonic() and not waited_for_holder:
                    waited_for_holder = True
                    self._retry_after_holder(body)
                    continue
                raise NodeIdInUse(node_id_in_use_line(self.node_id, body.message))  # join() prints it
            if mtype == P.MsgType.ERROR:
                raise SystemExit(f"coordinator refused registration: {body.code}: {body.message}")
        raise SystemExit(
            f"no answer from coordinator at {self.endpoint} within {self.register_timeout_s:g}s"
            f"{unresolved_host_hint(self.endpoint)}"
        )

    def _retry_after_holder(self, refusal: P.ErrorMsg) -> None:
        """The node id is in use: the holder may be this node's crashed agent (systemd restarted
        us). Once it has been silent past the heartbeat timeout the node id is free, so REGISTER
        once more then; a live holder heartbeats meanwhile and the second REGISTER is refused too.
        (A wait past --register-timeout-s is not made: the agent exits at once.)"""
        log.warning(
            "node id %s is in use by another agent (%s); trying once more in %.1fs in case that agent has died",
            self.node_id,
            refusal.message,
            refusal.retry_after_s,
        )
        until = time.monotonic() + refusal.retry_after_s
        while time.monotonic() < until:
            self._check_stop_while_waiting()
            time.sleep(min(0.2, max(0.0, until - time.monotonic())))
        self._to_coord(self._register_msg())

    def _check_stop_while_waiting(self) -> None:
        """Raise :class:`StoppedWaiting` if SIGTERM arrived (``join`` queues it as a notice)."""
        if not self._signal_notices.empty():
            raise StoppedWaiting(
                f"stopped by SIGTERM while waiting for the coordinator at {self.endpoint}; nothing was started",
                128 + signal.SIGTERM,
            )

    # ------------------------------------------------------------ carrying out the scheduler's actions
    def _execute(self, actions: list[Action]) -> None:
        """Carry out the node Scheduler's actions, in order."""
        restarted = sorted({g for a in actions if isinstance(a, SpawnWorker) and a.cause == "restart" for g in a.gpus})
        if restarted:
            log.info("restart reconfiguration: starting fresh workers on GPUs %s", restarted)
        for action in actions:
            match action:
                case SpawnWorker():
                    self._spawn(action)
                case StopWorker(worker_id=wid, commit=commit, reason=reason):
                    self._to_worker(wid, P.Stop(commit=commit, reason=reason))
                    log.info("worker %s: stop sent (%s; %s)", wid, reason, "commit" if commit else "no commit")
                case KillWorker(worker_id=wid, reason=reason):
                    proc = self.procs.get(wid)
                    if proc is not None and proc.poll() is None:
                        log.info("worker %s: %s: killing it", wid, reason)
                        proc.kill()
                case FormGroup():
                    self._send_form(action)
                case GroupServing(members=members, generation=gen, after_s=after_s):
                    log.info(
                        "SP group %s: generation %d serving at SP=%d (%.2fs after GROUP_FORM)",
                        members[0],
                        gen,
                        len(members),
                        after_s,
                    )
                case RestartNode(reason=reason, gpus=gpus):
                    log.info(
                        "restart reconfiguration (%s): stopping every worker of the node; restarting on GPUs %s",
                        reason,
                        list(gpus),
                    )
                case Drain(reason=reason):
                    log.info("draining: %s", reason)
                case ReportGpus():
                    self._report_gpus(action, [a.worker_id for a in actions if isinstance(a, StopWorker)])
                case ReportNotice():
                    self._report_notice(action)
                case ReturnLeases():
                    self._return_leases(action)
                case StartSpare():
                    self.start_spare()
                case StopSpare(give_up=give_up):
                    if give_up:
                        log.error("%s: no more spares on this node", give_up)
                    self._stop_spare()
                case GiveUpGpus(gpus=gpus, failures=failures, exit_code=code):
                    why = (
                        f"workers on GPUs {list(gpus)} failed {failures} starts in a row (last exit code {code}); "
                        "not starting them again: see this node's worker logs"
                    )
                    log.error("%s", why)
                    self.workers_error = why if not self.workers_error else f"{self.workers_error}; {why}"
                case DeliverLeases():  # carried out by _on_leases, which holds the frames
                    raise AssertionError("DeliverLeases outside _on_leases")

    def _report_gpus(self, action: ReportGpus, stopped: list[str]) -> None:
        if action.revoked and not self.restart_mode:
            log.info("revoked GPUs %s: stopping %s; node keeps GPUs %s", list(action.revoked), stopped, self.gpus)
        self.heartbeat(time.monotonic())

    def _report_notice(self, action: ReportNotice) -> None:
        notice = action.notice
        self._to_coord(
            P.Notice(
                node_id=self.node_id,
                session=self.session,
                source=notice.source,
                scope=notice.scope,
                deadline_unix_s=notice.deadline_unix_s,
                key=notice.key,
                kind=notice.kind,
                is_hint=notice.is_hint,
            )
        )
        if action.acknowledge:
            self._pending_ack.append(notice)

    def _return_leases(self, action: ReturnLeases) -> None:
        self._to_coord(
            P.Fail(
                node_id=self.node_id,
                session=self.session,
                worker_id=action.worker_id,
                request_ids=list(action.request_ids),
                lease_ids=list(action.lease_ids),
                reason=action.reason,
            )
        )

    def _send_form(self, action: FormGroup) -> None:
        """Tell every member to (re)form generation ``action.generation`` at a fresh rendezvous port."""
        port = listen_port()  # below the ephemeral range: no outgoing connection takes it meanwhile
        latest = self.wcache.latest()
        form = P.GroupForm(
            members=list(action.members),
            master_addr="127.0.0.1",
            master_port=port,
            generation=action.generation,
            version=latest if latest is not None else self.registered.latest_version,
            pids=[self.sched.workers[m].pid if m in self.sched.workers else 0 for m in action.members],
        )
        for m in action.members:
            self._to_worker(m, form)
        log.info("SP group %s: generation %d, SP=%d", action.members[0], action.generation, len(action.members))

    # ------------------------------------------------------------ worker processes
    def _worker_conf_json(self) -> str:
        reg = self.registered
        conf = {
            "model": reg.model,
            "sampler": reg.sampler,
            "worker_batch_size": reg.worker_batch_size,
            "torch_threads": reg.torch_threads,
            "sp_degree": reg.sp_degree,
            "sp_cfg_parallel": reg.sp_cfg_parallel,
            "sp_backend": reg.sp_backend,
            "lora": reg.lora,
            "weights_dir": str(self.wcache.dir),
            "offload_rollout_while_training": reg.offload_rollout_while_training,
        }
        return msgspec.json.encode(conf).decode()

    def _preexec(self):
        nice = self.nice
        return (lambda: os.nice(nice)) if nice else None

    def start_workers(self) -> None:
        """The node's first workers (SP groups form once all their members said hello)."""
        if self.restart_mode and self.warm_spare:
            log.info("restart reconfiguration: no warm spare (workers restart cold)")
        self._execute(self.sched.start(time.monotonic()))

    def spawn_worker(self, gpus: list[int]) -> str:
        """Start a worker on ``gpus`` now (the warm spare becomes it if there is one); returns
        its worker id."""
        action = self.sched.spawn(gpus)
        self._spawn(action)
        return action.worker_id

    def _spawn(self, action: SpawnWorker) -> None:
        """Start ``action``'s worker: the warm spare becomes it when it can (even one still warming
        up has a head start), else a fresh process starts."""
        wid, gpus = action.worker_id, list(action.gpus)
        env = scrubbed_env()  # workers never authenticate: no credentials in their environment
        env.update(worker_nccl_env(env))  # a peer's death aborts the communicator, never kills the survivor
        # its own device only, whatever the agent sees (Slurm and container runtimes set the agent's)
        env["CUDA_VISIBLE_DEVICES"] = worker_visible_devices(gpus, self.visible_devices)
        self.worker_logs[wid] = log_mark(f"worker-{wid}", env)
        proc = self._hand_to_spare(wid, gpus, env) if action.from_spare else None
        spare_pid = proc.pid if proc is not None else 0
        if proc is not None:
            log.info("worker %s: the warm spare (pid %d) takes GPUs %s", wid, proc.pid, gpus)
        else:
            proc = self._launch(wid, gpus, env)
            log.info("spawned worker %s (pid %d)", wid, proc.pid)
        self.procs[wid] = proc
        self.sched.worker_spawned(wid, spare_pid, time.monotonic())

    def _launch(self, worker_id: str, gpus: list[int], env: dict[str, str]) -> subprocess.Popen:
        """A fresh Rollout Worker process."""
        cmd = [
            sys.executable,
            "-m",
            "spotlight.workers.rollout.worker",
            "--agent",
            self.worker_endpoint,
            "--worker-id",
            worker_id,
            "--gpus",
            ",".join(map(str, gpus)),
            "--config-json",
            self._worker_conf_json(),
        ]
        return spawn_logged(cmd, f"worker-{worker_id}", env=env, preexec_fn=self._preexec())

    def _hand_to_spare(self, worker_id: str, gpus: list[int], env: dict[str, str]) -> subprocess.Popen | None:
        """Send the warm spare its assignment; its process, or None if it cannot take it."""
        spare = self._take_spare()
        if spare is None:
            return None
        job = {"worker_id": worker_id, "gpus": gpus, "cuda_visible_devices": env["CUDA_VISIBLE_DEVICES"]}
        try:
            spare.proc.stdin.write(json.dumps(job).encode() + b"\n")
            spare.proc.stdin.close()
        except OSError as exc:  # it died just now: start the worker cold
            log.warning("warm spare (pid %d) could not take %s (%s): starting it cold", spare.proc.pid, worker_id, exc)
            spare.proc.kill()
            return None
        return spare.proc

    def check_workers(self) -> None:
        """Main-loop housekeeping: reap exited workers (the scheduler decides what follows), tend
        the warm spare, kill stopped workers past their deadline."""
        now = time.monotonic()
        for wid, proc in list(self.procs.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del self.procs[wid]
            revoked = wid in self.sched.revoking
            actions = self.sched.worker_exited(wid, rc, now, spare_refused=rc == EXIT_SPARE_UNUSABLE)
            failed = ChildExit.of(f"worker {wid}", rc, self.worker_logs.pop(wid, None))
            if revoked:
                log.info("worker %s left after revocation (code %s)", wid, rc)
            elif rc != 0 and rc != EXIT_SPARE_UNUSABLE:
                restart = any(isinstance(a, SpawnWorker) and a.cause == "replace" for a in actions)
                log.error("%s", failed.report("; restarting it" if restart else ""))
                # the leases it gives back carry its cause to the coordinator's console
                actions = [_with_cause(a, failed.cause) for a in actions]
            self._execute(actions)
        self.check_spare()
        self._execute(self.sched.overdue(now))

    # ------------------------------------------------------------ warm spare
    def start_spare(self) -> None:
        """Start the warm spare in the background (no-op if disabled, present, not registered
        yet, or draining). It imports torch and the worker modules, prepares what needs no GPU,
        writes ``ready`` on its pipe and waits on stdin for its assignment."""
        if not self.warm_spare or self.spare is not None or self.registered is None or self.draining:
            return
        env = scrubbed_env(PYTORCH_NVML_BASED_CUDA_CHECK="1")  # an availability check must not initialise CUDA
        env.update(worker_nccl_env(env))  # the spare becomes a worker: the same NCCL settings
        read_fd, write_fd = os.pipe()
        conf = self._worker_conf_json()
        cmd = self._spare_cmd(conf, write_fd)
        try:
            self._spares_started += 1
            self._spare_log = log_mark(f"worker-{self.node_id}-spare{self._spares_started}", env)
            proc = spawn_logged(
                cmd,
                f"worker-{self.node_id}-spare{self._spares_started}",
                env=env,
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                preexec_fn=self._preexec(),
            )
        except OSError as exc:
            os.close(read_fd)
            log.error("could not start the warm spare: %s", exc)
            return
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        self.spare = Spare(proc, read_fd, conf, time.monotonic())
        self.sched.spare_started()
        log.info("started warm spare (pid %d)", proc.pid)

    def _spare_cmd(self, conf_json: str, ready_fd: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "spotlight.workers.rollout.spare",
            "--agent",
            self.worker_endpoint,
            "--config-json",
            conf_json,
            "--ready-fd",
            str(ready_fd),
            "--parent-pid",
            str(os.getpid()),
        ]

    def _take_spare(self) -> Spare | None:
        """The live spare, handed over (None if there is none or it was started for another
        configuration, e.g. before a re-registration changed it)."""
        spare = self.spare
        if spare is None:
            return None
        if spare.proc.poll() is not None or spare.conf_json != self._worker_conf_json():
            self._stop_spare()
            self.sched.spare_unusable(time.monotonic())
            return None
        self.spare = None
        os.close(spare.ready_fd)
        return spare

    def _stop_spare(self) -> None:
        """Kill the spare (it holds no work) and reap it."""
        spare, self.spare = self.spare, None
        if spare is None:
            return
        os.close(spare.ready_fd)
        if spare.proc.poll() is None:
            spare.proc.kill()
        try:
            spare.proc.wait(timeout=SHUTDOWN_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "warm spare (pid %d) still exiting %.0fs after SIGKILL (a loaded kernel is slow to free its memory)",
                spare.proc.pid,
                SHUTDOWN_KILL_WAIT_S,
            )
        if spare.proc.stdin is not None:
            spare.proc.stdin.close()

    def check_spare(self) -> None:
        """Main-loop housekeeping: note when the spare is ready, report one that died unused (the
        scheduler restarts it with backoff, or gives spares up), start one when it is due."""
        now = time.monotonic()
        spare = self.spare
        if spare is None:
            self._execute(self.sched.spare_tick(now))
            return
        if not spare.ready:
            try:
                if os.read(spare.ready_fd, 64):
                    spare.ready = True
                    self.sched.spare_ready()
                    log.info("warm spare (pid %d) ready after %.1fs", spare.proc.pid, now - spare.started_at)
            except BlockingIOError:
                pass
        rc = spare.proc.poll()
        if rc is None:
            return
        self._stop_spare()
        retry_in_s = self.sched.spare_died(now)
        then = (
            f"no more spares on this node ({self.sched.spare.failures} failures in a row)"
            if retry_in_s is None
            else f"restarting it in {retry_in_s:.0f}s"
        )
        log.error("%s", ChildExit.of("warm spare", rc, self._spare_log).report(f" before it was needed; {then}"))

    def spare_status(self) -> dict | None:
        """``{"pid", "ready"}`` of the current spare, or None."""
        if self.spare is None:
            return None
        return {"pid": self.spare.proc.pid, "ready": self.spare.ready}

    def heartbeat(self, now: float) -> None:
        workers = [
            P.WorkerInfo(worker_id=s.worker_id, gpus=s.gpus, busy=bool(s.in_flight), pid=s.pid)
            for s in self.sched.live_workers()
        ]
        self._to_coord(
            P.Heartbeat(
                node_id=self.node_id,
                session=self.session,
                workers=workers,
                in_flight=self.sched.in_flight(),
                draining=self.draining,
                detector_healthy=self.detector_healthy,
                detector_error=self.detector_error,
                workers_error=self.workers_error,
                gpus_given_up=self.sched.given_up_gpus(),
                gpus=self.gpus,
            )
        )
        self._last_heartbeat = now

    # ------------------------------------------------------------ preemption and GPU changes
    def on_notice(self, notice: PreemptionNotice) -> None:
        """A notice from any source: the scheduler reports it and acts on its scope."""
        left = notice.deadline_unix_s - time.time()
        actions = self.sched.notice(notice, remaining_s=left, now=time.monotonic())
        if not actions:  # `spotlight up` stopping a slow agent after the coordinator's SHUTDOWN
            log.info("SIGTERM while stopping (%s): finishing the stop", self.stop_reason)
            return
        if notice.kind == "revoke":  # expected events on a spot node: INFO
            log.info("GPU revocation (%s): %.1fs to deadline", notice.scope, left)
        else:
            log.info(
                "preemption notice: %s %s%s scope=%s, %.1fs to deadline",
                notice.source,
                notice.kind,
                " (hint)" if notice.is_hint else "",
                notice.scope,
                left,
            )
        self._execute(actions)

    def revoke_gpus(self, gpus: list[int], *, grace_s: float) -> list[str]:
        """Per-GPU revocation (:meth:`agent.node_scheduler.NodeScheduler.revoke`); returns the ids
        of the workers told to stop."""
        actions = self.sched.revoke(gpus, grace_s, time.monotonic())
        self._execute(actions)
        return [a.worker_id for a in actions if isinstance(a, StopWorker)]

    def add_gpus(self, gpus: list[int]) -> list[str]:
        """GPUs granted to this node (:meth:`agent.node_scheduler.NodeScheduler.add`); returns the
        ids of the workers started on them (none in restart mode: the node restarts)."""
        actions = self.sched.add(gpus, time.monotonic())
        self._execute(actions)
        return [a.worker_id for a in actions if isinstance(a, SpawnWorker)]

    def begin_drain(self, reason: str, grace_s: float | None = None) -> None:
        """Stop pulling; ask every worker to commit in-flight state and exit."""
        self._execute(self.sched.drain(reason, grace_s, time.monotonic()))

    def poll_detector(self) -> None:
        while True:
            try:
                res = self._detector_q.get_nowait()
            except queue.Empty:
                break
            if res.healthy != self.detector_healthy or (res.error or "") != self.detector_error:
                (log.info if res.healthy else log.error)(
                    "preemption detector %s%s", "healthy" if res.healthy else "UNHEALTHY: ", res.error or ""
                )
            self.detector_healthy, self.detector_error = res.healthy, res.error or ""
            for notice in res.notices:
                self.on_notice(notice)
        while True:
            try:
                self.on_notice(self._signal_notices.get_nowait())
            except queue.Empty:
                break
        if self.revocations_due.is_set() and not self.draining:
            self.revocations_due.clear()
            self.apply_revoked_gpus_file()

    def apply_revoked_gpus_file(self) -> None:
        """SIGUSR1: revoke the GPUs the scheduler's file lists, give back those no longer listed
        (:mod:`agent.revocations`); an unreadable file is one error line and changes nothing."""
        path = self.revoked_gpus_file
        try:
            text = path.read_text() if path.exists() else ""
        except OSError as exc:
            log.error("SIGUSR1: cannot read the revoked-GPUs file %s: %s; nothing changed", path, exc)
            return
        ch = revocation_changes(text, self.gpus, self._file_revoked)
        if ch.error:
            log.error("SIGUSR1: revoked-GPUs file %s: %s; nothing changed", path, ch.error)
            return
        if ch.unknown:
            log.warning("SIGUSR1: %s lists GPUs %s, which this node does not hold: ignored", path, list(ch.unknown))
        log.info("SIGUSR1: %s: revoking GPUs %s, giving back GPUs %s", path, list(ch.revoke), list(ch.give_back))
        if ch.revoke:
            self.on_notice(revoke_notice(list(ch.revoke), self.grace_s, time.time()))
            self._file_revoked |= set(ch.revoke)
        if ch.give_back:
            self._file_revoked -= set(ch.give_back)
            self.add_gpus(list(ch.give_back))

    # ------------------------------------------------------------ control socket
    def on_control(self) -> None:
        """Local control commands (JSON): revoke, add, preempt, status."""
        try:
            req = json.loads(self.control.recv())
            cmd = req.get("cmd")
            if cmd in ("revoke", "add") and (
                bad := control_gpus_error(cmd, [int(g) for g in req["gpus"]], self.gpus, self.visible_devices)
            ):
                reply = {"ok": False, "error": bad, "gpus": self.gpus}  # nothing changed, nothing told the coordinator
            elif cmd == "revoke":
                grace = float(req.get("grace_s", self.grace_s))
                notice = revoke_notice([int(g) for g in req["gpus"]], grace, time.time())
                self.on_notice(notice)
                reply = {"ok": True, "gpus": self.gpus}
            elif cmd == "add":
                reply = {"ok": True, "started": self.add_gpus([int(g) for g in req["gpus"]]), "gpus": self.gpus}
            elif cmd == "preempt":
                grace = float(req.get("grace_s", self.grace_s))
                self.on_notice(sigterm_notice(grace, time.time(), key=f"control-{time.time()}"))
                reply = {"ok": True}
            elif cmd == "status":
                reply = self.status()
            else:
                reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": f"bad control request: {exc}"}
        self.control.send(json.dumps(reply).encode())

    def status(self) -> dict:
        """The ``status`` control reply (``spotlight-agent agent-status``; tests and benchmarks
        read its keys)."""
        workers = self.sched.workers.values()
        return {
            "ok": True,
            "node_id": self.node_id,
            "gpus": self.gpus,
            "workers": {s.worker_id: s.status.value for s in workers},
            "in_flight": self.sched.in_flight(),
            "detector_healthy": self.detector_healthy,
            "detector_error": self.detector_error,
            "draining": self.draining,
            "sp_degree": self.sp_degree,
            "groups": [g.status() for g in self.sched.groups],
            "worker_pids": {s.worker_id: s.pid for s in workers},
            "from_spare": {s.worker_id: s.spare_pid for s in workers if s.spare_pid},
            "warm_spare": self.warm_spare,
            "spare": self.spare_status(),
            "spares_used": self.spares_used,
            "reconfiguration": "restart" if self.restart_mode else "elastic",
            "live_migration": self.live_migration,
            "restarts": self.restarts,
            "revoked_gpus_file": str(self.revoked_gpus_file),
        }

    # ------------------------------------------------------------ messages from workers
    def on_worker(self, frames: list) -> None:
        wid = bytes(frames[0]).decode(errors="replace")
        try:
            mtype, body, payload = P.decode(frames[1:])
        except P.ProtocolError as exc:
            log.error("worker %s sent a malformed frame: %s", wid, exc)
            return
        now = time.monotonic()
        if mtype == P.MsgType.WORKER_HELLO:
            self._execute(self.sched.worker_hello(wid, body.pid, now))
        elif mtype == P.MsgType.PULL:
            self._on_pull(wid, body)
        elif mtype in (P.MsgType.RESULT, P.MsgType.COMMIT, P.MsgType.FAIL):
            body.node_id, body.session, body.worker_id = self.node_id, self.session, wid
            ids = [it.request_id for it in body.items] if mtype != P.MsgType.FAIL else list(body.request_ids)
            actions = self.sched.work_finished(wid, ids, committed=mtype == P.MsgType.COMMIT)
            self._to_coord(body, payload)
            self._execute(actions)  # a revoked worker is ended only once its commit went out
        elif mtype == P.MsgType.GROUP_FORMED:
            self._execute(self.sched.group_formed(wid, body.generation, body.took_s, now))
        elif mtype == P.MsgType.FETCH_WEIGHTS:
            self._on_fetch_weights(wid, body, now)
        else:
            log.warning("worker %s sent unexpected %s", wid, mtype.name)

    def _on_pull(self, wid: str, body: P.Pull) -> None:
        """Relay a worker's PULL; answer it with no leases when no work may go to it now."""
        if self.reconnecting or not self.sched.may_pull(wid):
            self._to_worker(wid, P.Leases(worker_id=wid))
            return
        body.node_id, body.session, body.worker_id = self.node_id, self.session, wid
        if not self._to_coord(body):  # coordinator unreachable: the worker asks again later
            self._to_worker(wid, P.Leases(worker_id=wid))

    def _on_fetch_weights(self, wid: str, body: P.FetchWeights, now: float) -> None:
        hdr = self.wcache.ready(body.version)
        if hdr is not None:  # the worker maps <weights_dir>/v<version>.safetensors itself
            self._to_worker(wid, hdr)
            return
        waiters = self.weight_waiters.setdefault(body.version, [])
        if wid not in waiters:
            waiters.append(wid)
        # one fetch per version and node, whatever the number of workers asking
        self._fetch_weights(self.wcache.fetch(body.version, now))

    # ------------------------------------------------------------ messages from the coordinator
    def on_coordinator(self, frames: list) -> None:
        self._last_coord_msg = time.monotonic()
        try:
            mtype, body, payload = P.decode(frames)
        except P.ProtocolError as exc:
            log.error("coordinator sent a malformed frame: %s", exc)
            return
        handler = {
            P.MsgType.LEASES: self._on_leases,
            P.MsgType.WEIGHTS: self._on_weights,
            P.MsgType.WEIGHTS_CHUNK: self._on_weights_chunk,
            P.MsgType.HEARTBEAT: lambda body, payload: None,  # the ack; any message refreshes _last_coord_msg
            P.MsgType.REGISTERED: self._on_registered,
            P.MsgType.SHUTDOWN: self._on_shutdown,
            P.MsgType.ERROR: self._on_error,
        }.get(mtype)
        if handler is None:
            log.warning("coordinator sent unexpected %s", mtype.name)
            return
        handler(body, payload)

    def _on_leases(self, body: P.Leases, payload) -> None:
        items = [(i.request_id, i.lease_id) for i in body.items]
        for action in self.sched.leases_granted(body.worker_id, items, time.monotonic()):
            if isinstance(action, DeliverLeases):
                self._to_worker(action.worker_id, body, payload)
            else:
                self._execute([action])

    def _on_weights(self, body: P.Weights, payload) -> None:
        requests, not_found = self.wcache.on_weights(body, time.monotonic())
        self._fetch_weights(requests)
        if not_found:
            for wid in self.weight_waiters.pop(body.version, []):
                self._to_worker(wid, P.Weights(version=body.version, size_bytes=0, found=False))

    def _on_weights_chunk(self, body: P.WeightsChunk, payload) -> None:
        if not payload:
            log.error("coordinator sent WEIGHTS_CHUNK v%d #%d without its frame", body.version, body.index)
            return
        requests, done = self.wcache.on_chunk(body, payload[0], time.monotonic())
        self._fetch_weights(requests)
        if done is not None:
            for wid in self.weight_waiters.pop(body.version, []):
                self._to_worker(wid, done)

    def _on_registered(self, body: P.Registered, payload) -> None:
        if body.node_id != self.node_id:
            return
        # the latest registration is the coordinator's current session
        self.session = body.session
        self.registered.latest_version = body.latest_version
        if self.reconnecting:
            self.reconnecting = False
            self._register_backoff_s = 1.0
            log.warning(
                "re-registered with the coordinator (new session); %d workers kept running",
                len(self.sched.live_workers()),
            )
            self._fetch_weights(self.wcache.restart_all(time.monotonic()))  # requests lost with the old coordinator
        self.heartbeat(time.monotonic())

    def _on_shutdown(self, body: P.Shutdown, payload) -> None:
        log.info("coordinator asked to shut down: %s", body.reason)
        self._execute(self.sched.shutdown(body.reason, time.monotonic(), grace_s=SHORT_STOP_S))

    def _on_error(self, body: P.ErrorMsg, payload) -> None:
        # a coordinator that restarted (resume) or declared this node dead does not know its
        # session: expected, and answered by re-registering, so INFO; anything else is an error
        routine = body.code in ("unknown_session", "not_registered")
        log.log(logging.INFO if routine else logging.ERROR, "coordinator error %s: %s", body.code, body.message)
        if self.draining:
            return
        if body.code == "node_id_in_use":
            # this agent was silent past the heartbeat timeout and another agent process took
            # the node id meanwhile: it owns the node now, so this one stops (no re-register loop)
            log.error(
                "%s: stopping this agent's workers and exiting with status %d",
                node_id_in_use_line(self.node_id, body.message),
                EXIT_NODE_ID_IN_USE,
            )
            self.exit_code = EXIT_NODE_ID_IN_USE
            self.reconnecting = False
            self.begin_drain("node id taken by another agent", grace_s=SHORT_STOP_S)
        elif body.code in ("unknown_session", "not_registered") and not self.reconnecting:
            # the coordinator restarted (or declared this node dead): re-register, keep workers
            log.info("coordinator does not know this session (restarted?): re-registering; workers keep running")
            self.reconnecting = True
            now = time.monotonic()
            self._next_register = min(self._next_register, now) if self._next_register else now

    # ------------------------------------------------------------ startup, main loop, shutdown
    def check_not_preempted(self) -> None:
        """Startup check (spot agents): poll the detector once before joining.

        Raises :class:`NodePreempted` (exit status :data:`EXIT_NODE_PREEMPTED`, with a one-line
        message) if the VM shows an active node-scope notice, new or already handled by an
        earlier agent on this VM (its key is in the :class:`agent.preemption.NoticeLedger`, so it
        is not drained twice); a notice whose deadline passed more than 30 s ago is stale and
        ignored (``agent.preemption.active_node_notice``).  An unhealthy detector does not block
        the join: it is logged and the detector thread keeps polling.
        """
        if not self.is_spot or isinstance(self.detector, NullDetector):
            return
        res = self.detector.poll(time.time())
        if not res.healthy:
            log.warning("preemption detector unhealthy at startup (%s); joining anyway", res.error)
        notice = active_node_notice(res, time.time())
        if notice is not None:
            handled = "already handled" if notice in res.known else "new"
            msg = (
                f"not joining: this VM has an active {notice.source} {notice.kind} notice ({handled}, deadline in "
                f"{notice.deadline_unix_s - time.time():.0f}s: {notice.detail}); exiting with status "
                f"{EXIT_NODE_PREEMPTED} so a supervisor does not restart it"
            )
            log.warning("%s", msg)
            raise NodePreempted(msg)

    def run(self) -> int:
        """Join, serve until told to stop, shut down; returns the exit status."""
        self.check_not_preempted()
        try:
            self.register()
        except KeyboardInterrupt:  # SIGINT, or a second SIGTERM (sigterm_handler sets stopped_by)
            signum = self.stopped_by or signal.SIGINT
            raise StoppedWaiting(
                f"stopped by {signal.Signals(signum).name} while waiting for the coordinator at {self.endpoint}; "
                "nothing was started",
                128 + signum,
            ) from None
        self._take_node_state()
        self.start_workers()  # the first warm spare follows once they said hello (check_spare)
        self._detector_thread.start()
        try:
            self._serve()
        finally:
            self.shutdown()
        return self.exit_code

    def _serve(self) -> None:
        """The main loop: relay messages, act on notices and exits, keep the coordinator link."""
        poller = zmq.Poller()
        for sock in (self.coord, self.workers_sock, self.control):
            poller.register(sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll(100))
            if self.workers_sock in events:
                self._recv_all(self.workers_sock, self.on_worker)
            if self.coord in events:
                self._recv_all(self.coord, self.on_coordinator, copy=False)  # weight chunks: no extra copy
            if self.control in events:
                self.on_control()
            self.poll_detector()
            now = time.monotonic()
            self.check_workers()
            self._tend_coordinator(now)
            stop_deadline = self.sched.stop_deadline
            if self.draining and (not self.procs or (stop_deadline is not None and now > stop_deadline)):
                return

    @staticmethod
    def _recv_all(sock: zmq.Socket, handle, copy: bool = True, batch: int = 64) -> None:
        """Hand up to ``batch`` waiting messages of ``sock`` to ``handle``."""
        for _ in range(batch):
            try:
                handle(sock.recv_multipart(zmq.NOBLOCK, copy=copy))
            except zmq.Again:
                return

    def _tend_coordinator(self, now: float) -> None:
        """Weight fetches past due, heartbeats, re-registration with backoff while the coordinator
        is silent or has forgotten this node, and the exit once it has been silent too long."""
        interval = self.registered.heartbeat_interval_s
        if self.wcache.downloads and not self.reconnecting:
            self._fetch_weights(self.wcache.overdue(now))
        if now - self._last_heartbeat >= interval:
            self.heartbeat(now)
        silent_s = now - self._last_coord_msg
        if not self.draining and not self.reconnecting and silent_s > max(self.reconnect_after_s, 3 * interval):
            log.warning("coordinator silent for %.0fs: re-registering with backoff; workers keep running", silent_s)
            self.reconnecting = True
            self._next_register = now
        if self.reconnecting and not self.draining and now >= self._next_register:
            self._to_coord(self._register_msg())
            self._next_register = now + self._register_backoff_s
            self._register_backoff_s = min(30.0, self._register_backoff_s * 2)
        if not self.draining and silent_s > self.coordinator_timeout_s:
            log.error(
                "coordinator silent for %.0fs: stopping workers and exiting (a supervisor restarts and re-registers)",
                silent_s,
            )
            self.exit_code = EXIT_COORDINATOR_LOST
            self.begin_drain("coordinator lost", grace_s=SHORT_STOP_S)

    def shutdown(self) -> None:
        """After the drain: acknowledge notices that wait for it, stop the processes within one
        deadline, say goodbye, close the sockets and empty the weight cache."""
        self.shutting_down = True
        self._detector_thread.stop_event.set()
        # Azure: approve the event only after the commit (docs/preemption-notices.md §3.3)
        for notice in self._pending_ack:
            try:
                self.detector.acknowledge(notice)
            except Exception as exc:
                log.warning("could not acknowledge notice %s: %s", notice.key, exc)
        self._stop_spare()  # idle: nothing to commit
        self._stop_workers()
        try:
            self._to_coord(P.Bye(node_id=self.node_id, session=self.session, reason=self.stop_reason or "exit"))
        except zmq.ZMQError:
            pass
        self.coord.close(linger=1000)
        self.workers_sock.close(linger=0)
        self.control.close(linger=0)
        self._remove_control_socket()
        self.wcache.clear()
        try:
            os.unlink(ipc_path(self.worker_endpoint))
        except OSError:
            pass
        try:
            os.rmdir(self._ipc_dir)
        except OSError:
            pass

    def _remove_control_socket(self) -> None:
        """Remove the control socket's file this agent bound, unless another agent of the same
        node id has bound its own there since (this one's node id was taken while it ran)."""
        path = ipc_path(control_endpoint(self.node_id, create=False))
        try:
            if self._control_file is not None and _file_id(path) == self._control_file:
                os.unlink(path)
        except OSError:
            pass

    def _stop_workers(self) -> None:
        """SIGTERM every worker, SIGKILL those left after :data:`SHUTDOWN_TERM_WAIT_S`: one deadline
        for all, so the stop time does not grow with the GPU count (at most
        SHUTDOWN_TERM_WAIT_S + SHUTDOWN_KILL_WAIT_S)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for wait_s, last in ((SHUTDOWN_TERM_WAIT_S, False), (SHUTDOWN_KILL_WAIT_S, True)):
            deadline = time.monotonic() + wait_s
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            alive = [p for p in self.procs.values() if p.poll() is None]
            if not alive:
                return
            if last:
                log.warning(
                    "workers %s still exiting %.0fs after SIGKILL (a loaded kernel is slow to free their memory)",
                    [p.pid for p in alive],
                    wait_s,
                )
            else:
                log.error("workers %s ignored SIGTERM for %.0fs: killing them", [p.pid for p in alive], wait_s)
                for p in alive:
                    p.kill()


def _file_id(path: str) -> tuple[int, int, int]:
    """Which file ``path`` is (device, inode, change time: an inode number alone may be reused
    at once by a file made after this one was removed)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _with_cause(action, cause: str):
    """``action`` with a worker's ``cause`` (its exception line) added to the reason of leases it
    gives back (:class:`ReturnLeases`: the coordinator logs that reason); other actions as they are."""
    if not cause or not isinstance(action, ReturnLeases):
        return action
    return dataclasses.replace(action, reason=f"{action.reason}: {cause}"[:1000])


def _parse_gpus(text: str) -> list[int]:
    """The GPU indices of ``join --gpus``.

    Raises:
        ValueError: one phrase that starts with ``--gpus`` (``join`` prints it as its one
            ``error:`` line, as it does every refusal of its input).
    """
    from spotlight.util.gpus import parse_gpu_indices

    try:
        gpus = parse_gpu_indices(text)
    except ValueError as exc:
        raise ValueError(f"--gpus: {exc}") from None
    if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise ValueError(f"--gpus must list distinct non-negative indices, got {text[:40]!r}")
    if len(gpus) > P.MAX_GPUS_PER_NODE:  # the coordinator refuses the registration of more
        raise ValueError(f"--gpus lists {len(gpus)} GPUs; one node registers at most {P.MAX_GPUS_PER_NODE}")
    return gpus


def _seconds(low: float, high: float | None = None):
    """A typer ``parser`` for an option in seconds: a finite number in ``[low, high]``. typer's own
    range check lets ``inf`` through and calls ``nan`` "not greater than or equal to 0"; this one
    names what is wrong (click's usage error names the option). The option keeps its ``min``
    and ``max`` for its help text."""
    span = f">= {low:g}" if high is None else f"from {low:g} to {high:g}"

    def parse(value) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise typer.BadParameter(f"{str(value)[:40]!r} is not a number (seconds, {span})") from None
        if not math.isfinite(x):
            raise typer.BadParameter(f"{value} is not a finite number of seconds (expected {span})")
        if x < low or (high is not None and x > high):
            raise typer.BadParameter(f"{value} is out of range (seconds, {span})")
        return x

    return parse


MAX_POLL_INTERVAL_S = 3600.0
"""Longest --poll-interval-s (a larger wait overflows the detector thread's timer)."""

# ---------------------------------------------------------------- `join` options
_Coordinator = Annotated[
    str, typer.Option("--coordinator", "-c", help="Coordinator address HOST:PORT (or a tcp:// endpoint).")
]
_Gpus = Annotated[str, typer.Option("--gpus", help="Comma-separated GPU indices this agent may use, e.g. 0,1.")]
_NodeId = Annotated[Optional[str], typer.Option("--node-id", help="Unique node id (default: hostname-pid).")]
_Reserved = Annotated[
    bool, typer.Option("--reserved", help="This is the reserved node's own rollout agent (not preemptible).")
]
_Cloud = Annotated[str, typer.Option("--cloud", help="Preemption notice source: aws, gcp, azure or none.")]
_MetadataUrl = Annotated[
    Optional[str], typer.Option("--metadata-url", help="Override the cloud metadata base URL (e.g. a mock server).")
]
_Keys = Annotated[
    Optional[pathlib.Path],
    path_option(
        "--keys",
        envvar="SPOTLIGHT_KEYS",
        help="Directory with the coordinator's public key (server.key) and this node's secret key "
        "(<role>.<name>.key_secret); see README 'Security model'.",
    ),
]
_Key = Annotated[
    Optional[str], typer.Option("--key", help="Which client key in --keys to use (its name), when there are several.")
]
_GraceS = Annotated[
    float,
    typer.Option(
        "--grace-s",
        min=0.0,
        parser=_seconds(0.0),
        help="Seconds workers get to commit in-flight state on a notice or SIGTERM.",
    ),
]
_PollIntervalS = Annotated[
    float,
    typer.Option(
        "--poll-interval-s",
        min=0.05,
        max=MAX_POLL_INTERVAL_S,
        parser=_seconds(0.05, MAX_POLL_INTERVAL_S),
        help="Seconds between cloud metadata polls (AWS recommends 5, Azure 1).",
    ),
]
_RegisterTimeoutS = Annotated[
    float,
    typer.Option(
        "--register-timeout-s",
        min=0.1,
        parser=_seconds(0.1),
        help="Give up (exit 1) if the coordinator does not answer the first registration within this many "
        "seconds; raise it when the agent may start long before the coordinator.",
    ),
]
_CoordinatorTimeoutS = Annotated[
    float,
    typer.Option(
        "--coordinator-timeout-s",
        min=1.0,
        parser=_seconds(1.0),
        help="Exit (code 4) after hearing nothing from the coordinator for this long; before that the agent "
        "re-registers with backoff and keeps its workers (a coordinator restarted with --resume finds them).",
    ),
]
_WeightsDir = Annotated[
    Optional[pathlib.Path],
    path_option(
        "--weights-dir",
        help="Directory of the node's weight-version cache (a local disk with room for 3 versions; emptied at "
        "start). Default: <state dir>/weights.",
    ),
]
_Nice = Annotated[
    int,
    typer.Option(
        "--nice",
        min=0,
        max=19,
        help="CPU niceness of the worker processes (local mode runs simulated spot GPUs at 5 so they slow the "
        "trainer less on shared CPU cores).",
    ),
]
_WarmSpare = Annotated[
    Optional[bool],
    typer.Option(
        "--warm-spare/--no-warm-spare",
        help="Keep one pre-started spare worker process that becomes the next worker when a GPU is granted "
        "(joins without a process start). Default: on for spot nodes, off with --reserved (its GPUs do not "
        "come and go).",
    ),
]
_RevokedGpusFile = Annotated[
    Optional[pathlib.Path],
    path_option(
        "--revoked-gpus-file",
        help="File in which a cluster scheduler lists the GPUs it took back (indices as in --gpus); the agent "
        "reads it on SIGUSR1, revokes those and gives back those no longer listed. Default: "
        "<state dir>/<node id>/revoked-gpus.",
    ),
]
_LogLevel = Annotated[
    str,
    typer.Option("--log-level", envvar="SPOTLIGHT_LOG_LEVEL", help="Logging level (DEBUG, INFO, WARNING, ERROR)."),
]
_LogFile = Annotated[
    Optional[pathlib.Path],
    path_option("--log-file", help="Also append the log to this file (the console keeps it too)."),
]


@app.command()
def join(
    coordinator: _Coordinator,
    gpus: _Gpus = "0",
    node_id: _NodeId = None,
    reserved: _Reserved = False,
    cloud: _Cloud = "none",
    metadata_url: _MetadataUrl = None,
    keys: _Keys = None,
    key: _Key = None,
    grace_s: _GraceS = 20.0,
    poll_interval_s: _PollIntervalS = 1.0,
    register_timeout_s: _RegisterTimeoutS = 60.0,
    coordinator_timeout_s: _CoordinatorTimeoutS = 600.0,
    weights_dir: _WeightsDir = None,
    nice: _Nice = 0,
    warm_spare: _WarmSpare = None,
    revoked_gpus_file: _RevokedGpusFile = None,
    log_level: _LogLevel = "INFO",
    log_file: _LogFile = None,
) -> None:
    """Register this node with a coordinator and serve Rollout Workers until told to stop.

    A spot agent first polls its cloud's metadata once: if this VM already has an active
    preemption notice (for example after a drain, when systemd restarts the agent), it does not
    join and exits with status 75 (the units' RestartPreventExitStatus), without draining again.
    If another live agent holds the same --node-id, the coordinator refuses this one, which exits
    with status 78 (also in RestartPreventExitStatus) after one more try once that agent's
    heartbeats would have timed out, if that is within --register-timeout-s (so a crashed agent
    restarted by systemd gets in then). The directories it makes (its state directory, the weight
    cache) go again when it exits, unless they hold something (a handled-notice ledger).
    """
    _setup_logging(node_id, log_level, log_file)
    coordinator = _checked_endpoint(coordinator)
    try:
        gpu_list = _parse_gpus(gpus)
    except ValueError as exc:
        _fail(str(exc))
    if (bad := gpu_ids_error(gpu_list)) is not None:
        _fail(f"--gpus: {bad}")
    if (outside := visibility_error(gpu_list, os.environ.get("CUDA_VISIBLE_DEVICES"))) is not None:
        _fail(f"--gpus: {outside}")
    client_keys = _checked_keys(keys, key, reserved)
    if revoked_gpus_file is not None and (bad := file_path_error(revoked_gpus_file)) is not None:
        _fail(f"--revoked-gpus-file {revoked_gpus_file}: {bad}")
    nid = node_id or f"{socket.gethostname()}-{os.getpid()}"
    made: list[pathlib.Path] = []  # directories this join created: removed at its end if left empty
    try:
        node_dir = _made_node_dirs(nid, weights_dir, made)
        try:
            detector = make_detector(cloud, metadata_url, ledger=NoticeLedger(node_dir / "handled-notices.json"))
        except ValueError as exc:
            _fail(f"--cloud: {exc}")
        try:
            daemon = AgentDaemon(
                coordinator,
                gpu_list,
                node_id=nid,
                is_spot=not reserved,
                keys=client_keys,
                grace_s=grace_s,
                detector=detector,
                poll_interval_s=poll_interval_s,
                nice=nice,
                register_timeout_s=register_timeout_s,
                coordinator_timeout_s=coordinator_timeout_s,
                warm_spare=(not reserved) if warm_spare is None else warm_spare,
                weights_dir=weights_dir,
                revoked_gpus_file=revoked_gpus_file,
            )
        except OSError as exc:  # e.g. no room for the workers' socket directory in $TMPDIR
            _fail(f"cannot start the agent: {exc}")
        code = _run_daemon(daemon, grace_s)
    finally:
        remove_made_dirs(made)
    raise typer.Exit(code)


def make_dir(path: pathlib.Path, *, mode: int = 0o700) -> list[pathlib.Path]:
    """Create the directory ``path`` (``mode``) and its missing parents, unless it is one already;
    the directories it created, outermost first (for :func:`remove_made_dirs`).

    Raises:
        ValueError: why ``path`` cannot be a writable directory, one phrase that names the
            culprit when it is not ``path`` itself ("not a directory", "/x is not a directory",
            "not writable", "cannot create /x/y: Permission denied"); nothing is left behind.
    """
    target = pathlib.Path(os.path.abspath(path))
    top, missing = target, []
    while not os.path.lexists(top) and top.parent != top:
        missing.append(top)
        top = top.parent
    if not os.path.isdir(top):
        raise ValueError("not a directory" if top == target else f"{top} is not a directory")
    if not os.access(top, os.W_OK | os.X_OK):
        raise ValueError("not writable" if top == target else f"cannot create it: {top} is not writable")
    made: list[pathlib.Path] = []
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode if d == target else 0o777)
        except FileExistsError:
            if os.path.isdir(d):  # made by another process meanwhile: not ours to remove
                continue
            remove_made_dirs(made)
            raise ValueError("not a directory" if d == target else f"{d} is not a directory") from None
        except OSError as exc:
            remove_made_dirs(made)
            raise ValueError(f"cannot create {d}: {exc.strerror or exc}") from None
        made.append(d)
    return made


def remove_made_dirs(made: list[pathlib.Path]) -> None:
    """Remove the directories :func:`make_dir` created (``made``, outermost first) that are empty,
    innermost first; one that holds something (a handled-notice ledger, a scheduler's
    revoked-GPUs file, another agent's files) stays, and so do its parents."""
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            pass


def file_path_error(path: pathlib.Path) -> str | None:
    """Why ``path`` cannot be a file (it may not exist yet): a directory, or below something that
    is not a directory; None when it can. Creates nothing."""
    target = pathlib.Path(os.path.abspath(path))
    if os.path.isdir(target):
        return "a directory, not a file"
    top = target.parent
    while not os.path.lexists(top) and top.parent != top:
        top = top.parent
    if not os.path.isdir(top):
        return f"{top} is not a directory"
    return None


def _made_node_dirs(node_id: str, weights_dir: pathlib.Path | None, made: list[pathlib.Path]) -> pathlib.Path:
    """Create this agent's state directory (``<state root>/<node id>``) and its weight cache
    directory before anything starts, appending what was created to ``made``; the state
    directory. A path that cannot be a writable directory: one line, exit 2."""
    from spotlight.net.agent_paths import state_root

    root = state_root()
    node_dir = state_dir(node_id, create=False)
    env = " ($SPOTLIGHT_AGENT_STATE)" if os.environ.get("SPOTLIGHT_AGENT_STATE") else ""
    wanted = [(root, f"agent state directory {root}{env}"), (node_dir, f"agent state directory {node_dir}")]
    if weights_dir is not None:
        wanted.append((weights_dir, f"--weights-dir {weights_dir}"))
    else:
        wanted.append((node_dir / "weights", f"weight cache {node_dir / 'weights'} (or pass --weights-dir)"))
    for path, what in wanted:
        try:
            made += make_dir(path, mode=0o777 if path == root else 0o700)
        except ValueError as exc:
            _fail(f"{what}: {exc}")
    return node_dir


def _setup_logging(node_id: str | None, level: str, log_file: pathlib.Path | None) -> None:
    """The agent's logging (``--log-level``, ``--log-file``); a bad one: one line, exit 2."""
    if log_file is not None and (bad := file_path_error(log_file)) is not None:
        _fail(f"--log-file {log_file}: {bad}")
    try:
        configure_logging(
            f"agent[{node_id}]" if node_id else "agent",
            f"agent-{node_id}" if node_id else None,
            level=level,
            log_file=str(log_file) if log_file else None,
        )
    except ValueError as exc:
        _fail(f"--log-level: {exc}")
    except OSError as exc:
        where = f"--log-file {log_file}" if log_file is not None else "the agent's log file"
        other = exc.filename and os.path.abspath(exc.filename) != os.path.abspath(str(log_file))
        culprit = f" ({exc.filename})" if other else ""
        _fail(f"{where}: cannot open it{culprit}: {exc.strerror or exc}")


def _checked_endpoint(coordinator: str) -> str:
    """``--coordinator`` as a tcp:// endpoint; checked before anything connects: one line, exit 2."""
    from spotlight.net.endpoints import tcp_endpoint

    try:
        return tcp_endpoint(coordinator)
    except ValueError as exc:
        _fail(str(exc))


def _checked_keys(keys: pathlib.Path | None, name: str | None, reserved: bool) -> ClientKeys:
    """This node's CURVE keys from ``--keys``; checked before anything connects: one line, exit 2."""
    if keys is None:
        _fail(
            "no keys: pass --keys DIR (or set SPOTLIGHT_KEYS) holding the coordinator's server.key and this "
            "node's <role>.<name>.key_secret (README 'Security model')"
        )
    if not keys.is_dir():
        _fail(
            f"--keys {keys}: {'not a directory' if os.path.lexists(keys) else 'no such directory'} (it must hold "
            "the coordinator's server.key and this node's <role>.<name>.key_secret)"
        )
    try:
        return load_client_keys(keys, name=name, role="reserved" if reserved else "agent")
    except KeysError as exc:
        _fail(f"--keys: {exc}")
    except OSError as exc:  # an unreadable directory or key file
        _fail(f"--keys {keys}: cannot read {exc.filename or keys}: {exc.strerror or exc}")


def sigterm_handler(daemon: AgentDaemon, grace_s: float):
    """The agent's SIGTERM handler. The first SIGTERM is a node preemption notice (Kubernetes'
    pod termination, Slurm's ``--signal=TERM@<grace>``, systemd's stop): it is queued for the main
    loop, which reports it to the coordinator with the deadline ``now + grace_s`` and drains (the
    workers commit, then the agent exits 0). A second SIGTERM stops at once, as SIGINT does: it
    raises ``KeyboardInterrupt`` in the main loop, whose shutdown stops the workers without
    waiting for their commits (unless the agent is already in that shutdown)."""
    received = 0

    def handler(signum, frame) -> None:
        nonlocal received
        received += 1
        if received == 1:
            daemon._signal_notices.put(sigterm_notice(grace_s, time.time()))
        elif not daemon.shutting_down:
            log.warning("second SIGTERM: stopping at once, without waiting for the workers' commits")
            daemon.stopped_by = signal.SIGTERM
            raise KeyboardInterrupt

    return handler


def _run_daemon(daemon: AgentDaemon, grace_s: float) -> int:
    """Run ``daemon`` to its end; its exit status. SIGTERM is one more preemption source (same
    commit path, deadline = now + grace; a second one stops at once, :func:`sigterm_handler`);
    the daemon's one-line reasons go to stderr."""
    signal.signal(signal.SIGTERM, sigterm_handler(daemon, grace_s))
    signal.signal(signal.SIGUSR1, lambda *_: daemon.revocations_due.set())  # a scheduler's per-GPU revocation
    try:
        return daemon.run()
    except KeyboardInterrupt:  # SIGINT or a second SIGTERM while serving: the workers were stopped at once
        signum = daemon.stopped_by or signal.SIGINT
        typer.echo(
            f"spotlight-agent: stopped at once by {signal.Signals(signum).name}: workers stopped without "
            "waiting for their commits (their leases run again elsewhere)",
            err=True,
        )
        return 128 + signum
    except StoppedWaiting as exc:
        typer.echo(f"spotlight-agent: {exc}", err=True)
        return exc.code
    except NodeIdInUse as exc:
        typer.echo(f"spotlight-agent: error: {exc}", err=True)
        return exc.code
    except SystemExit as exc:  # the daemon's one-line reasons (no answer, refused key): the CLI's error style
        if not isinstance(exc.code, str):
            raise
        typer.echo(f"spotlight-agent: error: {exc.code}", err=True)
        return 1
    finally:
        import shutil

        shutil.rmtree(daemon._ipc_dir, ignore_errors=True)


def unresolved_host_hint(endpoint: str) -> str:
    """``" (HOST does not resolve: …)"`` when the host of a ``tcp://HOST:PORT`` endpoint has no
    address (a typo in --coordinator, or DNS not up yet), else ``""``: the reason a join heard
    nothing that the wait alone does not tell."""
    import socket

    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if not host or host == "*":
        return ""
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        return f" ({host} does not resolve: {exc.strerror or exc})"
    except OSError:
        return ""
    return ""


def gpu_ids_error(gpus: list[int]) -> str | None:
    """Why a list of GPU ids is malformed whatever the node holds (none given, negative, above
    :data:`spotlight.protocol.MAX_GPU_INDEX`, repeated), or None; the CLI checks it before
    contacting the agent. An id above that bound would be taken, then every HEARTBEAT that
    carries it would fail to decode at the coordinator (the node would time out)."""
    if not gpus:
        return "no GPU given"
    negative = sorted({g for g in gpus if g < 0})
    if negative:
        return f"GPU ids are 0 or more, got {negative}"
    too_big = sorted({g for g in gpus if g > P.MAX_GPU_INDEX})
    if too_big:
        return f"GPU ids are at most {P.MAX_GPU_INDEX} (the largest the coordinator accepts), got {too_big[:8]}"
    if len(set(gpus)) != len(gpus):
        return f"GPU ids repeated: {gpus}"
    return None


def control_gpus_error(
    cmd: str, gpus: list[int], node_gpus: list[int], visible_devices: str | None = None
) -> str | None:
    """Why a local `revoke` / `add` of `gpus` on a node holding `node_gpus` is refused, or None
    (an added GPU must also be in the agent's ``CUDA_VISIBLE_DEVICES``, ``visible_devices``).

    Checked before anything changes: a bad request must neither stop a worker nor reach the
    coordinator's event log as a revocation or an addition."""
    bad = gpu_ids_error(gpus)
    if bad is not None:
        return bad
    held = f"this node's GPUs are {sorted(node_gpus)}" if node_gpus else "this node holds no GPU"
    if cmd == "revoke":
        unknown = sorted(g for g in gpus if g not in node_gpus)
        if unknown:
            return f"GPU(s) {unknown} not on this node ({held}): nothing revoked"
    elif cmd == "add":
        present = sorted(g for g in gpus if g in node_gpus)
        if present:
            return f"GPU(s) {present} already on this node ({held}): nothing added"
        if (outside := visibility_error(gpus, visible_devices)) is not None:
            return f"{outside}: nothing added"
    return None


def _fail(message: str) -> None:
    """One line on stderr, exit status 2 (a usage error, before anything starts)."""
    typer.echo(f"spotlight-agent: error: {message}", err=True)
    raise typer.Exit(2)


_STATE_DIR_HELP = (
    "Agent state directory (default $SPOTLIGHT_AGENT_STATE or ~/.local/state/spotlight-agent; a local run's "
    "agents live in <run_dir>/agents)."
)


def _control(node_id: str, request: dict, timeout_s: float = 5.0, state_dir_opt: Optional[pathlib.Path] = None) -> dict:
    """Send ``request`` to the local agent ``node_id``'s control socket and return its reply.
    A missing state directory is reported (exit 2), never created; no answer: exit 1."""
    from spotlight.net.agent_paths import state_root

    if state_dir_opt is not None:
        os.environ["SPOTLIGHT_AGENT_STATE"] = str(state_dir_opt)
    root = state_root()
    flag = "--state-dir" if state_dir_opt is not None else "agent state directory"
    if not root.is_dir():
        _fail(f"{flag} {root}: {'not a directory' if root.exists() else 'no such directory'}")
    node_dir = state_dir(node_id, create=False)
    if not node_dir.is_dir():
        _fail(f"no agent {node_id!r} in {root} (no {node_dir}; is --node-id or --state-dir wrong?)")
    endpoint = control_endpoint(node_id, create=False)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(json.dumps(request).encode())
        if not sock.poll(int(timeout_s * 1000)):
            typer.echo(
                f"spotlight-agent: error: agent {node_id!r} did not answer on {endpoint} "
                "(is it running on this machine?)",
                err=True,
            )
            raise typer.Exit(1)
        return json.loads(sock.recv())
    finally:
        sock.close()


def _reply(reply: dict) -> None:
    """A control reply: JSON on stdout when the agent did it (for scripts), else one
    ``spotlight-agent: error:`` line on stderr and exit status 1."""
    if not reply.get("ok"):
        typer.echo(f"spotlight-agent: error: {reply.get('error') or 'the agent refused the request'}", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps(reply))


@app.command()
def revoke(
    gpu: list[int] = typer.Option(..., "--gpu", help="GPU index to take away from Spotlight (repeatable)."),
    node_id: str = typer.Option(..., "--node-id", help="Node id of the local agent."),
    grace_s: float = typer.Option(
        10.0,
        "--grace-s",
        min=0.0,
        parser=_seconds(0.0),
        help="Seconds the affected worker gets to commit its in-flight state.",
    ),
    state_dir_opt: Optional[pathlib.Path] = path_option(None, "--state-dir", help=_STATE_DIR_HELP),
) -> None:
    """Per-GPU revocation by a cluster scheduler: the worker on that GPU commits and exits.

    The rest of the node keeps running."""
    if (bad := gpu_ids_error(gpu)) is not None:
        _fail(f"--gpu: {bad}")
    _reply(_control(node_id, {"cmd": "revoke", "gpus": gpu, "grace_s": grace_s}, state_dir_opt=state_dir_opt))


@app.command("add-gpu")
def add_gpu(
    gpu: list[int] = typer.Option(..., "--gpu", help="GPU index newly granted to Spotlight (repeatable)."),
    node_id: str = typer.Option(..., "--node-id", help="Node id of the local agent."),
    state_dir_opt: Optional[pathlib.Path] = path_option(None, "--state-dir", help=_STATE_DIR_HELP),
) -> None:
    """A GPU was (re)granted to this node: start a Rollout Worker on it."""
    if (bad := gpu_ids_error(gpu)) is not None:
        _fail(f"--gpu: {bad}")
    _reply(_control(node_id, {"cmd": "add", "gpus": gpu}, state_dir_opt=state_dir_opt))


@app.command("agent-status")
def agent_status(
    node_id: str = typer.Option(..., "--node-id", help="Node id of the local agent."),
    state_dir_opt: Optional[pathlib.Path] = path_option(None, "--state-dir", help=_STATE_DIR_HELP),
) -> None:
    """Print the local agent's GPUs, workers, SP groups, in-flight requests and detector health (JSON)."""
    typer.echo(json.dumps(_control(node_id, {"cmd": "status"}, state_dir_opt=state_dir_opt), indent=2))


def main() -> None:
    from spotlight.util.cli_run import main_of

    main_of(app, "spotlight-agent: error:")


if __name__ == "__main__":
    main()
