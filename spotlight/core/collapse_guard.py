"""Collapse guard: alerts when training looks like collapse or reward hacking (docs/collapse-guard.md).

Rewards that rise while images degrade, KL blow-ups and over-optimisation are what users of
Flow-GRPO-style training report most. The guard watches each iteration's metrics row and
raises an alert when:

* ``heldout_drop``: the held-out score (``eval/score``, when the run evaluates) has fallen
  ``heldout_drop`` below its best while the training reward is at or above its value at the
  best — the reward is being gained some other way;
* ``image_drift``: an image statistic of the rollout samples has drifted from the first
  iterations' (the baseline) by more than its bound: ``image/speckle`` (share of near-white
  pixels with visible colour, the patch-grid noise of a pixel-space DiT under RL) by more
  than ``speckle_rise`` absolute, ``image/hf_energy`` (high-frequency energy) by more than
  ``hf_energy_ratio`` times, ``image/saturation`` by more than ``saturation_ratio`` times
  (either way), ``image/color_entropy`` by more than ``color_entropy_change`` bits (either way:
  noise adds colours, collapse removes them) — over ``patience`` consecutive iterations;
* ``kl_runaway`` / ``clipfrac_runaway``: ``train/approx_kl`` or ``train/clipfrac`` above
  ``kl_max`` / ``clipfrac_max`` for ``patience`` consecutive iterations.

Pure: :func:`check` takes the metrics rows so far and returns the new alerts; the
coordinator logs them (console, event log, status) and carries out the configured action.
:func:`image_stats` computes the image statistics from uint8 images (numpy only).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

IMAGE_STATS = ("image/speckle", "image/hf_energy", "image/saturation", "image/color_entropy")


@dataclasses.dataclass(frozen=True)
class GuardSettings:
    """Bounds of the guard (the ``[guard]`` config section carries the same fields)."""

    baseline_iterations: int = 1
    patience: int = 2
    heldout_drop: float = 0.1
    speckle_rise: float = 0.10
    hf_energy_ratio: float = 2.0
    saturation_ratio: float = 2.0
    kl_max: float = 0.5
    clipfrac_max: float = 0.5
    color_entropy_change: float = 1.0


@dataclasses.dataclass(frozen=True)
class Alert:
    """One guard alert: ``kind`` (see the module docstring), the 0-based ``iteration`` whose
    row raised it, the metric, its value and the bound it crossed, and a one-line message."""

    kind: str
    iteration: int
    metric: str
    value: float
    bound: float
    message: str


def _num(row: dict, key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, (int, float)) and math.isfinite(float(v)):
        return float(v)
    return None


def _baseline(rows: Sequence[dict], key: str, n: int) -> float | None:
    vals = [v for v in (_num(r, key) for r in rows[:n]) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _image_breach(rows: Sequence[dict], i: int, key: str, s: GuardSettings) -> tuple[float, float] | None:
    """(value, bound) when row ``i``'s ``key`` is out of bounds against the baseline, else None."""
    base = _baseline(rows, key, s.baseline_iterations)
    v = _num(rows[i], key)
    if base is None or v is None or i < s.baseline_iterations:
        return None
    if key == "image/speckle":
        bound = base + s.speckle_rise
        return (v, bound) if v > bound else None
    if key == "image/hf_energy":
        bound = base * s.hf_energy_ratio
        return (v, bound) if base > 0 and v > bound else None
    if key == "image/saturation":
        hi, lo = base * s.saturation_ratio, base / s.saturation_ratio
        if base > 0 and v > hi:
            return v, hi
        if base > 0 and v < lo:
            return v, lo
    if key == "image/color_entropy":
        if v > base + s.color_entropy_change:
            return v, base + s.color_entropy_change
        if v < base - s.color_entropy_change:
            return v, base - s.color_entropy_change
    return None


def _sustained(rows: Sequence[dict], test, s: GuardSettings) -> tuple[float, float] | None:
    """The last row's breach when each of the last ``patience`` rows breaches, else None."""
    if len(rows) < s.patience:
        return None
    got = None
    for i in range(len(rows) - s.patience, len(rows)):
        got = test(i)
        if got is None:
            return None
    return got


