"""Paper Fig. 14: ablation — RLBoost, RLBoost + exploration, Spotlight (= RLBoost + exploration +
elastic SP): spot GPU utilisation, iterations to target, mean iteration time and cost.

Simulated (default, seconds): ``spotlight simulate --policy rlboost --policy rlboost+explore
--policy spotlight`` on the whole Bamboo trace (4 spot nodes x 2 GPUs, 4 reserved) with the
shipped Qwen-Image 1280x1280 / H100 profile (the paper's ablation setup: DeepSeek-OCR
1280x1280). ``--trace-seeds`` averages several random placements of the trace.
Real local runs: ``--run-dir LABEL=PATH --target R`` adds the same four numbers from finished
runs of the three modes (``spot/busy_fraction``, iterations until the 3-point average of the
held-out score (``--score``: ``eval/partial`` of the run's ``eval.jsonl`` by default, as
``benchmarks/convergence.py`` scores; ``reward/control_mean`` for runs without ``eval.every``)
reaches R, ``time/iteration_s``, ``cost/usd``).

    python benchmarks/fig14_ablation.py                 # toy / CPU, ~30 s
    python benchmarks/fig14_ablation.py --trace-seeds 0,1,2,3,4

Real scale on a GPU cluster: run ``spotlight up --config examples/paper/ocr-1280.toml`` once per
mode (``run.mode = "rlboost"``, ``"rlboost+explore"``, default) and pass the run directories.

Paper (§6.6): both exploring modes need 39 % fewer iterations than RLBoost; elastic SP raises spot
utilisation from 93 % to 99 % and cuts the mean iteration time by 15.7 % against RLBoost+Exp;
total cost 1.7x lower than RLBoost.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance, provenance_line, save_result  # noqa: E402
from _runs import BAMBOO, cost_to_target, finite_mean, parse_labelled, read_metrics, simulate_policies  # noqa: E402

from spotlight.studies.convergence import SCORE_KEYS  # noqa: E402

MODES = ["rlboost", "rlboost+explore", "spotlight"]
METRICS = [
    ("spot_utilisation", "spot GPU utilisation", 100, "%"),
    ("iterations", "iterations to target", 1, ""),
    ("iteration_s", "mean iteration (s)", 1, ""),
    ("cost_usd", "cost to target ($)", 1, ""),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(BAMBOO))
    ap.add_argument("--trace-seeds", default="0,1,2", help="random placements of the trace to average")
    ap.add_argument(
        "--run-dir", action="append", default=[], help="LABEL=PATH of a finished local run of one mode (repeatable)"
    )
    ap.add_argument("--target", type=float, default=None)
    ap.add_argument(
        "--score",
        default="eval/partial",
        choices=[*SCORE_KEYS, "reward/control_mean"],
        help="score of the local runs' iterations to target (default: the held-out panel's partial credit)",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig14_ablation.png"))
    args = ap.parse_args()

    per_mode: dict[str, list[dict]] = {m: [] for m in MODES}
    setup = ""
    for ts in [int(s) for s in args.trace_seeds.split(",")]:
        sims, setup = simulate_policies(MODES, trace=args.trace, trace_seed=ts)
        for r in sims:
            per_mode[r.policy].append(
                {
                    "spot_utilisation": r.spot_utilisation,
                    "iterations": r.iterations,
                    "iteration_s": r.wall_s / r.iterations,
                    "cost_usd": r.cost_usd,
                    "critical_path_share": r.critical_path_share,
                    "finished": r.finished,
                }
            )
    sim = {
        m: {
            k: statistics.mean(x[k] for x in rows)
            for k in ("spot_utilisation", "iterations", "iteration_s", "cost_usd", "critical_path_share")
        }
        for m, rows in per_mode.items()
    }
    print(f"Fig. 14 (simulated, mean of {len(per_mode['spotlight'])} trace placements): {setup}")
    print(
        f"{'mode':>16} {'spot util.':>10} {'iterations':>10} {'iteration (s)':>13} {'cost ($)':>9} {'x spotlight':>11} "
        f"{'critical path':>13}"
    )
    for m, r in sim.items():
        r["cost_vs_spotlight"] = r["cost_usd"] / sim["spotlight"]["cost_usd"]
        print(
            f"{m:>16} {100 * r['spot_utilisation']:9.1f}% {r['iterations']:10.0f} {r['iteration_s']:13.0f} "
            f"{r['cost_usd']:9,.0f} {r['cost_vs_spotlight']:10.2f}x {100 * r['critical_path_share']:12.1f}%"
        )
    it_gain = 1 - sim["spotlight"]["iterations"] / sim["rlboost"]["iterations"]
    dur_gain = 1 - sim["spotlight"]["iteration_s"] / sim["rlboost+explore"]["iteration_s"]
    print(
        f"exploration: {100 * it_gain:.0f}% fewer iterations than RLBoost (paper 39%); elastic SP: "
        f"iteration {100 * dur_gain:.1f}% shorter than RLBoost+Exp (paper 15.7%), "
        f"spot utilisation {100 * sim['rlboost+explore']['spot_utilisation']:.0f}% -> "
        f"{100 * sim['spotlight']['spot_utilisation']:.0f}% (paper 93% -> 99%); "
        f"cost RLBoost / Spotlight {sim['rlboost']['cost_vs_spotlight']:.2f}x (paper 1.7x)"
    )
    local = {}
    if args.run_dir:
        if args.target is None:
            sys.exit("error: --run-dir needs --target")
        for label, path in parse_labelled(args.run_dir).items():
            try:
                c = cost_to_target(path, args.target, key=args.score)
            except ValueError as exc:
                sys.exit(f"error: --run-dir {label}: {exc}")
            rows = read_metrics(path)
            local[label] = {
                # the last row, and a mode that leaves spot GPUs idle by design, have none (null)
                "spot_utilisation": finite_mean(r.get("spot/busy_fraction") for r in rows),
                "iterations": c["iterations"],
                "reached": c["reached"],
                "iteration_s": statistics.mean(r["time/iteration_s"] for r in rows),
                "cost_usd": c["cost_usd"],
            }
            r = local[label]
            print(
                f"local {label:>10} {100 * r['spot_utilisation']:9.1f}% "
                f"{r['iterations']:10d}{'' if r['reached'] else '*'} {r['iteration_s']:13.1f} {r['cost_usd']:9.4f}"
            )
    prov = provenance()
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(12, 3.2))
    colors = ["#8fb3d9", "#f2b36f", "#d62728"]
    for ax, (key, title, scale, unit) in zip(axes, METRICS):
        vals = [scale * sim[m][key] for m in MODES]
        ax.bar(range(len(MODES)), vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,.0f}{unit}" if v >= 10 else f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(MODES)), ["RLBoost", "RLBoost+Exp", "Spotlight"], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Fig. 14: ablation (simulated, Bamboo trace, Qwen-Image 1280x1280 profile)", fontsize=10)
    out = save_result(
        fig,
        args.out,
        {"provenance": prov, "setup": setup, "simulated": sim, "per_placement": per_mode, "local": local},
        indent=2,
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
