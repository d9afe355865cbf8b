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

Among eligible actions the Planner maximises a sliding-window UCB (§4.3.3)::

    UCB(a_i) = mu_i + beta * sqrt(ln(N + 1) / n_i),   n_i = min(N_i, W_b)

with ``UCB = +inf`` for unseen arms, ties broken by lower planned cost, then
fewer effective steps, then fewer sequences.  The bandit feedback is the
variance-amplification ratio of §4.3.2, see :func:`feedback_ratio`.

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
    "feedback_ratio",
    "selection_key",
]

_STATE_VERSION = 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
        if self.cost_steps is not None and (not _is_real(self.cost_steps) or not math.isfinite(self.cost_steps) or self.cost_steps <= 0):
            raise ValueError(f"cost_steps must be a finite number > 0, got {self.cost_steps!r}")
        if not _is_real(self.cache_threshold) or not math.isfinite(self.cache_threshold) or self.cache_threshold < 0:
            raise ValueError(f"cache_threshold must be a finite number >= 0, got {self.cache_threshold!r}")
        if not _is_real(self.effective_steps) or not math.isfinite(self.effective_steps) or self.effective_steps <= 0:
            raise ValueError(f"effective_steps must be a finite number > 0, got {self.effective_steps!r}")
        if not _is_real(self.accuracy) or not (-1.0 <= self.accuracy <= 1.0):
            raise ValueError(f"accuracy must be a rank correlation in [-1, 1], got {self.accuracy!r}")


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
    min_sequences: lower end of the d grid; usually the rollout group size K.
    sequence_step: spacing of the d grid ``min, min+step, ..., max`` (max always included).
    min_effective_steps: smallest admissible s (12 in §6.8 for DeepSeek-OCR).
    min_exploration_accuracy: smallest admissible Spearman rho (0.8 in §6.8).
    beta: UCB exploration coefficient (0.5, Appendix B.2).
    window: W_b, sliding window of observations per arm (§4.3.3).
    """

    max_sequences: int = 32
    min_sequences: int = 8
    sequence_step: int = 8
    min_effective_steps: float = 1.0
    min_exploration_accuracy: float = 0.8
    beta: float = 0.5
    window: int = 10

    def __post_init__(self) -> None:
        if not _is_int(self.min_sequences) or self.min_sequences < 1:
            raise ValueError(f"min_sequences must be an int >= 1, got {self.min_sequences!r}")
        if not _is_int(self.max_sequences) or self.max_sequences < self.min_sequences:
            raise ValueError(
                f"max_sequences must be an int >= min_sequences ({self.min_sequences}), got {self.max_sequences!r}"
            )
        if not _is_int(self.sequence_step) or self.sequence_step < 1:
            raise ValueError(f"sequence_step must be an int >= 1, got {self.sequence_step!r}")
        if (
            not _is_real(self.min_effective_steps)
            or not math.isfinite(self.min_effective_steps)
            or self.min_effective_steps <= 0
        ):
            raise ValueError(f"min_effective_steps must be a finite number > 0, got {self.min_effective_steps!r}")
        if not _is_real(self.min_exploration_accuracy) or not (-1.0 <= self.min_exploration_accuracy <= 1.0):
            raise ValueError(
                f"min_exploration_accuracy must be in [-1, 1], got {self.min_exploration_accuracy!r}"
            )
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
    step_time_s: t_step, profiled latency of one denoising step for ONE sequence
        on one GPU [s / step / sequence].
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

    def to_log(self) -> dict[str, Any]:
        """JSON-able record for metrics.jsonl (``inf`` UCB written as ``"inf"``)."""
        return {
            "action": None if self.action is None else self.action.to_dict(),
            "budget_s": self.budget_s,
            "reason": self.reason,
            "eligible": [s.to_dict() for s in self.eligible],
            "rejected_steps": [
                {"cache_threshold": o.cache_threshold, "effective_steps": o.effective_steps, "accuracy": o.accuracy}
                for o in self.rejected_steps
            ],
        }


@dataclass
class _Arm:
    count: int = 0  # N_i: total times this arm received feedback
    window: deque = field(default_factory=deque)  # last W_b feedback values


class Planner:
    """UCB bandit over (d, s) restricted to the actions that fit the window (§4.3)."""

    def __init__(self, config: PlannerConfig, step_options: Sequence[StepOption], rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self.rejected_steps: list[StepOption] = []
        # Options with the same effective_steps as a better one (higher accuracy,
        # then lower threshold) would create indistinguishable arms; keep one.
        self.shadowed_steps: list[StepOption] = []
        kept: dict[float, StepOption] = {}
        for opt in step_options:
            if opt.accuracy < config.min_exploration_accuracy or opt.effective_steps < config.min_effective_steps:
                self.rejected_steps.append(opt)
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
        mean = sum(arm.window) / n
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

    def update(self, action: Action, feedback: float) -> None:
        """Record bandit feedback r (§4.3.2) for ``action``.

        Non-finite feedback (e.g. from :func:`feedback_ratio` with no control
        groups) is ignored and counted in ``num_ignored_feedback``.
        """
        if action not in self._arms:
            raise ValueError(f"unknown action {action!r}: not in the planner's action grid")
        if not _is_real(feedback) or not math.isfinite(feedback):
            self.num_ignored_feedback += 1
            return
        arm = self._arms[action]
        arm.count += 1
        arm.window.append(float(feedback))
        self.total_updates += 1

    def arm_stats(self, action: Action) -> tuple[int, list[float]]:
        """(N_i, current window) of one arm."""
        arm = self._arms[action]
        return arm.count, list(arm.window)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able bandit state (arm windows, counters, rng state) for resuming."""
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
        """Restore :meth:`state_dict` output. Arms not in the current grid raise ValueError."""
        if d.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported planner state version {d.get('version')!r}")
        arms = {a: _Arm(window=deque(maxlen=self.config.window)) for a in self._actions}
        for rec in d["arms"]:
            a = Action(int(rec["num_sequences"]), float(rec["effective_steps"]), float(rec["cache_threshold"]))
            if a not in arms:
                raise ValueError(f"state has arm {a!r} that is not in the planner's action grid")
            arms[a].count = int(rec["count"])
            arms[a].window.extend(float(x) for x in rec["window"])
        self._arms = arms
        self.total_updates = int(d["total_updates"])
        self.num_ignored_feedback = int(d["num_ignored_feedback"])
        if d.get("rng_state") is not None:
            version, internal, gauss = d["rng_state"]
            self._rng.setstate((version, tuple(internal), gauss))


def feedback_ratio(explored_group_stds: Sequence[float], control_group_stds: Sequence[float]) -> float:
    """Bandit feedback r = sigma_all / sigma_unc (§4.3.2).

    sigma_all is the mean per-prompt reward std over ALL groups (explored and
    control); sigma_unc the mean over the control (unexplored) groups.
    Returns ``math.nan`` when there are no control groups or sigma_unc == 0;
    the caller must then skip the update (``Planner.update`` ignores nan).
    """
    explored = [float(x) for x in explored_group_stds]
    control = [float(x) for x in control_group_stds]
    if any(x < 0 for x in explored + control):
        raise ValueError("reward standard deviations must be >= 0")
    if not control:
        return math.nan
    sigma_unc = sum(control) / len(control)
    if sigma_unc == 0 or not math.isfinite(sigma_unc):
        return math.nan
    sigma_all = (sum(explored) + sum(control)) / (len(explored) + len(control))
    return sigma_all / sigma_unc
