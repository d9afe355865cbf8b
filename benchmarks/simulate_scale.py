"""Cluster-scale simulation: throughput and its scaling efficiency from 8 to 1,000 spot
GPUs, and how much faster than real time the simulator runs (paper §6.6,
Fig. 15: 7.7× throughput for 8× spot GPUs).

Every run drives the real pure cores (iteration core, Request Scheduler, Planner, Instance
Manager, seed bank) through ``spotlight.sim``, with the shipped Qwen-Image / H100 profile,
4 reserved GPUs and exploration uncapped while training runs (the paper's throughput
setting). Throughput = requests completed (rollout + exploration) per second of wall time.

    python benchmarks/simulate_scale.py                 # ~1 min on 2 CPU cores
    python benchmarks/simulate_scale.py --iterations 2 --gpus 8,64
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spotlight.sim.profile import load_profile  # noqa: E402
from spotlight.sim.simulator import simulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--gpus",
        default="8,64,256,1000",
        help="spot GPU counts (static pools of 8-GPU nodes; 8 = 4 nodes x 2 as in the paper)",
    )
    ap.add_argument(
        "--iterations",
        type=int,
        default=4,
        help=">= 3: throughput is measured between the ends of the first and the second-to-last iteration",
    )
    ap.add_argument(
        "--trace",
        default=str(REPO / "examples" / "traces" / "bamboo" / "p3-trace.csv"),
        help="trace for the 1,000-GPU trace-driven run ('' to skip)",
    )
    args = ap.parse_args()
    base = load_profile()
    rows = []
    print(
        f"{'spot GPUs':>9} {'nodes':>9} {'req/s':>8} {'scaling':>8} {'efficiency':>10} {'sim time':>10} "
        f"{'real time':>9} {'× real':>9} {'spot busy':>9}"
    )
    first = None
    for n in [int(x) for x in args.gpus.split(",")]:
        nodes, per = (n // 2, 2) if n <= 8 else (n // 8, 8)
        prof = dataclasses.replace(base, spot_nodes=nodes, gpus_per_spot_node=per)
        t0 = time.perf_counter()
        r = simulate(prof, "spotlight", None, iterations=args.iterations, max_candidates_per_prompt=10**7)
        real = time.perf_counter() - t0
        # steady state: from the end of the first iteration (nodes started) to the end of the
        # last one that explored a next batch (the final iteration has nothing to explore)
        a, b = r.rows[0], r.rows[-2]
        rps = (b["sim/requests_done"] - a["sim/requests_done"]) / (b["t_s"] - a["t_s"])
        first = first or (n, rps)
        scale = rps / first[1]
        eff = scale / (n / first[0])
        rows.append((n, rps, scale, eff))
        print(
            f"{n:>9} {nodes:>4}x{per:<4} {rps:>8.2f} {scale:>7.1f}x {eff:>10.2f} {r.wall_s / 3600:>8.1f} h "
            f"{real:>7.1f} s {r.wall_s / real:>8,.0f}x {r.spot_busy_training:>9.3f}"
        )
    if args.trace:
        from spotlight.traces.actions import trace_actions

        prof = dataclasses.replace(base, spot_nodes=125, gpus_per_spot_node=8)
        actions = trace_actions(args.trace, spot_nodes=125, gpus_per_node=8, seed=0, replicas=25, until_s=30 * 86400.0)
        t0 = time.perf_counter()
        r = simulate(prof, "spotlight", actions, iterations=args.iterations, max_candidates_per_prompt=10**7)
        real = time.perf_counter() - t0
        print(
            f"\ntrace-driven, 125 nodes x 8 GPUs (25 seeded placements of {pathlib.Path(args.trace).name}, "
            f"peak {25 * 32} GPUs): "
            f"{r.iterations} iterations, {r.wall_s / 3600:.1f} h simulated in {real:.1f} s = {r.wall_s / real:,.0f}x "
            "real time; "
            f"{r.preemptions} revocations, {r.additions} additions, {r.requests_done:,} requests, "
            f"spot utilisation {r.spot_utilisation:.3f}, "
            f"spot busy while training {r.spot_busy_training:.3f}, critical path {100 * r.critical_path_share:.2f}%"
        )


if __name__ == "__main__":
    main()
