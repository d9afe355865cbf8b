"""Convergence benchmark on the embedded task (issue "Dynamic exploration", paper §6.3).

Runs `spotlight up --local` three times with the same seeds and iteration budget:

  (a) no-exploration   explore.mode = "off"            (RLBoost: default seeds only)
  (b) critical-path    explore.mode = "critical_path"  (veRL-omni(spot): best-of-N on v_n
                       before each rollout, N = --best-of, keep top/bottom K/2)
  (c) spotlight        explore.mode = "stale", planner = "bandit" (dynamic exploration of
                       batch n+1 on stale v_n by the spot workers during training)

and reports, per variant: iterations to reach the target score (the lowest saturated
score among the variants, as the paper does in §6.2: saturated = best 3-iteration moving
average), mean iteration wall time, and exploration seconds on the critical path as a
share of iteration time. The score is the mean reward of the 4 control prompt groups
(default seeds, never explored), so selection never biases it. Writes a reward-vs-iteration
PNG and a markdown table.

    python benchmarks/convergence.py --iterations 20      # ~15-20 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import pathlib
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


def moving_average(x: list[float], k: int = 3) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if len(x) < k:
        return x
    return np.convolve(x, np.ones(k) / k, mode="valid")


def run_variant(name: str, overrides: dict, args, out_dir: pathlib.Path) -> list[dict]:
    run_dir = out_dir / name
    metrics = run_dir / "metrics.jsonl"
    if args.reuse and metrics.is_file() and len(metrics.read_text().splitlines()) == args.iterations:
        print(f"== {name}: reusing {metrics}", flush=True)
        return [json.loads(line) for line in metrics.read_text().splitlines()]
    cfg = load_config(args.config, {"run.iterations": args.iterations, "run.sample_grid_every": 0, **overrides})
    conf = out_dir / f"{name}.toml"
    out_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, conf)
    cmd = [sys.executable, "-m", "spotlight.cli", "up", "--local", "--agents", str(args.agents), "--config", str(conf), "--run-dir", str(run_dir)]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=REPO, check=True)
    print(f"== {name}: {time.monotonic() - t0:.0f}s", flush=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(results: dict[str, list[dict]], score_key: str) -> tuple[float, dict]:
    smoothed = {n: moving_average([r[score_key] for r in rows]) for n, rows in results.items()}
    saturated = {n: float(np.max(s)) for n, s in smoothed.items()}
    target = min(saturated.values())
    table = {}
    for n, rows in results.items():
        s = smoothed[n]
        hit = np.nonzero(s >= target)[0]
        # the moving average at index i covers iterations i..i+2: reached at iteration i+3
        iters = int(hit[0]) + 3 if hit.size else None
        it_s = np.array([r["time/iteration_s"] for r in rows])
        crit = np.array([r["time/explore_critical_path_s"] for r in rows])
        table[n] = {
            "iterations_to_target": iters,
            "saturated_score": saturated[n],
            "mean_iteration_s": float(it_s.mean()),
            "critical_path_share": float(crit.sum() / it_s.sum()),
            "final_score": float(s[-1]),
        }
    return target, table


def plot(results: dict[str, list[dict]], score_key: str, target: float, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, rows in results.items():
        y = [r[score_key] for r in rows]
        ax.plot(range(1, len(y) + 1), y, alpha=0.35)
        ma = moving_average(y)
        ax.plot(range(3, len(ma) + 3), ma, label=f"{n} (3-iter avg)", linewidth=2)
    ax.axhline(target, color="gray", linestyle="--", label="target")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"{score_key} (JPEG compressibility, control prompts)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--best-of", type=int, default=32, help="N of the critical-path best-of-N baseline")
    ap.add_argument("--config", default=None)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "convergence"))
    ap.add_argument("--score", default="reward/control_mean")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs found in --out (same --iterations)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    VARIANTS["critical-path"]["explore.num_candidates"] = args.best_of
    results = {n: run_variant(n, VARIANTS[n], args, out) for n in args.variants.split(",")}
    target, table = summarize(results, args.score)
    plot(results, args.score, target, out / "convergence.png")
    lines = [
        f"Target score (lowest saturated 3-iteration average of `{args.score}` among variants): {target:.4f}",
        "",
        "| variant | iterations to target | saturated score | mean iteration (s) | exploration on critical path (share of iteration time) |",
        "|---|---|---|---|---|",
    ]
    for n, row in table.items():
        it = row["iterations_to_target"] if row["iterations_to_target"] is not None else f"> {args.iterations}"
        lines.append(f"| {n} | {it} | {row['saturated_score']:.4f} | {row['mean_iteration_s']:.1f} | {100 * row['critical_path_share']:.1f} % |")
    text = "\n".join(lines)
    (out / "convergence.md").write_text(text + "\n")
    (out / "convergence.json").write_text(json.dumps({"target": target, "table": table}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
