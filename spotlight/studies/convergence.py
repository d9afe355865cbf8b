"""Convergence statistics (paper §6.2–6.3, Fig. 10): how many iterations, and how much wall
time, a run needs until its held-out score reaches a target, with bootstrap confidence
intervals over run seeds. ``benchmarks/convergence.py`` runs the modes and calls these.

The score of an iteration is the run's own held-out evaluation (docs/evaluation.md): the
``eval/*`` scores the coordinator writes to ``eval.jsonl`` for the weights an iteration
trained, on a fixed panel of test prompts and seeds sampled with the ODE. Every mode has it
(``verl-omni-spot`` has no control prompts, so no ``reward/control_mean``), and the seed bank
cannot bias it: the panel's seeds are fixed and never explored.

Definitions (the same for every mode):

* **curve** of a run: its evaluated iterations (1-based: ``eval.jsonl``'s 0-based
  ``iteration`` + 1; ``iteration = -1`` is the base model, kept apart) and their scores;
* **moving average**: the mean of ``k`` consecutive evaluated points; the window ending at
  evaluated iteration ``i`` is credited to ``i``;
* **saturated score** of a mode: the best ``k``-point moving average of its seed-mean curve;
  the **target** is the lowest saturated score among the modes (paper §6.2);
* **iterations to target** of a run: the first iteration whose window's mean is at or above
  the target; a run that never gets there is **censored** at ``iterations run + 1`` (and its
  wall time at the whole run's plus one mean iteration): a lower bound, counted so that a mode
  whose runs fail is not flattered by averaging only its lucky ones;
* **learned**: a mode learned when, at the window where its seed-mean curve is best, its runs'
  gain over the base model's score is at least ``z`` (2) standard errors over runs above 0; the
  target must also be that far above the base score. A mode that did not learn reaches a
  target only by noise, and "iterations to target" then counts how soon its noise touched the
  target: no convergence comparison can be read from it;
* **confidence interval**: the percentile bootstrap of the mean over runs (fixed generator
  seed, so a summary is reproducible); the ratio of two modes' means resamples each mode's
  runs independently.

Pure: numpy only, no I/O, no clocks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import numpy as np

SCORE_KEYS = ("eval/partial", "eval/strict", "eval/score")
"""Held-out scores a curve can use: partial credit, GenEval's strict verdict (both shapes task
only) and the run's reward on the panel (every task)."""

RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Curve:
    """A run's held-out scores: ``iterations`` (1-based, increasing) and their ``scores``;
    ``base`` is the base model's score (None when it was not evaluated)."""

    iterations: tuple[int, ...]
    scores: tuple[float, ...]
    base: float | None = None


@dataclasses.dataclass(frozen=True)
class CI:
    """A mean and its confidence interval ``[low, high]`` (NaN for no values)."""

    mean: float
    low: float
    high: float
    n: int

    def overlaps(self, other: CI) -> bool:
        return self.low <= other.high and other.low <= self.high

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in dataclasses.asdict(self).items()}

    def format(self, fmt: str = "%.2f", scale: float = 1.0) -> str:
        """``"m [lo, hi]"`` (``"—"`` without values)."""
        if self.n == 0 or math.isnan(self.mean):
            return "—"
        m, lo, hi = (fmt % (v * scale) for v in (self.mean, self.low, self.high))
        return m if lo == hi == m else f"{m} [{lo}, {hi}]"


def format_ci(d: Mapping | None, fmt: str = "%.2f", scale: float = 1.0) -> str:
    """:meth:`CI.format` of a :meth:`CI.to_json` dict as a summary stores it (``"—"`` for None,
    no values or a null mean)."""
    if not d or d.get("n", 0) == 0 or d.get("mean") is None:
        return "—"
    return CI(d["mean"], d["low"], d["high"], d["n"]).format(fmt, scale)


def heldout_curve(eval_rows: Iterable[Mapping], key: str = "eval/partial") -> Curve:
    """The curve of a run from its ``eval.jsonl`` rows (``{"iteration", "version", "eval/…"}``):
    one point per evaluated iteration (a resumed run may have evaluated one twice: the last row
    counts), the base model (``iteration = -1``) as ``base``.

    Raises:
        ValueError: a row that is not an object with ``iteration``, a row without ``key`` (a
            score this task does not have, e.g. ``eval/strict`` outside the shapes task), or a
            score that is not a finite number.
    """
    by_iteration: dict[int, float] = {}
    for row in eval_rows:
        if not isinstance(row, Mapping) or "iteration" not in row:
            raise ValueError(f"evaluation row without 'iteration': {str(row)[:120]}")
        if key not in row:
            have = sorted(k for k in row if k in SCORE_KEYS)
            raise ValueError(f"evaluation of iteration {row['iteration']} has no {key!r} (it has {have})")
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"evaluation of iteration {row['iteration']}: {key} is {value!r}, not a number")
        by_iteration[int(row["iteration"])] = float(value)
    base = by_iteration.pop(-1, None)
    its = sorted(i for i in by_iteration if i >= 0)
    return Curve(tuple(i + 1 for i in its), tuple(by_iteration[i] for i in its), base)


