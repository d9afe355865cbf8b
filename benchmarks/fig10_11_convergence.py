"""Paper Fig. 10 (iterations to the target score) and Fig. 11 (exploration overhead on the
critical path), on the embedded shapes task.

Reads the output of ``benchmarks/convergence.py`` (``<dir>/convergence.json``: the run modes
rlboost, verl-omni-spot and Spotlight times the run seeds, each run's numbers and the means with
their 95 % bootstrap intervals) and draws both figures from it:

* Fig. 10: iterations until the moving average of the held-out score (``eval.jsonl``,
  ``eval/partial`` by default) reaches the target (the lowest saturated score among the modes,
  as the paper's §6.2 defines it), per mode: mean with its interval and every run (hollow: a
  run that never reached it, counted as iterations + 1), and the ratio to Spotlight's;
* Fig. 11: the share of iteration time spent exploring on the critical path
  (``time/explore_critical_path_s / time/iteration_s`` over each run), and the mean iteration
  time.

Toy scale on CPU (default): summarise existing runs, a few seconds::

    python benchmarks/fig10_11_convergence.py --from benchmarks/out/convergence
    python benchmarks/fig10_11_convergence.py --rerun --iterations 20 --seeds 0,1,2,3,4   # hours on 2 cores

``--rerun`` runs ``benchmarks/convergence.py`` first with the given options (``--reuse`` keeps
finished runs). Real scale on a GPU cluster: run ``benchmarks/convergence.py --config
examples/paper/<setup>.toml`` on the cluster's coordinator host (the script drives
``spotlight up``; drop ``--local`` agents by running agents on the spot nodes), then this script
on its output directory.

Paper (§6.3): Spotlight reaches the target 1.42-4.00x faster than RLBoost and 1.00-2.25x faster
than veRL-omni(spot) (Fig. 10); its exploration overhead is 2-3 % of the mean iteration (Fig. 11),
while veRL-omni(spot)'s iterations are 1.32-1.54x longer (§6.2).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance_line, save_result  # noqa: E402
from _runs import learned_modes, read_convergence  # noqa: E402

from spotlight.studies.convergence import format_ci  # noqa: E402

LABELS = {
    "rlboost": "rlboost\n(no exploration)",
    "verl-omni-spot": "verl-omni-spot\n(best-of-N, critical path)",
    "spotlight": "Spotlight",
}


def read_summary(src: pathlib.Path) -> dict:
    """``src/convergence.json`` (:func:`_runs.read_convergence`); exits with its one-line error."""
    try:
        return read_convergence(src)
    except (OSError, ValueError) as exc:
        sys.exit(f"error: {exc}")


def rows_from_summary(conv: dict) -> dict[str, dict]:
    """Per mode: the figure's numbers (per run and mean [low, high]) from a schema-2 summary."""
    rows = {}
    spot = conv["modes"].get("spotlight")
    for m, t in conv["modes"].items():
        runs = t["runs"]
        ratio = conv["ratios"].get(f"{m}/spotlight")
        if m == "spotlight":
            ratio = {"mean": 1.0, "low": 1.0, "high": 1.0, "n": t["n"]}
        rows[m] = {
            "runs": t["n"],
            "reached": t["reached"],
            "iterations_per_run": [r["iterations_censored"] for r in runs],
            "reached_per_run": [r["reached"] for r in runs],
            "iterations_to_target": t["iterations_to_target"],
            "wall_s_to_target": t["wall_s_to_target"],
            "critical_path_share_per_run": [r["critical_path_share"] for r in runs],
            "critical_path_share": t["critical_path_share"],
            "mean_iteration_s": t["mean_iteration_s"],
            "iterations_vs_spotlight": ratio if spot is not None else None,
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--from",
        dest="src",
        default=str(REPO / "benchmarks" / "out" / "convergence"),
        help="convergence.py output directory",
    )
    ap.add_argument("--rerun", action="store_true", help="run benchmarks/convergence.py into --from first")
    ap.add_argument("--iterations", type=int, default=20, help="with --rerun")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="with --rerun")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig10_11_convergence.png"))
    args = ap.parse_args()
    src = pathlib.Path(args.src)
    if args.rerun:
        cmd = [
            sys.executable,
            str(REPO / "benchmarks" / "convergence.py"),
            "--reuse",
            "--iterations",
            str(args.iterations),
            "--seeds",
            args.seeds,
            "--out",
            str(src),
        ]
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    conv = read_summary(src)
    rows = rows_from_summary(conv)
    print(
        f"Fig. 10/11 (shapes task, {len(conv['seeds'])} run seed(s) x {conv['iterations']} iterations): target "
        f"{conv['target']:.4f} of {conv['score']} ({conv['window']}-point moving average); "
        "mean [95 % bootstrap interval]"
    )
    print(
        f"{'mode':>15} {'reached':>7} {'iterations to target':>22} {'x spotlight':>20} {'wall to target (s)':>20} "
        f"{'iteration (s)':>18} {'critical path (%)':>18}"
    )
    for m, r in rows.items():
        print(
            f"{m:>15} {r['reached']}/{r['runs']:<5} {format_ci(r['iterations_to_target'], '%.1f'):>22} "
            f"{format_ci(r['iterations_vs_spotlight'], '%.2f'):>20} {format_ci(r['wall_s_to_target'], '%.0f'):>20} "
            f"{format_ci(r['mean_iteration_s'], '%.1f'):>18} {format_ci(r['critical_path_share'], '%.1f', 100):>18}"
        )
    print(
        f"(a run that never reached the target counts as {conv['iterations'] + 1} iterations: censored; "
        "'x spotlight' = this mode's iterations to target / Spotlight's, runs of each resampled independently)"
        if isinstance(conv["iterations"], int)
        else "(a run that never reached the target counts as its iterations + 1: censored)"
    )
    lr = conv.get("learning") or {}
    learned = learned_modes(conv)
    unlearned = learned == []
    if unlearned:
        print(
            f"NOTE: no mode raised the held-out score beyond noise (target {lr['target_gain']:+.4f} from the base "
            f"model's {lr['base']:.4f}): Fig. 10 shows noise, not convergence"
        )
    elif learned and len(learned) < len(lr["modes"]):
        print(f"NOTE: only {', '.join(learned)} learned beyond noise; the other modes' bars are noise")
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bars(ax, key, per_run_key, color, scale=1.0, hollow=False):
        names = list(rows)
        means = [scale * (rows[m][key]["mean"] or 0.0) for m in names]
        err = [
            [scale * (rows[m][key]["mean"] - rows[m][key]["low"]) for m in names],
            [scale * (rows[m][key]["high"] - rows[m][key]["mean"]) for m in names],
        ]
        ax.bar(range(len(names)), means, yerr=err, capsize=4, color=color)
        for i, m in enumerate(names):
            ys = [scale * y for y in rows[m][per_run_key]]
            filled = rows[m]["reached_per_run"] if hollow else [True] * len(ys)
            ax.scatter(
                [i + 0.06 * (j - (len(ys) - 1) / 2) for j in range(len(ys))],
                ys,
                s=16,
                zorder=3,
                facecolors=["k" if f else "none" for f in filled],
                edgecolors="k",
            )
        ax.set_xticks(range(len(names)), [LABELS.get(m, m) for m in names], fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    bars(axes[0], "iterations_to_target", "iterations_per_run", "#8fb3d9", hollow=True)
    for i, m in enumerate(rows):
        axes[0].text(i, 0.3, f"reached {rows[m]['reached']}/{rows[m]['runs']}", ha="center", fontsize=8)
    axes[0].set_ylabel("iterations to target")
    axes[0].set_title(
        "Fig. 10: iterations to target (95 % CI; hollow = not reached)"
        + ("\nno mode learned beyond noise: this shows noise" if unlearned else ""),
        fontsize=9,
        color="firebrick" if unlearned else "black",
    )
    bars(axes[1], "critical_path_share", "critical_path_share_per_run", "#e6a57e", scale=100)
    axes[1].set_ylabel("exploration on the critical path (% of iteration time)")
    axes[1].set_title("Fig. 11: exploration overhead (95 % CI)", fontsize=9)
    out = save_result(
        fig,
        args.out,
        {
            "source": str(src),
            "score": conv["score"],
            "window": conv["window"],
            "target": conv["target"],
            "learning": lr,
            "seeds": conv["seeds"],
            "iterations": conv["iterations"],
            "modes": rows,
            "ratios": conv["ratios"],
            "goal": conv.get("goal"),
        },
        indent=2,
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
