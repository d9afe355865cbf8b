"""The coordinator: Spotlight's control plane on the reserved node, composed of small parts.

One iteration (paper §4.2, docs/architecture.md §3)::

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

The parts, each in its own module of this package: the iteration core and the other pure
cores (:mod:`spotlight.core`) decide; :class:`~.control_plane.ControlPlane` authorizes,
validates and handles every agent and status message; :class:`~.trainer_group.TrainerGroup`
runs the Train Workers and receives their uploads; :class:`~.reward_scorer.RewardScorer` scores
samples off the loop; :mod:`spotlight.rl.batch` assembles each update; :mod:`.recorder`,
:mod:`.status` and :mod:`.resume` write what the run leaves behind. :class:`Coordinator` builds
them (no side effects), starts them (:meth:`Coordinator.start`: sockets and files), runs the
serve loop and carries out the core's decisions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import random
import socket
import time
from typing import Callable, Sequence

import numpy as np
import torch

from spotlight import protocol as P
from spotlight.config import STEP_CACHE_FAMILIES, SpotlightConfig, dump_config
from spotlight.coordinator import evaluation, recorder, resume
from spotlight.coordinator.control_plane import ControlPlane
from spotlight.coordinator.recorder import RunRecorder, format_progress
from spotlight.coordinator.reward_scorer import RewardScorer
from spotlight.coordinator.server import ControlServer
from spotlight.coordinator.status import RunClock, snapshot
from spotlight.coordinator.tracking import Trackers, open_trackers
from spotlight.coordinator.trainer_group import ExternalTrainers, TrainerGroup
from spotlight.core.collapse_guard import Alert, GuardSettings, check, cleared, image_stats
from spotlight.core.events import EventLog
from spotlight.core.instance_manager import InstanceManager, cost_metrics
from spotlight.core.iteration import (
    CoreObservation,
    IterationDone,
    IterationSettings,
    Phase,
    RolloutParked,
    StartSaving,
    StartTraining,
    build_iteration_core,
    spot_nodes_missing,
)
from spotlight.core.offload import RELEASE_TIMEOUT_S, release_wait_over
from spotlight.core.planner import Action, StepOption, StepTimes, no_fit_message
from spotlight.core.request_scheduler import RequestKind, RequestScheduler, lost_steps
from spotlight.core.seed_bank import SeedBank
from spotlight.errors import SpotlightError
from spotlight.net.security import ServerKeys, init_keys, load_server_keys
from spotlight.rewards.reward_fn import RewardFn
from spotlight.rl.batch import Sample, build_training_batches, result_sample
from spotlight.rl.sampler import Conditioning
from spotlight.store.tensor_store import TensorStore
from spotlight.studies.profiling import load_profile

log = logging.getLogger("spotlight.coordinator")

PULL_PHASES = frozenset({Phase.EXPLORE_FIRST, Phase.ROLLOUT, Phase.TRAIN, Phase.DRAIN})


class Coordinator:
    """Runs a whole post-training job.

    Args:
        cfg: resolved run config.
        run_dir: output directory (config, metrics, samples, final model, tensor store).
        bind: ZeroMQ endpoint to listen on for agents and ``spotlight status`` (CURVE).
        keys: the coordinator's keys and allow-list; None creates them in ``run_dir/keys``.
        prompts: the prompt set (N prompts).
        prompt_metadata: each prompt's record fields (:attr:`spotlight.tasks.prompts.PromptSet.metadata`),
            passed to the reward with its images; None = ``{}`` for every prompt.
        cond: its text conditioning from the model family (every tensor ``[N, …]``: ``embeds
            [N, T, D] float32``, ``mask [N, T]``, family extras such as pooled projections and
            the negative prompt for CFG); ``embeds`` and ``mask`` alone do for callers without.
        progress: called with one line per iteration (:func:`.recorder.format_progress`).
        trackers: experiment trackers: ``"tensorboard"``, ``"wandb"``; empty = none.
        resume: continue the run in ``run_dir`` from its last complete checkpoint.
        external_trainers: the Train Worker ranks are launched by torchrun or srun and connect
            (:class:`~.trainer_group.ExternalTrainers`); None = the coordinator starts them.

    Construction has no side effects; :meth:`start` binds the sockets and writes the files.

    Raises:
        SpotlightError: ``explore.num_steps`` asks for cached exploration without a profile, or
            ``explore.profile_path`` names a missing or malformed file.
    """

    def __init__(
        self,
        cfg: SpotlightConfig,
        run_dir: pathlib.Path,
        *,
        bind: str,
        keys: ServerKeys | None = None,
        prompts: list[str],
        prompt_metadata: Sequence[dict] | None = None,
        cond: Conditioning | None = None,
        embeds: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        progress: Callable[[str], None] = print,
        resume: bool = False,
        trackers: Sequence[str] = (),
        external_trainers: ExternalTrainers | None = None,
    ):
        cond = cond if cond is not None else _conditioning(embeds, mask)
        if len(cond) != len(prompts):
            raise ValueError(f"conditioning has {len(cond)} rows for {len(prompts)} prompts")
        self.cfg, self.run_dir, self.bind, self.keys = cfg, pathlib.Path(run_dir), bind, keys
        self.prompts, self.cond, self.progress, self.resume = prompts, cond, progress, resume
        self.prompt_metadata = list(prompt_metadata) if prompt_metadata is not None else [{} for _ in prompts]
        if len(self.prompt_metadata) != len(prompts):
            raise ValueError(f"{len(self.prompt_metadata)} metadata records for {len(prompts)} prompts")
        self.tracker_kinds = tuple(trackers)
        self.sched = RequestScheduler(cfg.cluster.lease_timeout_s, max_failures=cfg.cluster.max_request_failures)
        self.instances = InstanceManager(cfg.cluster.heartbeat_timeout_s)
        self.store = TensorStore(self.run_dir / "tensor_store", memory_max_bytes=cfg.cluster.weight_memory_max_bytes)
        self.seed_bank = SeedBank(cfg.run.seed, cfg.data.group_size)
        self.events = EventLog()
        profile = self.profile = load_profile(cfg, self.run_dir)  # None: t_step measured online, no cache
        if profile is not None:
            log.info("%s", profile.describe())
        self.step_times = StepTimes(profile.t_step_s if profile else None)
        self.core = build_core(cfg, self.sched, self.seed_bank, profile, num_prompts=len(prompts))
        self.scorer = RewardScorer(RewardFn(cfg.reward), cfg.reward)
        core = self.core
        self.trainers = TrainerGroup(
            cfg,
            self.run_dir,
            self.store,
            self.events,
            phase=lambda: core.phase,
            iteration=lambda: core.iteration,
            needed_versions=self.needed_versions,
            external=external_trainers,
            instances=self.instances,
            say=progress,
        )
        self.checkpoint_version: int | None = None  # the weights the last run checkpoint names
        self.recorder = RunRecorder(self.run_dir, resume=resume)
        parts = (self.sched, self.instances, self.store, self.events)
        self.control = ControlPlane(cfg, *parts, run=self, workers=core, trainers=self.trainers)
        self.samples: dict[str, Sample] = {}
        self.history: list[dict] = []
        self.done, self.error = False, None
        self.stop_reason: str | None = None  # why it stopped early without an error (set by `up`)
        self.clock = RunClock(t_start=time.monotonic(), started_unix_s=time.time())
        self.server: ControlServer | None = None
        self.endpoint: str | None = None
        self.tracker: Trackers = Trackers()
        self._train_stats: dict[str, float] = {}
        self._held_update: tuple[int, object, float] | None = None
        """(iteration, its TrainingBatches, when it was ready): an update waiting for the
        Rollout Workers on the trainers' GPUs to release their device memory."""
        self._requests_at_row = 0
        self._parked_at_row = 0
        self._warned_steps = False
        self.evals = evaluation.Evaluations(self.run_dir, evaluation.cache_dir()) if cfg.eval.every else None
        self.eval_results: list[dict] = []  # this coordinator's finished held-out evaluations
        self._waiting_said: str | None = None  # the last "waiting for spot nodes" line printed
        self.guard_alerts: list[Alert] = []  # every alert of this coordinator (status shows them)
        self._guard_live: list[Alert] = []  # alerts whose condition still holds (not repeated)
        self._rollback: tuple[int, Alert] | None = None  # a planned rollback: (target version, its alert)
        self.rollbacks_done = 0  # this coordinator's collapse-guard rollbacks
        self.pending_row: dict | None = None  # resumed: the last iteration's row, written after the final evaluation

    def start(self) -> Coordinator:
        """Write the run's config and keys, bind the sockets, open the run's files, restore a
        resumed run and open the trackers. Returns self.

        Raises:
            zmq.ZMQError: ``bind`` cannot be bound.
            CheckpointError: ``resume`` and the newest checkpoint is unreadable.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(self.cfg, self.run_dir / "config.toml")
        if self.keys is None:
            init_keys(self.run_dir / "keys", exist_ok=True)
            self.keys = load_server_keys(self.run_dir / "keys")
        cluster = self.cfg.cluster
        trainer_frame = max(cluster.weight_chunk_bytes, P.MAX_BODY_BYTES) + P.FRAME_OVERHEAD_BYTES
        external = self.trainers.external
        self.server = ControlServer(
            self.bind,
            self.keys,
            max_message_bytes=cluster.max_message_bytes,
            trainer_max_message_bytes=trainer_frame,
            trainer_bind=external.bind if external is not None else None,
        )
        try:
            self._open(time.monotonic())
        except BaseException:  # a half-started coordinator leaves no socket behind
            self.server.close(linger_ms=0)
            self.server = None
            raise
        return self

    def _open(self, now: float) -> None:
        self.endpoint = self.server.endpoint
        self.control.keys = self.keys
        self.control.attach(self.server)
        self.store.open()
        self.recorder.open()
        self.clock = RunClock(t_start=now, started_unix_s=time.time())
        self.events.continue_from(now, [])
        # the Train Workers' GPUs (rank r: GPU r of this host) are billed for the whole run, once;
        # external ranks are billed per host from their TRAIN_HELLO (TrainerGroup)
        if self.trainers.external is None:
            self.instances.hold(
                "trainers", list(range(self.cfg.train.num_train_workers)), now, host=socket.gethostname()
            )
        if self.resume:
            resume.restore(self, now)
        else:
            self.sched.start_epoch(self.recorder.epoch)
        config_text = (self.run_dir / "config.toml").read_text()
        first = self.core.iteration + 1
        self.tracker = open_trackers(self.tracker_kinds, self.run_dir, config_text=config_text, first_step=first)
        if self.resume and self.evals is not None:
            self._catch_up_evaluations()
        keys_dir = str(self.keys.directory) if self.keys.directory else None
        recorder.write_coordinator_json(self.run_dir, self.endpoint, self.server.trainer_endpoint, keys_dir)

    def start_trainers(self) -> None:
        """Start the Train Worker processes, or wait for external ranks (:meth:`.TrainerGroup.start`)."""
        self.trainers.start(self.server, self.keys, time.monotonic())

    # ------------------------------------------------------------ the run, as the control plane sees it
    def accepts_pulls(self) -> bool:
        return self.core.phase in PULL_PHASES

    def conditioning(self, prompt_indices: list[int]) -> dict[str, torch.Tensor]:
        return self.cond.index(prompt_indices).to_tensors()

    def snapshot(self, now: float | None = None) -> dict:
        """What ``spotlight status`` shows (:mod:`spotlight.coordinator.status`)."""
        return snapshot(self, time.monotonic() if now is None else now)

    def on_results(self, body: P.Result, completed: list, tensors: dict, now: float) -> None:
        """Keep the samples of a RESULT's completed requests, tell the core, and score them."""
        observe_step_times(self.step_times, self.instances.nodes.get(body.node_id), body, completed)
        ids, images, prompts, metadata = [], [], [], []
        for i, req in completed:
            slot, pidx = self.core.request_meta[req.request_id]
            s, image = result_sample(req, slot, pidx, body.batch_id, tensors, i, self.cfg.sampler.sde_window_start)
            s.computed_steps = body.items[i].computed_steps
            ids.append(req.request_id)
            images.append(image)
            self.samples[req.request_id] = s
            self.core.record_result(req.request_id, now)
            prompts.append(self.prompts[pidx])
            metadata.append(self.prompt_metadata[pidx])
        if ids:
            self.scorer.submit(ids, np.stack(images), prompts, metadata)

    # ------------------------------------------------------------ the serve loop
    def observation(self) -> CoreObservation:
        """What the iteration core needs to know about processes and nodes now."""
        tr, latest, saving = self.trainers, self.store.latest_version, self.core.phase is Phase.SAVING
        spot_workers = sum(len(r.workers) for r in self.instances.live(spot=True))
        return CoreObservation(
            trainers_ready=tr.all_ready and 0 <= latest <= tr.version,
            any_worker_node=bool(self.instances.live()),
            train_done=tr.all_done and not saving and latest >= self.core.iteration + 1,
            final_saved=saving and tr.all_done,
            num_spot_gpus=self.instances.num_spot_gpus(),
            step_time_s=self.step_times.t_step_s,
            spot_slots=spot_workers * self.cfg.cluster.worker_batch_size,
            num_spot_nodes=len(self.instances.live(spot=True)),
        )

    def waiting_for_spot_nodes(self) -> str | None:
        """One line while iteration 1 waits for ``cluster.min_spot_nodes`` spot nodes
        (:func:`~spotlight.core.iteration.spot_nodes_missing`), else None."""
        want = self.cfg.cluster.min_spot_nodes
        if self.core.phase is not Phase.STARTING or not want:
            return None
        have = len(self.instances.live(spot=True))
        missing = spot_nodes_missing(self.core.iteration, have, want)
        if not missing:
            return None
        return (
            f"waiting for spot nodes: {have} of {want} alive (cluster.min_spot_nodes); "
            f"iteration 1 starts when {missing} more join"
        )

    def serve(self, timeout_s: float | None = None, *, on_tick: Callable[[], None] | None = None) -> None:
        """Run until the job finishes (or ``timeout_s`` passes, or a part fails). ``on_tick`` is
        called with the housekeeping, every half second (``spotlight up`` watches its local
        agents there).

        Raises:
            RuntimeError: a train worker died (the message: one line, then the last lines of its
                log), reward scoring gave up, or the timeout passed.
        """
        self._on_tick = on_tick
        if self.pending_row is not None:  # resumed from the last iteration's checkpoint, before its row
            row, self.pending_row = self.pending_row, None
            self._finish_last_row(row, time.monotonic())
            self.write_status()
        t_start = last_house = time.monotonic()
        while not self.done:
            self.control.serve_once(50)
            now = time.monotonic()
            for rid, reward in self.scorer.poll(now):
                if rid in self.samples:
                    self.samples[rid].reward = reward
                    self.core.record_reward(rid, reward)
            self.step(now)
            if now - last_house > 0.5:
                self.control.housekeeping(now)
                self.trainers.housekeeping(now)
                if on_tick is not None:
                    on_tick()
                last_house = now
                self._say_waiting(now)
            failed = None if self.error or self.done else self.trainers.failed(now)
            if failed is not None:
                self.error = failed.summary  # one line for status.json; the console gets its log's tail too
                raise RuntimeError(failed.report())
            self.error = self.error or self.scorer.error or self.trainers.fatal
            if self.error:
                raise RuntimeError(self.error)
            if timeout_s is not None and now - t_start > timeout_s:
                where = f"phase {self.core.phase}, iteration {self.core.iteration + 1}"
                raise RuntimeError(f"run did not finish within {timeout_s:.0f}s ({where})")
        if self.evals is not None and self.evals.busy:
            self.progress("waiting for the last held-out evaluation…")
            self._serve_until_evaluated(self.cfg.eval.timeout_s, on_tick)
        if self.evals is not None:
            evaluation.first_vs_last(self.run_dir)
        self.recorder.append_requests(self.sched.requests())  # the ones not retired yet: the run ended
        from spotlight.util.plots import reward_curve

        reward_curve(self.history, self.run_dir / "reward_curve.png")

    def _say_waiting(self, now: float) -> None:
        """While iteration 1 waits for ``cluster.min_spot_nodes``: a console line (and a fresh
        status snapshot) each time the count of live spot nodes changes."""
        line = self.waiting_for_spot_nodes()
        if line is not None and line != self._waiting_said:
            self.progress(line)
            self.write_status(now)
        self._waiting_said = line

    def _serve_until_evaluated(self, timeout_s: float, on_tick: Callable[[], None] | None) -> dict:
        """Keep answering agents and trainers (heartbeats, goodbyes) while the queued held-out
        evaluations finish, up to ``timeout_s``; then stop any still running. Returns the newest
        finished evaluation's ``eval/*`` (:meth:`_poll_evals`; {} when none finished)."""
        deadline = last_house = time.monotonic()
        deadline += timeout_s
        newest: dict = {}
        while self.evals.busy and time.monotonic() < deadline:
            self.control.serve_once(200)
            now = time.monotonic()
            if now - last_house > 0.5:
                self.control.housekeeping(now)
                self.trainers.housekeeping(now)
                if on_tick is not None:
                    on_tick()
                last_house = now
            newest = self._poll_evals() or newest
        if self.evals.busy:
            log.warning("held-out evaluation did not finish within %.0f s; stopped", timeout_s)
            self.evals.close()
        return newest

    def step(self, now: float) -> None:
        """Advance the iteration core; this shell carries its decisions out."""
        for d in self.core.advance(now, self.observation()):
            if isinstance(d, StartTraining):
                self._start_training(d.iteration, d.request_ids, now)
            elif isinstance(d, IterationDone):
                self._end_iteration(d.iteration, d.metrics, now)
            elif isinstance(d, StartSaving):
                self.trainers.save_final(self.run_dir / "final")
            elif isinstance(d, RolloutParked):
                self.error = self.error or parked_message(self.sched, d, self.prompts)
        self._send_update_once_released(now)
        self.done = self.core.done

    def _send_update_once_released(self, now: float) -> None:
        """Send the held update to the Train Workers once every Rollout Worker sharing their
        GPUs has moved its weights to host memory (``spotlight/core/offload.py``), or after
        :data:`~spotlight.core.offload.RELEASE_TIMEOUT_S`; the wait goes to ``time/offload_wait_s``."""
        if self._held_update is None:
            return
        n, batches, ready_at = self._held_update
        awaited = self.control.awaited_release()
        if not release_wait_over(awaited, started_at=ready_at, now=now):
            return
        pending = sorted(w for w, r in awaited.items() if r.value != "released")
        if pending:
            log.warning(
                "iteration %d: %s still hold their GPU memory after %.0f s; training starts anyway",
                n + 1,
                ", ".join(pending),
                RELEASE_TIMEOUT_S,
            )
        self._held_update = None
        self.control.offload.waited(now - ready_at)
        rollback_version, lr_scale = self._rollback_for_update(n)
        self.trainers.train(
            n, batches, rollback_version=rollback_version, lr_scale=lr_scale, keep_versions=self._kept_train_versions()
        )

    def _start_training(self, n: int, request_ids: list[str], now: float | None = None) -> None:
        """Build iteration ``n``'s update: the DONE rollout requests the core chose, filtered
        (non-finite, zero-std groups), with group advantages (:mod:`spotlight.rl.batch`). It goes
        to the Train Workers from :meth:`step` (:meth:`_send_update_once_released`)."""
        samples = [self.samples[rid] for rid in request_ids]
        for s in samples:  # verl-omni-spot: the selected exploration candidates are the rollout
            s.reused_as_rollout = s.kind == RequestKind.EXPLORE
        t = self.cfg.train
        batches = build_training_batches(
            samples,
            self.cond,
            world_size=t.num_train_workers,
            advantage_std=t.advantage_std,
            filter_zero_std_groups=t.filter_zero_std_groups,
        )
        self.error = self.error or report_update(n, len(samples), batches)
        if batches.num_micro_batches < t.steps_per_iteration and not self._warned_steps:
            self._warned_steps = True
            log.warning(
                "train.steps_per_iteration = %d but iteration %d has %d rollout batches: "
                "%d optimizer steps (one per batch at most)",
                t.steps_per_iteration,
                n + 1,
                batches.num_micro_batches,
                batches.num_micro_batches,
            )
        self._train_stats = batches.metrics()
        # sent by step(), at once unless a Rollout Worker on a trainer GPU must first release it
        self._held_update = (n, batches, time.monotonic() if now is None else now)
        if self.cfg.run.save_rollouts:
            recorder.save_rollouts(self.run_dir, n, samples)
        log_plan(self.core.plan_logs.get(n + 1), n + 1, stream_extra=self.cfg.explore.stream_extra)

    def _end_iteration(self, n: int, metrics: dict, now: float) -> None:
        """Record iteration ``n`` (metrics row, progress line, sample grid) and checkpoint it;
        the core begins the next iteration on its next ``advance``."""
        done = self.control.requests_done
        in_iteration, self._requests_at_row = done - self._requests_at_row, done
        row = dict(metrics) | self._train_stats
        row |= cluster_metrics(self, in_iteration, iteration_s=float(metrics.get("time/iteration_s", 0.0)), now=now)
        row |= self.trainers.metrics()
        row |= self.control.offload.take()
        row |= image_stats([s.image.numpy() for s in self.samples.values() if s.iteration == n and s.in_rollout])
        row |= self._poll_evals()
        total = self.cfg.run.iterations
        parked, self._parked_at_row = self.control.requests_parked - self._parked_at_row, self.control.requests_parked
        row["requests/parked"] = parked
        self.progress(format_progress(row, total))
        final_eval = self.evals is not None and n == total - 1
        if not final_eval:
            self._record_row(row, now)
        every = self.cfg.run.sample_grid_every
        if every and (n % every == 0 or n == total - 1):
            verdicts = self.cfg.reward.kind == "geneval_shapes"
            grid = recorder.write_sample_grid(self.run_dir, n, self.samples.values(), self.prompts, verdicts=verdicts)
            if grid is not None:
                self.tracker.log_image(n + 1, "samples", grid)
        for rid, s in list(self.samples.items()):  # trained on; explored for the next batch
            if s.iteration <= n or (s.kind == RequestKind.EXPLORE and s.iteration == n + 1):
                del self.samples[rid]
        if self.evals is None:
            resume.write_run_checkpoint(self, n)
        elif not final_eval:
            self._request_evals(n, total)
            resume.write_run_checkpoint(self, n)
        else:
            # the last iteration's row carries the evaluation of the final weights, so every run
            # that evaluates ends with eval/* in metrics.jsonl; its checkpoint does not wait for
            # that evaluation: it holds the row, and a run stopped meanwhile resumes to just the
            # evaluation and the final save (docs/architecture.md §13, docs/evaluation.md)
            self._request_evals(n, total)
            resume.write_run_checkpoint(self, n, pending_row=row)
            self._finish_last_row(row, now)
        self.write_status(now)

    def _record_row(self, row: dict, now: float) -> None:
        """Append iteration ``row["iteration"]``'s metrics row (history, ``metrics.jsonl``,
        trackers, event log) and run the collapse guard on it."""
        n, total = int(row["iteration"]), self.cfg.run.iterations
        self.history.append(row)
        self.recorder.append_metrics(row)
        self._guard(now)
        self.events.append(
            now, "iteration", "", f"{n + 1}/{total} done: reward {row.get('reward/mean', math.nan):+.4f}"
        )
        self.tracker.log_metrics(n + 1, row)

    def _finish_last_row(self, row: dict, now: float) -> None:
        """Join the evaluation of the final weights (answering agents and trainers meanwhile) and
        record the last iteration's ``row`` with its ``eval/*``: from this coordinator's join, or,
        after a resume, from ``eval.jsonl`` when an earlier coordinator recorded it already."""
        row = dict(row)
        if self.evals.busy:
            self.progress("evaluating the final weights on the held-out panel…")
            row |= self._serve_until_evaluated(self.cfg.eval.timeout_s, getattr(self, "_on_tick", None))
        if not any(k.startswith("eval/") for k in row):
            final = [r for r in evaluation.read_results(self.run_dir) if int(r["iteration"]) == int(row["iteration"])]
            if final:
                row |= evaluation.row_scores(final[-1])
        self._record_row(row, now)

    def _request_evals(self, n: int, total: int) -> None:
        """Queue the held-out evaluations iteration ``n`` (0-based) makes due: the base model after
        iteration 1, the version ``n`` trained when :func:`~spotlight.coordinator.evaluation.due`
        (a request already queued or done is skipped)."""
        if n == 0:
            self.evals.request(-1, 0)  # the base model, for comparison (skipped when its result exists)
        if evaluation.due(n, self.cfg.eval.every, total):
            self.evals.request(n, self.store.latest_version)

    def _poll_evals(self, results: list[dict] | None = None) -> dict:
        """Record finished held-out evaluations (``eval.jsonl``, TensorBoard at their own
        iteration, the panel grid); the newest one's ``eval/*`` scores for the metrics row."""
        if self.evals is None:
            return {}
        results = self.evals.poll() if results is None else results
        for r in results:
            base = evaluation.base_result(self.run_dir, self.eval_results)  # before r is in eval.jsonl
            self.eval_results.append(r)
            with (self.run_dir / "eval.jsonl").open("a") as f:
                f.write(json.dumps(r) + "\n")
            step = int(r["iteration"]) + 1
            self.tracker.log_metrics(step, {k: v for k, v in r.items() if k.startswith("eval/")})
            grid = evaluation.result_path(self.run_dir, int(r["iteration"])).with_suffix(".png")
            if grid.is_file():
                self.tracker.log_image(step, "eval", grid)
            self.progress(evaluation.result_line(r, base))
        return evaluation.row_scores(results[-1]) if results else {}

    def _catch_up_evaluations(self) -> None:
        """A resumed run: drop the results of the iterations it trains again, record the results
        an earlier coordinator left unread, queue the due
        evaluations that never finished (:func:`~spotlight.coordinator.evaluation.catch_up`), and
        say once which were skipped because their version is deleted (docs/evaluation.md)."""
        done, total = self.core.iteration, self.cfg.run.iterations
        stale = evaluation.drop_discarded(self.run_dir, done)
        if stale:
            self.progress(
                "dropped the held-out results of iteration "
                + ", ".join(str(n + 1) for n in stale)
                + ": the stop came before its checkpoint, so it is trained and evaluated again"
            )
        if self.cfg.eval.keep_best and (held := evaluation.drop_stale_best(self.run_dir, stale)) is not None:
            self.progress(
                f"removed best/ (v{held.get('version', '?')}, the weights of iteration {int(held['iteration']) + 1}, "
                "trained again): the next evaluation that beats every held-out result kept writes it"
            )
        plan = evaluation.catch_up(
            self.cfg.eval.every,
            total,
            done,
            recorded=(int(r["iteration"]) for r in evaluation.read_results(self.run_dir)),
            written=evaluation.written_iterations(self.run_dir),
            available=self.store.weight_versions(),
        )
        found = []
        for n, version in plan.record:
            path = evaluation.result_path(self.run_dir, n)
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                log.warning("held-out evaluation of v%d: %s is unreadable (%s); skipped", version, path, exc)
        self._poll_evals(found)
        if plan.gone:
            log.warning(
                "held-out evaluation of %s skipped: the run stopped before it finished and the weights "
                "are deleted (run.keep_weight_versions)",
                ", ".join(f"v{v}" for _, v in plan.gone),
            )
        if plan.evaluate:
            self.progress(
                "queued the held-out evaluations the stop left without a result: "
                + ", ".join(f"v{v}" for _, v in plan.evaluate)
            )
        for n, version in plan.evaluate:
            self.evals.request(n, version)

    def _guard(self, now: float) -> None:
        """The collapse guard's alerts for the row just written: console, event log, status;
        with ``guard.action = "stop"`` the run stops (its checkpoint is already written)."""
        g = self.cfg.guard
        if not g.enabled:
            return
        settings = GuardSettings(**{f.name: getattr(g, f.name) for f in dataclasses.fields(GuardSettings)})
        for a in cleared(self.history, self._guard_live, settings):
            self._guard_live.remove(a)
        for a in check(self.history, settings, already=self._guard_live):
            self._guard_live.append(a)
            self.guard_alerts.append(a)
            log.warning("collapse guard (%s), iteration %d: %s", a.kind, a.iteration + 1, a.message)
            self.events.append(now, "guard", "", f"{a.kind}: {a.message}"[:300])
            if g.action == "stop":
                self.error = self.error or f"collapse guard stopped the run at iteration {a.iteration + 1}: {a.message}"
            elif g.action == "rollback":
                self._plan_rollback(a, now)

    def _plan_rollback(self, a: Alert, now: float) -> None:
        """``guard.action = "rollback"``: the next update is replaced by a rollback to the best
        held-out version (``best/``: the highest ``eval/score`` so far; the base model v0 before any
        evaluation finished) with the learning rate times ``guard.rollback_lr_factor``
        (docs/collapse-guard.md). One at a time; after ``guard.max_rollbacks`` the run stops."""
        g = self.cfg.guard
        if self._rollback is not None:
            return
        if self.rollbacks_done >= g.max_rollbacks:
            self.error = self.error or (
                f"collapse guard stopped the run at iteration {a.iteration + 1} after {self.rollbacks_done} "
                f"rollbacks (guard.max_rollbacks): {a.message}"
            )
            return
        best = evaluation.best_evaluation(evaluation.read_results(self.run_dir))
        target = int(best["version"]) if best is not None else 0
        self._rollback = (target, a)
        where = f"v{target} (held-out {best['eval/score']:.3f})" if best is not None else "v0 (the base model)"
        self.events.append(now, "guard", "", f"rollback to {where} planned: {a.kind}"[:300])

    def _rollback_for_update(self, n: int) -> tuple[int, float]:
        """``(rollback_version, lr_scale)`` of iteration ``n``'s update: a planned rollback's, else (-1, 1)."""
        if self._rollback is None:
            return -1, 1.0
        (target, alert), self._rollback = self._rollback, None
        self.rollbacks_done += 1
        factor = self.cfg.guard.rollback_lr_factor
        latest = self.store.latest_version
        if target >= latest:  # the weights in use are the best evaluated: only the learning rate drops
            self.progress(
                f"collapse guard ({alert.kind}): v{latest} is the best held-out version; learning rate × {factor:g}"
            )
            return -1, factor
        self.progress(
            f"collapse guard ({alert.kind}): iteration {n + 1} rolls back to v{target} (the best held-out "
            f"version) instead of training, learning rate × {factor:g} (rollback {self.rollbacks_done} of "
            f"{self.cfg.guard.max_rollbacks})"
        )
        return target, factor

    def _kept_train_versions(self) -> tuple[int, ...]:
        """Trainer checkpoints a rollback may need (``guard.action = "rollback"``): the best held-out
        version's and those of versions still being evaluated; () otherwise."""
        g = self.cfg.guard
        if not (g.enabled and g.action == "rollback") or self.evals is None:
            return ()
        best = evaluation.best_evaluation(evaluation.read_results(self.run_dir))
        keep = set(self.evals.pending_versions) | ({int(best["version"])} if best is not None else {0})
        return tuple(sorted(keep))

    # ------------------------------------------------------------ status & shutdown
    def needed_versions(self) -> set[int]:
        """Weight versions the Tensor Store must keep (:func:`spotlight.core.retention.versions_to_delete`):
        those live workers hold, those unfinished requests must run with, the last checkpoint's,
        and those a held-out evaluation still has to read (queued or running)."""
        unfinished = {r.weight_version for r in self.sched.requests() if not r.status.is_terminal()}
        mine = set() if self.checkpoint_version is None else {self.checkpoint_version}
        evaluating = set() if self.evals is None else set(self.evals.pending_versions)
        return self.control.versions_in_use() | unfinished | mine | evaluating

    def node_registered(self, node_id: str) -> bool:
        """True once agent ``node_id`` has registered with this coordinator (whatever its
        status since). Safe to call from another thread (one dict lookup)."""
        return node_id in self.instances.nodes

    def write_status(self, now: float | None = None) -> None:
        recorder.write_status(self.run_dir, self.snapshot(now))

    def shutdown_agents(self, reason: str = "run finished") -> None:
        """Ask every live agent and train worker to stop (``reason`` is logged by them)."""
        self.control.shutdown_agents(reason)
        self.trainers.shutdown(reason)

    def close(self) -> None:
        """Record why the run stopped, write the last status, stop the parts and the sockets."""
        now, total = time.monotonic(), self.cfg.run.iterations
        if self.done:
            why = f"all {total} iterations done"
        elif self.error:
            why = f"stopped: {self.error}"
        else:
            reason = self.stop_reason or "interrupted or timed out"
            why = f"stopped after {len(self.history)}/{total} iterations ({reason})"
        self.events.append(now, "finish", "", why[:300])
        if self.server is not None:
            self.write_status(now)  # the GPUs held when it stopped, the trainers' included
        self.instances.release("trainers", now)  # billed up to here
        self.trainers.release_holds(now)
        if self.evals is not None:
            self.evals.close()
        self.tracker.close()
        self.scorer.close()
        self.trainers.wait(timeout_s=10)
        if self.server is not None:
            self.server.close(linger_ms=500)


