"""Paper Fig. 10 (iterations to the target score) and Fig. 11 (exploration overhead on the
critical path), on the embedded shapes task.

Reads the output of ``benchmarks/convergence.py`` (``<dir>/convergence.json`` and the run
directories next to it: three variants — no exploration (RLBoost), best-of-N on the critical
path (veRL-omni(spot)), Spotlight — times the run seeds) and draws both figures from it:

* Fig. 10: iterations (and wall seconds) until the 3-iteration moving average of the
  control-prompt reward reaches the target (the lowest saturated score among the variants,
  as the paper's §6.2 defines it), per variant, mean and per-seed points;
* Fig. 11: the share of iteration time spent exploring on the critical path
  (``time/explore_critical_path_s / time/iteration_s`` from each run's metrics.jsonl), and
  the mean iteration time.

Toy scale on CPU (default): summarise existing runs, a few seconds::

    python benchmarks/fig10_11_convergence.py --from benchmarks/out/convergence
    python benchmarks/fig10_11_convergence.py --rerun --iterations 12 --seeds 0,1,2   # ~5 h on 2 cores

``--rerun`` runs ``benchmarks/convergence.py`` first with the given options (``--reuse`` keeps
finished runs). Real scale on a GPU cluster: run ``benchmarks/convergence.py --config
examples/paper/<setup>.toml`` on the cluster's coordinator host (the script drives
``spotlight up``; drop ``--local`` agents by running agents on the spot nodes), then this script
on its output directory.

Paper: Spotlight reaches the target in 1.3-1.5x fewer iterations than RLBoost (Fig. 10) and its
exploration adds <1 % to the critical path, against 32-54 % longer iterations for veRL-omni(spot)
(Fig. 11).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance_line, save_result  # noqa: E402
from _runs import read_metrics  # noqa: E402

LABELS = {
    "no-exploration": "no exploration\n(RLBoost)",
    "critical-path": "best-of-N, critical path\n(veRL-omni(spot))",
    "spotlight": "Spotlight",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--from",
        dest="src",
        default=str(REPO / "benchmarks" / "out" / "convergence"),
        help="convergence.py output directory",
    )
    ap.add_argument("--rerun", action="store_true", help="run benchmarks/convergence.py into --from first")
    ap.add_argument("--iterations", type=int, default=12, help="with --rerun")
    ap.add_argument("--seeds", default="0,1,2", help="with --rerun")
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
    summary = src / "convergence.json"
    if not summary.is_file():
        sys.exit(
            f"error: {summary} not found; run `python benchmarks/convergence.py --out {src}` (or this script with "
            "--rerun)"
        )
    conv = json.loads(summary.read_text())
    target, table = conv["target"], conv["table"]
    rows = {}
    for v, t in table.items():
        shares, crit_s, it_s = [], [], []
        for seed in conv["seeds"]:
            rd = src / f"{v}-s{seed}"
            if not (rd / "metrics.jsonl").is_file():
                continue
            m = read_metrics(rd)
            crit = sum(r.get("time/explore_critical_path_s", 0.0) for r in m)
            tot = sum(r["time/iteration_s"] for r in m)
            shares.append(crit / tot)
            crit_s.append(crit / len(m))
            it_s.append(tot / len(m))
        rows[v] = {
            "runs": t["runs"],
            "reached": t["reached"],
            "iterations_to_target": t["iterations_to_target"],
            "wall_s_to_target": t["wall_s_to_target"],
            "critical_path_share_per_run": shares or [t["critical_path_share"]],
            "critical_path_s_per_iteration": crit_s,
            "mean_iteration_s_per_run": it_s or [t["mean_iteration_s"]],
        }
    base = rows.get("no-exploration")
    print(
        f"Fig. 10/11 (shapes task, {len(conv['seeds'])} seeds x {conv['iterations']} iterations): target {target:.4f}"
    )
    print(
        f"{'variant':>16} {'reached':>7} {'iters to target':>16} {'vs RLBoost':>10} {'wall to target':>15} "
        f"{'iteration':>10} {'critical path':>13}"
    )
    for v, r in rows.items():
        it = r["iterations_to_target"]
        mean_it = statistics.mean(it) if it else float("nan")
        ratio = (
            statistics.mean(base["iterations_to_target"]) / mean_it
            if base and base["iterations_to_target"] and it
            else float("nan")
        )
        r["iterations_vs_rlboost"] = ratio
        wall = f"{statistics.mean(r['wall_s_to_target']):.0f} s" if r["wall_s_to_target"] else "-"
        print(
            f"{v:>16} {r['reached']}/{r['runs']:<5} {mean_it:16.1f} {ratio:9.2f}x {wall:>15} "
            f"{statistics.mean(r['mean_iteration_s_per_run']):9.1f}s "
            f"{100 * statistics.mean(r['critical_path_share_per_run']):12.1f}%"
        )
    print("(iterations to target counts only the runs that reached it; 'vs RLBoost' = RLBoost's mean / this mean)")
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(rows)
    x = range(len(names))
    ax = axes[0]
    ax.bar(
        x,
        [statistics.mean(rows[v]["iterations_to_target"]) if rows[v]["iterations_to_target"] else 0 for v in names],
        color="#8fb3d9",
    )
    for i, v in enumerate(names):
        ax.scatter(
            [i] * len(rows[v]["iterations_to_target"]), rows[v]["iterations_to_target"], color="k", s=12, zorder=3
        )
        ax.text(i, 0.3, f"reached {rows[v]['reached']}/{rows[v]['runs']}", ha="center", fontsize=8)
    ax.set_xticks(list(x), [LABELS.get(v, v) for v in names], fontsize=8)
    ax.set_ylabel("iterations to target")
    ax.set_title("Fig. 10: iterations to target", fontsize=10)
    ax = axes[1]
    ax.bar(x, [100 * statistics.mean(rows[v]["critical_path_share_per_run"]) for v in names], color="#e6a57e")
    for i, v in enumerate(names):
        ax.scatter(
            [i] * len(rows[v]["critical_path_share_per_run"]),
            [100 * s for s in rows[v]["critical_path_share_per_run"]],
            color="k",
            s=12,
            zorder=3,
        )
    ax.set_xticks(list(x), [LABELS.get(v, v) for v in names], fontsize=8)
    ax.set_ylabel("exploration on the critical path (% of iteration time)")
    ax.set_title("Fig. 11: exploration overhead", fontsize=10)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    out = save_result(
        fig,
        args.out,
        {
            "source": str(src),
            "target": target,
            "seeds": conv["seeds"],
            "iterations": conv["iterations"],
            "variants": rows,
        },
        indent=2,
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