def check(rows: Sequence[dict], settings: GuardSettings, *, already: Sequence[Alert] = ()) -> list[Alert]:
    """New alerts for the last row of ``rows`` (metrics rows in iteration order).

    ``already``: alerts raised before; a kind/metric already raised is not raised again
    until its condition has cleared for a row (so a warning is not repeated every iteration).
    """
    if not rows:
        return []
    s = settings
    last = rows[-1]
    it = int(last.get("iteration", len(rows) - 1))
    raised = {(a.kind, a.metric) for a in already}
    out: list[Alert] = []

    def add(kind: str, metric: str, value: float, bound: float, message: str) -> None:
        if (kind, metric) not in raised:
            out.append(Alert(kind, it, metric, value, bound, message))

    # held-out score against its best, while the training reward keeps up
    scores = [(j, _num(r, "eval/score")) for j, r in enumerate(rows)]
    scores = [(j, v) for j, v in scores if v is not None]
    if len(scores) >= 2 and scores[-1][0] == len(rows) - 1:
        best_j, best = max(scores, key=lambda jv: jv[1])
        now = scores[-1][1]
        r_best, r_now = _num(rows[best_j], "reward/mean"), _num(last, "reward/mean")
        if best - now >= s.heldout_drop and r_best is not None and r_now is not None and r_now >= r_best:
            add(
                "heldout_drop",
                "eval/score",
                now,
                best - s.heldout_drop,
                f"held-out score {now:.3f} is {best - now:.3f} below its best {best:.3f} (iteration {best_j + 1}) "
                f"while the training reward rose ({r_best:+.3f} → {r_now:+.3f}): reward hacking or collapse",
            )
    for key in IMAGE_STATS:
        got = _sustained(rows, lambda i, key=key: _image_breach(rows, i, key, s), s)
        if got is not None:
            base = _baseline(rows, key, s.baseline_iterations)
            add(
                "image_drift",
                key,
                got[0],
                got[1],
                f"{key} = {got[0]:.3f} has left its bound {got[1]:.3f} (first {s.baseline_iterations} iterations: "
                f"{base:.3f}) for {s.patience} iterations: the samples are degrading",
            )
    for key, bound, kind in (
        ("train/approx_kl", s.kl_max, "kl_runaway"),
        ("train/clipfrac", s.clipfrac_max, "clipfrac_runaway"),
    ):
        got = _sustained(
            rows,
            lambda i, key=key, bound=bound: (v, bound) if (v := _num(rows[i], key)) is not None and v > bound else None,
            s,
        )
        if got is not None:
            add(kind, key, got[0], bound, f"{key} = {got[0]:.4g} above {bound:.4g} for {s.patience} iterations")
    return out


def cleared(rows: Sequence[dict], alerts: Sequence[Alert], settings: GuardSettings) -> list[Alert]:
    """The alerts of ``alerts`` whose condition no longer holds on the last row (to be re-armed)."""
    out = []
    for a in alerts:
        if a.kind == "image_drift":
            still = _image_breach(rows, len(rows) - 1, a.metric, settings) is not None
        elif a.kind in ("kl_runaway", "clipfrac_runaway"):
            v = _num(rows[-1], a.metric)
            still = v is not None and v > a.bound
        else:
            v = _num(rows[-1], "eval/score")
            still = v is None or v <= a.bound
        if not still:
            out.append(a)
    return out


def image_stats(images: Sequence[np.ndarray]) -> dict[str, float]:
    """Statistics of ``[3, H, W]`` (or ``[H, W, 3]``) uint8 RGB images, averaged over images.

    * ``image/speckle``: share of near-white pixels (channel mean >= 200) whose chroma
      (max - min channel) exceeds 15 — background that gained colour noise;
    * ``image/hf_energy``: mean squared difference of horizontally and vertically adjacent
      pixels (0-1 scale) — high-frequency energy, which checkered patch-grid noise raises;
    * ``image/saturation``: mean HSV saturation, (max - min) / max;
    * ``image/color_entropy``: entropy (bits) of the 4×4×4-bin colour histogram.
    """
    if not images:
        return {}
    sp, hf, sat, ent = [], [], [], []
    for im in images:
        a = np.asarray(im)
        if a.ndim == 3 and a.shape[0] == 3 and a.shape[-1] != 3:
            a = a.transpose(1, 2, 0)
        x = a.astype(np.float32)
        mx, mn = x.max(axis=2), x.min(axis=2)
        light = x.mean(axis=2) >= 200
        sp.append(float(((mx - mn) > 15)[light].mean()) if light.any() else 0.0)
        y = x / 255.0
        hf.append(float((np.diff(y, axis=0) ** 2).mean() + (np.diff(y, axis=1) ** 2).mean()) / 2)
        sat.append(float(np.where(mx > 0, (mx - mn) / np.maximum(mx, 1e-6), 0.0).mean()))
        bins = (a // 64).reshape(-1, 3).astype(np.int64)
        counts = np.bincount(bins[:, 0] * 16 + bins[:, 1] * 4 + bins[:, 2], minlength=64).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        ent.append(float(-(p * np.log2(p)).sum()))
    n = len(images)
    return {
        "image/speckle": sum(sp) / n,
        "image/hf_energy": sum(hf) / n,
        "image/saturation": sum(sat) / n,
        "image/color_entropy": sum(ent) / n,
    }