def observe_step_times(step_times: StepTimes, node, body: P.Result, completed: list) -> None:
    """Feed a RESULT's timing to the step-time averages (the Planner's t_step counts uncached
    batches of spot workers only, :class:`spotlight.core.planner.StepTimes`)."""
    cached = bool(completed) and float(completed[0][1].params.get("cache_threshold", 0.0)) > 0
    spot = node is not None and node.is_spot
    steps = [it.computed_steps for it in body.items]
    step_times.observe(body.elapsed_s, steps, body.num_gpus, spot=spot, cached=cached)


def _conditioning(embeds: torch.Tensor | None, mask: torch.Tensor | None) -> Conditioning:
    if embeds is None or mask is None:
        raise ValueError("Coordinator needs `cond` (or `embeds` and `mask`)")
    return Conditioning(embeds.float(), mask)


def parked_message(sched: RequestScheduler, d: RolloutParked, prompts: Sequence[str]) -> str:
    """The one line a run stopped by parked rollout requests ends with: the first request,
    its prompt, the worker it last failed on and its error (docs/architecture.md §4)."""
    req = sched.get(d.request_ids[0])
    prompt = prompts[req.prompt_index] if 0 <= req.prompt_index < len(prompts) else "?"
    more = f" (and {len(d.request_ids) - 1} more)" if len(d.request_ids) > 1 else ""
    return (
        f"iteration {d.iteration + 1}: rollout request {req.request_id}{more} (prompt {req.prompt_index} "
        f"{prompt[:80]!r}, seed {req.seed}) failed {req.failures} times on {len(req.failed_on)} workers "
        f"(cluster.max_request_failures), last on {req.worker_id}: {req.error}; "
        "the update needs every rollout sample, so the run stops"
    )


