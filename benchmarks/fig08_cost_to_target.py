"""Paper Fig. 8: total cost to the target score of every mode, normalised to the reserved-only
baseline (RLBoost(3x)).

Two sources, side by side:

* **simulated** (default, seconds): ``spotlight simulate`` of the five modes (spotlight,
  rlboost, rlboost+explore, verl-omni-spot, reserved-only) on the whole Bamboo trace
  (``examples/traces/bamboo/p3-trace.csv``) placed on 4 spot nodes x 2 GPUs + 4 reserved
  GPUs, with the shipped Qwen-Image / H100 profile (its iterations to target and prices,
  each with its source);
* **real local runs**: ``--run-dir LABEL=PATH`` (repeatable) reads each run's held-out
  evaluations (``eval.jsonl``; ``--score``, ``eval/partial`` by default, or a ``metrics.jsonl``
  column such as ``reward/control_mean``) and takes the cumulative ``cost/usd`` of
  ``metrics.jsonl`` at the first iteration whose ``--window``-point moving average reaches
  ``--target``. By default the runs of ``benchmarks/convergence.py`` found under
  ``--convergence-dir`` are used as its ``convergence.json`` measured them (its target: the
  lowest saturated score, paper §6.2), one bar per run mode (mean over every run, censored).

Toy scale on CPU::

    python benchmarks/fig08_cost_to_target.py                          # ~20 s
    python benchmarks/fig08_cost_to_target.py --run-dir spotlight=runs/a --run-dir rlboost=runs/b --target 0.30

Real scale on a GPU cluster: run each mode with ``spotlight up --config examples/paper/<setup>.toml``
(``run.mode`` set per baseline) until its validation score saturates, then pass the run
directories with ``--run-dir`` and the paper's target for that setup (``--target``).

Paper: Spotlight is the cheapest in all setups: 1.92-6.39x cheaper than the reserved-only
baselines, 1.35-2.22x than RLBoost, 1.71-3.62x than veRL-omni(spot).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance, provenance_line, save_result  # noqa: E402
from _runs import BAMBOO, cost_to_target, learned_modes, parse_labelled, read_convergence, simulate_policies  # noqa: E402

MODES = ["reserved-only", "rlboost", "verl-omni-spot", "rlboost+explore", "spotlight"]


def local_runs(args) -> tuple[dict[str, list[dict]], float | None]:
    """Cost to target of the local runs: ``{label: [per-run dicts]}`` and the target used.

    With ``--run-dir``: each run's ``--score`` curve against ``--target``
    (:func:`_runs.cost_to_target`). Otherwise the runs of ``benchmarks/convergence.py`` under
    ``--convergence-dir``, as its ``convergence.json`` measured them (its target, one label per
    run mode); a summary written by the older script is skipped with a note."""
    target = args.target
    if args.run_dir:
        if target is None:
            sys.exit(f"error: --run-dir needs --target (the {args.score} to reach)")
        runs: dict[str, list[pathlib.Path]] = {}
        for label, path in parse_labelled(args.run_dir).items():
            runs.setdefault(label.split("#")[0], []).append(path)
        try:
            return {
                label: [cost_to_target(p, target, key=args.score, k=args.window) for p in paths]
                for label, paths in runs.items()
            }, target
        except ValueError as exc:
            sys.exit(f"error: {exc}")
    summary = pathlib.Path(args.convergence_dir) / "convergence.json"
    if not summary.is_file():
        return {}, target
    try:
        conv = read_convergence(args.convergence_dir)
    except ValueError as exc:
        print(f"note: no local bars: {exc}")
        return {}, target
    if learned_modes(conv) == []:
        print(
            f"note: in {summary} no mode raised the held-out score beyond noise: the local costs to target below "
            "measure noise, not convergence"
        )
    out = {}
    for mode, t in conv["modes"].items():
        out[mode] = [
            {
                "run": r["run_dir"],
                "mode": mode,
                "iterations": r["iterations_censored"],
                "reached": r["reached"],
                "cost_usd": r["cost_usd_censored"] if r.get("cost_usd_censored") is not None else math.nan,
                "wall_s": r["wall_s_censored"],
                "iterations_run": r["iterations_run"],
            }
            for r in t["runs"]
        ]
    return out, conv["target"]


def _plot_costs(sim_rows: list[dict], local_rows: list[dict]):
    """The figure: simulated cost to target per mode (normalised to reserved-only), and beside it
    the local runs' cost relative to Spotlight's when there are any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncol = 2 if local_rows else 1
    fig, axes = plt.subplots(1, ncol, figsize=(5.2 * ncol, 3.8), squeeze=False)
    ax = axes[0][0]
    colors = [
        "#bbbbbb" if r["mode"] == "reserved-only" else ("#d62728" if r["mode"] == "spotlight" else "#8fb3d9")
        for r in sim_rows
    ]
    bars = ax.bar(range(len(sim_rows)), [r["normalised"] for r in sim_rows], color=colors, hatch=None)
    bars[0].set_hatch("//")
    ax.set_xticks(range(len(sim_rows)), [r["mode"] for r in sim_rows], rotation=20, fontsize=8)
    ax.set_ylabel("cost to target / reserved-only")
    ax.set_title("simulated (Bamboo trace, Qwen-Image profile)", fontsize=9)
    if local_rows:
        ax = axes[0][1]
        ax.bar(range(len(local_rows)), [r["vs_spotlight"] for r in local_rows], color="#8fb3d9")
        ax.set_xticks(range(len(local_rows)), [r["mode"] for r in local_rows], rotation=15, fontsize=8)
        ax.set_ylabel("cost to target / Spotlight's")
        ax.set_title("real local runs (shapes task, CPU)", fontsize=9)
    for a in axes[0]:
        a.grid(axis="y", alpha=0.3)
    fig.suptitle("Fig. 8: cost to target", fontsize=10)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(BAMBOO))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--run-dir",
        action="append",
        default=[],
        help="LABEL=PATH of a finished local run (repeatable; LABEL#2=PATH adds a seed)",
    )
    ap.add_argument("--target", type=float, default=None, help="target --score for --run-dir")
    ap.add_argument(
        "--score",
        default="eval/partial",
        help="--run-dir: held-out score of eval.jsonl (eval/partial, eval/strict, eval/score) or a metrics column "
        "(reward/control_mean)",
    )
    ap.add_argument("--window", type=int, default=3, help="--run-dir: moving-average window")
    ap.add_argument("--convergence-dir", default=str(REPO / "benchmarks" / "out" / "convergence"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig08_cost_to_target.png"))
    args = ap.parse_args()

    sims, setup = simulate_policies(MODES, trace=args.trace, seed=args.seed)
    ref = next(r for r in sims if r.policy == "reserved-only").cost_usd
    spot = next(r for r in sims if r.policy == "spotlight").cost_usd
    print(f"Fig. 8 (simulated): {setup}")
    print(
        f"{'mode':>16} {'iterations':>10} {'wall (h)':>9} {'cost ($)':>9} {'/ reserved-only':>15} {'x spotlight':>11}"
    )
    sim_rows = []
    for r in sims:
        row = {
            "mode": r.policy,
            "iterations": r.iterations,
            "wall_h": r.wall_s / 3600,
            "cost_usd": r.cost_usd,
            "normalised": r.cost_usd / ref,
            "vs_spotlight": r.cost_usd / spot,
            "finished": r.finished,
        }
        sim_rows.append(row)
        print(
            f"{r.policy:>16} {r.iterations:>10} {row['wall_h']:9.1f} {r.cost_usd:9,.0f} {row['normalised']:15.2f} "
            f"{row['vs_spotlight']:10.2f}x"
        )
    local, target = local_runs(args)
    local_rows = []
    if local:
        print(
            "\nFig. 8 (real local runs, CPU 'GPUs'): cost until the moving average of the held-out score reaches "
            f"{target:.4f}"
        )
        print(f"{'mode':>32} {'reached':>7} {'iterations':>10} {'cost ($)':>9} {'x spotlight':>11}")
        means = {label: statistics.mean(r["cost_usd"] for r in rs) for label, rs in local.items()}
        s_ref = means.get("spotlight", float("nan"))
        for label, rs in local.items():
            hit = [r for r in rs if r["reached"]]
            it = statistics.mean(r["iterations"] for r in rs)
            row = {
                "mode": label,
                "reached": len(hit),
                "runs": len(rs),
                "iterations": it,
                "cost_usd": means[label],
                "vs_spotlight": means[label] / s_ref,
                "per_run": rs,
            }
            local_rows.append(row)
            print(f"{label:>32} {len(hit)}/{len(rs):<5} {it:10.1f} {means[label]:9.4f} {row['vs_spotlight']:10.2f}x")
        print(
            "(mean over every run; a run that never reached the target counts its iterations + 1 and its whole cost "
            "plus one mean iteration's: censored, as benchmarks/convergence.py counts, so those means are lower bounds)"
        )
    prov = provenance()
    print(provenance_line())

    fig = _plot_costs(sim_rows, local_rows)
    out = save_result(
        fig,
        args.out,
        {"provenance": prov, "setup": setup, "simulated": sim_rows, "local_target": target, "local": local_rows},
        indent=2,
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
