"""The Planner: bandit-based dynamic exploration (Spotlight paper §4.3).

At the start of every exploration phase the Planner picks an action
``a = (d, s)`` -- ``d`` candidate sequences (seeds) per explored prompt and
``s`` effective denoising steps per sequence (§4.3.1).  ``s`` is not a
truncated schedule: each value is a row of an offline-profiled table mapping a
First-Block-Cache threshold to the mean number of *computed* denoising steps
and to the exploration accuracy (Spearman rho of exploration vs. full-rollout
rewards, §6.8).  Rows below the target accuracy or below the minimum number of
effective steps are refused.

Only actions whose planned time fits the exploration window are eligible
(§4.3.1)::

    W          = T_train * N_spot                      [GPU-seconds]
    T_plan(a)  = d * C * s * t_step                    [GPU-seconds]
    A_elig     = { a : T_plan(a) <= W }

Both sides are in GPU-seconds: ``t_step`` is GPU-seconds per (sequence x computed
step), i.e. the wall time per sequence-step of a worker times the GPUs that worker
occupies (:func:`step_time_gpu_s`). A sequence-parallel group of g GPUs is ONE worker
whose wall time per sequence-step must be multiplied by g, otherwise a plan built on
it overruns the window by the SP degree (the paper's spot nodes run SP 2).

The d grid starts above the rollout group size K (:func:`min_selective_sequences`):
seed selection keeps the top K/2 and bottom K/2 candidates, so d <= K candidates are
all kept -- an arm that costs spot time and selects nothing.

Among eligible actions the Planner maximises a sliding-window UCB (§4.3.3)::

    UCB(a_i) = mu_i + beta * sqrt(ln(N + 1) / n_i),   n_i = min(N_i, W_b)

with ``UCB = +inf`` for unseen arms, ties broken by lower planned cost, then
fewer effective steps, then fewer sequences.  The bandit feedback is the
variance-amplification ratio of §4.3.2, see :func:`feedback_ratio` and
:func:`feedback_from_groups` (ours, not the paper's: the control std is floored and
the ratio capped, see there). An iteration whose feedback is unavailable (no control
group, no fully explored group) still counts as a play of its arm, with no value
(:meth:`Planner.update`), so an arm is never re-picked forever as "unseen".

This module is pure logic: observations and an injected ``random.Random`` in,
a :class:`Plan` out.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = [
    "Action",
    "ArmScore",
    "Plan",
    "Planner",
    "PlannerConfig",
    "PlannerObservation",
    "StepOption",
    "feedback_from_groups",
    "feedback_ratio",
    "min_selective_sequences",
    "selection_key",
    "step_time_gpu_s",
    "StepTimes",
]

_STATE_VERSION = 2  # 2: arm windows may hold None (a play without feedback); 1 still loads

DEFAULT_FEEDBACK_STD_FLOOR = 0.02
"""Default floor on sigma_unc (2 % of a reward range of [0, 1]), see :func:`feedback_ratio`."""

DEFAULT_MAX_FEEDBACK = 5.0
"""Default cap on the feedback ratio, see :func:`feedback_ratio`."""

NEUTRAL_FEEDBACK = 1.0
"""The value of an arm that was played but never got feedback: ratio 1 = no amplification."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_feedback_bounds(std_floor: float, max_feedback: float) -> None:
    if not _is_real(std_floor) or not math.isfinite(std_floor) or std_floor < 0:
        raise ValueError(f"feedback_std_floor must be a finite number >= 0, got {std_floor!r}")
    if not _is_real(max_feedback) or not math.isfinite(max_feedback) or max_feedback < 1:
        raise ValueError(f"max_feedback must be a finite number >= 1 (1 = no amplification), got {max_feedback!r}")