def report_update(n: int, num_samples: int, batches) -> str | None:
    """Log what iteration ``n``'s update leaves out; returns the run's error when nothing at all
    can be trained (every reward non-finite), so it stops clearly instead of "finishing"."""
    bad_rewards, bad_latents = batches.dropped["nonfinite_reward"], batches.dropped["nonfinite_latents"]
    if bad_latents:
        log.error(
            "iteration %d: %d samples have non-finite latents or log-probs and are left out of the update",
            n + 1,
            bad_latents,
        )
    if not bad_rewards:
        return None
    log.error("iteration %d: %d samples have non-finite rewards and are left out of the update", n + 1, bad_rewards)
    if bad_rewards < num_samples:
        return None
    return (
        f"iteration {n + 1}: every one of {num_samples} rewards is non-finite (NaN/inf); "
        "check the reward function or service"
    )


def log_plan(plan: dict | None, m: int, *, stream_extra: bool) -> None:
    """One INFO line on the Planner's choice for batch ``m`` (§4.3.1: not fitting is no warning)."""
    if plan is None:
        return
    a = plan["action"]
    if a is None:
        log.info("planner: %s", no_fit_message(plan, streams=stream_extra and plan.get("num_spot_gpus", 0) > 0))
        return
    log.info(
        "planner: iteration %d explores d=%d s=%.1f (threshold %.3f), budget %.1fs",
        m + 1,
        a["num_sequences"],
        a["effective_steps"],
        a["cache_threshold"],
        plan["budget_s"],
    )


