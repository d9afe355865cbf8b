"""The coordinator: Spotlight's control plane on the reserved node.

This is the only place on the reserved side that owns sockets, processes and clocks;
every decision is delegated to a pure core (Request Scheduler, Instance Manager, seed
bank, Planner). One iteration (paper §4.2, docs/architecture.md §3)::

                     ┌──────────────────────── iteration n ─────────────────────────┐
    seed bank ──▶ ROLLOUT  batch n × K seeds, weights v_n, pulled by ALL workers
                   │  (reserved + spot; results stream in, rewards scored on a thread pool)
                   ▼  all Done + scored → group advantages
                 TRAIN    Train Workers (FSDP2): v_n → v_{n+1}          ─┐ concurrently
                 EXPLORE  batch n+1 × d candidate seeds on STALE v_n,    │ (spot workers
                          pulled by spot workers only                   ─┘  only)
                   ▼  TRAIN_DONE + Weights(v_{n+1}) → Tensor Store publishes v_{n+1}
                 DRAIN    leftover exploration pulled by ALL workers (critical path, §4.3.4)
                   ▼  top-k / bottom-k seeds per prompt → seed bank
                 iteration n+1

What each phase waits for and who unblocks it:

* ROLLOUT waits for every rollout request of the iteration to be Done (workers' RESULT
  messages) and for its reward (the reward thread pool).
* TRAIN waits for TRAIN_DONE from every train rank and the new weights from rank 0.
* DRAIN waits for every exploration request of the next batch to be Done and scored.

Workers pull (PULL → LEASES); the coordinator never pushes work. A dead agent is
detected by missed heartbeats and its leases are re-enqueued (Instance Manager +
Request Scheduler), so every request ends Done exactly once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import pathlib
import random
import re
import secrets
import socket
import subprocess
import sys
import time
from typing import Callable, Sequence

import msgspec
import numpy as np
import torch

from spotlight import protocol as P
from spotlight.config import SpotlightConfig, dump_config
from spotlight.coordinator.recorder import RunRecorder
from spotlight.coordinator.server import PUBLIC, TRAINER, ControlServer, Inbound
from spotlight.core.events import EventLog, cost_summary, eta_s
from spotlight.core.instance_manager import InstanceManager, cost_metrics
from spotlight.core.iteration import (
    CoreObservation,
    IterationCore,
    IterationDone,
    IterationSettings,
    StartSaving,
    StartTraining,
)
from spotlight.core.planner import Action, Planner, PlannerConfig, StepOption, no_fit_message, step_time_gpu_s
from spotlight.core.request_scheduler import RequestKind, RequestScheduler, lost_steps
from spotlight.core.seed_bank import SeedBank
from spotlight.errors import SpotlightError
from spotlight.models.lora import lora_spec
from spotlight.net.security import (
    Principal,
    ServerKeys,
    ephemeral_client,
    init_keys,
    load_server_keys,
    reload_allow_list,
    write_client_file,
)
from spotlight.rewards.reward_fn import RewardFn
from spotlight.rl.grpo import group_advantages
from spotlight.rl.sampler import Conditioning
from spotlight.store.checkpoint import train_checkpoint_dir
from spotlight.store.tensor_store import TensorStore, check_key
from spotlight.store.tensor_wire import pack_tensors, unpack_tensors
from spotlight.store.weight_sync import WeightSyncError, check_safetensors_file, fetch_replies
from spotlight.studies.profiling import load_profile
from spotlight.util.procs import scrubbed_env, spawn_logged

log = logging.getLogger("spotlight.coordinator")

AGENT_MESSAGES = frozenset(
    {
        P.MsgType.REGISTER,
        P.MsgType.HEARTBEAT,
        P.MsgType.PULL,
        P.MsgType.RESULT,
        P.MsgType.COMMIT,
        P.MsgType.FAIL,
        P.MsgType.FETCH_WEIGHTS,
        P.MsgType.FETCH_STATE,
        P.MsgType.NOTICE,
        P.MsgType.BYE,
    }
)
"""What an ``agent`` / ``reserved`` key may send (besides STATUS_REQUEST, open to every role)."""
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
STATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
MAX_GPUS_PER_NODE = 64
FRAME_OVERHEAD_BYTES = 64 * 1024
"""Slack over the largest frame a trainer sends: libzmq checks MAXMSGSIZE against the frame
as it is on the wire, which CURVE makes a few dozen bytes longer than its plaintext."""


class Rejected(SpotlightError):
    """A message refused by validation or authorization: becomes an ERROR reply with ``code``."""

    def __init__(self, code: str, message: str, *, retry_after_s: float = 0.0):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclasses.dataclass
class Peer:
    """An authenticated connection (keyed by its routing id) and the node it registered."""

    principal: Principal
    node_id: str | None = None


@dataclasses.dataclass
class Sample:
    """One finished request's outputs, kept until the iteration is trained on."""

    request_id: str
    kind: RequestKind
    iteration: int
    slot: int
    prompt_index: int
    seed: int
    batch_id: str
    image: torch.Tensor
    window_latents: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    computed_steps: int = 0
    reward: float | None = None
    window_start: int = 0
    reused_as_rollout: bool = False
    """An exploration candidate selected as part of its iteration's rollout (the
    verl-omni-spot baseline, params ``as_rollout``): trained on, shown in the sample grid."""

    @property
    def in_rollout(self) -> bool:
        """Part of the rollout of its iteration: a rollout request, or a candidate reused as one."""
        return self.kind == RequestKind.ROLLOUT or self.reused_as_rollout


