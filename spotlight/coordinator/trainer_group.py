"""The Train Workers seen from the coordinator: their processes, readiness, updates and uploads.

One rank per reserved GPU runs ``python -m spotlight.workers.train.train_worker`` (FSDP2,
paper §5). Each authenticates on the coordinator's loopback trainer socket with a per-run key
that exists only in the coordinator and a 0600 file in the run directory
(``keys/trainer.json``). The exchange, per iteration n (docs/architecture.md §3)::

    rank r ── TRAIN_READY(rank, world) ─▶ (once)
    coord  ── TRAIN_BATCH(n, micro-batches, tensors) ─▶ every rank
    rank 0 ── WEIGHTS(v_{n+1} header) ─▶ WEIGHTS_CHUNK × k ─▶  Tensor Store publishes v_{n+1}
    rank r ── TRAIN_DONE(n, metrics) ─▶
    ...
    coord  ── SHUTDOWN("save:<run>/final") ─▶ every rank ── TRAIN_DONE(-1) ─▶  (the final save)

**External ranks** (``spotlight up --external-trainers``, :class:`ExternalTrainers`): the ranks are
started by torch's own launcher (``torchrun``) or Slurm's ``srun`` on one or more reserved nodes
(``python -m spotlight.workers.train.launch``), not by the coordinator. They connect to the
trainer socket, bound on a routable address, with a ``trainer`` key of the coordinator's
allow-list (ZeroMQ CURVE + ZAP, like the agents: the coordinator never serves an unauthenticated
trainer), and open with a handshake that gives them what a spawned rank gets on its command line::

    rank r ── TRAIN_HELLO(rank, world, local rank, host, GPU) ─▶
    coord  ── TRAIN_SETUP(config, resume version, checkpoint dir, session) ─▶ rank r ── TRAIN_READY ─▶ …
    rank r's heartbeat thread ── TRAIN_HEARTBEAT(rank, session) ─▶ every heartbeat_interval_s

Each rank's GPU is billed from its TRAIN_HELLO to the end of the run, per host (``trainers@<host>``
holds of the Instance Manager, so a GPU shared with a reserved agent on that host is billed
once). Until every rank said hello the coordinator waits, saying who is missing, for at most
``timeout_s``. A rank silent for ``heartbeat_timeout_s`` (its process died, its host is gone) is
forgotten while the group is incomplete, and stops the run once it was complete, as a dead
child process does. (A heartbeat of its own, not the end of its connection: the libzmq here
has no disconnect notification for ROUTER sockets, and a rank's main thread may be inside a
step for minutes.)

Every message is validated before anything changes; a refusal raises
:class:`~spotlight.coordinator.server.Rejected` (one ERROR reply).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import secrets
import socket
import subprocess
import sys
from typing import Callable

import numpy as np

from spotlight import protocol as P
from spotlight.config import SpotlightConfig
from spotlight.coordinator.server import TRAINER, ControlServer, Rejected
from spotlight.core.events import EventLog
from spotlight.core.instance_manager import InstanceManager
from spotlight.core.retention import versions_to_delete
from spotlight.net.security import ServerKeys, ephemeral_client, write_client_file
from spotlight.rl.batch import TrainingBatches
from spotlight.store.checkpoint import is_checkpoint_iteration, train_checkpoint_dir
from spotlight.store.tensor_store import TensorStore
from spotlight.store.tensor_wire import pack_tensors
from spotlight.store.weight_sync import WeightSyncError, check_safetensors_file
from spotlight.util.disk import free_bytes, space_problem
from spotlight.util.procs import ChildExit, LogMark, log_mark, scrubbed_env, spawn_logged
from spotlight.workers.train.launch_env import nccl_env
from spotlight.workers.train.peer_watch import EXIT_PEER_LOST

log = logging.getLogger("spotlight.coordinator")

__all__ = ["ExternalTrainers", "LostRank", "TrainerGroup"]

WAIT_REMINDER_S = 60.0
"""While external ranks are missing, how often the coordinator says so again."""


@dataclasses.dataclass(frozen=True)
class ExternalTrainers:
    """The run's Train Worker ranks are started by torchrun or srun, not by the coordinator.

    Attributes:
        bind: where the trainer socket listens (``tcp://HOST:PORT``; port 0 = any free port).
        timeout_s: how long the coordinator waits for every rank's TRAIN_HELLO.
        keys_dir: the coordinator's keys directory (named in the waiting lines).
        heartbeat_interval_s, heartbeat_timeout_s: each rank's TRAIN_HEARTBEAT period, and the
            silence after which it is lost.
    """

    bind: str
    timeout_s: float = 900.0
    keys_dir: str = ""
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 60.0
    """A rank's heartbeat thread needs Python's lock, which a long call that holds it delays."""


@dataclasses.dataclass(frozen=True)
class LostRank:
    """Why the run must stop that no child process's exit tells: an external rank's connection
    ended, or the ranks did not all connect in time (the interface of :class:`ChildExit` the
    coordinator uses)."""

    summary: str

    def report(self, then: str = "") -> str:
        return self.summary + then


class TrainerGroup:
    """The run's Train Worker ranks.

    Args:
        cfg: the run config (``train.num_train_workers``, ``cluster.weight_chunk_bytes``,
            ``run.keep_weight_versions``).
        run_dir: the run directory (config, keys, checkpoints, the upload spool).
        store: the Tensor Store the uploads are published in.
        events: the run's event log (a ``weights`` event per published version).
        phase, iteration: the iteration core's phase and iteration (read only), against which
            TRAIN_DONE and a republished version are checked.
    """

    def __init__(
        self,
        cfg: SpotlightConfig,
        run_dir: pathlib.Path,
        store: TensorStore,
        events: EventLog,
        *,
        phase: Callable[[], str],
        iteration: Callable[[], int],
        needed_versions: Callable[[], set[int]] = set,
        external: ExternalTrainers | None = None,
        instances: InstanceManager | None = None,
        say: Callable[[str], None] = lambda line: None,
    ):
        self.cfg, self.run_dir, self.store, self.events = cfg, pathlib.Path(run_dir), store, events
        self.external, self.instances, self.say = external, instances, say
        self.hellos: dict[int, P.TrainHello] = {}  # external ranks: rank -> its TRAIN_HELLO
        self.sessions: dict[int, str] = {}  # external ranks: rank -> the session its heartbeats name
        self.heard: dict[int, float] = {}  # external ranks: rank -> when its last heartbeat arrived
        self.waiting_since: float | None = None  # external: when the coordinator began to wait
        self._reminded_at = 0.0
        self.complete = False  # external: every rank was ready once (a lost rank then stops the run)
        self.stopping = False  # SHUTDOWN sent: ranks leaving now is expected
        self.lost: str | None = None  # external: why the group broke (a rank's connection ended, a timeout)
        self.needed_versions = needed_versions
        """Versions the retention must keep whatever their age (workers, unfinished requests, checkpoint)."""
        self._phase, self._iteration = phase, iteration
        self.world = cfg.train.num_train_workers
        self.ready: set[int] = set()
        self.done: dict[int, P.TrainDone] = {}
        self.ids: dict[int, bytes] = {}  # rank -> routing id of its connection
        self.procs: list[subprocess.Popen] = []
        self.logs: list[LogMark | None] = []  # where each rank's output goes (what it said when it failed)
        self.version = -1  # the newest version a trainer published through this coordinator
        self.version_bytes = 0  # its size
        self.resume_version: int | None = None
        """The version a resumed run's trainers load (set by the coordinator's restore)."""
        self.server: ControlServer | None = None
        self.fatal: str | None = None
        """Why the run must stop though every rank lives (a version that does not fit the disk)."""

    # ------------------------------------------------------------ processes
    def start(self, server: ControlServer, keys: ServerKeys, now: float | None = None) -> None:
        """Spawn every rank (rank r uses GPU r of this host), connected to ``server``'s
        trainer socket with a fresh per-run trainer key; with external ranks, start waiting
        for them instead."""
        self.server = server
        if self.external is not None:
            self.waiting_since = self._reminded_at = now if now is not None else _monotonic()
            return
        conf_path = self.run_dir / "config.toml"
        key_file = self.run_dir / "keys" / "trainer.json"
        key_file.parent.mkdir(parents=True, exist_ok=True)
        write_client_file(key_file, ephemeral_client(keys, "trainer", f"run-{os.getpid()}"))
        master_port = _free_port()
        env = scrubbed_env()
        env.update(nccl_env(env)[0])  # a dead peer is aborted, never a survivor's process
        for rank in range(self.world):
            cmd = [sys.executable, "-m", "spotlight.workers.train.train_worker", "--coordinator"]
            cmd += [server.trainer_endpoint, "--keys-file", str(key_file), "--rank", str(rank)]
            cmd += ["--world-size", str(self.world), "--config-json", str(conf_path), "--master-port", str(master_port)]
            cmd += ["--checkpoint-dir", str(train_checkpoint_dir(self.run_dir))]
            cmd += ["--spool-dir", str(self.run_dir / "tensor_store" / "spool")]
            if self.resume_version is not None:
                cmd += ["--resume-version", str(self.resume_version)]
            if self.cfg.guard.enabled and self.cfg.guard.action == "rollback":
                cmd += ["--checkpoint-initial"]  # the base model is a version a rollback may return to
            self.logs.append(log_mark(f"trainer-{rank}", env))
            self.procs.append(spawn_logged(cmd, f"trainer-{rank}", env=env))

    def failed(self, now: float | None = None) -> ChildExit | LostRank | None:
        """Why the run must stop: the first rank that exited with a non-zero code, with the last
        lines of its log (a rank that died before one that stopped because it lost a peer,
        :data:`~spotlight.workers.train.peer_watch.EXIT_PEER_LOST`); with external ranks, one
        whose connection ended, or ranks that did not connect within the timeout (None: all fine)."""
        exited = [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
        exited.sort(key=lambda rc: rc[1] == EXIT_PEER_LOST)
        if exited:
            rank, code = exited[0]
            return ChildExit.of(f"train worker rank {rank}", code, self.logs[rank], disk=self.run_dir)
        now = now if now is not None else _monotonic()
        self._check_heartbeats(now)
        if self.lost is not None:
            return LostRank(self.lost)
        if self.external is not None and self.waiting_since is not None and not self.complete:
            if len(self.hellos) < self.world and now - self.waiting_since > self.external.timeout_s:
                self.lost = (
                    f"{len(self.hellos)} of {self.world} train worker ranks connected within "
                    f"{self.external.timeout_s:g} s (missing: {self._missing()}); start them with torchrun or srun "
                    f'(README "Multi-node training") with --coordinator {self.advertised_endpoint()} and a trainer key '
                    f"of {self.external.keys_dir or 'the coordinator'}, or raise --trainer-timeout-s"
                )
                return LostRank(self.lost)
        return None

    # ------------------------------------------------------------ external ranks
    def advertised_endpoint(self) -> str:
        """``HOST:PORT`` the external ranks connect to (this host's name when bound to all interfaces)."""
        ep = self.server.trainer_endpoint if self.server is not None else (self.external.bind if self.external else "")
        host, _, port = ep.removeprefix("tcp://").rpartition(":")
        if host in ("0.0.0.0", "*", "[::]", "::"):
            host = socket.gethostname()
        return f"{host}:{port}"

    def _missing(self) -> str:
        missing = [r for r in range(self.world) if r not in self.hellos]
        shown = ", ".join(map(str, missing[:16])) + (" …" if len(missing) > 16 else "")
        return f"rank {shown}" if len(missing) == 1 else f"ranks {shown}"

    def housekeeping(self, now: float) -> None:
        """External ranks still missing: say so again every :data:`WAIT_REMINDER_S`."""
        if self.external is None or self.waiting_since is None or len(self.hellos) == self.world:
            return
        if now - self._reminded_at >= WAIT_REMINDER_S:
            self._reminded_at = now
            waited = now - self.waiting_since
            self.say(
                f"still waiting for train worker {self._missing()} ({len(self.hellos)} of {self.world} connected, "
                f"{waited:.0f} s of {self.external.timeout_s:g} s)"
            )

    def _hold_host(self, host: str, now: float) -> None:
        """Bill the GPUs of the external ranks on ``host`` (none left: release its hold)."""
        if self.instances is None:
            return
        # a rank without a GPU (the CPU) counts as "GPU <rank>", as the ranks the coordinator starts do
        gpus = sorted({h.gpu if h.gpu >= 0 else h.rank for h in self.hellos.values() if h.host == host})
        if gpus:
            self.instances.hold(f"trainers@{host}", gpus, now, host=host)
        else:
            self.instances.release(f"trainers@{host}", now)

    def release_holds(self, now: float) -> None:
        """End the billing of every external rank's GPU (the run ended)."""
        if self.instances is not None:
            for host in {h.host for h in self.hellos.values()}:
                self.instances.release(f"trainers@{host}", now)

    def _check_heartbeats(self, now: float) -> None:
        """External ranks silent for ``heartbeat_timeout_s``: forgotten while the group is
        incomplete; once it was complete, the run must stop (:meth:`failed`)."""
        if self.external is None or self.stopping or self.lost is not None:
            return
        timeout = self.external.heartbeat_timeout_s
        for rank in sorted(r for r, t in self.heard.items() if now - t > timeout):
            hello = self.hellos.get(rank)
            where = f" on {hello.host}" if hello is not None and hello.host else ""
            if self.complete:
                self.lost = (
                    f"train worker rank {rank}{where} sent no heartbeat for {timeout:g} s: its process died or its "
                    "host is unreachable (the other ranks stop too)"
                )
                return
            for table in (self.ids, self.hellos, self.sessions, self.heard):
                table.pop(rank, None)
            self.ready.discard(rank)
            if hello is not None:
                self._hold_host(hello.host, now)
            self.say(f"train worker rank {rank}{where} went silent before every rank was ready; waiting for it again")

    def num_alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def wait(self, timeout_s: float = 10.0) -> None:
        """Wait for every rank to exit; kill a rank still running after ``timeout_s``."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()

    # ------------------------------------------------------------ state
    @property
    def all_ready(self) -> bool:
        return len(self.ready) == self.world

    @property
    def all_done(self) -> bool:
        return len(self.done) == self.world

    def metrics(self) -> dict[str, float]:
        """The ranks' TRAIN_DONE metrics of the last update, averaged over ranks (NaN where a
        rank did not report a key); the slowest rank's ``train/step_s`` and the largest
        ``train/peak_memory_bytes`` (what must fit one GPU)."""
        rows = [d.metrics for d in self.done.values()]
        if not rows:
            return {}
        worst = {"train/step_s", "train/peak_memory_bytes"}
        return {k: float((np.max if k in worst else np.mean)([m.get(k, float("nan")) for m in rows])) for k in rows[0]}

    # ------------------------------------------------------------ outbound
    def send(self, rank: int, msg, frames=None) -> bool:
        ident = self.ids.get(rank)
        return ident is not None and self.server is not None and self.server.send(TRAINER, ident, msg, frames)

    def train(
        self,
        n: int,
        batches: TrainingBatches,
        *,
        rollback_version: int = -1,
        lr_scale: float = 1.0,
        keep_versions: tuple[int, ...] = (),
    ) -> None:
        """Send iteration ``n``'s update (one :class:`~spotlight.rl.batch.RankBatch` per rank); the
        ranks save their checkpoint of v_{n+1} only on a checkpointed iteration (``run.checkpoint_every``).
        ``rollback_version`` >= 0: the collapse guard's rollback instead of the update (the ranks
        load that version's checkpoint and publish it as v_{n+1}); ``lr_scale``: the learning rate's
        factor; ``keep_versions``: trainer checkpoints the ranks must not prune."""
        self.done.clear()
        save = is_checkpoint_iteration(n, self.cfg.run.checkpoint_every, self.cfg.run.iterations)
        for rank, rb in enumerate(batches.ranks):
            metas, frames = pack_tensors(rb.tensors)
            msg = P.TrainBatch(
                iteration=n,
                version=n,
                micro_batches=rb.micro_batches,
                tensors=metas,
                checkpoint=save,
                rollback_version=rollback_version,
                lr_scale=lr_scale,
                keep_versions=sorted(keep_versions),
            )
            self.send(rank, msg, frames)

    def save_final(self, final_dir: pathlib.Path) -> None:
        """Ask every rank to save the final model to ``final_dir`` and exit (TRAIN_DONE(-1) each)."""
        self.done.clear()
        for rank in sorted(self.ids):
            self.send(rank, P.Shutdown(reason=f"save:{final_dir}"))

    def shutdown(self, reason: str) -> None:
        self.stopping = True
        for rank in list(self.ids):
            self.send(rank, P.Shutdown(reason=reason))

    # ------------------------------------------------------------ inbound
    def handle(self, identity: bytes, mtype: P.MsgType, body, payload: list, now: float) -> None:
        """One message from a trainer connection (already authenticated as a ``trainer`` key)."""
        if mtype == P.MsgType.TRAIN_HELLO:
            self._on_hello(identity, body, now)
            return
        if mtype == P.MsgType.TRAIN_HEARTBEAT:
            if self.sessions.get(body.rank) != body.session:
                raise Rejected("unknown_session", f"TRAIN_HEARTBEAT for rank {body.rank} names another session")
            self.heard[body.rank] = now
            return
        if mtype == P.MsgType.TRAIN_READY:
            self._on_ready(identity, body)
            return
        rank = next((r for r, i in self.ids.items() if i == identity), None)
        if rank is None or (self.external is not None and rank not in self.ready):
            raise Rejected("unknown_session", f"{mtype.name} from a trainer that sent no TRAIN_READY")
        if mtype in (P.MsgType.WEIGHTS, P.MsgType.WEIGHTS_CHUNK) and rank != 0:
            raise Rejected("forbidden", f"only rank 0 publishes weights (got {mtype.name} from rank {rank})")
        if mtype == P.MsgType.WEIGHTS:
            self._on_weights(body, payload)
        elif mtype == P.MsgType.WEIGHTS_CHUNK:
            self._on_chunk(body, payload, now)
        elif mtype == P.MsgType.TRAIN_DONE:
            self._on_done(rank, body)

    def _check_world(self, rank: int, world_size: int) -> None:
        if world_size != self.world or rank >= self.world:
            raise Rejected(
                "bad_request",
                f"rank {rank} of {world_size}: this run has {self.world} train workers (train.num_train_workers); "
                f"launch {self.world} ranks in all",
            )

    def _on_hello(self, identity: bytes, body: P.TrainHello, now: float) -> None:
        """An external rank introduces itself: checked, billed, answered with TRAIN_SETUP."""
        if self.external is None:
            raise Rejected(
                "forbidden",
                "this coordinator starts its own train workers; ranks launched by torchrun or srun need "
                "`spotlight up --external-trainers`",
            )
        if body.protocol_version != P.PROTOCOL_VERSION:
            raise Rejected(
                "protocol",
                f"trainer speaks protocol {body.protocol_version}, this coordinator {P.PROTOCOL_VERSION}: "
                "install the same Spotlight version on every node",
            )
        self._check_world(body.rank, body.world_size)
        if body.num_nodes * body.local_world_size != body.world_size or body.local_rank >= body.local_world_size:
            raise Rejected(
                "bad_request",
                f"rank {body.rank}: {body.num_nodes} nodes × {body.local_world_size} ranks per node is not "
                f"{body.world_size} ranks (local rank {body.local_rank})",
            )
        if body.num_nodes != self.cfg.train.num_train_nodes:
            # the memory plan counts each GPU's shard over one node's ranks (HSDP): another layout
            # would hold another share of the model than `up` checked
            raise Rejected(
                "bad_request",
                f"rank {body.rank}: the ranks were launched over {body.num_nodes} node(s) "
                f"({body.local_world_size} per node), but this run has train.num_train_nodes = "
                f"{self.cfg.train.num_train_nodes}: set it to {body.num_nodes} in the run config so that "
                "`spotlight plan` and up's memory check count each GPU's share of the model, or launch "
                f"over {self.cfg.train.num_train_nodes} node(s)",
            )
        held = self.ids.get(body.rank)
        if held is not None and held != identity:
            other = self.hellos.get(body.rank)
            raise Rejected(
                "forbidden",
                f"train rank {body.rank} is already connected (from {other.host if other else '?'}): "
                "two launchers started the same rank?",
            )
        if self.complete:
            raise Rejected("forbidden", f"train rank {body.rank}: the trainer group is complete and running")
        session = secrets.token_hex(8)
        setup = P.TrainSetup(
            config_toml=(self.run_dir / "config.toml").read_text(),
            session=session,
            resume_version=-1 if self.resume_version is None else self.resume_version,
            checkpoint_dir=str(train_checkpoint_dir(self.run_dir)),
            heartbeat_interval_s=self.external.heartbeat_interval_s,
        )
        self.ids[body.rank] = identity
        self.hellos[body.rank] = body
        self.sessions[body.rank] = session
        self.heard[body.rank] = now
        self._hold_host(body.host, now)
        self.send(body.rank, setup)
        where = f" on {body.host}" if body.host else ""
        device = f"GPU {body.gpu}" if body.gpu >= 0 else "CPU"
        log.info("train worker rank %d of %d connected%s (%s, pid %d)", body.rank, self.world, where, device, body.pid)
        if len(self.hellos) == self.world:
            nodes = len({h.host for h in self.hellos.values()})
            self.say(
                f"all {self.world} train worker ranks connected ({body.num_nodes} × {body.local_world_size} "
                f"ranks, {nodes} host{'s' if nodes != 1 else ''}); they load the model"
            )
        else:
            self.say(f"train worker rank {body.rank}{where} connected ({len(self.hellos)} of {self.world})")

    def _on_ready(self, identity: bytes, body: P.TrainReady) -> None:
        self._check_world(body.rank, body.world_size)
        if self.external is not None and self.ids.get(body.rank) != identity:
            raise Rejected("unknown_session", f"TRAIN_READY from rank {body.rank} before its TRAIN_HELLO")
        if body.rank in self.ids and self.ids[body.rank] != identity:
            raise Rejected("forbidden", f"train rank {body.rank} is already connected")
        self.ready.add(body.rank)
        self.ids[body.rank] = identity
        if self.external is not None and self.all_ready:
            self.complete = True

    def _on_weights(self, body: P.Weights, payload: list) -> None:
        """The header of a version upload: its chunks follow on this connection."""
        expected = self.store.latest_version + 1
        republish = self._phase() == "starting" and body.version == self.store.latest_version  # a resumed trainer
        if (body.version != expected and not republish) or payload or not body.found:
            raise Rejected(
                "bad_request",
                f"WEIGHTS must announce version {expected} (got version {body.version}, {len(payload)} frames): "
                "its bytes follow in WEIGHTS_CHUNK messages",
            )
        max_chunk = self.cfg.cluster.weight_chunk_bytes
        if (
            not 1 <= body.chunk_bytes <= max_chunk
            or body.size_bytes < 1
            or body.num_chunks != -(-body.size_bytes // body.chunk_bytes)
        ):
            raise Rejected(
                "bad_request",
                f"WEIGHTS v{body.version}: {body.size_bytes} bytes in {body.num_chunks} chunks of {body.chunk_bytes} "
                f"(chunks must be 1..{max_chunk} bytes and cover the version exactly)",
            )
        weights_dir = self.store.root / "weights"
        full = space_problem(weights_dir, body.size_bytes, free_bytes(weights_dir), f"weight version v{body.version}")
        if full is not None:  # the run cannot go on without the version: stop it, naming the disk
            self.fatal = full
            raise Rejected("bad_request", full)
        try:
            self.store.begin_weights(
                body.version, body.size_bytes, body.chunk_bytes, body.digest, validate=check_safetensors_file
            )
        except WeightSyncError as exc:
            raise Rejected("bad_request", f"WEIGHTS v{body.version}: {exc}") from None

    def _on_chunk(self, body: P.WeightsChunk, payload: list, now: float) -> None:
        if len(payload) != 1 or len(payload[0]) != body.size_bytes:
            raise Rejected(
                "bad_request",
                f"WEIGHTS_CHUNK v{body.version} #{body.index} must carry one frame of {body.size_bytes} bytes",
            )
        try:
            published = self.store.put_weights_chunk(body.version, body.index, body.offset, payload[0])
        except WeightSyncError as exc:
            raise Rejected("bad_request", f"WEIGHTS_CHUNK v{body.version} #{body.index}: {exc}") from None
        if published:
            info = self.store.weights_info(body.version)
            self.version_bytes = info.size_bytes
            drop = versions_to_delete(
                self.store.weight_versions(),
                newest=body.version,
                keep=self.cfg.run.keep_weight_versions,
                needed=self.needed_versions() if self.cfg.run.keep_weight_versions else (),
            )
            for v in drop:
                self.store.delete_weights(v)
            if drop:
                log.info("deleted weight versions %s (run.keep_weight_versions)", ", ".join(f"v{v}" for v in drop))
            self.version = max(self.version, body.version)
            log.info("published weights v%d (%d bytes, %s)", body.version, info.size_bytes, info.digest[:23])
            self.events.append(now, "weights", "", f"v{body.version} published ({info.size_bytes / 1e6:.1f} MB)")

    def _on_done(self, rank: int, body: P.TrainDone) -> None:
        if body.rank != rank:
            raise Rejected("forbidden", f"TRAIN_DONE for rank {body.rank} from rank {rank}'s connection")
        phase = self._phase()
        if not (
            (phase == "train" and body.iteration == self._iteration()) or (phase == "saving" and body.iteration == -1)
        ):
            raise Rejected("bad_request", f"unexpected TRAIN_DONE for iteration {body.iteration} in phase {phase}")
        self.done[body.rank] = body


def _monotonic() -> float:
    import time

    return time.monotonic()


def _free_port() -> int:
    from spotlight.net.ports import listen_port

    return listen_port()  # below the ephemeral range: no outgoing connection takes it meanwhile
