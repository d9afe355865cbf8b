"""Paper Fig. 17: the Planner's choices (number of candidate sequences d, effective
denoising steps) over training iterations for UCB exploration coefficients β ∈ {0, 0.5, 1}.

The choices come from the real Planner (``spotlight.core.planner``, UCB over (d, s), paper §4.3,
Appendix B.2) driven through ``spotlight.sim`` on the shipped Qwen-Image / H100 profile,
with the simulator's synthetic rewards (a seeded per-(prompt, seed) reward whose stale-weight
estimate is noisy; ``spotlight.sim.simulator.SyntheticReward``). The paper's curves come from
real training on GenEval/DeepSeek-OCR rewards, so what can match is the *kind*: β = 0 locks
onto an early arm, larger β keeps switching longer. Pass run directories of real local runs
(``--runs``) to plot their choices from ``metrics.jsonl`` instead.

    python benchmarks/fig17_planner_beta.py                  # 3 β × 3 seeds × 60 iterations, ~1 min
    python benchmarks/fig17_planner_beta.py --iterations 100 --seeds 5
    python benchmarks/fig17_planner_beta.py --runs runs/beta0 runs/beta05 runs/beta1   # real runs
                                                              # (set planner.beta in each run's config)

Real scale: run Spotlight with ``planner.beta`` set per run and pass the run directories.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance_line, save_result  # noqa: E402


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over up to ``window`` finite values (the paper's smoothed curves)."""
    out = []
    for i in range(len(values)):
        win = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out


def choices_from_rows(rows: list[dict]) -> tuple[list[float], list[float]]:
    d = [float(r.get("explore/num_candidates", math.nan)) for r in rows]
    s = [float(r.get("explore/planned_steps", math.nan)) for r in rows]
    return d, s


def settle_iteration(values: list[float], tail: int = 10) -> int | None:
    """First iteration (1-based) after which the choice never changes again for >= ``tail`` iterations."""
    values = list(values)
    while values and any(isinstance(x, float) and not math.isfinite(x) for x in values[-1]):
        values.pop()  # the last iteration explores nothing (no next batch)
    for i in range(len(values)):
        rest = values[i:]
        if len(rest) >= tail and all(repr(v) == repr(rest[0]) for v in rest):  # repr: nan == nan
            return i + 1
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--betas", default="0,0.5,1")
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--smooth", type=int, default=5, help="moving-average window of the plotted curves")
    ap.add_argument(
        "--stream-extra",
        action="store_true",
        help="let spot GPUs stream extra candidates while training (off: the paper's planner, where d is what runs)",
    )
    ap.add_argument(
        "--runs",
        nargs="*",
        default=[],
        help="real run directories instead of simulation (label = planner.beta of each)",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig17_planner_beta.png"))
    args = ap.parse_args()

    series: dict[str, list[tuple[list[float], list[float]]]] = {}
    if args.runs:
        import tomllib

        for rd in map(pathlib.Path, args.runs):
            rows = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines() if line.strip()]
            beta = tomllib.loads((rd / "config.toml").read_text()).get("planner", {}).get("beta", 0.5)
            series.setdefault(f"β={beta}", []).append(choices_from_rows(rows))
    else:
        from spotlight.sim.profile import load_profile
        from spotlight.sim.simulator import POLICIES, simulate

        base = load_profile()
        policy = dataclasses.replace(POLICIES["spotlight"], stream_extra=args.stream_extra)
        for beta in [float(b) for b in args.betas.split(",")]:
            prof = dataclasses.replace(base, beta=beta)
            for seed in range(args.seeds):
                r = simulate(prof, policy, None, iterations=args.iterations, seed=seed)
                series.setdefault(f"β={beta:g}", []).append(choices_from_rows(r.rows))

    if args.runs:
        source = "runs " + " ".join(args.runs)
    else:
        source = f"simulated ({args.iterations} iterations x {args.seeds} seeds, Qwen-Image/H100 profile)"
    print(f"Fig. 17: planner choices, {source}")
    print(
        f"{'β':<8} {'mean d (last half)':>18} {'mean steps (last half)':>22} {'distinct arms':>13} "
        f"{'settled by iteration':>21}"
    )
    summary = {}
    for label, runs in series.items():
        ds, ss, arms, settle = [], [], [], []
        for d, s in runs:
            half = len(d) // 2
            ds += [v for v in d[half:] if math.isfinite(v)]
            ss += [v for v in s[half:] if math.isfinite(v)]
            arms.append(len({(a, b) for a, b in zip(d, s) if math.isfinite(a)}))
            settle.append(settle_iteration(list(zip(d, s))))  # type: ignore[arg-type]
        summary[label] = {
            "mean_d_last_half": sum(ds) / len(ds) if ds else math.nan,
            "mean_steps_last_half": sum(ss) / len(ss) if ss else math.nan,
            "distinct_arms": arms,
            "settled_by": settle,
        }
        settle_txt = ", ".join("never" if x is None else str(x) for x in settle)
        print(
            f"{label:<8} {summary[label]['mean_d_last_half']:>18.1f} {summary[label]['mean_steps_last_half']:>22.1f} "
            f"{sum(arms) / len(arms):>13.1f} {settle_txt:>21}"
        )
    print("paper: β = 0.5 stabilises in about 20 steps (Fig. 17); β = 0 commits early, β = 1 keeps exploring")
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for (label, runs), colour in zip(series.items(), colours):
        for k, (d, s) in enumerate(runs):
            xs = list(range(1, len(d) + 1))
            a.plot(
                xs, smooth(d, args.smooth), color=colour, alpha=0.9 if k == 0 else 0.35, label=label if k == 0 else None
            )
            b.plot(
                xs, smooth(s, args.smooth), color=colour, alpha=0.9 if k == 0 else 0.35, label=label if k == 0 else None
            )
    a.set_xlabel("iteration")
    a.set_ylabel("selected number of sequences d")
    b.set_xlabel("iteration")
    b.set_ylabel("selected effective denoising steps")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    a.set_title(f"candidates per prompt (moving average {args.smooth})")
    b.set_title("denoising steps (First Block Cache)")
    out = save_result(fig, args.out, {"args": vars(args), "summary": summary, "series": series})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