def cluster_metrics(coord: Coordinator, in_iteration: int, *, iteration_s: float, now: float) -> dict:
    """The metrics row's cluster part: cost, throughput (``in_iteration`` requests completed),
    spot events since the previous row, lost work, the Planner's t_step and the version size."""
    inst, c = coord.instances, coord.cfg.cost
    inst.integrate(now)
    before = int(sum(h.get("requests/completed", 0.0) for h in coord.history))
    spot_s, reserved_s = inst.gpu_seconds(spot=True), inst.gpu_seconds(spot=False)
    out = cost_metrics(
        spot_s,
        reserved_s,
        c.spot_usd_per_gpu_hour,
        c.reserved_usd_per_gpu_hour,
        requests_total=before + in_iteration,
        requests_in_iteration=in_iteration,
        iteration_s=iteration_s,
    )
    t_step = coord.step_times.t_step_s
    out["spot/num_gpus"] = inst.num_spot_gpus()
    out["planner/t_step_s"] = t_step if t_step is not None else math.nan
    out["weights/version_bytes"] = float(coord.trainers.version_bytes)
    out.update({f"spot/{k}": v for k, v in inst.take_spot_counts().items()})
    wall, steps = coord.step_times.step_wall_s, coord.cfg.sampler.num_steps
    out["spot/work_lost_steps"] = lost_steps(coord.sched.take_aborted(), step_wall_s=wall, total_steps=steps)
    return out