def moving_average(x: Sequence[float], k: int) -> np.ndarray:
    """Means of the ``len(x) - k + 1`` windows of ``k`` consecutive values (empty when ``x`` is
    shorter than ``k``).

    Raises:
        ValueError: ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"moving-average window must be >= 1, got {k}")
    x = np.asarray(x, dtype=np.float64)
    if len(x) < k:
        return np.zeros(0)
    return np.convolve(x, np.ones(k) / k, mode="valid")


def iterations_to_target(curve: Curve, target: float, k: int) -> int | None:
    """The first iteration whose ``k``-point window (ending there) averages at least
    ``target``, or None if none does."""
    ma = moving_average(curve.scores, k)
    hit = np.nonzero(ma >= target - 1e-12)[0]
    return int(curve.iterations[hit[0] + k - 1]) if hit.size else None


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The seed-mean curve: the mean score at every iteration all ``curves`` evaluated.

    Raises:
        ValueError: no curves.
    """
    if not curves:
        raise ValueError("no curves to average")
    common = sorted(set.intersection(*(set(c.iterations) for c in curves)))
    scores = [float(np.mean([c.scores[c.iterations.index(i)] for c in curves])) for i in common]
    bases = [c.base for c in curves if c.base is not None]
    return Curve(tuple(common), tuple(scores), float(np.mean(bases)) if bases else None)


def saturated_score(curves: Sequence[Curve], k: int) -> float:
    """The best ``k``-point moving average of the seed-mean curve.

    Raises:
        ValueError: the seed-mean curve has fewer than ``k`` points.
    """
    ma = moving_average(mean_curve(curves).scores, k)
    if not ma.size:
        raise ValueError(f"a {k}-point moving average needs at least {k} evaluated iterations common to every run")
    return float(ma.max())


def target_score(curves_by_mode: Mapping[str, Sequence[Curve]], k: int) -> tuple[float, dict[str, float]]:
    """``(target, {mode: saturated score})``: the target is the lowest saturated score among
    the modes, so every mode's seed-mean curve reaches it (paper §6.2)."""
    sat = {m: saturated_score(c, k) for m, c in curves_by_mode.items()}
    if not sat:
        raise ValueError("no modes to take a target from")
    return min(sat.values()), sat


def mode_learning(curves: Sequence[Curve], k: int, *, z: float = 2.0) -> dict:
    """Did one mode's runs raise the held-out score above the base model's (module docstring,
    "learned")? At the ``k``-point window where the mode's seed-mean curve is best (its
    saturated score), each run's own window mean minus its base score is that run's gain; the
    mode learned when the mean gain is at least ``z`` standard errors (spread over runs / √n)
    above 0. The window is picked after looking, so this errs towards "learned".

    Returns ``{"gain", "se", "n", "learned"}``; ``learned`` (and ``gain``/``se``) None with
    fewer than 2 runs, a run without a base evaluation, or fewer than ``k`` common points.
    """
    out = {"gain": None, "se": None, "n": len(curves), "learned": None}
    if len(curves) < 2 or any(c.base is None for c in curves):
        return out
    common = sorted(set.intersection(*(set(c.iterations) for c in curves)))
    ma = moving_average(mean_curve(curves).scores, k)
    if not ma.size:
        return out
    window = common[int(np.argmax(ma)) : int(np.argmax(ma)) + k]
    gains = np.array([np.mean([c.scores[c.iterations.index(i)] for i in window]) - c.base for c in curves])
    gain, se = float(gains.mean()), float(gains.std(ddof=1) / math.sqrt(len(gains)))
    # scores live in [0, 1]: a gain below 1e-6 is rounding, whatever its standard error
    return {"gain": gain, "se": se, "n": len(curves), "learned": bool(gain > 1e-6 and gain >= z * se)}


