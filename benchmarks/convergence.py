"""Convergence benchmark on the shapes task (paper §6.2–6.3, Fig. 10): does seed exploration
reach the target in fewer iterations, and what does it cost on the critical path?

Runs `spotlight up --local` on the embedded default (the shapes world, GenEval-style reward)
for each variant and each run seed (``run.seed``, ``data.shuffle_seed`` and ``planner.seed``
all set to it, so the variants of one seed see the same prompts in the same order and
start from the same default seeds):

  (a) no-exploration   explore.mode = "off"            (RLBoost: default seeds only)
  (b) critical-path    explore.mode = "critical_path"  (veRL-omni(spot): best-of-N on v_n
                       before each rollout, N = --best-of, keep top/bottom K/2)
  (c) spotlight        explore.mode = "stale", planner = "bandit" (exploration of batch
                       n+1 on the stale v_n by the spot workers during training)

Score per iteration: the mean reward (partial credit) of the 4 control prompt groups, which
are never explored, so seed selection never biases it. Target: the lowest saturated score
among the variants' seed-averaged curves (saturated = best 3-iteration moving average), as
the paper does in §6.2. A run reaches the target at the first iteration whose 3-iteration
moving average is at or above it. After each run, ``final/`` is evaluated on the held-out
test prompts (strict GenEval-style verdict, ODE sampling, ``--eval-seeds`` per prompt).

    python benchmarks/convergence.py                     # 3 variants x 3 seeds x 20 iterations
    python benchmarks/convergence.py --reuse             # re-summarise finished runs

Writes ``--out``/convergence.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spotlight.config import dump_config, load_config  # noqa: E402

VARIANTS = {
    "no-exploration": {"explore.mode": "off"},
    "critical-path": {"explore.mode": "critical_path", "explore.planner": "fixed"},
    "spotlight": {"explore.mode": "stale", "explore.planner": "bandit"},
}
LABELS = {
    "no-exploration": "(a) no exploration (RLBoost)",
    "critical-path": "(b) best-of-N on the critical path (veRL-omni(spot))",
    "spotlight": "(c) **Spotlight**: bandit-planned exploration on stale weights",
}
SCORE = "reward/control_mean"


def moving_average(x, k: int = 3) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if len(x) < k:
        return x
    return np.convolve(x, np.ones(k) / k, mode="valid")


def run_one(variant: str, seed: int, args, out_dir: pathlib.Path) -> dict:
    run_dir = out_dir / f"{variant}-s{seed}"
    metrics = run_dir / "metrics.jsonl"
    evaluation = run_dir / "eval.json"
    done = metrics.is_file() and len(metrics.read_text().splitlines()) == args.iterations and evaluation.is_file()
    if not (args.reuse and done):
        overrides = {
            "run.iterations": args.iterations,
            "run.keep_weight_versions": 0,  # fig09 scores every version of these runs
            "run.sample_grid_every": 5,
            "run.seed": seed,
            "data.shuffle_seed": seed,
            "planner.seed": seed,
            **VARIANTS[variant],
        }
        if variant == "critical-path":
            overrides["explore.num_candidates"] = args.best_of
        cfg = load_config(args.config, overrides)
        out_dir.mkdir(parents=True, exist_ok=True)
        conf = out_dir / f"{variant}-s{seed}.toml"
        dump_config(cfg, conf)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        cmd = [
            sys.executable,
            "-m",
            "spotlight.cli",
            "up",
            "--local",
            "--agents",
            str(args.agents),
            "--config",
            str(conf),
            "--run-dir",
            str(run_dir),
        ]
        print(f"== {variant} seed {seed}: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=REPO, check=True)
        print(f"== {variant} seed {seed}: {time.monotonic() - t0:.0f} s", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "spotlight.cli",
                "eval",
                "--run-dir",
                str(run_dir),
                "--num-seeds",
                str(args.eval_seeds),
            ],
            cwd=REPO,
            check=True,
        )
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"rows": rows, "eval": json.loads(evaluation.read_text())}


def summarize(results: dict[str, dict[int, dict]]) -> tuple[float, dict]:
    mean_curves = {
        v: np.mean([moving_average([r[SCORE] for r in run["rows"]]) for run in runs.values()], axis=0)
        for v, runs in results.items()
    }
    target = float(min(np.max(c) for c in mean_curves.values()))
    table = {}
    for v, runs in results.items():
        iters, walls, shares, it_s, tests, bases, reached = [], [], [], [], [], [], 0
        for run in runs.values():
            rows = run["rows"]
            s = moving_average([r[SCORE] for r in rows])
            hit = np.nonzero(s >= target - 1e-12)[0]
            t_iter = np.array([r["time/iteration_s"] for r in rows])
            crit = np.array([r["time/explore_critical_path_s"] for r in rows])
            if hit.size:
                n = int(hit[0]) + 3  # the average at index i covers iterations i..i+2 (1-based: i+1..i+3)
                reached += 1
                iters.append(n)
                walls.append(float(t_iter[:n].sum()))
            shares.append(float(crit.sum() / t_iter.sum()))
            it_s.append(float(t_iter.mean()))
            tests.append(run["eval"]["final"]["overall"])
            bases.append(run["eval"]["base"]["overall"])
        table[v] = {
            "runs": len(runs),
            "reached": reached,
            "iterations_to_target": iters,
            "wall_s_to_target": walls,
            "mean_iteration_s": float(np.mean(it_s)),
            "critical_path_share": float(np.mean(shares)),
            "test_score_final": tests,
            "test_score_base": float(np.mean(bases)),
            "saturated_score": float(np.max(mean_curves[v])),
        }
    return target, table


def _ms(xs: list[float], fmt: str) -> str:
    if not xs:
        return "—"
    return (fmt % np.mean(xs)) + " ± " + (fmt % (np.std(xs, ddof=1) if len(xs) > 1 else 0.0))


def plot(results, target: float, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for v, runs in results.items():
        curves = np.array([moving_average([r[SCORE] for r in run["rows"]]) for run in runs.values()])
        x = np.arange(3, curves.shape[1] + 3)
        m, sd = curves.mean(0), curves.std(0)
        ax.plot(x, m, linewidth=2, label=f"{v} (mean of {len(curves)} seeds, 3-iter avg)")
        ax.fill_between(x, m - sd, m + sd, alpha=0.15)
    ax.axhline(target, color="gray", linestyle="--", label="target")
    ax.set_xlabel("iteration")
    ax.set_ylabel("control-prompt reward (GenEval partial credit)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--best-of", type=int, default=24, help="N of the critical-path best-of-N baseline")
    ap.add_argument("--eval-seeds", type=int, default=4, help="test samples per prompt for final/")
    ap.add_argument("--config", default=None)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "convergence"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs found in --out")
    ap.add_argument(
        "--summarize-only",
        action="store_true",
        help="run nothing: summarise the finished runs found in --out (a partial benchmark)",
    )
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    results: dict[str, dict[int, dict]] = {v: {} for v in variants}
    for seed in seeds:  # seed-major: a partial benchmark still compares the variants
        for v in variants:
            if args.summarize_only:
                rd = out / f"{v}-s{seed}"
                if not ((rd / "eval.json").is_file() and (rd / "metrics.jsonl").is_file()):
                    print(f"== {v} seed {seed}: not finished, left out")
                    continue
                args.reuse = True
            results[v][seed] = run_one(v, seed, args, out)
    seeds_done = sorted({s for runs in results.values() for s in runs})
    common = [s for s in seeds_done if all(s in runs for runs in results.values())]
    if common != seeds_done:
        print(f"== summarising the seeds every variant finished: {common}")
        results = {v: {s: runs[s] for s in common} for v, runs in results.items()}
    seeds = common
    target, table = summarize(results)
    plot(results, target, out / "convergence.png")
    lines = [
        f"Target: {target:.4f} = the lowest saturated control-prompt score (best 3-iteration average of the seed-mean "
        "curve) among the variants. "
        f"{len(seeds)} run seeds per variant ({', '.join(map(str, seeds))}), {args.iterations} iterations, "
        f"{args.agents} local spot agents; mean ± sample std over seeds.",
        "",
        "| variant | reached target | iterations to target (runs that reached it) | wall time to target (s) "
        "| mean iteration (s) | exploration on critical path (share of iteration time) | test score of final/ (base "
        + f"{np.mean([t['test_score_base'] for t in table.values()]):.3f}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, row in table.items():
        lines.append(
            f"| {LABELS.get(v, v)} | {row['reached']}/{row['runs']} | {_ms(row['iterations_to_target'], '%.1f')} | "
            f"{_ms(row['wall_s_to_target'], '%.0f')} "
            f"| {row['mean_iteration_s']:.1f} | {100 * row['critical_path_share']:.1f} % | "
            f"{_ms(row['test_score_final'], '%.3f')} |"
        )
    text = "\n".join(lines)
    (out / "convergence.md").write_text(text + "\n")
    (out / "convergence.json").write_text(
        json.dumps(
            {"target": target, "table": table, "seeds": seeds, "iterations": args.iterations},
            indent=2,
            default=lambda o: None if isinstance(o, float) and math.isnan(o) else o,
        )
    )
    print(text)


if __name__ == "__main__":
    main()