def min_selective_sequences(group_size: int, sequence_step: int, max_sequences: int) -> int:
    """The smallest d of the default grid: the first grid value above K.

    ``K + sequence_step`` (capped at ``max_sequences``): d = K candidates would all be
    kept by the top-K/2 + bottom-K/2 selection, so the grid starts one step above K.

    Raises:
        ValueError: ``max_sequences <= group_size`` (no d can select anything) or a
            non-positive argument.
    """
    for name, v in (("group_size", group_size), ("sequence_step", sequence_step), ("max_sequences", max_sequences)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if max_sequences <= group_size:
        raise ValueError(
            f"max_sequences={max_sequences} must be > group_size K={group_size}: with d <= K candidates "
            "the top-K/2 + bottom-K/2 selection keeps every candidate, so no arm would select anything"
        )
    return min(group_size + sequence_step, max_sequences)


def step_time_gpu_s(
    elapsed_s: float, computed_steps: int, num_gpus: float, *, max_elapsed_s: float = 1e6
) -> float | None:
    """t_step in the budget's unit: GPU-seconds per (sequence x computed step).

    ``elapsed_s`` is the wall time a worker took for a batch, ``computed_steps`` the
    sequence-steps it computed (summed over the batch's sequences) and ``num_gpus`` the
    GPUs that worker occupied: 1 for a single-GPU worker, g for a sequence-parallel
    group of g GPUs, in between for a group that re-formed mid-batch (the worker reports
    it as ``protocol.Result.num_gpus``; the coordinator cannot infer it from heartbeats,
    which list every group member as a 1-GPU worker). The result
    ``elapsed_s * num_gpus / computed_steps`` is directly
    comparable with W = T_train * N_spot (N_spot counts GPUs), so a plan that fits W
    fits the GPUs whatever the SP degree. (An SP group is usually faster per
    sequence-step in wall time but not g times faster, so its GPU-seconds are higher
    than a single GPU's; planning on wall time would overrun W by up to the SP degree.)

    Returns:
        The estimate, or None when the observation is unusable: no computed steps, or
        ``elapsed_s`` not in ``(0, max_elapsed_s)`` (clock glitch, nothing measured).

    Raises:
        ValueError: ``num_gpus`` is not a finite number >= 1 (a caller bug, not a measurement).
    """
    if not _is_real(num_gpus) or not math.isfinite(num_gpus) or num_gpus < 1:
        raise ValueError(f"num_gpus must be a finite number >= 1, got {num_gpus!r}")
    if not _is_real(computed_steps) or computed_steps <= 0:
        return None
    if not _is_real(elapsed_s) or not math.isfinite(elapsed_s) or not (0 < elapsed_s < max_elapsed_s):
        return None
    return float(elapsed_s) * num_gpus / computed_steps


class StepTimes:
    """Exponential moving averages of how long denoising steps take, from RESULT messages.

    ``t_step_s``: GPU-seconds per (sequence × computed step) on spot workers, uncached batches
    only (a cached batch also pays for its skipped steps, which the Planner prices by
    ``cost_steps``): the Planner's t_step (:func:`step_time_gpu_s`). ``step_wall_s``: a batch's
    wall seconds per computed step, on any worker (prices ``spot/work_lost_steps``). Both None
    until measured; ``t_step_s`` may start from a profile.
    """

    def __init__(self, t_step_s: float | None = None):
        self.t_step_s = t_step_s
        self.step_wall_s: float | None = None

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.7 * old + 0.3 * new

    def observe(
        self, elapsed_s: float, computed_steps: list[int], num_gpus: float, *, spot: bool, cached: bool
    ) -> None:
        """One batch: ``elapsed_s`` wall seconds, the steps each sequence computed, the GPUs of
        the worker that ran it, whether it was a spot worker and ran with a step cache."""
        if not computed_steps:
            return
        if elapsed_s > 0:
            self.step_wall_s = self._ema(self.step_wall_s, elapsed_s / max(1, max(computed_steps)))
        if not spot or cached:
            return
        est = step_time_gpu_s(elapsed_s, sum(max(1, s) for s in computed_steps), num_gpus)
        if est is not None:
            self.t_step_s = self._ema(self.t_step_s, est)


@dataclass(frozen=True)
class StepOption:
    """One row of the profiled threshold -> effective-steps table (§4.3.1, §6.8).

    cache_threshold: First-Block-Cache threshold (0.0 = no cache = all steps computed).
    effective_steps: mean number of computed denoising steps per sequence at that threshold.
    accuracy: Spearman rank correlation of exploration vs. full-rollout rewards
        (1.0 for threshold 0).
    """

    cache_threshold: float
    effective_steps: float
    accuracy: float
    cost_steps: float | None = None
    """Measured cost of one sequence at this threshold in full-step units (profiled wall
    time ratio × T). A cached step still runs the first block and the embeddings, so
    ``cost_steps >= effective_steps``; None = assume skipped steps are free (the paper's
    ``s·t_step``)."""

    def __post_init__(self) -> None:
        if self.cost_steps is not None and (
            not _is_real(self.cost_steps) or not math.isfinite(self.cost_steps) or self.cost_steps <= 0
        ):
            raise ValueError(f"cost_steps must be a finite number > 0, got {self.cost_steps!r}")
        if not _is_real(self.cache_threshold) or not math.isfinite(self.cache_threshold) or self.cache_threshold < 0:
            raise ValueError(f"cache_threshold must be a finite number >= 0, got {self.cache_threshold!r}")
        if not _is_real(self.effective_steps) or not math.isfinite(self.effective_steps) or self.effective_steps <= 0:
            raise ValueError(f"effective_steps must be a finite number > 0, got {self.effective_steps!r}")
        if not _is_real(self.accuracy) or not (-1.0 <= self.accuracy <= 1.0):
            raise ValueError(f"accuracy must be a rank correlation in [-1, 1], got {self.accuracy!r}")


def costs_full_rollout(option: StepOption, options: Sequence[StepOption]) -> bool:
    """A cached ``option`` that costs at least what the uncached rollout (threshold 0, accuracy
    1) of ``options`` costs per sequence: dominated, never worth exploring with. At a high
    threshold the cache rarely skips a step while every step still pays for the first block's
    residual check, so the measured cost can exceed the full rollout's. Pure."""
    full = [o.cost_steps or o.effective_steps for o in options if o.cache_threshold == 0]
    return bool(full) and option.cache_threshold > 0 and (option.cost_steps or option.effective_steps) >= min(full)


@dataclass(frozen=True)
class Action:
    """A bandit arm a = (d, s) (§4.3.1).

    num_sequences: d, candidate sequences (seeds) per explored prompt.
    effective_steps: s, mean computed denoising steps per sequence.
    cache_threshold: the First-Block-Cache threshold that yields ``s``.
    """

    num_sequences: int
    effective_steps: float
    cache_threshold: float
    cost_steps: float | None = dataclasses.field(default=None, compare=False)
    """Cost of one sequence in full-step units (from :class:`StepOption`); None = ``effective_steps``."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "cost_steps": self.cost_steps,
            "num_sequences": self.num_sequences,
            "effective_steps": self.effective_steps,
            "cache_threshold": self.cache_threshold,
        }


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Planner hyper-parameters.

    max_sequences: upper end of the d grid (32 in §6.8).
    min_sequences: lower end of the d grid. Must be > ``group_size`` when that is given:
        selection keeps the top K/2 and bottom K/2 of d candidates, so d <= K keeps them
        all (no selection, spot time for nothing). :func:`min_selective_sequences` gives
        the usual value K + sequence_step.
    sequence_step: spacing of the d grid ``min, min+step, ..., max`` (max always included).
    min_effective_steps: smallest admissible s (12 in §6.8 for DeepSeek-OCR).
    min_exploration_accuracy: smallest admissible Spearman rho (0.8 in §6.8).
    beta: UCB exploration coefficient (0.5, Appendix B.2).
    window: W_b, sliding window of observations per arm (§4.3.3).
    group_size: K, the rollout group size the selected seeds fill; None = not checked
        (then any d >= 1 is accepted).
    feedback_std_floor: floor on the control groups' mean reward std sigma_unc in the
        feedback ratio, in reward units (ours, see :func:`feedback_ratio`); >= 0, 0 = no floor.
    max_feedback: cap on the feedback ratio (ours, see :func:`feedback_ratio`); >= 1.
    The Planner itself does not apply these two (:meth:`Planner.update` takes any finite
    value); they are here so one config object carries them to :func:`feedback_from_groups`.
    """

    max_sequences: int = 32
    min_sequences: int = 8
    sequence_step: int = 8
    min_effective_steps: float = 1.0
    min_exploration_accuracy: float = 0.8
    beta: float = 0.5
    window: int = 10
    group_size: int | None = None
    feedback_std_floor: float = DEFAULT_FEEDBACK_STD_FLOOR
    max_feedback: float = DEFAULT_MAX_FEEDBACK

    def __post_init__(self) -> None:
        if not _is_int(self.min_sequences) or self.min_sequences < 1:
            raise ValueError(f"min_sequences must be an int >= 1, got {self.min_sequences!r}")
        if not _is_int(self.max_sequences) or self.max_sequences < self.min_sequences:
            raise ValueError(
                f"max_sequences must be an int >= min_sequences ({self.min_sequences}), got {self.max_sequences!r}"
            )
        if not _is_int(self.sequence_step) or self.sequence_step < 1:
            raise ValueError(f"sequence_step must be an int >= 1, got {self.sequence_step!r}")
        if self.group_size is not None:
            if not _is_int(self.group_size) or self.group_size < 1:
                raise ValueError(f"group_size must be an int >= 1 or None, got {self.group_size!r}")
            if self.min_sequences <= self.group_size:
                raise ValueError(
                    f"min_sequences={self.min_sequences} must be > group_size K={self.group_size}: with d <= K "
                    f"candidates the top-K/2 + bottom-K/2 selection keeps every candidate (no selection, spot "
                    f"time for nothing); use min_sequences >= {self.group_size + 1}, e.g. "
                    f"K + sequence_step = {self.group_size + self.sequence_step}"
                )
        _check_feedback_bounds(self.feedback_std_floor, self.max_feedback)
        if (
            not _is_real(self.min_effective_steps)
            or not math.isfinite(self.min_effective_steps)
            or self.min_effective_steps <= 0
        ):
            raise ValueError(f"min_effective_steps must be a finite number > 0, got {self.min_effective_steps!r}")
        if not _is_real(self.min_exploration_accuracy) or not (-1.0 <= self.min_exploration_accuracy <= 1.0):
            raise ValueError(f"min_exploration_accuracy must be in [-1, 1], got {self.min_exploration_accuracy!r}")
        if not _is_real(self.beta) or not math.isfinite(self.beta) or self.beta < 0:
            raise ValueError(f"beta must be a finite number >= 0, got {self.beta!r}")
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")

    def sequence_grid(self) -> list[int]:
        """d values: min_sequences, +sequence_step, ..., max_sequences (inclusive)."""
        grid = list(range(self.min_sequences, self.max_sequences + 1, self.sequence_step))
        if grid[-1] != self.max_sequences:
            grid.append(self.max_sequences)
        return grid


@dataclass(frozen=True)
class PlannerObservation:
    """Inputs measured before an exploration phase (§4.3.1).

    train_time_s: T_train, measured duration of the last model update [s].
    num_spot_gpus: N_spot, live spot GPUs reported by the Instance Manager.
    num_explored_prompts: C, prompts to explore this iteration.
    step_time_s: t_step, GPU-seconds of one denoising step for ONE sequence
        [GPU-s / step / sequence]: the wall time per sequence-step of a worker times
        the GPUs it occupies (:func:`step_time_gpu_s`; a single-GPU profile's wall time
        is already in this unit).
    """

    train_time_s: float
    num_spot_gpus: int
    num_explored_prompts: int
    step_time_s: float

    def __post_init__(self) -> None:
        if not _is_real(self.train_time_s) or not math.isfinite(self.train_time_s) or self.train_time_s < 0:
            raise ValueError(f"train_time_s must be a finite number >= 0, got {self.train_time_s!r}")
        if not _is_int(self.num_spot_gpus) or self.num_spot_gpus < 0:
            raise ValueError(f"num_spot_gpus must be an int >= 0, got {self.num_spot_gpus!r}")
        if not _is_int(self.num_explored_prompts) or self.num_explored_prompts < 0:
            raise ValueError(f"num_explored_prompts must be an int >= 0, got {self.num_explored_prompts!r}")
        if not _is_real(self.step_time_s) or not math.isfinite(self.step_time_s) or self.step_time_s <= 0:
            raise ValueError(f"step_time_s must be a finite number > 0, got {self.step_time_s!r}")

    @property
    def budget_s(self) -> float:
        """W = T_train * N_spot [GPU-seconds] (§4.3.1)."""
        return float(self.train_time_s) * self.num_spot_gpus


@dataclass(frozen=True)
class ArmScore:
    """One eligible arm's score: planned cost [GPU-s], UCB (inf if unseen), window mean, n_i."""

    action: Action
    planned_cost_s: float
    ucb: float
    mean: float | None
    n: int

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.action.to_dict(),
            "planned_cost_s": self.planned_cost_s,
            "ucb": "inf" if math.isinf(self.ucb) else self.ucb,
            "mean": self.mean,
            "n": self.n,
        }