def learning_check(curves_by_mode: Mapping[str, Sequence[Curve]], target: float, k: int, *, z: float = 2.0) -> dict:
    """:func:`mode_learning` of every mode, and whether ``target`` is above the base model's
    score by at least ``z`` times the largest of their standard errors (a target within noise
    of the base is "reached" by noise alone).

    Returns ``{"base", "z", "modes": {mode: mode_learning}, "target_gain", "target_ok"}``;
    ``target_ok`` None when a mode's standard error is unknown or no run has a base score.
    """
    bases = [c.base for cs in curves_by_mode.values() for c in cs if c.base is not None]
    modes = {m: mode_learning(cs, k, z=z) for m, cs in curves_by_mode.items()}
    base = float(np.mean(bases)) if bases else None
    ses = [r["se"] for r in modes.values()]
    if base is None or any(se is None for se in ses) or not ses:
        return {"base": base, "z": z, "modes": modes, "target_gain": None, "target_ok": None}
    gain = float(target) - base
    target_ok = bool(gain >= z * max(ses) and gain > 1e-6)
    return {"base": base, "z": z, "modes": modes, "target_gain": gain, "target_ok": target_ok}


def common_window(curves: Iterable[Curve], k: int) -> int:
    """``k``, or fewer when some run evaluated fewer iterations (at least 1): the one window
    every run's curve can use, so every mode is measured with the same window."""
    shortest = min((len(c.scores) for c in curves), default=0)
    if shortest < 1:
        raise ValueError("a run has no evaluated iteration (eval.every = 0, or its evaluations failed)")
    return max(1, min(k, shortest))


def bootstrap_mean_ci(
    values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED, level: float = LEVEL
) -> CI:
    """The mean of ``values`` and its percentile-bootstrap confidence interval at ``level``
    (``resamples`` resamples with replacement, generator seeded with ``seed``). Identical values
    give a point; no values give NaNs."""
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return CI(math.nan, math.nan, math.nan, 0)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    lo, hi = _percentiles(means, level)
    return CI(float(x.mean()), lo, hi, int(x.size))


def bootstrap_ratio_ci(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = LEVEL,
) -> CI:
    """``mean(numerator) / mean(denominator)`` and its percentile-bootstrap interval, each
    side's runs resampled independently (``n`` = the smaller side's size).

    Raises:
        ValueError: an empty side, or a denominator value that is not > 0.
    """
    a = np.asarray(list(numerator), dtype=np.float64)
    b = np.asarray(list(denominator), dtype=np.float64)
    if a.size == 0 or b.size == 0:
        raise ValueError("a ratio needs values on both sides")
    if not (b > 0).all():
        raise ValueError(f"the denominator's values must be > 0, got {b.tolist()}")
    rng = np.random.default_rng(seed)
    num = a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
    den = b[rng.integers(0, b.size, size=(resamples, b.size))].mean(axis=1)
    lo, hi = _percentiles(num / den, level)
    return CI(float(a.mean() / b.mean()), lo, hi, int(min(a.size, b.size)))