class Coordinator:
    """Runs a whole post-training job.

    Args:
        cfg: resolved run config.
        run_dir: output directory (config, metrics, samples, final model, tensor store).
        bind: ZeroMQ endpoint to listen on for agents and ``spotlight status`` (CURVE).
        keys: the coordinator's keys and client allow-list (:mod:`spotlight.net.security`);
            None creates them in ``run_dir/keys`` (local runs and tests).
        prompts: the prompt set (N prompts).
        cond: its cached text conditioning from the model family (every tensor ``[N, …]``:
            ``embeds [N, T, D] float32``, ``mask [N, T]``, family extras such as pooled
            projections and the negative prompt for CFG).
        embeds, mask: the same for callers that have only embeddings and a mask.
        progress: called with one line per iteration (:meth:`format_progress`, at most 100
            characters).
        trackers: experiment trackers fed at the end of every iteration (metrics row, sample
            grid) and once with the resolved config: ``"tensorboard"`` (``run_dir/tensorboard``),
            ``"wandb"`` (offline, ``run_dir/wandb``); empty = none (:mod:`spotlight.coordinator.tracking`).
        resume: continue the run in ``run_dir`` from its last complete checkpoint (the
            iteration in flight when the previous coordinator died is run again); without a
            checkpoint the run restarts at iteration 0 in the same directory.

    Raises:
        CheckpointError: ``resume`` and the newest checkpoint is unreadable.
    """

    def __init__(
        self,
        cfg: SpotlightConfig,
        run_dir: pathlib.Path,
        *,
        bind: str,
        keys: ServerKeys | None = None,
        prompts: list[str],
        cond: Conditioning | None = None,
        embeds: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        progress: Callable[[str], None] = print,
        resume: bool = False,
        trackers: Sequence[str] = (),
    ):
        self.cfg = cfg
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "samples").mkdir(exist_ok=True)
        dump_config(cfg, self.run_dir / "config.toml")
        if keys is None:
            init_keys(self.run_dir / "keys", exist_ok=True)
            keys = load_server_keys(self.run_dir / "keys")
        self.keys = keys
        self.prompts = prompts
        if cond is None:
            if embeds is None or mask is None:
                raise ValueError("Coordinator needs `cond` (or `embeds` and `mask`)")
            cond = Conditioning(embeds.float(), mask)
        if len(cond) != len(prompts):
            raise ValueError(f"conditioning has {len(cond)} rows for {len(prompts)} prompts")
        self.cond = cond
        self.progress = progress
        self.server = ControlServer(
            bind,
            keys,
            max_message_bytes=cfg.cluster.max_message_bytes,
            trainer_max_message_bytes=max(cfg.cluster.weight_chunk_bytes, P.MAX_BODY_BYTES) + FRAME_OVERHEAD_BYTES,
        )
        self.endpoint = self.server.endpoint
        self.peers: dict[bytes, Peer] = {}
        self.node_route: dict[str, bytes] = {}  # node id -> routing id of its current connection
        self.node_owner: dict[str, str] = {}  # node id -> principal that first registered it
        self.max_gpus_per_node = MAX_GPUS_PER_NODE
        self.rejected = 0
        self.handler_errors = 0
        self._allow_list_mtime = 0.0
        self.sched = RequestScheduler(cfg.cluster.lease_timeout_s)
        self.instances = InstanceManager(cfg.cluster.heartbeat_timeout_s)
        self._clashes: set[tuple[str, str, str]] = (
            set()
        )  # (node id, holder's, claimant's instance id) refused and logged
        self.store = TensorStore(self.run_dir / "tensor_store", memory_max_bytes=cfg.cluster.weight_memory_max_bytes)
        self.seed_bank = SeedBank(cfg.run.seed, cfg.data.group_size)
        self.reward_fn = RewardFn(cfg.reward)
        self.reward_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=cfg.reward.num_threads, thread_name_prefix="reward"
        )
        self.reward_jobs: list[tuple] = []  # (future | None, request ids, images, prompts[, retry_at])
        self._reward_failures = 0
        self._reward_failing_since: float | None = None
        self.samples: dict[str, Sample] = {}
        self.worker_node: dict[str, str] = {}
        self.train_ready: set[int] = set()
        self.train_done: dict[int, P.TrainDone] = {}
        self.recorder = RunRecorder(self.run_dir, resume=resume)
        self.metrics_path = self.recorder.metrics_path
        self.history: list[dict] = []
        self.version = -1
        self.done = False
        self.error: str | None = None
        self.stop_reason: str | None = None
        """Why the run stopped early when that is not an error of the run (``spotlight up`` sets
        it: interrupted, timed out); recorded in the last status event."""
        self.train_procs: list[subprocess.Popen] = []
        rng = random.Random(cfg.data.shuffle_seed)
        self.prompt_order = list(range(len(prompts)))
        rng.shuffle(self.prompt_order)
        self.trainer_ids: dict[int, bytes] = {}
        # ---- exploration planning (paper §4.3)
        self.profile = load_profile(cfg)
        self.t_step_s: float | None = self.profile.t_step_s if self.profile else None
        self.step_wall_s: float | None = (
            None  # EMA of a batch's wall seconds per denoising step (for spot/work_lost_steps)
        )
        self.planner: Planner | None = None
        if cfg.explore.active and cfg.explore.planner == "bandit" and cfg.num_explored_prompts > 0:
            options = (
                self.profile.step_options() if self.profile else [StepOption(0.0, float(cfg.sampler.num_steps), 1.0)]
            )
            pc = cfg.planner
            self.planner = Planner(
                PlannerConfig(
                    max_sequences=pc.max_sequences,
                    min_sequences=cfg.planner_min_sequences,
                    sequence_step=pc.sequence_step,
                    min_effective_steps=pc.min_effective_steps,
                    min_exploration_accuracy=pc.min_exploration_accuracy,
                    beta=pc.beta,
                    window=pc.window,
                    group_size=cfg.data.group_size,
                    feedback_std_floor=pc.feedback_std_floor,
                    max_feedback=pc.max_feedback,
                ),
                options,
                random.Random(pc.seed),
            )
        mode = self.explore_mode()
        self.core = IterationCore(
            IterationSettings(
                iterations=cfg.run.iterations,
                prompts_per_iteration=cfg.data.prompts_per_iteration,
                num_control_prompts=cfg.data.num_control_prompts,
                group_size=cfg.data.group_size,
                run_seed=cfg.run.seed,
                num_steps=cfg.sampler.num_steps,
                explore_mode=mode,
                reuse_exploration=cfg.explore.reuse_as_rollout and mode == "critical_path",
                stream_extra=cfg.explore.stream_extra,
                max_candidates_per_prompt=cfg.explore.max_candidates_per_prompt,
            ),
            self.sched,
            self.seed_bank,
            self.planner,
            self.fixed_action() if mode != "off" and (self.planner is None or mode == "critical_path") else None,
            self.prompt_order,
            self.sampler_params,
        )
        self.resume_version: int | None = None
        self.t_start = time.monotonic()
        self.started_unix_s = time.time()
        # accounting: the Train Workers' reserved GPUs (rank r uses GPU r on
        # this host) are billed for the whole run; a colocated reserved Rollout Worker on the
        # same GPU (a reserved agent of this host) shares it and is not billed twice
        self.instances.hold(
            "trainers", list(range(cfg.train.num_train_workers)), self.t_start, host=socket.gethostname()
        )
        self._requests_done = 0  # rollout + exploration requests completed (this coordinator)
        self._requests_done_at_row = 0
        self.elapsed_before_s = 0.0  # run time of earlier coordinators of this run (resume)
        self.events = EventLog(start_s=self.t_start)
        if resume:
            self._restore(time.monotonic())
        else:
            self.sched.start_epoch(self.recorder.epoch)
        self._iterations_before_start = len(
            self.history
        )  # done by an earlier coordinator (resume): not in this one's ETA
        from spotlight.coordinator.tracking import open_trackers

        self.tracker = open_trackers(
            trackers,
            self.run_dir,
            config_text=(self.run_dir / "config.toml").read_text(),
            first_step=self.iteration + 1,
        )
        (self.run_dir / "coordinator.json").write_text(
            json.dumps(
                {
                    "endpoint": self.endpoint,
                    "trainer_endpoint": self.server.trainer_endpoint,
                    "pid": os.getpid(),
                    "keys_dir": str(keys.directory) if keys.directory else None,
                }
            )
        )

    # ------------------------------------------------------------ the iteration core's state
    @property
    def phase(self) -> str:
        """The iteration machine's phase (:class:`spotlight.core.iteration.IterationCore`)."""
        return self.core.phase

    @property
    def iteration(self) -> int:
        return self.core.iteration

    @property
    def request_meta(self) -> dict[str, tuple[int, int]]:
        return self.core.request_meta

    @property
    def last_train_s(self) -> float | None:
        return self.core.last_train_s

    @last_train_s.setter
    def last_train_s(self, value: float | None) -> None:
        self.core.last_train_s = value

    @property
    def plan_logs(self) -> dict[int, dict]:
        return self.core.plan_logs

    def batch_prompts(self, iteration: int) -> list[int]:
        """Prompt indices of iteration ``iteration``'s batch (deterministic epoch order)."""
        return self.core.batch_prompts(iteration)

    def is_control(self, slot: int) -> bool:
        """Control (unexplored) prompt groups are the last ``num_control_prompts`` slots."""
        return self.core.settings.is_control(slot)

    def explore_mode(self) -> str:
        """ "stale", "critical_path" or "off" (no explored prompts also means off)."""
        if not self.cfg.explore.active or self.cfg.num_explored_prompts == 0:
            return "off"
        return self.cfg.explore.mode

    def fixed_action(self) -> Action:
        """The fixed planner's action: d = num_candidates; s and its cache threshold from
        ``explore.num_steps`` via the profile table (or ``explore.cache_threshold``)."""
        cfg = self.cfg.explore
        T = float(self.cfg.sampler.num_steps)
        if cfg.num_steps and cfg.num_steps < T:
            if self.profile is None:
                from spotlight.errors import SpotlightError

                raise SpotlightError(
                    "explore.num_steps < sampler.num_steps needs a profile: run `spotlight profile` first"
                )
            opt = min(self.profile.step_options(), key=lambda o: abs(o.effective_steps - cfg.num_steps))
            return Action(cfg.num_candidates, opt.effective_steps, opt.cache_threshold)
        return Action(cfg.num_candidates, T, cfg.cache_threshold)

    def choose_action(self, n_next: int, now: float) -> Action | None:
        """Exploration action for batch ``n_next`` (None = explore nothing), by the core."""
        return self.core.choose_action(n_next, now, self.observation())

    def observation(self) -> CoreObservation:
        """What the iteration core needs to know about processes and nodes now."""
        world = self.cfg.train.num_train_workers
        spot_workers = sum(len(r.workers) for r in self.instances.live(spot=True))
        return CoreObservation(
            trainers_ready=len(self.train_ready) == world and 0 <= self.store.latest_version <= self.version,
            any_worker_node=bool(self.instances.live()),
            train_done=len(self.train_done) == world and self.store.latest_version >= self.iteration + 1,
            num_spot_gpus=self.instances.num_spot_gpus(),
            step_time_s=self.t_step_s,
            spot_slots=spot_workers * self.cfg.cluster.worker_batch_size,
        )

    # ------------------------------------------------------------ wire
    def send(self, identity: bytes, msg, frames=None, msg_type=None) -> bool:
        """Reply to a public peer (agent, status client); never blocks (see ControlServer.send)."""
        return self.server.send(PUBLIC, identity, msg, frames, msg_type)

    def send_trainer(self, rank: int, msg, frames=None) -> bool:
        ident = self.trainer_ids.get(rank)
        return ident is not None and self.server.send(TRAINER, ident, msg, frames)

    def error_to(
        self, identity: bytes, code: str, message: str, channel: str = PUBLIC, *, retry_after_s: float = 0.0
    ) -> None:
        """One log line and an ERROR reply; nothing else changes (docs/architecture.md §9)."""
        self.rejected += 1
        peer = self.peers.get(identity)
        who = f"{peer.principal.id}" + (f" node {peer.node_id}" if peer and peer.node_id else "") if peer else "?"
        # an agent of an earlier coordinator (resume) or a forgotten session heartbeats until it
        # re-registers, which the ERROR reply makes it do: expected, so INFO; the rest is ERROR
        # node_id_in_use: on_register logs each clash once at WARNING, not each refused REGISTER
        level = logging.INFO if code in ("unknown_session", "node_id_in_use") else logging.ERROR
        log.log(level, "rejected message from %r (%s): %s: %s", identity, who, code, message[:300])
        self.server.send(channel, identity, P.ErrorMsg(code=code, message=message[:1000], retry_after_s=retry_after_s))

    # ------------------------------------------------------------ trainer processes
    def start_trainers(self) -> None:
        """Start the Train Worker processes; each authenticates with a per-run key that exists
        only in this process and a 0600 file in the run dir (``keys/trainer.json``)."""
        world = self.cfg.train.num_train_workers
        master_port = _free_port()
        conf_path = self.run_dir / "config.toml"
        key_file = self.run_dir / "keys" / "trainer.json"
        key_file.parent.mkdir(parents=True, exist_ok=True)
        write_client_file(key_file, ephemeral_client(self.keys, "trainer", f"run-{os.getpid()}"))
        env = scrubbed_env()
        for rank in range(world):
            cmd = [
                sys.executable,
                "-m",
                "spotlight.workers.train.train_worker",
                "--coordinator",
                self.server.trainer_endpoint,
                "--keys-file",
                str(key_file),
                "--rank",
                str(rank),
                "--world-size",
                str(world),
                "--config-json",
                str(conf_path),
                "--master-port",
                str(master_port),
            ]
            cmd += ["--checkpoint-dir", str(train_checkpoint_dir(self.run_dir))]
            cmd += ["--spool-dir", str(self.run_dir / "tensor_store" / "spool")]
            if self.resume_version is not None:
                cmd += ["--resume-version", str(self.resume_version)]
            self.train_procs.append(spawn_logged(cmd, f"trainer-{rank}", env=env))

    # ------------------------------------------------------------ handlers
    def handle(self, msg: Inbound) -> None:
        """Authorize and dispatch one inbound message. Anything wrong with it — bad frames, a
        role that may not send it, a foreign node id, session or lease, an impossible value —
        is answered with one ERROR and one log line, and changes nothing."""
        rid = msg.routing_id
        if msg.error is not None:
            self.error_to(rid, "malformed", msg.error, msg.channel)
            return
        try:
            self._dispatch(msg, time.monotonic())
        except Rejected as exc:
            self.error_to(rid, exc.code, str(exc), msg.channel, retry_after_s=exc.retry_after_s)
        except Exception as exc:  # a handler bug must not stop the run: report and carry on
            self.handler_errors += 1
            log.error(
                "internal error handling %s from %r: %s: %s",
                msg.mtype.name,
                rid,
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
            if role != "trainer" or mtype not in (
                P.MsgType.TRAIN_READY,
                P.MsgType.TRAIN_DONE,
                P.MsgType.WEIGHTS,
                P.MsgType.WEIGHTS_CHUNK,
            ):
                raise Rejected("forbidden", f"{principal.id} may not send {mtype.name} on the trainer socket")
            self.on_trainer(msg.routing_id, mtype, body, msg.payload, now)
            return
        if mtype == P.MsgType.STATUS_REQUEST:
            self.send(msg.routing_id, P.Status(snapshot=self.snapshot()))
            return
        if role not in ("agent", "reserved") or mtype not in AGENT_MESSAGES:
            raise Rejected("forbidden", f"{principal.id} ({role}) may not send {mtype.name}")
        if mtype == P.MsgType.REGISTER:
            self.on_register(msg.routing_id, principal, body, now)
            return
        peer = self.peers.get(msg.routing_id)
        node_id = getattr(body, "node_id", "")
        if (
            peer is None
            or peer.node_id is None
            or node_id != peer.node_id
            or self.node_route.get(node_id) != msg.routing_id
            or not self.instances.session_ok(node_id, getattr(body, "session", ""))
        ):
            raise Rejected("unknown_session", f"{mtype.name} from an unregistered or stale session (node {node_id!r})")
        wid = getattr(body, "worker_id", None)
        if wid and not wid.startswith(node_id + "/"):
            raise Rejected("forbidden", f"worker {wid!r} does not belong to node {node_id!r}")
        handler = getattr(self, f"on_{mtype.name.lower()}")
        handler(msg.routing_id, body, msg.payload, now)  # validates fully before it changes anything
        if mtype not in (P.MsgType.HEARTBEAT, P.MsgType.BYE):
            self.instances.heartbeat(node_id, now)

    def on_register(self, identity: bytes, principal: Principal, body: P.Register, now: float) -> None:
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
        claim = self.instances.claim(body.node_id, body.instance_id, now)
        if not claim.accepted:
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
        # ---- accepted: from here on state changes
        self.node_owner[body.node_id] = principal.id
        old_route = self.node_route.get(body.node_id)
        if claim.decision == "replaces_silent":
            log.warning(
                "node %s registered by a new agent process: the previous one was silent for %.1fs (over cluster.heartbeat_timeout_s) and is replaced",
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
        stale = self.instances.register(
            body.node_id,
            session,
            gpus,
            body.is_spot,
            now,
            host="" if body.is_spot else body.hostname,
            instance_id=body.instance_id,
        )
        for wid in stale:
            self.sched.release_worker(wid, reason="agent re-registered", now=now)
            self.core.busy.gone(wid, now)
        for wid, node in list(self.worker_node.items()):
            if node == body.node_id:
                self.sched.release_worker(wid, reason="agent re-registered", now=now)
                self.core.busy.gone(wid, now)
        log.info("agent %s joined as %s (%d GPUs, spot=%s)", body.node_id, principal.id, len(gpus), body.is_spot)
        self.events.append(
            now,
            "join",
            body.node_id,
            f"{len(gpus)} {'spot' if body.is_spot else 'reserved'} GPU{'s' if len(gpus) != 1 else ''}"
            + (" (re-registered)" if old_route is not None else ""),
        )
        self.send(
            identity,
            P.Registered(
                node_id=body.node_id,
                heartbeat_interval_s=self.cfg.cluster.heartbeat_interval_s,
                lease_timeout_s=self.cfg.cluster.lease_timeout_s,
                worker_batch_size=self.cfg.cluster.worker_batch_size,
                torch_threads=self.cfg.cluster.torch_threads,
                sp_degree=self.cfg.cluster.sp_degree if body.is_spot else self.cfg.cluster.reserved_sp_degree,
                reconfiguration=self.cfg.cluster.reconfiguration,
                live_migration=self.cfg.cluster.live_migration,
                model=msgspec.to_builtins(self.cfg.model),
                sampler=msgspec.to_builtins(self.cfg.sampler),
                lora=lora_spec(self.cfg.train),
                latest_version=self.store.latest_version,
                session=session,
                weight_window_chunks=self.cfg.cluster.weight_window_chunks,
            ),
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
            gpus=body.gpus,
        )
        is_spot = self.instances.nodes[node_id].is_spot
        for w in body.workers:
            self.worker_node[w.worker_id] = node_id
            self.core.busy.seen(w.worker_id, is_spot, now)
            self.sched.renew(w.worker_id, now)
        self.send(identity, P.Heartbeat(node_id=node_id))  # ack: lets the agent detect a dead coordinator

    def _heartbeat_events(self, node_id: str, body: P.Heartbeat, now: float) -> None:
        """Event-log what a validated heartbeat changes: GPUs added or gone, workers re-formed
        (an SP group), the preemption detector turning unhealthy or recovering."""
        rec = self.instances.nodes[node_id]
        plural = lambda n, what: f"{n} {what}{'s' if n != 1 else ''}"  # noqa: E731
        if body.gpus is not None and sorted(body.gpus) != sorted(rec.gpus):
            added, gone = sorted(set(body.gpus) - set(rec.gpus)), sorted(set(rec.gpus) - set(body.gpus))
            if added:
                self.events.append(
                    now,
                    "add",
                    node_id,
                    f"+{plural(len(added), 'GPU')} (index {','.join(map(str, added))}): {len(body.gpus)} now",
                )
            if gone:
                self.events.append(
                    now,
                    "remove",
                    node_id,
                    f"-{plural(len(gone), 'GPU')} (index {','.join(map(str, gone))}): {len(body.gpus)} now",
                )
        workers = {w.worker_id: sorted(w.gpus) for w in body.workers}
        if rec.workers and workers and workers != {k: sorted(v) for k, v in rec.workers.items()}:
            self.events.append(
                now,
                "reform",
                node_id,
                f"{plural(len(workers), 'worker')}: " + ", ".join(plural(len(g), "GPU") for g in workers.values()),
            )
        if body.detector_healthy != rec.detector_healthy:
            self.events.append(
                now,
                "detector",
                node_id,
                f"unhealthy: {body.detector_error}" if not body.detector_healthy else "healthy again",
            )

    def on_pull(self, identity, body: P.Pull, payload, now) -> None:
        node = self.instances.nodes[body.node_id]
        self.worker_node[body.worker_id] = body.node_id
        self.core.busy.seen(body.worker_id, node.is_spot, now)
        leases = []
        if self.phase in ("explore_first", "rollout", "train", "drain") and node.status.value == "alive":
            leases = self.sched.pull(
                body.worker_id,
                is_spot=node.is_spot,
                max_requests=max(1, min(body.max_requests, self.cfg.cluster.worker_batch_size * 4)),
                now=now,
            )
        items, tensors = [], {}
        idx = []
        for i, lease in enumerate(leases):
            req = self.sched.get(lease.request_id)
            slot, pidx = self.request_meta[req.request_id]
            items.append(
                P.LeaseItem(
                    lease_id=lease.lease_id,
                    request_id=req.request_id,
                    kind=req.kind.value,
                    iteration=req.iteration,
                    prompt_index=pidx,
                    seed=req.seed,
                    weight_version=req.weight_version,
                    params=dict(req.params),
                    resume_step=lease.resume_step,
                )
            )
            idx.append(pidx)
            if lease.resume_step is not None and lease.commit_key:
                got = self.store.get_state(lease.commit_key)
                if got is not None:
                    for name, t in unpack_tensors(*got).items():
                        tensors[f"state.{i}.{name}"] = t
        if items:
            tensors.update(self.cond.index(idx).to_tensors())
            self.core.busy.start(body.worker_id, now)
        metas, frames = pack_tensors(tensors) if tensors else ([], [])
        self.send(identity, P.Leases(worker_id=body.worker_id, items=items, tensors=metas), frames)

    def _end_busy(self, worker_id: str, now: float) -> None:
        self.core.busy.end(worker_id, now)

    def _observe_step_time(self, body: P.Result) -> None:
        """EMA of GPU-seconds per (sequence × computed step) on spot workers: the Planner's t_step,
        in the unit of W = T_train · N_spot (an SP group's wall time × its GPUs, ``Result.num_gpus``)."""
        node = self.instances.nodes.get(body.node_id)
        if node is None or not node.is_spot or not body.items:
            return
        try:
            req = self.sched.get(body.items[0].request_id)
        except KeyError:
            return
        if float(req.params.get("cache_threshold", 0.0)) > 0:
            return  # a cached batch also pays for its skipped steps: the Planner prices those by cost_steps
        steps = sum(max(1, it.computed_steps) for it in body.items)
        est = step_time_gpu_s(body.elapsed_s, steps, body.num_gpus)
        if est is None:
            return
        self.t_step_s = est if self.t_step_s is None else 0.7 * self.t_step_s + 0.3 * est

    def _held(self, worker_id: str, request_id: str, lease_id: int) -> bool:
        """True iff ``worker_id`` holds the current lease ``lease_id`` of ``request_id``."""
        return self.sched.holder(request_id, lease_id) == worker_id

    def _check_unique(self, ids: list[str]) -> None:
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
                raise Rejected(
                    "bad_request",
                    f"RESULT needs images [{B}, 3, {S}, {S}] uint8, got {None if img is None else (tuple(img.shape), str(img.dtype))}",
                )
        mine = [(i, it) for i, it in enumerate(body.items) if self._held(body.worker_id, it.request_id, it.lease_id)]
        if any(_trained_on(self.sched.get(it.request_id)) for _, it in mine):
            for name in ("window_latents", "log_probs"):
                t = tensors.get(name)
                if t is None or t.dtype != torch.float32 or t.ndim < 2 or t.shape[0] != B:
                    raise Rejected(
                        "bad_request",
                        f"a rollout RESULT (or an exploration reused as the rollout) needs {name} [{B}, ...] float32",
                    )
        # ---- validated: from here on state changes
        self._end_busy(body.worker_id, now)
        self._observe_step_time(body)
        if body.items and body.elapsed_s > 0:
            est = body.elapsed_s / max(1, max(it.computed_steps for it in body.items))
            self.step_wall_s = est if self.step_wall_s is None else 0.7 * self.step_wall_s + 0.3 * est
        accepted, images, prompts = [], [], []
        for i, item in mine:
            if not self.sched.complete(item.request_id, item.lease_id, now):
                continue
            self._requests_done += 1
            req = self.sched.get(item.request_id)
            if req.commit_key:
                self.store.delete_state(req.commit_key)
            slot, pidx = self.request_meta[req.request_id]
            s = Sample(
                req.request_id,
                req.kind,
                req.iteration,
                slot,
                pidx,
                req.seed,
                body.batch_id,
                tensors["images"][i],
                computed_steps=item.computed_steps,
                window_start=int(req.params.get("sde_window_start", self.cfg.sampler.sde_window_start)),
            )
            if _trained_on(req):  # a rollout, or a candidate that may become the rollout (verl-omni-spot)
                s.window_latents = tensors["window_latents"][i]
                s.log_probs = tensors["log_probs"][i]
            self.samples[req.request_id] = s
            self.core.record_result(req.request_id, now)
            accepted.append(req.request_id)
            images.append(s.image.numpy())
            prompts.append(self.prompts[pidx])
        if len(accepted) < len(body.items):
            log.info(
                "ignored %d stale/duplicate/foreign results from %s", len(body.items) - len(accepted), body.worker_id
            )
        if accepted:
            self._score(accepted, np.stack(images), prompts)

    def _score(self, ids: list[str], images: np.ndarray, prompts: list[str]) -> None:
        self.reward_jobs.append((self.reward_pool.submit(self.reward_fn, images, prompts), ids, images, prompts))

    def poll_rewards(self) -> None:
        """Collect finished scoring jobs. A failed job keeps its samples and is retried with
        exponential backoff (1 s … 30 s); after ``reward.give_up_after_s`` of failures the
        run stops with a clear error instead of spinning."""
        now = time.monotonic()
        still = []
        for job in self.reward_jobs:
            fut, ids, images, prompts = job[:4]
            retry_at = job[4] if len(job) > 4 else 0.0
            if fut is None:  # waiting for its retry time
                if now >= retry_at:
                    still.append((self.reward_pool.submit(self.reward_fn, images, prompts), ids, images, prompts))
                else:
                    still.append(job)
                continue
            if not fut.done():
                still.append(job)
                continue
            try:
                rewards = fut.result()
            except Exception as exc:  # keep the samples, retry later
                self._reward_failures += 1
                self._reward_failing_since = self._reward_failing_since or now
                backoff = min(30.0, 2.0 ** min(self._reward_failures, 5) / 2)
                if self._reward_failures <= 3 or self._reward_failures % 10 == 0:
                    log.error(
                        "reward scoring failed (%s); keeping %d samples, retrying in %.0fs", exc, len(ids), backoff
                    )
                if now - self._reward_failing_since > self.cfg.reward.give_up_after_s:
                    self.error = f"reward scoring has failed for {now - self._reward_failing_since:.0f}s (last error: {exc}); giving up (reward.give_up_after_s)"
                still.append((None, ids, images, prompts, now + backoff))
                continue
            self._reward_failures = 0
            self._reward_failing_since = None
            for rid, r in zip(ids, rewards):
                if rid in self.samples:
                    self.samples[rid].reward = float(r)
                    self.core.record_reward(rid, float(r))
        self.reward_jobs = still

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
        self._end_busy(body.worker_id, now)
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
            self.events.append(
                now,
                "commit",
                body.node_id,
                f"{body.worker_id}: {len(mine)} request{'s' if len(mine) != 1 else ''} at step {max(it.step for _, it in mine)}",
            )
        if len(mine) < len(body.items):
            log.info("ignored %d stale/foreign commits from %s", len(body.items) - len(mine), body.worker_id)

    def on_fail(self, identity, body: P.Fail, payload, now) -> None:
        if len(body.request_ids) != len(body.lease_ids):
            raise Rejected(
                "bad_request", f"FAIL lists {len(body.request_ids)} request ids but {len(body.lease_ids)} lease ids"
            )
        self._check_unique(list(body.request_ids))
        mine = [(r, l) for r, l in zip(body.request_ids, body.lease_ids) if self._held(body.worker_id, r, l)]
        self._end_busy(body.worker_id, now)
        for rid, lid in mine:
            self.sched.fail(rid, lid, reason=body.reason, now=now)
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
        try:  # weight_sync.fetch_replies: shared with the stand-in coordinators of tests and benchmarks
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
            if not self.send(identity, msg, frames or None) and isinstance(msg, P.WeightsChunk):
                return  # the agent's queue is full or it is gone: it asks again

    def on_fetch_state(self, identity, body, payload, now) -> None:
        raise Rejected(
            "unsupported", "FETCH_STATE is not served: committed state travels with the lease that resumes it"
        )

    def on_notice(self, identity, body: P.Notice, payload, now) -> None:
        if not math.isfinite(body.deadline_unix_s):
            raise Rejected("bad_request", "notice deadline must be a finite unix time")
        self.instances.notice(body.node_id, msgspec.to_builtins(body), now)
        left_s = body.deadline_unix_s - time.time()
        if body.kind == "revoke":
            self.events.append(
                now,
                "revoke",
                body.node_id,
                f"{body.scope}, {left_s:.0f}s grace" + (f" ({body.source})" if body.source != "revoke" else ""),
            )
        else:
            self.events.append(
                now,
                "notice",
                body.node_id,
                f"{body.source} {body.kind}"
                + (" (hint)" if body.is_hint else "")
                + (f" for {body.scope}" if body.scope != "node" else "")
                + f", deadline in {left_s:.0f}s",
            )
        what = (
            f"GPU revocation ({body.scope})"
            if body.kind == "revoke"
            else f"preemption notice ({body.source} {body.kind}{', hint' if body.is_hint else ''})"
        )
        log.info(
            "%s from %s: deadline in %.1fs", what, body.node_id, body.deadline_unix_s - time.time()
        )  # expected on spot nodes: INFO

    def on_bye(self, identity, body: P.Bye, payload, now) -> None:
        if self.instances.nodes[body.node_id].status.value != "dead":
            self.events.append(now, "leave", body.node_id, body.reason or "goodbye")
        for wid in self.instances.goodbye(body.node_id, now, body.reason):
            self.sched.release_worker(wid, reason=f"agent left: {body.reason}", now=now)
            self.core.busy.gone(wid, now)

    def on_trainer(self, identity: bytes, mtype, body, payload, now: float) -> None:
        world = self.cfg.train.num_train_workers
        if mtype == P.MsgType.TRAIN_READY:
            if body.world_size != world or body.rank >= world:
                raise Rejected(
                    "bad_request", f"rank {body.rank} of {body.world_size}: this run has {world} train workers"
                )
            if body.rank in self.trainer_ids and self.trainer_ids[body.rank] != identity:
                raise Rejected("forbidden", f"train rank {body.rank} is already connected")
            self.train_ready.add(body.rank)
            self.trainer_ids[body.rank] = identity
            return
        rank = next((r for r, i in self.trainer_ids.items() if i == identity), None)
        if rank is None:
            raise Rejected("unknown_session", f"{mtype.name} from a trainer that sent no TRAIN_READY")
        if mtype in (P.MsgType.WEIGHTS, P.MsgType.WEIGHTS_CHUNK) and rank != 0:
            raise Rejected("forbidden", f"only rank 0 publishes weights (got {mtype.name} from rank {rank})")
        if mtype == P.MsgType.WEIGHTS:
            # the header of a version upload: its chunks follow on this connection
            expected = self.store.latest_version + 1
            republish = self.phase == "starting" and body.version == self.store.latest_version  # a resumed trainer
            if (body.version != expected and not republish) or payload or not body.found:
                raise Rejected(
                    "bad_request",
                    f"WEIGHTS must announce version {expected} (got version {body.version}, {len(payload)} frames): its bytes follow in WEIGHTS_CHUNK messages",
                )
            if (
                not 1 <= body.chunk_bytes <= self.cfg.cluster.weight_chunk_bytes
                or body.size_bytes < 1
                or body.num_chunks != -(-body.size_bytes // body.chunk_bytes)
            ):
                raise Rejected(
                    "bad_request",
                    f"WEIGHTS v{body.version}: {body.size_bytes} bytes in {body.num_chunks} chunks of {body.chunk_bytes} (chunks must be 1..{self.cfg.cluster.weight_chunk_bytes} bytes and cover the version exactly)",
                )
            try:
                self.store.begin_weights(
                    body.version, body.size_bytes, body.chunk_bytes, body.digest, validate=check_safetensors_file
                )
            except WeightSyncError as exc:
                raise Rejected("bad_request", f"WEIGHTS v{body.version}: {exc}") from None
        elif mtype == P.MsgType.WEIGHTS_CHUNK:
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
                keep = self.cfg.run.keep_weight_versions
                if keep:
                    self.store.prune_weights(self.weights_keep_from(body.version - keep + 1))
                self.version = max(self.version, body.version)
                log.info("published weights v%d (%d bytes, %s)", body.version, info.size_bytes, info.digest[:23])
                self.events.append(now, "weights", "", f"v{body.version} published ({info.size_bytes / 1e6:.1f} MB)")
        elif mtype == P.MsgType.TRAIN_DONE:
            if body.rank != rank:
                raise Rejected("forbidden", f"TRAIN_DONE for rank {body.rank} from rank {rank}'s connection")
            if not (
                (self.phase == "train" and body.iteration == self.iteration)
                or (self.phase == "saving" and body.iteration == -1)
            ):
                raise Rejected(
                    "bad_request", f"unexpected TRAIN_DONE for iteration {body.iteration} in phase {self.phase}"
                )
            self.train_done[body.rank] = body

    def weights_keep_from(self, keep_from: int) -> int:
        """Oldest weight version that must stay on disk (the last checkpoint's is never pruned)."""
        return keep_from

    # ------------------------------------------------------------ iteration machine
    def submit_exploration(self, n_next: int, version: int, action: Action, now: float) -> int:
        """Exploration requests for batch ``n_next`` (d candidate seeds per explored prompt on
        weights ``version``), by the core."""
        return self.core.submit_exploration(n_next, version, action, now)

    def sampler_params(self, n: int) -> dict:
        """Request params fixed per iteration: the SDE window start when it is drawn at random
        (Flow-GRPO-Fast ``sde_window_range``); exploration of batch n uses the same window."""
        lo, hi = self.cfg.sampler.sde_window_range
        return {"sde_window_start": self.cfg.sampler.window_start_for(self.cfg.run.seed, n)} if hi > lo else {}

    def start_training(self, n: int, request_ids: list[str], now: float) -> None:
        """Send iteration ``n``'s update to the Train Workers: the DONE rollout requests the
        core chose, filtered (non-finite, zero-std groups), with group advantages."""
        samples = [self.samples[rid] for rid in request_ids]
        for s in samples:  # verl-omni-spot: the selected exploration candidates are the rollout
            s.reused_as_rollout = s.kind == RequestKind.EXPLORE
        finite, dropped = trainable_samples(samples)
        if dropped["nonfinite_reward"]:
            log.error(
                "iteration %d: %d samples have non-finite rewards and are left out of the update",
                n + 1,
                dropped["nonfinite_reward"],
            )
            if dropped["nonfinite_reward"] == len(samples):
                # nothing could ever be trained: stop clearly instead of "finishing" a run that learned nothing
                self.error = f"iteration {n + 1}: every one of {len(samples)} rewards is non-finite (NaN/inf); check the reward function or service"
        if dropped["nonfinite_latents"]:
            log.error(
                "iteration %d: %d samples have non-finite latents or log-probs and are left out of the update",
                n + 1,
                dropped["nonfinite_latents"],
            )
        adv = (
            group_advantages([s.reward for s in finite], [s.slot for s in finite], std=self.cfg.train.advantage_std)
            if finite
            else np.zeros(0)
        )
        zero_std = 0
        if self.cfg.train.filter_zero_std_groups and finite:
            keep = zero_std_filter(adv, [s.slot for s in finite])
            zero_std = len(finite) - int(keep.sum())
            finite = [s for s, k in zip(finite, keep) if k]
            adv = adv[keep]
        self._drop_stats = {
            "train/nonfinite_samples": float(dropped["nonfinite_latents"]),
            "train/nonfinite_rewards": float(dropped["nonfinite_reward"]),
            "train/zero_std_filtered": float(zero_std),
        }
        # micro-batches = rollout batches (same composition as at rollout → bit-identical recompute)
        by_batch: dict[str, list[int]] = collections.defaultdict(list)
        for i, s in enumerate(finite):
            by_batch[s.batch_id].append(i)
        batches = list(by_batch.values())
        if len(batches) < self.cfg.train.steps_per_iteration and not getattr(self, "_warned_steps", False):
            self._warned_steps = True
            log.warning(
                "train.steps_per_iteration = %d but iteration %d has %d rollout batches: %d optimizer steps (one per batch at most)",
                self.cfg.train.steps_per_iteration,
                n + 1,
                len(batches),
                len(batches),
            )
        world = self.cfg.train.num_train_workers
        self.train_done.clear()
        for rank in range(world):
            mine = batches[rank::world]
            rows = [i for b in mine for i in b]
            local, pos = [], 0
            for b in mine:
                local.append(list(range(pos, pos + len(b))))
                pos += len(b)
            # one row of conditioning for a rank without samples (its padding passes need shapes)
            tensors = self.cond.index([0]).to_tensors(prefix="pad.cond.")
            if rows:
                tensors.update(
                    {
                        "window_latents": torch.stack([finite[i].window_latents for i in rows]),
                        "log_probs": torch.stack([finite[i].log_probs for i in rows]),
                        "advantages": torch.tensor([adv[i] for i in rows], dtype=torch.float32),
                        "window_start": torch.tensor([finite[i].window_start for i in rows], dtype=torch.int64),
                    }
                )
                tensors.update(self.cond.index([finite[i].prompt_index for i in rows]).to_tensors())
            metas, frames = pack_tensors(tensors)
            self.send_trainer(rank, P.TrainBatch(iteration=n, version=n, micro_batches=local, tensors=metas), frames)
        if self.cfg.run.save_rollouts:
            self.save_rollouts(n, samples)
        plan = self.plan_logs.get(n + 1)
        if plan is not None:
            a = plan["action"]
            if a is None:  # the Planner working as designed (§4.3.1): not a warning
                streams = self.cfg.explore.stream_extra and plan.get("num_spot_gpus", 0) > 0
                log.info("planner: %s", no_fit_message(plan, streams=streams))
            else:
                log.info(
                    "planner: iteration %d explores d=%d s=%.1f (threshold %.3f), budget %.1fs",
                    n + 2,
                    a["num_sequences"],
                    a["effective_steps"],
                    a["cache_threshold"],
                    plan["budget_s"],
                )

    def save_rollouts(self, n: int, samples: list[Sample]) -> None:
        """``rollouts/iter_NNNN.safetensors``: per request id, image, window latents, log-probs, reward, seed."""
        from safetensors.torch import save_file

        out = {}
        for s in samples:
            out[f"{s.request_id}.image"] = s.image.contiguous()
            out[f"{s.request_id}.window_latents"] = s.window_latents.contiguous()
            out[f"{s.request_id}.log_probs"] = s.log_probs.contiguous()
            out[f"{s.request_id}.reward"] = torch.tensor([s.reward], dtype=torch.float64)
            out[f"{s.request_id}.seed"] = torch.tensor([s.seed], dtype=torch.int64)
            out[f"{s.request_id}.prompt_index"] = torch.tensor([s.prompt_index], dtype=torch.int64)
        d = self.run_dir / "rollouts"
        d.mkdir(exist_ok=True)
        save_file(out, d / f"iter_{n:04d}.safetensors")

    def step(self, now: float) -> None:
        """Advance the iteration machine (called after every batch of messages): the core
        decides, this shell carries its decisions out."""
        if self.phase == "saving":
            if len(self.train_done) == self.cfg.train.num_train_workers:
                self.core.phase = "finished"
                self.done = True
            return
        if self.phase == "finished":
            return
        for d in self.core.advance(now, self.observation()):
            if isinstance(d, StartTraining):
                self.start_training(d.iteration, d.request_ids, now)
            elif isinstance(d, IterationDone):
                self.end_iteration(d.iteration, d.metrics, now)
            elif isinstance(d, StartSaving):
                self.begin_saving()

    def end_iteration(self, n: int, metrics: dict, now: float) -> None:
        """Record iteration ``n`` (metrics row, progress line, sample grid) and checkpoint it;
        the core begins the next iteration on its next ``advance``."""
        row = dict(metrics)
        row.update(getattr(self, "_drop_stats", {}))
        self.instances.integrate(now)
        in_iteration, self._requests_done_at_row = self._requests_done - self._requests_done_at_row, self._requests_done
        before = sum(h.get("requests/completed", 0.0) for h in self.history)
        row.update(
            cost_metrics(
                self.instances.gpu_seconds(spot=True),
                self.instances.gpu_seconds(spot=False),
                self.cfg.cost.spot_usd_per_gpu_hour,
                self.cfg.cost.reserved_usd_per_gpu_hour,
                requests_total=int(before) + in_iteration,
                requests_in_iteration=in_iteration,
                iteration_s=float(row.get("time/iteration_s", 0.0)),
            )
        )
        row.update(
            {
                "spot/num_gpus": self.instances.num_spot_gpus(),
                "planner/t_step_s": self.t_step_s if self.t_step_s is not None else float("nan"),
                "weights/version_bytes": float(getattr(self, "version_bytes", 0)),
            }
        )
        # spot events since the previous row: notices, GPUs revoked and added, and
        # denoising steps lost with leases that ended uncommitted (spotlight.core.request_scheduler.lost_steps)
        row.update({f"spot/{k}": v for k, v in self.instances.take_spot_counts().items()})
        row["spot/work_lost_steps"] = lost_steps(
            self.sched.take_aborted(), step_wall_s=self.step_wall_s, total_steps=self.cfg.sampler.num_steps
        )
        done_metrics = [d.metrics for d in self.train_done.values()]
        if done_metrics:
            for k in done_metrics[0]:
                row[k] = float(np.mean([m.get(k, float("nan")) for m in done_metrics]))
        self.history.append(row)
        self.recorder.append_metrics(row)
        self.progress(self.format_progress(row))
        self.events.append(
            now,
            "iteration",
            "",
            f"{n + 1}/{self.cfg.run.iterations} done: reward {row.get('reward/mean', float('nan')):+.4f}",
        )
        self.tracker.log_metrics(n + 1, row)
        every = self.cfg.run.sample_grid_every
        if every and (n % every == 0 or n == self.cfg.run.iterations - 1):
            grid = self.write_sample_grid(n)
            if grid is not None:
                self.tracker.log_image(n + 1, "samples", grid)
        for s in [
            s
            for s in self.samples.values()
            if s.iteration <= n + 1 and (s.iteration <= n or s.kind == RequestKind.EXPLORE)
        ]:
            del self.samples[s.request_id]
        self.write_checkpoint(n)
        self.write_status(now)

    def begin_saving(self) -> None:
        self.train_done.clear()
        for rank in sorted(self.trainer_ids):
            self.send_trainer(rank, P.Shutdown(reason=f"save:{self.run_dir / 'final'}"))
        self.core.phase = "saving"

    # ------------------------------------------------------------ checkpoint & resume
    def checkpoint_state(self) -> dict:
        """Everything the iteration machine needs to continue after iteration ``self.iteration - 1``
        (taken between iterations: no sample, lease or reward job is outstanding)."""
        return {
            "iteration": self.iteration,
            "version": self.store.latest_version,
            "metrics_bytes": self.recorder.metrics_bytes(),
            "requests_bytes": self.recorder.requests_bytes(),
            "scheduler": self.sched.state_dict(),
            "seed_bank": self.seed_bank.state_dict(),
            "planner": self.planner.state_dict() if self.planner is not None else None,
            "instances": self.instances.state_dict(),
            "core": self.core.state_dict(),
            "t_step_s": self.t_step_s,
            "version_bytes": getattr(self, "version_bytes", 0),
            "epoch": self.recorder.epoch,
            "elapsed_s": self.elapsed_before_s + time.monotonic() - self.t_start,
            "events": self.events.to_list(),
        }

    def _earlier_sessions(self, st: dict) -> tuple[float, list[dict]]:
        """Run time and events of the coordinators before this one: from ``status.json`` (the
        last snapshot, saved when the previous coordinator exited or after its last iteration),
        else from the checkpoint ``st``."""
        elapsed, events = st.get("elapsed_s"), st.get("events")
        try:
            snap = json.loads((self.run_dir / "status.json").read_text())
            if (
                isinstance(snap.get("elapsed_s"), (int, float))
                and snap["elapsed_s"] >= (elapsed or 0.0)
                and isinstance(snap.get("events"), list)
            ):
                elapsed, events = snap["elapsed_s"], snap["events"]
        except (OSError, ValueError, AttributeError):
            pass
        elapsed = (
            float(elapsed) if isinstance(elapsed, (int, float)) and math.isfinite(elapsed) and elapsed > 0 else 0.0
        )
        return elapsed, events if isinstance(events, list) else []

    def _eta_s(self, session_elapsed_s: float, done_n: int, total: int) -> float | None:
        """Seconds left: from this coordinator's own iterations once one has ended; before that,
        on a resumed run, from the earlier coordinators' iteration times (``time/iteration_s``
        of the metrics rows it continued); None when neither exists."""
        if done_n >= total:
            return 0.0
        mine = done_n - self._iterations_before_start
        if mine <= 0:
            times = [
                h["time/iteration_s"]
                for h in self.history
                if isinstance(h.get("time/iteration_s"), (int, float)) and math.isfinite(h["time/iteration_s"])
            ]
            return sum(times) / len(times) * (total - done_n) if times else None
        return eta_s(session_elapsed_s, mine, total - self._iterations_before_start)

    def start(self) -> "Coordinator":
        """Bind the sockets and write the run's files (today the constructor still does both:
        this is where they move). Returns self.

        Raises:
            SpotlightError, zmq.ZMQError: as the constructor does today.
        """
        return self

    def node_registered(self, node_id: str) -> bool:
        """True once agent ``node_id`` has registered with this coordinator (whatever its
        status since). Safe to call from another thread (one dict lookup)."""
        return node_id in self.instances.nodes

    def retire_requests(self, before_iteration: int) -> int:
        """Move the terminal requests of iterations ``< before_iteration`` out of memory (the
        Request Scheduler, the prompt-slot map) into ``requests.jsonl``: a long run's memory and
        checkpoints then hold about two iterations of requests, not all of them. Returns how many."""
        dropped = self.sched.take_terminal(before_iteration=before_iteration)
        self.recorder.append_requests(dropped)
        meta = self.request_meta
        for r in dropped:
            meta.pop(r.request_id, None)
        return len(dropped)

    def write_checkpoint(self, n: int) -> None:
        """Iteration ``n``'s run checkpoint; the trainers saved theirs (v_{n+1}) before TRAIN_DONE.
        The terminal requests of iterations before ``n`` are retired first (:meth:`retire_requests`)."""
        t0 = time.monotonic()
        self.retire_requests(before_iteration=n)
        self.recorder.checkpoint(n, self.checkpoint_state())
        self.checkpoint_s = time.monotonic() - t0

    def _restore(self, now: float) -> None:
        got = self.recorder.latest()
        if got is None:
            log.warning("resume: %s has no complete checkpoint; restarting the run at iteration 0", self.run_dir)
            self.sched.start_epoch(self.recorder.epoch)
            self.recorder.truncate_metrics(0)
            self.recorder.truncate_requests(0)
            return
        n, st = got
        legacy = {
            "version": 1,
            "iteration": st["iteration"],
            "explore_action": st.get("explore_action", {}),
            "plan_logs": st.get("plan_logs", {}),
            "last_train_s": st.get("last_train_s"),
        }
        self.core.load_state_dict(
            st.get("core") or legacy
        )  # checkpoints written before the iteration core keep loading
        self.sched.load_state_dict(st["scheduler"], epoch=self.recorder.epoch, now=now)
        self.seed_bank.load_state_dict(st["seed_bank"])
        if self.planner is not None and st.get("planner"):
            self.planner.load_state_dict(st["planner"])
        self.instances.load_state_dict(st["instances"])
        self.t_step_s = st["t_step_s"]
        self.version_bytes = st["version_bytes"]
        self.history = self.recorder.truncate_metrics(int(st["metrics_bytes"]))
        # checkpoints from before requests were retired hold every request: start the log empty
        self.recorder.truncate_requests(int(st.get("requests_bytes", 0)))
        self.store.latest_version = int(st["version"])
        self.resume_version = int(st["version"])
        for r in self.sched.requests():  # prompt slots of restored requests (pulls of resumed work need them)
            self.request_meta.setdefault(r.request_id, (r.group, r.prompt_index))
        self.elapsed_before_s, earlier = self._earlier_sessions(st)  # status keeps the whole run's time and events
        self.events = EventLog(start_s=self.t_start - self.elapsed_before_s)
        self.events.extend(earlier)
        log.info(
            "resumed from the checkpoint of iteration %d: continuing at iteration %d with weights v%d (coordinator start #%d)",
            n + 1,
            self.iteration + 1,
            self.resume_version,
            self.recorder.epoch + 1,
        )
        self.events.append(
            now,
            "resume",
            "",
            f"after iteration {n + 1}/{self.cfg.run.iterations}: continuing with iteration {self.iteration + 1}, weights v{self.resume_version}",
        )
        self.progress(
            f"resumed {self.run_dir} after iteration {n + 1}/{self.cfg.run.iterations}: continuing with iteration {self.iteration + 1} (weights v{self.resume_version})"
        )

    def format_progress(self, row: dict) -> str:
        """One line for iteration ``row["iteration"]`` (0-based in the row, shown 1-based):
        reward mean, rollout / train / exploration time, spot busy share of the training
        window, share of the iteration spent exploring on the critical path, the run's cost so
        far (USD); dropped or skipped work is flagged at the end. At most 100 characters for runs
        of up to 999 iterations with phases under 1000 s, a critical-path share under 10% and a
        cost under $1000."""

        def dur(s: float) -> str:
            return (
                "?"
                if not math.isfinite(s)
                else f"{s:.1f}s"
                if s < 9.95
                else f"{s:.0f}s"
                if s < 999.5
                else f"{s / 60:.0f}m"
                if s < 5970
                else f"{s / 3600:.1f}h"
            )

        def pct(x: float | None) -> str:
            return "-" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"

        n_total = self.cfg.run.iterations
        line = (
            f"iter {row['iteration'] + 1:>{len(str(n_total))}}/{n_total} reward {row['reward/mean']:+.3f}"
            f"  rollout {dur(row['time/rollout_s'])} train {dur(row['time/train_s'])} explore {dur(row['time/explore_s'])}"
            f"  spot busy {pct(row.get('spot/busy_fraction'))} critical {pct(row.get('time/critical_path_share'))}"
            f" ${row.get('cost/usd', float('nan')):.2f}"
        )
        if row.get("train/nonfinite_samples"):
            line += f"  [{int(row['train/nonfinite_samples'])} non-finite dropped]"
        if row.get("train/skipped_steps"):
            line += f"  [{int(row['train/skipped_steps'])} steps skipped]"
        return line

    def _pending_samples_for_grid(self, n: int) -> list[Sample]:
        return sorted(
            (s for s in self.samples.values() if s.iteration == n and s.in_rollout), key=lambda s: (s.slot, s.seed)
        )

    def write_sample_grid(self, n: int) -> pathlib.Path | None:
        from spotlight.util.plots import sample_grid

        samples = self._pending_samples_for_grid(n)
        if not samples:
            return None
        labels = {s.slot: self.prompts[s.prompt_index] for s in samples}
        verdicts = None
        if self.cfg.reward.kind == "geneval_shapes":
            # strict and partial-credit rewards are both 1 exactly when every clause holds
            verdicts = [None if s.reward is None else s.reward >= 1.0 for s in samples]
        title = f"iteration {n + 1} (rollout samples; reward under each image" + (
            ", pass = every clause of the prompt holds)" if verdicts else ")"
        )
        path = self.run_dir / "samples" / f"iter_{n + 1:04d}.png"
        sample_grid(
            [s.image for s in samples],
            [s.slot for s in samples],
            [s.reward for s in samples],
            path,
            title=title,
            labels=labels,
            verdicts=verdicts,
        )
        return path

    # ------------------------------------------------------------ liveness & status
    def housekeeping(self, now: float) -> None:
        self._reload_allow_list()
        for node_id, workers in self.instances.reap(now).items():
            log.error("agent %s missed heartbeats: re-enqueueing its requests", node_id)
            self.events.append(now, "dead", node_id, self.instances.nodes[node_id].history[-1][2])
            for wid in workers:
                self.sched.release_worker(wid, reason="agent dead", now=now)
                self.core.busy.gone(wid, now)
            for wid, node in list(self.worker_node.items()):
                if node == node_id:
                    self.sched.release_worker(wid, reason="agent dead", now=now)
                    self.core.busy.gone(wid, now)
        for rid in self.sched.expire(now):
            log.warning("lease of %s expired: re-enqueued", rid)
        for i, proc in enumerate(self.train_procs):
            if proc.poll() not in (None, 0) and not self.done:
                self.error = f"train worker rank {i} exited with code {proc.returncode}"

    def snapshot(self, now: float | None = None) -> dict:
        """What ``spotlight status`` shows (JSON-able; the STATUS message and ``status.json``).

        Iteration numbers are 1-based as everywhere a person reads them: ``iteration`` is the
        one under way (or the last, once finished), ``iterations_done`` how many have ended.
        (``metrics.jsonl`` rows keep their 0-based ``iteration`` index = number - 1.)
        Times are seconds (``elapsed_s``: the run's, earlier coordinators of a resumed run
        included, event ``t_s`` likewise; ``session_elapsed_s``: since this coordinator started);
        ``version`` is -1 until the first weights are published; ``eta_s`` is None before the
        first iteration of this coordinator ends; costs are USD (``cost``, see
        :func:`spotlight.core.events.cost_summary`).
        """
        now = time.monotonic() if now is None else now
        counts = {}
        for kind in RequestKind:
            counts[kind.value] = {k.value: v for k, v in self.sched.counts(kind=kind).items()}
        total = self.cfg.run.iterations
        done_n = len(self.history)
        elapsed_s = now - self.t_start  # this coordinator's
        self.instances.integrate(now)
        version = self.store.latest_version  # -1: none published yet (the screen says so)
        return {
            "phase": self.phase,
            "iteration": min(done_n + 1, total),
            "iterations_done": done_n,
            "iterations": total,
            "finished": self.done,
            "error": self.error,
            "version": version,
            "started_unix_s": self.started_unix_s,
            "elapsed_s": round(self.elapsed_before_s + elapsed_s, 1),  # the whole run's: earlier coordinators' too
            "session_elapsed_s": round(elapsed_s, 1),
            "eta_s": self._eta_s(elapsed_s, done_n, total),
            "gpus": self.instances.gpu_counts(),  # the GPUs the cost meter bills: the trainers' included
            "cost": cost_summary(
                self.instances.gpu_seconds(spot=True),
                self.instances.gpu_seconds(spot=False),
                self.cfg.cost.spot_usd_per_gpu_hour,
                self.cfg.cost.reserved_usd_per_gpu_hour,
            ),
            "nodes": [
                {
                    "node_id": r.node_id,
                    "status": r.status.value,
                    "why": r.history[-1][2] if r.history else "",
                    "spot": r.is_spot,
                    "num_gpus": r.num_gpus,
                    "gpus": r.gpus,
                    "workers": sorted(r.workers),
                    "detector_healthy": r.detector_healthy,
                    "detector_error": r.detector_error,
                    "last_seen_s_ago": round(now - r.last_seen, 1),
                }
                for r in self.instances.nodes.values()
            ],
            "requests": counts,
            "last_metrics": self.history[-1] if self.history else {},
            "reward_curve": [h["reward/mean"] for h in self.history],
            "tensor_store": self.store.stats(),
            "events": self.events.to_list(),
        }

    def write_status(self, now: float | None = None) -> None:
        """``status.json``: the last snapshot, so ``spotlight status --run-dir`` can show a run
        whose coordinator has ended (written atomically: a reader never sees half a file)."""
        path = self.run_dir / "status.json"
        tmp = path.with_name(f".status.json.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.snapshot(now), default=str))
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as exc:  # a status file must never stop the run
            log.warning("could not write %s: %s", path, exc)

    def serve(self, timeout_s: float | None = None) -> None:
        """Run until the job finishes (or ``timeout_s`` passes, or a train worker dies).

        Raises:
            RuntimeError: a train worker died, or the timeout passed.
        """
        t_start = time.monotonic()
        last_house = 0.0
        while not self.done:
            for msg in self.server.poll(50):
                self.handle(msg)
            now = time.monotonic()
            self.poll_rewards()
            self.step(now)
            if now - last_house > 0.5:
                self.housekeeping(now)
                last_house = now
            if self.error:
                raise RuntimeError(self.error)
            if timeout_s is not None and now - t_start > timeout_s:
                raise RuntimeError(
                    f"run did not finish within {timeout_s:.0f}s (phase {self.phase}, iteration {self.iteration + 1})"
                )
        self.write_request_log()
        from spotlight.util.plots import reward_curve

        reward_curve(self.history, self.run_dir / "reward_curve.png")

    def write_request_log(self) -> None:
        """``requests.jsonl``: append the requests not retired yet (the run ended), so the file
        holds the final status and transition history of every request of the run."""
        self.recorder.append_requests(self.sched.requests())

    def _reload_allow_list(self) -> None:
        """Pick up keys added or revoked with ``spotlight keys`` while the run is live."""
        d = self.keys.directory
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
        """Ask every live agent and train worker to stop (``reason`` is logged by them)."""
        for rec in self.instances.nodes.values():
            if rec.status.value in ("alive", "draining") and rec.node_id in self.node_route:
                self.send(self.node_route[rec.node_id], P.Shutdown(reason=reason))
        for rank in list(getattr(self, "trainer_ids", {})):
            self.send_trainer(rank, P.Shutdown(reason=reason))

    def close(self) -> None:
        now = time.monotonic()
        total = self.cfg.run.iterations
        if self.done:
            why = f"all {total} iterations done"
        elif self.error:
            why = f"stopped: {self.error}"
        else:
            why = f"stopped after {len(self.history)}/{total} iterations ({self.stop_reason or 'interrupted or timed out'})"
        self.events.append(now, "finish", "", why[:300])
        self.write_status(now)  # the GPUs held when it stopped, the trainers' included
        self.instances.release("trainers", now)  # billed up to here
        self.tracker.close()
        self.reward_pool.shutdown(wait=False, cancel_futures=True)
        for proc in self.train_procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.server.close(linger_ms=500)


def _trained_on(req) -> bool:
    """A request whose window latents and log-probs are kept for training: a rollout, or an
    exploration candidate of the verl-omni-spot baseline (params ``as_rollout``), whose
    selected candidates are the rollout."""
    return req.kind == RequestKind.ROLLOUT or bool(req.params.get("as_rollout"))


def trainable_samples(samples: list[Sample]) -> tuple[list[Sample], dict[str, int]]:
    """Samples the update may use: a finite reward AND finite window latents and log-probs.

    A non-finite latent or log-prob (an overflowed rollout) would make the loss, then every
    weight, non-finite after one step; such samples are dropped here, next to the reward filter.

    Returns:
        ``(kept samples, {"nonfinite_reward": n, "nonfinite_latents": m})``.
    """
    kept, counts = [], {"nonfinite_reward": 0, "nonfinite_latents": 0}
    for s in samples:
        if s.reward is None or not math.isfinite(s.reward):
            counts["nonfinite_reward"] += 1
        elif (s.window_latents is not None and not bool(torch.isfinite(s.window_latents).all())) or (
            s.log_probs is not None and not bool(torch.isfinite(s.log_probs).all())
        ):
            counts["nonfinite_latents"] += 1
        else:
            kept.append(s)
    return kept, counts


def zero_std_filter(advantages: np.ndarray, groups: list[int]) -> np.ndarray:
    """Flow-GRPO's filter (``train_sd3.py``): keep-mask ``[N] bool`` that drops every group whose
    advantages are all exactly 0 (all rewards equal), keeping at least one group if all are."""
    adv = np.asarray(advantages)
    g = np.asarray(groups)
    keep = np.ones(len(adv), dtype=bool)
    for gid in np.unique(g):
        idx = g == gid
        if np.all(adv[idx] == 0.0):
            keep[idx] = False
    if not keep.any() and len(adv):
        keep[g == g[0]] = True  # an empty update would stall; the zero advantages add no gradient
    return keep


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