def selection_key(score: ArmScore) -> tuple[float, float, float, int]:
    """Sort key, best first: highest UCB, then lower planned cost, fewer
    effective steps, fewer sequences (§4.3.3)."""
    return (-score.ucb, score.planned_cost_s, score.action.effective_steps, score.action.num_sequences)


@dataclass(frozen=True)
class Plan:
    """The Planner's decision for one exploration phase.

    action: the chosen arm, or None to explore nothing this iteration (``reason`` says why).
    budget_s: W = T_train * N_spot [GPU-seconds].
    eligible: every eligible arm with its score, in selection order (best first).
    rejected_steps: step options refused for accuracy or minimum effective steps.
    """

    action: Action | None
    budget_s: float
    eligible: list[ArmScore]
    rejected_steps: list[StepOption]
    reason: str
    cheapest_s: float | None = None  # T_plan of the cheapest arm when none fits W

    def to_log(self) -> dict[str, Any]:
        """JSON-able record for metrics.jsonl (``inf`` UCB written as ``"inf"``)."""
        return {
            "action": None if self.action is None else self.action.to_dict(),
            "budget_s": self.budget_s,
            "reason": self.reason,
            **({"cheapest_s": self.cheapest_s} if self.cheapest_s is not None else {}),
            "eligible": [s.to_dict() for s in self.eligible],
            "rejected_steps": [
                {"cache_threshold": o.cache_threshold, "effective_steps": o.effective_steps, "accuracy": o.accuracy}
                for o in self.rejected_steps
            ],
        }


