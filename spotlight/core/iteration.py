"""The iteration core: the coordinator's phase machine as pure logic (paper §4.2, docs/architecture.md §3).

One training iteration n, as decided here::

    ROLLOUT   batch n × K seeds (seed bank), weights v_n, pulled by every worker
      ▼       all Done + scored  → StartTraining(n, request ids)
    TRAIN     the shell trains v_n → v_{n+1}; meanwhile (mode "stale") the Planner picks
              (d, s) for batch n+1 and d candidate seeds per explored prompt are queued on
              the stale v_n for spot workers; when the spot queue runs low, EXTRA candidates
              for the same prompts are streamed in so spot GPUs never idle while training
              runs
      ▼       the shell reports the update done → unfinished extras are cancelled (a worker
              still computing one finishes its batch, up to one batch time, and its result
              is refused as stale: workers are not interrupted)
    DRAIN     waits for the planned d candidates only (the critical path, §4.3.4)
      ▼       top-K/2 + bottom-K/2 seeds per prompt → seed bank → IterationDone(n, metrics)

The phases and their allowed moves are :data:`PHASE_TRANSITIONS` (any other move raises
:class:`InvalidPhaseTransition`); SAVING → FINISHED, once the Train Workers saved the final
model, is the core's too. Where exploration happens is the run's strategy
(:mod:`spotlight.core.exploration`): mode "critical_path" (the veRL-omni(spot) best-of-N
baseline) explores batch n on v_n *before* its rollout. With ``reuse_exploration`` the selected
candidates ARE the rollout (N generations per prompt, not N + K): its exploration requests carry
params ``as_rollout``, so workers run them uncached and return their window latents and log-probs.

Who drives it: :class:`spotlight.coordinator.coordinator.Coordinator` (sockets, processes, rewards on a
thread pool) and :mod:`spotlight.sim` (a virtual clock). Both own the same
:class:`~spotlight.core.request_scheduler.RequestScheduler`, seed bank and Planner objects the
core is built with (one factory, :func:`build_iteration_core`, builds it for both), report what
happened (``record_result``, ``record_reward``, and the worker events ``worker_seen``,
``worker_gone``, ``lease_started``, ``lease_ended``) and call
``advance(now, obs)``, which returns the decisions the shell must carry out. No sockets,
threads, clocks or torch here: every method takes ``now`` (seconds, any monotonic origin).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from spotlight.core.busy import BusyMeter
from spotlight.core.exploration import STRATEGIES, ExplorationStrategy
from spotlight.core.planner import Action, Planner, PlannerConfig, PlannerObservation, StepOption, feedback_from_groups
from spotlight.core.request_scheduler import RequestKind, RequestScheduler, RequestStatus
from spotlight.core.seed_bank import SeedBank, seed_from_text, seed_prefix

__all__ = [
    "PHASE_TRANSITIONS",
    "CoreObservation",
    "InvalidPhaseTransition",
    "IterationCore",
    "IterationDone",
    "IterationSettings",
    "Phase",
    "StartSaving",
    "StartTraining",
    "build_iteration_core",
    "spot_nodes_missing",
]

_STATE_VERSION = 1


class Phase(str, enum.Enum):
    """Where iteration ``IterationCore.iteration`` stands. A ``str`` enum: ``"train"`` in
    ``status.json`` and in ``spotlight status`` is ``Phase.TRAIN``."""

    STARTING = "starting"  # waiting for the Train Workers (and, to begin, one worker node; min_spot_nodes)
    EXPLORE_FIRST = "explore_first"  # critical_path: batch n's candidates before its rollout
    ROLLOUT = "rollout"  # batch n on v_n, pulled by every worker, scored as it finishes
    TRAIN = "train"  # v_n -> v_{n+1} on the Train Workers; stale: spot workers explore n+1
    DRAIN = "drain"  # leftover planned exploration of n+1, pulled by every worker
    ENDED = "ended"  # iteration n recorded; the shell checkpoints before n+1 begins
    SAVING = "saving"  # every iteration done: the Train Workers save the final model
    FINISHED = "finished"  # the final model is saved: the run is over (terminal)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


PHASE_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset(
        {
            Phase.ROLLOUT,  # trainers ready, a node alive (iteration 1: min_spot_nodes spot nodes): n begins
            Phase.EXPLORE_FIRST,  # ... or begins with its own exploration (critical_path)
            Phase.SAVING,  # resumed from the checkpoint of the last iteration: only the save is left
        }
    ),
    Phase.EXPLORE_FIRST: frozenset(
        {
            Phase.ROLLOUT,  # every candidate scored: the rollout uses the selected seeds
            Phase.TRAIN,  # reuse_exploration: the selected candidates are the rollout
        }
    ),
    Phase.ROLLOUT: frozenset({Phase.TRAIN}),  # every rollout request Done and scored
    Phase.TRAIN: frozenset({Phase.DRAIN}),  # TRAIN_DONE from every rank, v_{n+1} published
    Phase.DRAIN: frozenset({Phase.ENDED}),  # the planned exploration of n+1 is scored
    Phase.ENDED: frozenset(
        {
            Phase.ROLLOUT,  # the shell checkpointed iteration n: iteration n+1 begins
            Phase.EXPLORE_FIRST,  # ... with its own exploration first (critical_path)
            Phase.SAVING,  # n was the last iteration
        }
    ),
    Phase.SAVING: frozenset({Phase.FINISHED}),  # every Train Worker reported the final model saved
    Phase.FINISHED: frozenset(),  # terminal
}
"""The phase machine: every allowed move, with what causes it. Anything else is a bug in the
core (or a shell trying to drive it) and raises :class:`InvalidPhaseTransition`."""


class InvalidPhaseTransition(RuntimeError):
    """A phase change that :data:`PHASE_TRANSITIONS` does not allow."""


_TERMINAL = frozenset(s for s in RequestStatus if s.is_terminal())
# enum members as globals: ``RequestKind.X`` goes through the enum metaclass's ``__getattr__`` hook
_ROLLOUT, _EXPLORE = RequestKind.ROLLOUT, RequestKind.EXPLORE
_PARKED = RequestStatus.PARKED


@dataclass(frozen=True, kw_only=True)
class IterationSettings:
    """What the phase machine needs from the run config.

    iterations: number of training iterations of the run.
    prompts_per_iteration: prompt groups per batch (N).
    num_control_prompts: the last slots of a batch, never explored (the Planner's reference, §4.3.2).
    group_size: K samples per prompt.
    run_seed: seeds of default and candidate noise derive from it (docs/architecture.md §3).
    num_steps: T denoising steps of a full rollout.
    explore_mode: "stale" (Spotlight), "critical_path" (best-of-N before the rollout) or "off".
    reuse_exploration: critical_path only: the selected candidates are the rollout (veRL-omni).
    stream_extra: stale only: queue extra candidates while training runs.
    max_candidates_per_prompt: cap on planned + extra candidates of one prompt in one iteration.
    min_spot_nodes: iteration 1 begins only once this many spot nodes are alive
        (``cluster.min_spot_nodes``; :func:`spot_nodes_missing`); later iterations go on with
        whatever is alive.
    """

    iterations: int
    prompts_per_iteration: int
    num_control_prompts: int
    group_size: int
    run_seed: int
    num_steps: int
    explore_mode: str = "stale"
    reuse_exploration: bool = False
    stream_extra: bool = True
    max_candidates_per_prompt: int = 256
    min_spot_nodes: int = 0

    def __post_init__(self) -> None:
        if self.explore_mode not in STRATEGIES:
            raise ValueError(
                f"explore_mode must be one of {', '.join(map(repr, STRATEGIES))}, got {self.explore_mode!r}"
            )
        if self.reuse_exploration and self.explore_mode != "critical_path":
            raise ValueError("reuse_exploration needs explore_mode='critical_path'")
        if self.max_candidates_per_prompt < 1:
            raise ValueError(f"max_candidates_per_prompt must be >= 1, got {self.max_candidates_per_prompt}")
        if self.min_spot_nodes < 0:
            raise ValueError(f"min_spot_nodes must be >= 0, got {self.min_spot_nodes}")

    def is_control(self, slot: int) -> bool:
        """Control (unexplored) prompt groups are the last ``num_control_prompts`` slots."""
        return slot >= self.prompts_per_iteration - self.num_control_prompts


@dataclass(frozen=True)
class CoreObservation:
    """What the shell knows now, passed to :meth:`IterationCore.advance`.

    trainers_ready: every Train Worker is up and the current weights are published.
    any_worker_node: at least one node is alive (an iteration may start).
    train_done: the update of the iteration in TRAIN finished and v_{n+1} is published.
    final_saved: in SAVING, every Train Worker saved the final model.
    num_spot_gpus: live spot GPUs (the Planner's N_spot).
    step_time_s: t_step, GPU-seconds per sequence per computed step (None = unknown yet).
    spot_slots: requests the live spot workers can hold at once (workers × batch size);
        extras are streamed while fewer than this many exploration requests are queued.
    num_spot_nodes: live spot nodes (registered and heartbeating).
    """

    trainers_ready: bool = True
    any_worker_node: bool = True
    train_done: bool = False
    final_saved: bool = False
    num_spot_gpus: int = 0
    step_time_s: float | None = None
    spot_slots: int = 0
    num_spot_nodes: int = 0


def spot_nodes_missing(iteration: int, num_spot_nodes: int, min_spot_nodes: int) -> int:
    """How many more spot nodes must join before 0-based ``iteration`` may begin (0: it may).

    Only iteration 1 (``iteration == 0``, also when a run stopped before its first iteration
    ended starts again) waits for ``min_spot_nodes``: the run starts with the capacity it asked
    for; nodes that leave later are spot capacity coming and going, so a later iteration (and a
    resumed run) goes on with whatever is alive, as always."""
    if iteration > 0:
        return 0
    return max(0, min_spot_nodes - num_spot_nodes)


@dataclass(frozen=True)
class StartTraining:
    """Train on these DONE rollout requests of ``iteration`` (the shell builds the batches)."""

    iteration: int
    request_ids: list[str]


@dataclass(frozen=True)
class IterationDone:
    """Iteration ``iteration`` ended; ``metrics`` are the core's part of its metrics row."""

    iteration: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class RolloutParked:
    """Rollout requests of ``iteration`` were parked (``cluster.max_request_failures`` workers
    gave each back with an error): the update cannot be built without them, so the run stops
    (docs/architecture.md §4). Emitted once; the phase stays ROLLOUT."""

    iteration: int
    request_ids: list[str]


@dataclass(frozen=True)
class StartSaving:
    """Every iteration is done: save the final model."""


@dataclass
class _Exploration:
    """Bookkeeping of the exploration of one batch."""

    iteration: int
    action: Action
    planned: set[str] = field(default_factory=set)  # ids of the d planned candidates per prompt
    extra: set[str] = field(default_factory=set)  # ids of streamed extra candidates
    next_index: dict[int, int] = field(default_factory=dict)  # slot -> next candidate index j
    done: list[str] = field(default_factory=list)  # DONE exploration request ids (result order)


class IterationCore:
    """The coordinator's iteration machine (paper §4.2-§4.5), pure.

    Args:
        settings: see :class:`IterationSettings`.
        sched: the run's Request Scheduler (the core submits and cancels; the shell forwards
            worker pulls and reports to it).
        seed_bank: selected seeds per (iteration, slot).
        planner: the bandit Planner (§4.3), or None for a fixed action.
        fixed_action: the action when ``planner`` is None (and the critical-path baseline's).
        strategy: where and when to explore; default: the one named by ``settings.explore_mode``
            (:data:`spotlight.core.exploration.STRATEGIES`).
        prompt_order: prompt indices in epoch order; batch n takes ``prompts_per_iteration``
            consecutive entries, wrapping around.
        sampler_params: per-iteration request params (e.g. a drawn SDE window start).
    """

    def __init__(
        self,
        settings: IterationSettings,
        sched: RequestScheduler,
        seed_bank: SeedBank,
        planner: Planner | None,
        fixed_action: Action | None,
        prompt_order: list[int],
        sampler_params: Callable[[int], dict] = lambda n: {},
        strategy: ExplorationStrategy | None = None,
    ) -> None:
        if not prompt_order:
            raise ValueError("prompt_order is empty")
        self.settings = settings
        self.sched = sched
        self.seed_bank = seed_bank
        self.planner = planner
        self.fixed_action = fixed_action
        self.prompt_order = list(prompt_order)
        self.sampler_params = sampler_params
        self.strategy = strategy if strategy is not None else STRATEGIES[settings.explore_mode]
        self.phase = Phase.STARTING
        self.iteration = 0
        self.done = False
        self.stopped = False  # a RolloutParked was emitted: nothing more moves
        self.request_meta: dict[str, tuple[int, int]] = {}  # request id -> (slot, prompt index)
        self.rewards: dict[str, float | None] = {}  # DONE request id -> reward (None = not scored yet)
        self.rollout_done: dict[int, list[str]] = collections.defaultdict(list)
        # (iteration, kind) -> DONE but unscored (a plain dict: a Counter's item assignment
        # goes through a slow generic slot, and this one changes twice per result)
        self._unscored: dict[tuple[int, RequestKind], int] = {}
        self.explorations: dict[int, _Exploration] = {}
        self.explore_iter: int | None = None
        self.explore_action: dict[int, Action] = {}  # iteration whose seeds it chose -> action
        self.plan_logs: dict[int, dict] = {}
        self.last_train_s: float | None = None
        self.busy = BusyMeter()
        """Lease-holding time over alive time per worker; fed by the worker events below."""
        self.t: dict[str, float] = {}
        self._rollout_stats: dict[str, Any] = {}
        self._explore_stats: dict[str, Any] = {}
        self._explored_slots: dict[int, set[int]] = {}  # batch -> slots with >= d scored candidates
        self._candidates_per_prompt: dict[int, float] = {}  # batch -> median candidates per explored prompt

    # ------------------------------------------------------------------ batches
    def batch_prompts(self, iteration: int) -> list[int]:
        """Prompt indices of batch ``iteration`` (deterministic epoch order)."""
        p, order = self.settings.prompts_per_iteration, self.prompt_order
        return [order[(iteration * p + i) % len(order)] for i in range(p)]

    # ------------------------------------------------------------------ reports from the shell
    def record_result(self, request_id: str, now: float) -> None:
        """The shell's ``sched.complete`` accepted ``request_id``: it awaits its reward."""
        req = self.sched.get(request_id)
        self.rewards[request_id] = None
        key = (req.iteration, req.kind)
        unscored = self._unscored
        unscored[key] = unscored.get(key, 0) + 1
        if req.kind is _ROLLOUT:
            self.rollout_done[req.iteration].append(request_id)
        else:
            ex = self.explorations.get(req.iteration)
            if ex is not None:
                ex.done.append(request_id)
            self.t["explore_last_result"] = now

    def record_reward(self, request_id: str, reward: float) -> None:
        """The reward of a recorded result (NaN allowed: such samples are left out of training)."""
        rewards = self.rewards
        if rewards.get(request_id, 0.0) is not None:  # unknown, or already scored
            return
        req = self.sched.get(request_id)
        rewards[request_id] = float(reward)
        self._unscored[(req.iteration, req.kind)] -= 1

    def scored(self, iteration: int, kind: RequestKind) -> bool:
        """Every request of (iteration, kind) ended and each DONE one has its reward."""
        return self.sched.is_finished(iteration=iteration, kind=kind) and self._unscored.get((iteration, kind), 0) == 0

    # ------------------------------------------------------------------ worker events from the shell
    def worker_seen(self, worker_id: str, is_spot: bool, now: float) -> None:
        """A worker is alive (it heartbeats or pulls); idle until a lease starts."""
        self.busy.seen(worker_id, is_spot, now)

    def worker_gone(self, worker_id: str, now: float) -> None:
        """A worker left (its agent left, died or re-registered); its open lease time ends."""
        self.busy.gone(worker_id, now)

    def lease_started(self, worker_id: str, now: float) -> None:
        """A worker was granted requests."""
        self.busy.start(worker_id, now)

    def lease_ended(self, worker_id: str, now: float) -> None:
        """A worker returned its results, committed or gave its requests back."""
        self.busy.end(worker_id, now)

    # ------------------------------------------------------------------ the machine
    def _set_phase(self, phase: Phase) -> None:
        if phase not in PHASE_TRANSITIONS[self.phase]:
            raise InvalidPhaseTransition(f"iteration {self.iteration}: {self.phase.value} -> {phase.value}")
        self.phase = phase

    def advance(self, now: float, obs: CoreObservation) -> list:
        """Move the phase machine as far as the observations allow; returns the decisions
        (:class:`StartTraining`, :class:`IterationDone`, :class:`StartSaving`) in order."""
        out: list = []
        while True:
            before = (self.phase, self.iteration)
            self._STEPS[self.phase](self, now, obs, out)
            if (self.phase, self.iteration) == before or (out and isinstance(out[-1], IterationDone)):
                return out  # after IterationDone the shell checkpoints before the next batch starts
            obs = dataclasses.replace(obs, train_done=False)  # a new phase never inherits "done"

    def _from_starting(self, now: float, obs: CoreObservation, out: list) -> None:
        if not obs.trainers_ready:
            return
        if self.iteration >= self.settings.iterations:
            self._begin_saving(out)
        elif obs.any_worker_node and not spot_nodes_missing(
            self.iteration, obs.num_spot_nodes, self.settings.min_spot_nodes
        ):
            self.begin_iteration(self.iteration, now)

    def _from_explore_first(self, now: float, obs: CoreObservation, out: list) -> None:
        n = self.iteration
        if not self.scored(n, _EXPLORE):
            return
        self.t["explore_end"] = now
        self._explore_stats = self.finish_exploration(n)
        self.t["rollout_start"] = now
        if self.settings.reuse_exploration:
            self.t["rollout_end"] = now
            self._start_training(n, self._selected_exploration(n), now, out, obs)
        else:
            self._set_phase(Phase.ROLLOUT)
            self.submit_rollout(n, now)

    def _from_rollout(self, now: float, obs: CoreObservation, out: list) -> None:
        n = self.iteration
        if self.stopped:
            return
        if self.scored(n, _ROLLOUT):
            parked = [r.request_id for r in self.sched.requests(iteration=n, kind=_ROLLOUT, status=_PARKED)]
            if parked:
                self.stopped = True
                out.append(RolloutParked(n, parked))
                return
            self.t["rollout_end"] = now
            self._start_training(n, list(self.rollout_done.get(n, [])), now, out, obs)

    def _from_train(self, now: float, obs: CoreObservation, out: list) -> None:
        if not obs.train_done:
            self.strategy.while_training(self, now, obs)
            return
        self.t["train_end"] = now
        self.last_train_s = now - self.t["rollout_end"]
        self.sched.set_training_active(False)
        self.strategy.training_ended(self, now)
        self._set_phase(Phase.DRAIN)

    def _from_drain(self, now: float, obs: CoreObservation, out: list) -> None:
        n = self.iteration
        m = self.strategy.drained_batch(self, n)
        if m is not None and not self.scored(m, _EXPLORE):
            return
        if m is not None:
            self.t["explore_end"] = now
            self._explore_stats = self.finish_exploration(m)
        out.append(IterationDone(n, self._end_metrics(n, now)))
        self._end_iteration(n, now)
        self._set_phase(Phase.ENDED)

    def _from_ended(self, now: float, obs: CoreObservation, out: list) -> None:
        # between iterations: nothing queued (the shell checkpointed)
        if self.iteration >= self.settings.iterations:
            self._begin_saving(out)
        else:
            self.begin_iteration(self.iteration, now)

    def _from_saving(self, now: float, obs: CoreObservation, out: list) -> None:
        if obs.final_saved:
            self._set_phase(Phase.FINISHED)
            self.done = True

    def _stay(self, now: float, obs: CoreObservation, out: list) -> None:
        """FINISHED: nothing moves any more."""

    _STEPS = {
        Phase.STARTING: _from_starting,
        Phase.EXPLORE_FIRST: _from_explore_first,
        Phase.ROLLOUT: _from_rollout,
        Phase.TRAIN: _from_train,
        Phase.DRAIN: _from_drain,
        Phase.ENDED: _from_ended,
        Phase.SAVING: _from_saving,
        Phase.FINISHED: _stay,
    }

    def _begin_saving(self, out: list) -> None:
        self._set_phase(Phase.SAVING)
        out.append(StartSaving())

    def _start_training(self, n: int, request_ids: list[str], now: float, out: list, obs: CoreObservation) -> None:
        self._rollout_stats = self.rollout_stats(request_ids)
        self._planner_feedback(n, request_ids)
        out.append(StartTraining(n, request_ids))
        self.sched.set_training_active(True)
        self._set_phase(Phase.TRAIN)
        self.strategy.training_started(self, n, now, obs)

    def begin_iteration(self, n: int, now: float) -> None:
        """Queue iteration ``n``'s first work (its rollout, or its exploration first)."""
        self.t = {"iter_start": now, "rollout_start": now}
        self.explore_iter = None
        self._explore_stats = {}
        self._set_phase(Phase(self.strategy.begin_iteration(self, n, now)))

    def _end_iteration(self, n: int, now: float) -> None:
        for rid in self.rollout_done.pop(n, []):
            self.rewards.pop(rid, None)
        for m in [m for m in self.explorations if m <= n]:
            for rid in self.explorations.pop(m).done:
                self.rewards.pop(rid, None)
        for key in [k for k, v in self._unscored.items() if k[0] <= n and v == 0]:
            del self._unscored[key]
        self.seed_bank.forget(n)
        self.busy.forget(now - self.busy.keep_s)
        self.iteration = n + 1

    # ------------------------------------------------------------------ submissions
    def submit_rollout(self, n: int, now: float) -> list[str]:
        items = []
        for slot, pidx in enumerate(self.batch_prompts(n)):
            seeds, _ = self.seed_bank.seeds_for(n, slot)
            items += [(pidx, seed, slot) for seed in seeds]
        ids = self.sched.submit(_ROLLOUT, n, items, weight_version=n, params=self.sampler_params(n), now=now)
        for rid, (pidx, _, slot) in zip(ids, items):
            self.request_meta[rid] = (slot, pidx)
        return ids

    def _explore_params(self, n_next: int, action: Action) -> dict:
        params = self.sampler_params(n_next)
        if self.settings.reuse_exploration:
            # the selected candidates are the rollout: full fidelity, with window latents and log-probs
            params["as_rollout"] = True
        elif action.cache_threshold > 0:
            params["cache_threshold"] = action.cache_threshold
        return params

    def submit_exploration(self, n_next: int, version: int, action: Action, now: float, *, planned: bool = True) -> int:
        """d candidate seeds per explored prompt of batch ``n_next``, on weights ``version``.

        ``planned=False`` queues nothing now and records no action for the Planner: the
        candidates are only streamed as extras while training runs (when no arm fits)."""
        ex = _Exploration(n_next, action)
        items = []
        d = min(action.num_sequences, self.settings.max_candidates_per_prompt) if planned else 0
        for slot, pidx in enumerate(self.batch_prompts(n_next)):
            if self.settings.is_control(slot):
                continue
            prefix = seed_prefix(self.settings.run_seed, "candidate", n_next, slot)  # = derive_seed(..., j)
            items += [(pidx, seed_from_text(f"{prefix}{j}"), slot) for j in range(d)]
            ex.next_index[slot] = d
        self.explorations[n_next] = ex
        if planned:
            self.explore_action[n_next] = action
        self.explore_iter = n_next
        self.t["explore_start"] = now
        ids = self.sched.submit(
            _EXPLORE, n_next, items, weight_version=version, params=self._explore_params(n_next, action), now=now
        )
        for rid, (pidx, _, slot) in zip(ids, items):
            self.request_meta[rid] = (slot, pidx)
        ex.planned.update(ids)
        return len(ids)

    def stream_extra(self, now: float, obs: CoreObservation) -> None:
        """Keep the spot queue from running dry while training runs: when
        fewer exploration requests are queued than the spot workers can hold, queue extra
        candidates (the next candidate indices) of the explored prompts, round-robin, up to
        twice that many (so refills come in chunks, not one per pull)."""
        m = self.explore_iter
        if not self.settings.stream_extra or m is None or obs.spot_slots <= 0:
            return
        ex = self.explorations.get(m)
        if ex is None or not ex.next_index:
            return
        ready = self.sched.num_ready(kind=_EXPLORE)
        if ready >= obs.spot_slots:
            return
        want = 2 * obs.spot_slots - ready
        cap = self.settings.max_candidates_per_prompt
        next_index = ex.next_index
        slots = sorted(next_index)
        prompts = self.batch_prompts(m)
        prefix = seed_prefix(self.settings.run_seed, "candidate", m)
        slot_prefix = {slot: f"{prefix}{slot}|" for slot in slots}  # + j: the text of derive_seed(..., slot, j)
        items = []
        # round-robin over the slots, one candidate each per pass, until ``want`` or every
        # slot reached the cap (a pass's open slots are known when it starts: only the
        # pass itself advances them)
        while len(items) < want:
            open_slots = [slot for slot in slots if next_index[slot] < cap]
            if not open_slots:
                break
            for slot in open_slots[: want - len(items)]:
                j = next_index[slot]
                items.append((prompts[slot], seed_from_text(f"{slot_prefix[slot]}{j}"), slot))
                next_index[slot] = j + 1
        if not items:
            return
        ids = self.sched.submit(
            _EXPLORE, m, items, weight_version=m - 1, params=self._explore_params(m, ex.action), now=now
        )
        meta = self.request_meta
        for rid, (pidx, _, slot) in zip(ids, items):
            meta[rid] = (slot, pidx)
        ex.extra.update(ids)

    def stop_streaming(self, now: float) -> None:
        """Training ended: cancel the extras that are not done (their late results are stale);
        the planned candidates are still waited for in DRAIN."""
        m = self.explore_iter
        ex = self.explorations.get(m) if m is not None else None
        if ex is None or not ex.extra:
            return
        get = self.sched.get
        live = [rid for rid in ex.extra if get(rid).status not in _TERMINAL]
        if live:
            self.sched.cancel_requests(live, reason="training ended: extra candidate abandoned", now=now)

    # ------------------------------------------------------------------ planner
    def choose_action(self, n_next: int, now: float, obs: CoreObservation) -> Action | None:
        """The exploration action for batch ``n_next`` (None = explore nothing), §4.3.1."""
        if self.planner is None:
            return self.fixed_action
        t_train = (
            self.last_train_s
            if self.last_train_s is not None
            else self.t.get("rollout_end", now) - self.t.get("iter_start", now)
        )
        t_step = obs.step_time_s if obs.step_time_s else 1e-3
        num_explored = self.settings.prompts_per_iteration - self.settings.num_control_prompts
        pobs = PlannerObservation(
            train_time_s=max(t_train, 1e-6),
            num_spot_gpus=obs.num_spot_gpus,
            num_explored_prompts=num_explored,
            step_time_s=t_step,
        )
        plan = self.planner.plan(pobs)
        self.plan_logs[n_next] = plan.to_log() | {
            "t_train_s": t_train,
            "t_step_s": t_step,
            "num_spot_gpus": pobs.num_spot_gpus,
        }
        return plan.action

    def cheapest_action(self) -> Action:
        """The Planner's cheapest arm (by planned GPU steps): what spot GPUs stream, unplanned,
        when no arm fits the training window."""
        return min(
            self.planner.actions,
            key=lambda a: (a.num_sequences * (a.cost_steps or a.effective_steps), a.effective_steps),
        )

    def _planner_feedback(self, n: int, request_ids: list[str]) -> None:
        """r = σ̄_all / σ̄_unc over iteration n's groups (§4.3.2) → the arm that was chosen.

        With streamed extras a prompt may have had more candidates than planned. The arm
        credited is still the one the Planner chose: the arm is the decision, and the extras
        its consequence (a cheaper plan leaves more of the window to stream). Crediting the
        grid arm matching the candidates scored instead left the chosen arm unseen forever
        (UCB = ∞), so the Planner re-picked it every iteration whatever β was (seen in the
        Fig. 17 benchmark). ``planner/executed_candidates_per_prompt`` records what ran."""
        by_slot = collections.defaultdict(list)
        for rid in request_ids:
            r = self.rewards.get(rid)
            if r is not None and math.isfinite(r):
                by_slot[self.request_meta[rid][0]].append(r)
        control = {k for k in by_slot if self.settings.is_control(k)}
        explored = self._explored_slots.pop(n, set()) - control
        if self.planner is not None:
            r = self.planner.feedback(by_slot, explored, control)
        else:
            r = feedback_from_groups(by_slot, explored, control)
        self._rollout_stats["planner/feedback"] = r
        self._rollout_stats["planner/explored_groups"] = float(len(explored & by_slot.keys()))
        action = self.explore_action.pop(n, None)
        per_prompt = self._candidates_per_prompt.pop(n, None)
        if self.planner is None or action is None or not self.strategy.credits_planner:
            return
        self._rollout_stats["planner/credited_num_sequences"] = action.num_sequences
        if per_prompt is not None:
            self._rollout_stats["planner/executed_candidates_per_prompt"] = float(per_prompt)
        self.planner.update(action, r)  # always: a NaN is a play without feedback

    def finish_exploration(self, m: int) -> dict:
        """Top/bottom selection per explored prompt of batch ``m`` into the seed bank.

        A prompt counts as explored only when at least the planned d candidates were scored
        with a finite reward (a partial exploration is rolled out with default seeds for the
        missing ones but is not credited to the Planner)."""
        ex = self.explorations.get(m)
        by_slot: dict[int, list[tuple[int, float]]] = collections.defaultdict(list)
        for rid in ex.done if ex else []:
            req = self.sched.get(rid)
            r = self.rewards.get(rid)
            by_slot[self.request_meta[rid][0]].append((req.seed, math.nan if r is None else r))
        d = min(ex.action.num_sequences, self.settings.max_candidates_per_prompt) if ex else None
        for slot, pairs in by_slot.items():
            self.seed_bank.record_exploration(m, slot, [p[0] for p in pairs], [p[1] for p in pairs], required=d)
        explored = self.seed_bank.explored_slots(m)
        self._explored_slots[m] = explored
        counts = [len(p) for s, p in by_slot.items() if s in explored]
        self._candidates_per_prompt[m] = float(np.median(counts)) if counts else 0.0
        n_planned = sum(1 for rid in (ex.done if ex else []) if rid in ex.planned)
        return {
            "explore/num_requests": len(ex.done) if ex else 0,
            "explore/num_extra_requests": len(ex.done) - n_planned if ex else 0,
            "explore/candidates_per_prompt": self._candidates_per_prompt[m],
        }

    def _selected_exploration(self, n: int) -> list[str]:
        """veRL-omni reuse: the exploration requests whose seeds the seed bank selected."""
        ex = self.explorations.get(n)
        picked = set()
        for slot in range(self.settings.prompts_per_iteration):
            seeds, explored = self.seed_bank.seeds_for(n, slot)
            if explored:
                picked.update((slot, s) for s in seeds)
        return [
            rid for rid in (ex.done if ex else []) if (self.request_meta[rid][0], self.sched.get(rid).seed) in picked
        ]

    # ------------------------------------------------------------------ metrics
    def rollout_stats(self, request_ids: list[str]) -> dict:
        rows = [(self.request_meta[rid][0], self.rewards.get(rid)) for rid in request_ids]
        rows = [(s, r) for s, r in rows if r is not None and math.isfinite(r)]
        rewards = np.array([r for _, r in rows], dtype=np.float64)
        by_slot = collections.defaultdict(list)
        for s, r in rows:
            by_slot[s].append(r)
        ctrl = [float(np.std(v)) for k, v in by_slot.items() if self.settings.is_control(k)]
        expl = [float(np.std(v)) for k, v in by_slot.items() if not self.settings.is_control(k)]
        return {
            "reward/mean": float(rewards.mean()) if rewards.size else math.nan,
            "reward/std": float(rewards.std()) if rewards.size else math.nan,
            "reward/control_std": float(np.mean(ctrl)) if ctrl else math.nan,
            "reward/explored_std": float(np.mean(expl)) if expl else math.nan,
            "reward/control_mean": float(np.mean([r for s, r in rows if self.settings.is_control(s)]))
            if ctrl
            else math.nan,
            "rollout/num_samples": len(rows),
        }

    def _end_metrics(self, n: int, now: float) -> dict[str, Any]:
        t = self.t
        row: dict[str, Any] = {"iteration": n, "version": n}
        row.update(self._rollout_stats)
        row.update(self._explore_stats)
        strategy = self.strategy
        m = strategy.metrics_batch(self, n)
        train_end = t.get("train_end", now)
        explore_done = t.get("explore_last_result", t.get("explore_end", 0.0))
        explored = m is not None and "explore_start" in t
        explore_s = max(0.0, explore_done - t["explore_start"]) if explored else 0.0
        critical = strategy.critical_path_s(t, train_end) if explored else 0.0
        action = self.explore_action.get(m) if m is not None else None
        if action is None:
            action = strategy.fallback_action(self)
        if action is not None:
            row["explore/num_candidates"] = action.num_sequences
            row["explore/planned_steps"] = action.effective_steps
            row["explore/cache_threshold"] = action.cache_threshold
        if m in self.plan_logs:
            row["planner"] = self.plan_logs.pop(m)
        iter_s = now - t["iter_start"]
        row.update(
            {
                "time/rollout_s": t["rollout_end"] - t["rollout_start"],
                "time/train_s": train_end - t["rollout_end"],
                "time/explore_s": explore_s,
                "time/explore_critical_path_s": critical,
                "time/critical_path_share": critical / iter_s if iter_s > 0 else 0.0,
                "time/iteration_s": iter_s,
                # the last iteration has no next batch to explore: spot idleness there is not
                # a scheduling loss (a cluster would hand the spot GPUs back), so it is NaN
                "spot/busy_fraction": self.busy.fraction(t["rollout_end"], train_end, spot=True)
                if not (strategy.explores_next_batch and n + 1 >= self.settings.iterations)
                else math.nan,
            }
        )
        return row

    # ------------------------------------------------------------------ persistence
    def forget_requests(self, request_ids) -> None:
        """Drop the prompt slots of requests the shell retired (written to the request log)."""
        meta = self.request_meta
        for rid in request_ids:
            meta.pop(rid, None)

    def adopt_restored_requests(self) -> None:
        """Learn the prompt slots of requests the scheduler got back from a checkpoint (a
        resumed run: pulls of resumed work and their results need them)."""
        for r in self.sched.requests():
            self.request_meta.setdefault(r.request_id, (r.group, r.prompt_index))

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state kept between iterations (the scheduler, seed bank and Planner
        are saved by their owners)."""
        return {
            "version": _STATE_VERSION,
            "iteration": self.iteration,
            "explore_action": {str(k): a.to_dict() for k, a in self.explore_action.items()},
            "plan_logs": {str(k): v for k, v in self.plan_logs.items()},
            "last_train_s": self.last_train_s,
            "explored_slots": {str(k): sorted(v) for k, v in self._explored_slots.items()},
            "candidates_per_prompt": {str(k): v for k, v in self._candidates_per_prompt.items()},
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (between iterations: nothing in flight).

        Raises:
            ValueError: unknown state version.
        """
        if d.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported iteration core state version {d.get('version')!r}")
        self.iteration = int(d["iteration"])
        self.explore_action = {
            int(k): Action(
                int(a["num_sequences"]), float(a["effective_steps"]), float(a["cache_threshold"]), a.get("cost_steps")
            )
            for k, a in d["explore_action"].items()
        }
        self.plan_logs = {int(k): v for k, v in d["plan_logs"].items()}
        self.last_train_s = d["last_train_s"]
        self._explored_slots = {int(k): set(v) for k, v in d.get("explored_slots", {}).items()}
        self._candidates_per_prompt = {int(k): float(v) for k, v in d.get("candidates_per_prompt", {}).items()}
        self.phase = Phase.STARTING


def build_iteration_core(
    settings: IterationSettings,
    sched: RequestScheduler,
    seed_bank: SeedBank,
    prompt_order: list[int],
    *,
    planner_config: PlannerConfig | None,
    step_options: list[StepOption],
    planner_seed: int = 0,
    fixed_action: Action | None = None,
    sampler_params: Callable[[int], dict] = lambda n: {},
) -> IterationCore:
    """The iteration core of a run: one recipe for the coordinator and the simulator.

    Args:
        settings: the phase machine's settings; ``explore_mode`` picks the strategy.
        sched, seed_bank, prompt_order, sampler_params: as :class:`IterationCore` takes them.
        planner_config: the bandit Planner's configuration (paper §4.3), or None for a fixed
            action. A Planner is built only when the run explores.
        step_options: the profiled (cache threshold → effective steps, accuracy) arms.
        planner_seed: seed of the Planner's tie-breaking RNG.
        fixed_action: d and s when there is no Planner, and the best-of-N action of the
            critical-path strategy (kept only where one of those applies).
    """
    explores = settings.explore_mode != "off"
    planner = (
        Planner(planner_config, step_options, random.Random(planner_seed)) if explores and planner_config else None
    )
    keep_fixed = explores and (planner is None or settings.explore_mode == "critical_path")
    return IterationCore(
        settings,
        sched,
        seed_bank,
        planner,
        fixed_action if keep_fixed else None,
        prompt_order,
        sampler_params,
        STRATEGIES[settings.explore_mode],
    )
