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

Every message is validated before anything changes; a refusal raises
:class:`~spotlight.coordinator.server.Rejected` (one ERROR reply).
"""

from __future__ import annotations

import logging
import os
import pathlib
import socket
import subprocess
import sys
from typing import Callable

import numpy as np

from spotlight import protocol as P
from spotlight.config import SpotlightConfig
from spotlight.coordinator.server import TRAINER, ControlServer, Rejected
from spotlight.core.events import EventLog
from spotlight.core.retention import versions_to_delete
from spotlight.net.security import ServerKeys, ephemeral_client, write_client_file
from spotlight.rl.batch import TrainingBatches
from spotlight.store.checkpoint import is_checkpoint_iteration, train_checkpoint_dir
from spotlight.store.tensor_store import TensorStore
from spotlight.store.tensor_wire import pack_tensors
from spotlight.store.weight_sync import WeightSyncError, check_safetensors_file
from spotlight.util.disk import free_bytes, space_problem
from spotlight.util.procs import ChildExit, LogMark, log_mark, scrubbed_env, spawn_logged

log = logging.getLogger("spotlight.coordinator")

__all__ = ["TrainerGroup"]


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
    ):
        self.cfg, self.run_dir, self.store, self.events = cfg, pathlib.Path(run_dir), store, events
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
    def start(self, server: ControlServer, keys: ServerKeys) -> None:
        """Spawn every rank (rank r uses GPU r of this host), connected to ``server``'s
        trainer socket with a fresh per-run trainer key."""
        self.server = server
        conf_path = self.run_dir / "config.toml"
        key_file = self.run_dir / "keys" / "trainer.json"
        key_file.parent.mkdir(parents=True, exist_ok=True)
        write_client_file(key_file, ephemeral_client(keys, "trainer", f"run-{os.getpid()}"))
        master_port = _free_port()
        env = scrubbed_env()
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

    def failed(self) -> ChildExit | None:
        """Why the run must stop: the first rank that exited with a non-zero code, with the last
        lines of its log (None: all fine)."""
        for rank, proc in enumerate(self.procs):
            if proc.poll() not in (None, 0):
                return ChildExit.of(f"train worker rank {rank}", proc.returncode, self.logs[rank], disk=self.run_dir)
        return None

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
        rank did not report a key)."""
        rows = [d.metrics for d in self.done.values()]
        if not rows:
            return {}
        return {k: float(np.mean([m.get(k, float("nan")) for m in rows])) for k in rows[0]}

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
        for rank in list(self.ids):
            self.send(rank, P.Shutdown(reason=reason))

    # ------------------------------------------------------------ inbound
    def handle(self, identity: bytes, mtype: P.MsgType, body, payload: list, now: float) -> None:
        """One message from a trainer connection (already authenticated as a ``trainer`` key)."""
        if mtype == P.MsgType.TRAIN_READY:
            self._on_ready(identity, body)
            return
        rank = next((r for r, i in self.ids.items() if i == identity), None)
        if rank is None:
            raise Rejected("unknown_session", f"{mtype.name} from a trainer that sent no TRAIN_READY")
        if mtype in (P.MsgType.WEIGHTS, P.MsgType.WEIGHTS_CHUNK) and rank != 0:
            raise Rejected("forbidden", f"only rank 0 publishes weights (got {mtype.name} from rank {rank})")
        if mtype == P.MsgType.WEIGHTS:
            self._on_weights(body, payload)
        elif mtype == P.MsgType.WEIGHTS_CHUNK:
            self._on_chunk(body, payload, now)
        elif mtype == P.MsgType.TRAIN_DONE:
            self._on_done(rank, body)

    def _on_ready(self, identity: bytes, body: P.TrainReady) -> None:
        if body.world_size != self.world or body.rank >= self.world:
            raise Rejected(
                "bad_request", f"rank {body.rank} of {body.world_size}: this run has {self.world} train workers"
            )
        if body.rank in self.ids and self.ids[body.rank] != identity:
            raise Rejected("forbidden", f"train rank {body.rank} is already connected")
        self.ready.add(body.rank)
        self.ids[body.rank] = identity

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
