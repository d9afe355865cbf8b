"""Paper Fig. 3: per-iteration phase times (rollout, training) vs the number of spot GPUs.

Runs ``spotlight up --local`` on the embedded shapes task with exploration off (the paper's
characterisation runs plain GRPO) for each number of local spot agents in ``--agents``
(one CPU "GPU" each; the reserved node's rollout worker is always there), and reads
``time/rollout_s``, ``time/train_s`` and ``time/iteration_s`` from each run's metrics.jsonl.
The first iteration (process start-up, weight loading) is left out when there are more.

Toy scale on CPU (default: 0, 1, 2 spot agents x 3 iterations, ~5 min on 2 idle cores)::

    python benchmarks/fig03_phase_times.py
    python benchmarks/fig03_phase_times.py --agents 0,1,2,4 --iterations 4

All the "GPUs" of a local run share this machine's cores, so adding agents cannot scale the
rollout the way GPUs do: on 2 cores it stops helping beyond ~1 agent (the honest reading is the
training time staying flat while the rollout share moves). Real scale on a GPU cluster: run
``spotlight up --config examples/paper/<setup>.toml`` with 0, 4, 8, 12 spot GPUs joined
(``spotlight-agent join`` on the spot nodes) and pass the run directories with
``--run-dir SPOT_GPUS=PATH``.

Paper: with 4 reserved GPUs rollout and training are each about half of an iteration; 4, 8 and
12 spot GPUs cut the rollout time 2x, 3x and 4x while training time stays constant.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance_line, save_result  # noqa: E402
from _runs import parse_labelled, read_metrics, spotlight_cli  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default="0,1,2", help="numbers of local spot agents")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument(
        "--run-dir", action="append", default=[], help="SPOT_GPUS=PATH of finished runs (instead of running)"
    )
    ap.add_argument("--work", default=str(REPO / "benchmarks" / "out" / "fig03"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig03_phase_times.png"))
    args = ap.parse_args()

    runs: dict[int, pathlib.Path] = {int(k): v for k, v in parse_labelled(args.run_dir).items()}
    if not runs:
        from spotlight.config import dump_config, load_config

        work = pathlib.Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        conf = work / "config.toml"
        dump_config(load_config(None, {"explore.mode": "off", "run.sample_grid_every": 0}), conf)
        for n in [int(a) for a in args.agents.split(",")]:
            rd = work / f"agents{n}"
            if rd.exists():
                shutil.rmtree(rd)
            spotlight_cli(
                "up",
                "--local",
                "--agents",
                str(n),
                "--iterations",
                str(args.iterations),
                "--config",
                str(conf),
                "--run-dir",
                str(rd),
                "--timeout-s",
                "1200",
            )
            runs[n] = rd
    table = []
    for n, rd in sorted(runs.items()):
        rows = read_metrics(rd)
        use = rows[1:] if len(rows) > 1 else rows
        row = {"spot_gpus": n, "iterations": len(use), "run": str(rd)}
        for k in ("rollout_s", "train_s", "iteration_s"):
            row[k] = statistics.mean(r[f"time/{k}"] for r in use)
        table.append(row)
    base = table[0]
    print(
        f"Fig. 3: phase times per iteration (mean of iterations 2..{args.iterations if not args.run_dir else 'n'}), "
        "exploration off"
    )
    print(
        f"{'spot GPUs':>9} {'rollout (s)':>11} {'train (s)':>9} {'iteration (s)':>13} {'rollout speed-up':>16} "
        f"{'rollout share':>13}"
    )
    for row in table:
        row["rollout_speedup"] = base["rollout_s"] / row["rollout_s"]
        print(
            f"{row['spot_gpus']:>9} {row['rollout_s']:11.1f} {row['train_s']:9.1f} {row['iteration_s']:13.1f} "
            f"{row['rollout_speedup']:15.2f}x {100 * row['rollout_s'] / row['iteration_s']:12.0f}%"
        )
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    x = range(len(table))
    ax.bar(x, [r["rollout_s"] for r in table], color="#8fb3d9", label="rollout")
    ax.bar(x, [r["train_s"] for r in table], bottom=[r["rollout_s"] for r in table], color="#e6a57e", label="training")
    ax.set_xticks(list(x), [str(r["spot_gpus"]) for r in table])
    ax.set_xlabel("spot GPUs (local CPU agents)")
    ax.set_ylabel("seconds per iteration")
    ax.set_title("Fig. 3 (toy): phase times vs spot GPUs", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    out = save_result(fig, args.out, {"table": table}, indent=2)
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