def build_core(cfg: SpotlightConfig, sched: RequestScheduler, seed_bank: SeedBank, profile, *, num_prompts: int):
    """The run's iteration core (:func:`spotlight.core.iteration.build_iteration_core`) from its
    config, step-time profile (None: no profile, so no cached arms) and prompt count (batches
    take the prompts in a seeded random order, ``data.shuffle_seed``)."""
    mode = cfg.explore.mode if cfg.explore.active and cfg.num_explored_prompts > 0 else "off"
    lo, hi = cfg.sampler.sde_window_range

    def sampler_params(n: int) -> dict:
        """Request params fixed per iteration: the SDE window start when it is drawn at random
        (Flow-GRPO-Fast ``sde_window_range``); exploration of batch n uses the same window."""
        return {"sde_window_start": cfg.sampler.window_start_for(cfg.run.seed, n)} if hi > lo else {}

    prompt_order = list(range(num_prompts))
    random.Random(cfg.data.shuffle_seed).shuffle(prompt_order)
    T = float(cfg.sampler.num_steps)
    # the full rollout is this run's own T steps at accuracy 1 whatever a profile says (one measured
    # for another sampler, or edited by hand, may lack it), so the Planner always has an arm
    cached = [o for o in profile.step_options() if o.cache_threshold > 0] if profile else []
    if cfg.model.family not in STEP_CACHE_FAMILIES:  # a profile's cached arms cannot run (sd3: no First Block Cache)
        cached = []
    options = [StepOption(0.0, T, 1.0), *cached]
    bandit = mode != "off" and cfg.explore.planner == "bandit"
    return build_iteration_core(
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
            min_spot_nodes=cfg.cluster.min_spot_nodes,
        ),
        sched,
        seed_bank,
        prompt_order,
        planner_config=cfg.planner_config() if bandit else None,
        step_options=options,
        planner_seed=cfg.planner.seed,
        fixed_action=fixed_action(cfg, profile) if mode != "off" and (not bandit or mode == "critical_path") else None,
        sampler_params=sampler_params,
    )


def fixed_action(cfg: SpotlightConfig, profile) -> Action:
    """The fixed planner's action: d = num_candidates; s and its cache threshold from
    ``explore.num_steps`` via the profile table (or ``explore.cache_threshold``).

    Raises:
        SpotlightError: ``explore.num_steps`` < ``sampler.num_steps`` without a profile.
    """
    ex, T = cfg.explore, float(cfg.sampler.num_steps)
    if ex.num_steps and ex.num_steps < T:
        if profile is None:
            raise SpotlightError(
                f"explore.num_steps = {ex.num_steps} (< sampler.num_steps = {cfg.sampler.num_steps}) picks its cache "
                "threshold from a profile, and this run has none: write one with `spotlight profile --config CONFIG "
                "--out PATH` and set explore.profile_path = PATH (or put it in the run directory as profile.json)"
            )
        opt = min(profile.step_options(), key=lambda o: abs(o.effective_steps - ex.num_steps))
        return Action(ex.num_candidates, opt.effective_steps, opt.cache_threshold)
    return Action(ex.num_candidates, T, ex.cache_threshold)