def no_fit_message(plan_log: dict[str, Any], *, streams: bool) -> str:
    """For a user: a plan that explores nothing because no arm fits the window W (what it
    means and what happens), from :meth:`Plan.to_log`. ``streams``: the spot GPUs stream
    the cheapest arm's candidates anyway (``explore.stream_extra`` and spot GPUs present)."""
    cheapest = plan_log.get("cheapest_s")
    if cheapest is None:  # C = 0, or an older log: the Planner's own words
        return f"no exploration this iteration: {plan_log.get('reason', '')}"
    what = (
        f"no exploration arm fits this iteration's training window (the cheapest needs "
        f"{cheapest:.1f} GPU-s, the spot GPUs have {plan_log['budget_s']:.1f} GPU-s while training runs)"
    )
    if streams:
        return f"{what}: spot GPUs stream the cheapest arm's candidates instead (nothing waits for them)"
    return f"{what}: the next batch is not explored (its rollouts use default seeds)"


@dataclass
class _Arm:
    count: int = 0  # N_i: total times this arm was played (with or without feedback)
    window: deque = field(default_factory=deque)  # last W_b plays: feedback value, or None = no feedback


class Planner:
    """UCB bandit over (d, s) restricted to the actions that fit the window (§4.3)."""

    def __init__(self, config: PlannerConfig, step_options: Sequence[StepOption], rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self.rejected_steps: list[StepOption] = []
        # Options with the same effective_steps as a better one (higher accuracy,
        # then lower threshold) would create indistinguishable arms; keep one. A cached option
        # that costs as much as the uncached rollout is shadowed by it.
        self.shadowed_steps: list[StepOption] = []
        kept: dict[float, StepOption] = {}
        for opt in step_options:
            if opt.accuracy < config.min_exploration_accuracy or opt.effective_steps < config.min_effective_steps:
                self.rejected_steps.append(opt)
                continue
            if costs_full_rollout(opt, step_options):
                self.shadowed_steps.append(opt)
                continue
            prev = kept.get(opt.effective_steps)
            if prev is None:
                kept[opt.effective_steps] = opt
            elif (-opt.accuracy, opt.cache_threshold) < (-prev.accuracy, prev.cache_threshold):
                self.shadowed_steps.append(prev)
                kept[opt.effective_steps] = opt
            else:
                self.shadowed_steps.append(opt)
        if not kept:
            raise ValueError(
                f"all {len(self.rejected_steps)} step options refused: none has accuracy >= "
                f"min_exploration_accuracy={config.min_exploration_accuracy} and effective_steps >= "
                f"min_effective_steps={config.min_effective_steps}"
            )
        self.step_options: list[StepOption] = sorted(kept.values(), key=lambda o: o.effective_steps)
        self._actions = [
            Action(d, o.effective_steps, o.cache_threshold, o.cost_steps)
            for o in self.step_options
            for d in config.sequence_grid()
        ]
        self._arms: dict[Action, _Arm] = {a: _Arm(window=deque(maxlen=config.window)) for a in self._actions}
        self.total_updates = 0  # N
        self.num_ignored_feedback = 0

    @property
    def actions(self) -> list[Action]:
        """The full d x s grid (before the budget filter)."""
        return list(self._actions)

    @staticmethod
    def planned_cost_s(action: Action, obs: PlannerObservation) -> float:
        """T_plan(a) = d * C * s * t_step [GPU-seconds] (§4.3.1)."""
        steps = action.cost_steps if action.cost_steps is not None else action.effective_steps
        return action.num_sequences * obs.num_explored_prompts * steps * obs.step_time_s

    def _score(self, action: Action, cost: float) -> ArmScore:
        arm = self._arms[action]
        n = len(arm.window)
        if n == 0:
            return ArmScore(action, cost, math.inf, None, 0)
        values = [x for x in arm.window if x is not None]
        mean = sum(values) / len(values) if values else NEUTRAL_FEEDBACK
        ucb = mean + self.config.beta * math.sqrt(math.log(self.total_updates + 1) / n)
        return ArmScore(action, cost, ucb, mean, n)

    def plan(self, obs: PlannerObservation) -> Plan:
        """Choose the exploration action for this iteration (§4.3.1, §4.3.3).

        Never returns an action whose T_plan exceeds W; returns ``action=None``
        when nothing fits or when there is nothing to explore (C = 0).
        """
        budget = obs.budget_s
        if obs.num_explored_prompts == 0:
            return Plan(None, budget, [], list(self.rejected_steps), "no prompts to explore (C=0)")
        costs = {a: self.planned_cost_s(a, obs) for a in self._actions}
        eligible = [self._score(a, c) for a, c in costs.items() if c <= budget]
        if not eligible:
            cheapest = min(costs.values())
            return Plan(
                None,
                budget,
                [],
                list(self.rejected_steps),
                f"no action fits: cheapest T_plan={cheapest:.3f}s > W={budget:.3f}s",
                cheapest,
            )
        eligible.sort(key=selection_key)
        top = [s for s in eligible if selection_key(s) == selection_key(eligible[0])]
        if len(top) > 1:  # exact tie on every criterion: cannot happen for distinct arms, kept injectable
            pick = self._rng.choice(top)
            eligible.remove(pick)
            eligible.insert(0, pick)
        best = eligible[0]
        ucb = "inf (unseen)" if math.isinf(best.ucb) else f"{best.ucb:.4f}"
        reason = (
            f"argmax UCB={ucb} among {len(eligible)} eligible of {len(self._actions)}; "
            f"T_plan={best.planned_cost_s:.3f}s <= W={budget:.3f}s"
        )
        return Plan(best.action, budget, eligible, list(self.rejected_steps), reason)

    def update(self, action: Action, feedback: float | None) -> None:
        """Record one play of ``action`` with its bandit feedback r (§4.3.2).

        Call it once per iteration whose seeds ``action`` chose, whether or not feedback
        could be computed. Non-finite or None feedback (no control group, no fully
        explored group, see :func:`feedback_from_groups`) is a play WITHOUT a value: it
        counts in N_i, N and the arm's window (so n_i grows and the UCB bonus shrinks),
        but not in the window mean; an arm whose window holds no value at all scores
        ``NEUTRAL_FEEDBACK`` (ratio 1 = no amplification). Such plays are also counted
        in ``num_ignored_feedback``. Ignoring them instead would leave the planner's state
        unchanged, so it would pick the same arm again, forever, while feedback stays
        unavailable (e.g. an unseen arm at UCB = +inf).
        """
        if action not in self._arms:
            raise ValueError(f"unknown action {action!r}: not in the planner's action grid")
        arm = self._arms[action]
        if feedback is None or not _is_real(feedback) or not math.isfinite(feedback):
            self.num_ignored_feedback += 1
            value = None
        else:
            value = float(feedback)
        arm.count += 1
        arm.window.append(value)
        self.total_updates += 1

    def feedback(
        self, rewards_by_slot: dict[int, Sequence[float]], explored_slots: set[int], control_slots: set[int]
    ) -> float:
        """:func:`feedback_from_groups` with this planner's ``feedback_std_floor`` and ``max_feedback``."""
        return feedback_from_groups(
            rewards_by_slot,
            explored_slots,
            control_slots,
            std_floor=self.config.feedback_std_floor,
            max_feedback=self.config.max_feedback,
        )

    def arm_stats(self, action: Action) -> tuple[int, list[float | None]]:
        """(N_i plays, current window; None = a play without feedback) of one arm."""
        arm = self._arms[action]
        return arm.count, list(arm.window)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able bandit state (arm plays and windows -- None for a play without
        feedback --, counters, rng state) for resuming."""
        version, internal, gauss = self._rng.getstate()
        return {
            "version": _STATE_VERSION,
            "total_updates": self.total_updates,
            "num_ignored_feedback": self.num_ignored_feedback,
            "arms": [
                {**a.to_dict(), "count": arm.count, "window": list(arm.window)}
                for a, arm in self._arms.items()
                if arm.count
            ],
            "rng_state": [version, list(internal), gauss],
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (version 2, or version 1: windows of values
        only, counts of feedback). Arms not in the current grid raise ValueError."""
        if d.get("version") not in (1, _STATE_VERSION):
            raise ValueError(f"unsupported planner state version {d.get('version')!r}")
        arms = {a: _Arm(window=deque(maxlen=self.config.window)) for a in self._actions}
        for rec in d["arms"]:
            a = Action(int(rec["num_sequences"]), float(rec["effective_steps"]), float(rec["cache_threshold"]))
            if a not in arms:
                raise ValueError(f"state has arm {a!r} that is not in the planner's action grid")
            arms[a].count = int(rec["count"])
            arms[a].window.extend(None if x is None else float(x) for x in rec["window"])
        self._arms = arms
        self.total_updates = int(d["total_updates"])
        self.num_ignored_feedback = int(d["num_ignored_feedback"])
        if d.get("rng_state") is not None:
            version, internal, gauss = d["rng_state"]
            self._rng.setstate((version, tuple(internal), gauss))


def feedback_ratio(
    explored_group_stds: Sequence[float],
    control_group_stds: Sequence[float],
    *,
    std_floor: float = DEFAULT_FEEDBACK_STD_FLOOR,
    max_feedback: float = DEFAULT_MAX_FEEDBACK,
) -> float:
    """Bandit feedback r = sigma_all / sigma_unc (§4.3.2), bounded.

    sigma_all is the mean per-prompt reward std over ALL groups (explored and
    control); sigma_unc the mean over the control (unexplored) groups.

    The paper's ratio is kept; the bounds are ours. With few control groups (4 in the
    paper) and 0/1-like rewards, every control group is sometimes constant, so
    sigma_unc is ~0: one iteration then yields a ratio of 10^5 and more, which dominates
    its arm's window mean for all W_b iterations and pins the bandit on that arm. So:

    * the denominator is ``max(sigma_unc, std_floor)``, in reward units. The default
      0.02 is 2 % of a reward range of [0, 1]: below it the control groups carry no
      measurable variance. Scale it with the reward range (it only matters when the
      control groups are nearly constant).
    * the ratio is capped at ``max_feedback`` (default 5). Selecting the top and bottom
      K/2 of d candidates raises a group's std by a factor of about 1.2-1.7 for d up to
      4K (order statistics of a normal), and sigma_all also averages in the control
      groups, so real ratios stay well below 5; the cap only bounds outliers. It
      bounds one iteration's pull on its arm's window mean to (cap - mu) / W_b. In a
      simulation (tests/unit/core/test_planner.py,
      test_degenerate_control_iteration_does_not_pin_its_arm) a single degenerate
      iteration kept a worse arm chosen for the 10 next iterations unbounded, 7 with a
      cap of 10, 3 with 5.

    Returns ``math.nan`` -- no evidence; :meth:`Planner.update` records a play without
    feedback -- when there are no control groups, a std is not finite, every group is
    constant (sigma_all == 0: nothing could show variance, neither the action nor the
    baseline), or sigma_unc == 0 with ``std_floor == 0``.
    """
    _check_feedback_bounds(std_floor, max_feedback)
    explored = [float(x) for x in explored_group_stds]
    control = [float(x) for x in control_group_stds]
    if any(x < 0 for x in explored + control):
        raise ValueError("reward standard deviations must be >= 0")
    if not control or not all(math.isfinite(x) for x in explored + control):
        return math.nan
    sigma_unc = max(sum(control) / len(control), std_floor)
    sigma_all = (sum(explored) + sum(control)) / (len(explored) + len(control))
    if sigma_unc == 0 or sigma_all == 0:
        return math.nan
    return min(sigma_all / sigma_unc, max_feedback)


def _pstd(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's default ``ddof=0``)."""
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def feedback_from_groups(
    rewards_by_slot: dict[int, Sequence[float]],
    explored_slots: set[int] | frozenset[int],
    control_slots: set[int] | frozenset[int],
    *,
    std_floor: float = DEFAULT_FEEDBACK_STD_FLOOR,
    max_feedback: float = DEFAULT_MAX_FEEDBACK,
) -> float:
    """The bandit feedback of one iteration from its rollout rewards per prompt slot.

    Args:
        rewards_by_slot: slot -> rewards of that prompt group's rollout samples
            (non-finite rewards are dropped; a group with no finite reward is skipped).
        explored_slots: slots whose seeds really came from exploration with the played
            action: at least d candidates with finite rewards were scored for them
            (:meth:`spotlight.core.seed_bank.SeedBank.explored_slots`). A slot whose
            exploration was cancelled or partial is NOT explored.
        control_slots: the unexplored control groups (default seeds by design).
        std_floor, max_feedback: bounds of :func:`feedback_ratio`.

    Groups in neither set (partly explored) are excluded: they are neither the arm's
    result nor the baseline. sigma_g is the population std of a group's rewards.

    Returns:
        :func:`feedback_ratio` over the explored and control groups' stds, or ``math.nan``
        when there is no explored group or no control group (no evidence about the arm;
        :meth:`Planner.update` records it as a play without feedback).

    Raises:
        ValueError: a slot is both explored and control.
    """
    both = set(explored_slots) & set(control_slots)
    if both:
        raise ValueError(f"slots {sorted(both)} are both explored and control")
    explored, control = [], []
    for slot, rewards in rewards_by_slot.items():
        finite = [float(r) for r in rewards if r is not None and math.isfinite(r)]
        if not finite:
            continue
        if slot in control_slots:
            control.append(_pstd(finite))
        elif slot in explored_slots:
            explored.append(_pstd(finite))
    if not explored or not control:
        return math.nan
    return feedback_ratio(explored, control, std_floor=std_floor, max_feedback=max_feedback)