def _percentiles(x: np.ndarray, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    lo, hi = np.percentile(x, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """One run measured against the target. ``iterations_to_target`` / ``wall_s_to_target`` /
    ``cost_usd_to_target`` are None when it never reached it; ``iterations_censored``,
    ``wall_s_censored`` and (when the run bills) ``cost_usd_censored`` always have a value (see
    :func:`run_outcome`)."""

    reached: bool
    iterations_to_target: int | None
    iterations_censored: int
    wall_s_to_target: float | None
    wall_s_censored: float
    cost_usd_to_target: float | None
    cost_usd_censored: float | None
    critical_path_share: float
    mean_iteration_s: float
    iterations_run: int


def run_outcome(metrics_rows: Sequence[Mapping], curve: Curve, target: float, k: int) -> RunOutcome:
    """A run's time to ``target`` from its ``metrics.jsonl`` rows (one per iteration, in order:
    ``time/iteration_s``, ``time/explore_critical_path_s``, cumulative ``cost/usd``) and its curve.

    Wall time to target = the summed ``time/iteration_s`` of iterations 1..n. A run that never
    reaches the target is censored at ``iterations run + 1`` iterations and its whole wall time
    (and cumulative ``cost/usd``) plus one mean iteration's. Critical-path share = summed
    ``time/explore_critical_path_s`` over summed ``time/iteration_s`` of the whole run.

    Raises:
        ValueError: no metrics rows.
    """
    if not metrics_rows:
        raise ValueError("the run has no metrics rows")
    t_iter = np.array([float(r.get("time/iteration_s", 0.0)) for r in metrics_rows])
    crit = np.array([float(r.get("time/explore_critical_path_s", 0.0)) for r in metrics_rows])
    total = float(t_iter.sum())
    n_run = len(metrics_rows)
    mean_it = total / n_run
    n = iterations_to_target(curve, target, k)
    if n is not None and n > n_run:  # an evaluation of an iteration the metrics do not have
        raise ValueError(f"iteration {n} was evaluated but the run has {n_run} metrics rows")
    wall = float(t_iter[:n].sum()) if n is not None else None
    cost = metrics_rows[n - 1].get("cost/usd") if n is not None else None
    last_cost = metrics_rows[-1].get("cost/usd")
    billed = isinstance(last_cost, (int, float)) and not isinstance(last_cost, bool)
    if n is not None:
        cost_censored = float(cost) if isinstance(cost, (int, float)) else None
    else:
        cost_censored = float(last_cost) * (n_run + 1) / n_run if billed else None
    return RunOutcome(
        reached=n is not None,
        iterations_to_target=n,
        iterations_censored=n if n is not None else n_run + 1,
        wall_s_to_target=wall,
        wall_s_censored=wall if wall is not None else total + mean_it,
        cost_usd_to_target=float(cost) if isinstance(cost, (int, float)) else None,
        cost_usd_censored=cost_censored,
        critical_path_share=float(crit.sum() / total) if total > 0 else 0.0,
        mean_iteration_s=mean_it,
        iterations_run=n_run,
    )


def mode_summary(
    outcomes: Sequence[RunOutcome],
    heldout: Mapping[str, Sequence[float]] | None = None,
    *,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = LEVEL,
) -> dict:
    """A mode's row: runs reaching the target (``reached`` of ``runs``) and the mean and
    bootstrap interval over runs of iterations and wall time to target (censored), critical-path
    share, mean iteration time and each held-out score of ``heldout`` (``{name: per-run
    values}``, e.g. the final evaluation's strict and partial scores)."""

    def ci(values):
        return bootstrap_mean_ci(values, resamples=resamples, seed=seed, level=level)

    out = {
        "runs": len(outcomes),
        "reached": sum(o.reached for o in outcomes),
        "iterations_to_target": ci([o.iterations_censored for o in outcomes]),
        "wall_s_to_target": ci([o.wall_s_censored for o in outcomes]),
        "critical_path_share": ci([o.critical_path_share for o in outcomes]),
        "mean_iteration_s": ci([o.mean_iteration_s for o in outcomes]),
    }
    for name, values in (heldout or {}).items():
        out[name] = ci([v for v in values if v is not None and not math.isnan(v)])
    return out


def goal_check(
    baseline: Sequence[RunOutcome],
    ours: Sequence[RunOutcome],
    *,
    min_ratio: float = 1.5,
    max_critical_share: float = 0.02,
    min_runs: int = 2,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = LEVEL,
) -> dict:
    """Does ``ours`` reach the target in at least ``min_ratio``× fewer iterations than
    ``baseline``, with the two modes' intervals of iterations to target not overlapping, at no
    more than ``max_critical_share`` of iteration time on the critical path?

    Returns ``{"ratio": CI, "ratio_ok", "ratio_low_ok", "separated", "critical_path_share": CI,
    "critical_path_ok", "met", "censored_runs"}``: ``ratio_ok`` tests the point estimate,
    ``ratio_low_ok`` the interval's lower end (the stricter reading); ``met`` = ratio_ok and
    separated and critical_path_ok and every run of ``ours`` reached the target.
    ``censored_runs`` counts the runs of either mode that never reached the target (their counts
    are lower bounds, so the ratio is uncertain beyond its interval when there are any);
    ``ours_censored`` those of ``ours``: a lower bound in the denominator makes the ratio an
    upper bound, which cannot show the goal (the baseline's, in the numerator, only make it
    conservative). Intervals are "apart" only when each mode has at least ``min_runs`` runs:
    the bootstrap interval of one run is a point and says nothing about the spread
    (``too_few_runs`` is then True)."""
    kw = {"resamples": resamples, "seed": seed, "level": level}
    it_base = [o.iterations_censored for o in baseline]
    it_ours = [o.iterations_censored for o in ours]
    ratio = bootstrap_ratio_ci(it_base, it_ours, **kw)
    too_few_runs = min(len(it_base), len(it_ours)) < min_runs
    separated = not too_few_runs and not bootstrap_mean_ci(it_base, **kw).overlaps(bootstrap_mean_ci(it_ours, **kw))
    share = bootstrap_mean_ci([o.critical_path_share for o in ours], **kw)
    out = {
        "ratio": ratio,
        "ratio_ok": ratio.mean >= min_ratio,
        "ratio_low_ok": ratio.low >= min_ratio,
        "separated": separated,
        "too_few_runs": too_few_runs,
        "critical_path_share": share,
        "critical_path_ok": share.mean <= max_critical_share,
        "censored_runs": sum(not o.reached for o in (*baseline, *ours)),
        "ours_censored": sum(not o.reached for o in ours),
        "min_ratio": min_ratio,
        "max_critical_share": max_critical_share,
    }
    out["met"] = bool(out["ratio_ok"] and out["separated"] and out["critical_path_ok"] and not out["ours_censored"])
    return out
