"""Tables and pictures of simulation results (``spotlight simulate``)."""

from __future__ import annotations

import math
import pathlib
from typing import Sequence

from spotlight.sim.simulator import SimResult

__all__ = ["comparison_rows", "plot_comparison"]


def comparison_rows(results: Sequence[SimResult], *, baseline: str = "spotlight") -> list[dict]:
    """One JSON-able row per policy, with cost and time relative to ``baseline``
    (``cost_vs_baseline = cost / baseline cost``: > 1 means dearer than the baseline). A run that
    did not finish has no cost to target: its ratio, and every ratio to an unfinished baseline,
    is NaN (its wall time and cost are where it stopped, ``stopped_because`` says why)."""
    base = next((r for r in results if r.policy == baseline), None)
    rows = []
    for r in results:
        comparable = base is not None and base.finished and r.finished and base.cost_usd > 0
        rows.append(
            {
                "policy": r.policy,
                "iterations_to_target": r.iterations,
                "wall_h": r.wall_s / 3600,
                "cost_usd": r.cost_usd,
                "cost_vs_baseline": r.cost_usd / base.cost_usd if comparable else math.nan,
                "time_per_iteration_s": r.wall_s / r.iterations if r.iterations else math.nan,
                "cost_per_iteration_usd": r.cost_usd / r.iterations if r.iterations else math.nan,
                "spot_gpu_hours": r.spot_gpu_hours,
                "reserved_gpu_hours": r.reserved_gpu_hours,
                "spot_utilisation": r.spot_utilisation,
                "spot_busy_training": r.spot_busy_training,
                "critical_path_share": r.critical_path_share,
                "preemptions": r.preemptions,
                "additions": r.additions,
                "work_lost_steps": r.work_lost_steps,
                "finished": r.finished,
                "stopped_because": r.stopped_because,
            }
        )
    return rows


def plot_comparison(results: Sequence[SimResult], path: pathlib.Path, *, title: str = "") -> None:
    """Three panels: cost to target per policy (spot / reserved share), cumulative cost vs
    wall time, and spot GPUs held vs busy share per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    color = {r.policy: f"C{i}" for i, r in enumerate(results)}  # one colour per policy in every panel
    ax = axes[0]
    names = [r.policy for r in results]
    spot = [r.spot_cost_usd for r in results]
    reserved = [r.reserved_cost_usd for r in results]
    ax.bar(names, reserved, label="reserved GPUs", color="#4c72b0")
    ax.bar(names, spot, bottom=reserved, label="spot GPUs", color="#dd8452")
    for i, r in enumerate(results):
        ax.text(i, r.cost_usd, f"${r.cost_usd:,.0f}\n{r.iterations} it", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("cost to target [USD]")
    ax.tick_params(axis="x", rotation=20)
    ax.legend(fontsize=8)
    ax.set_ylim(0, max(r.cost_usd for r in results) * 1.25)
    ax = axes[1]
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(sorted(results, key=lambda r: r.policy == "spotlight")):
        xs = [0] + [row["t_s"] / 3600 for row in r.rows]
        ys = [0] + [row["cost/usd"] for row in r.rows]
        ax.plot(
            xs,
            ys,
            styles[i % len(styles)],
            color=color[r.policy],
            lw=2.5 if r.policy == "spotlight" else 1.5,
            label=r.policy,
        )
        ax.plot(xs[-1:], ys[-1:], "o", color=color[r.policy])  # target reached
    ax.set_xlabel("wall time [h]")
    ax.set_ylabel("cumulative cost [USD] (dot: target reached)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[2]
    for r in results:
        if not any(math.isfinite(row.get("spot/busy_fraction", math.nan)) for row in r.rows):
            continue
        ax.plot(
            [row["iteration"] + 1 for row in r.rows],
            [row.get("spot/busy_fraction", math.nan) for row in r.rows],
            marker=".",
            color=color[r.policy],
            label=r.policy,
        )
    ax.set_xlabel("iteration")
    ax.set_ylabel("spot busy share of the training window")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
