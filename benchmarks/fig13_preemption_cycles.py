"""Paper Fig. 13: iteration time vs preemption-recovery cycles per iteration, with and without
live migration (paper §6.5).

The synthetic trace is the paper's: within each iteration, n events each take the spot pool
from 8 GPUs to 4 (one GPU from each of the 4 two-GPU nodes, so every node is left at SP = 1)
and give them back 5 s later (``spotlight.traces.synthetic.preemption_cycles``). Without live
migration a revoked worker's in-flight batch is recomputed from scratch; with it, the batch is
committed to the Tensor Store and resumed from its step (paying the profile's ``commit_s`` when
it is restored). Simulated through the real cores (``spotlight.sim``) with the shipped
Qwen-Image / H100 profile at 1280x1280.

    python benchmarks/fig13_preemption_cycles.py                 # n = 0, 1, 2, 4, 8; ~1-2 min
    python benchmarks/fig13_preemption_cycles.py --cycles 0,1,2,4,8,16 --iterations 6

Paper: live migration cuts iteration time by up to 4.6 % at frequent revocations.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance_line, save_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", default="0,1,2,4,8")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--down-s", type=float, default=5.0, help="seconds until the revoked GPUs come back (paper: 5)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig13_preemption_cycles.png"))
    args = ap.parse_args()

    from spotlight.sim.profile import load_profile
    from spotlight.sim.simulator import POLICIES, simulate
    from spotlight.traces.synthetic import preemption_cycles

    prof = dataclasses.replace(load_profile(), spot_nodes=4, gpus_per_spot_node=2)
    on = POLICIES["spotlight"]
    off = dataclasses.replace(on, name="spotlight (no live migration)", live_migration=False)
    # the iteration window the cycles are spread over: a static pool's mean iteration
    static = preemption_cycles(4, 2, cycles_per_iteration=0, iteration_s=1.0, iterations=0)
    base = simulate(prof, on, static, iterations=args.iterations)
    iteration_s = statistics.mean(r["time/iteration_s"] for r in base.rows[1:])
    print(
        f"Fig. 13: {prof.name}, 4 x 2 spot GPUs, {args.iterations} iterations; "
        f"cycles spread over {iteration_s:.0f}s iterations, {args.down_s:g}s down"
    )
    print(
        f"{'cycles/iter':>11} {'migration':>9} {'iteration (s)':>13} {'overhead':>9} {'lost steps':>10} "
        f"{'revocations':>11}"
    )
    rows = []
    ref = {}
    for n in [int(x) for x in args.cycles.split(",")]:
        acts = preemption_cycles(
            4, 2, cycles_per_iteration=n, iteration_s=iteration_s, iterations=args.iterations + 2, down_s=args.down_s
        )
        for pol, label in ((on, "on"), (off, "off")):
            r = simulate(prof, pol, acts, iterations=args.iterations)
            it = statistics.mean(x["time/iteration_s"] for x in r.rows[1:])
            ref.setdefault(label, it) if n == 0 else None
            row = {
                "cycles": n,
                "migration": label,
                "iteration_s": it,
                "lost_steps": r.work_lost_steps,
                "revocations": r.preemptions,
            }
            rows.append(row)
    base_it = {
        lab: next(
            r["iteration_s"] for r in rows if r["cycles"] == min(x["cycles"] for x in rows) and r["migration"] == lab
        )
        for lab in ("on", "off")
    }
    for row in rows:
        row["overhead"] = row["iteration_s"] / base_it[row["migration"]] - 1
        print(
            f"{row['cycles']:>11} {row['migration']:>9} {row['iteration_s']:>13.0f} {100 * row['overhead']:>8.2f}% "
            f"{row['lost_steps']:>10.0f} {row['revocations']:>11}"
        )
    worst = max((r["cycles"] for r in rows))
    t_on = next(r["iteration_s"] for r in rows if r["cycles"] == worst and r["migration"] == "on")
    t_off = next(r["iteration_s"] for r in rows if r["cycles"] == worst and r["migration"] == "off")
    print(
        f"at {worst} cycles per iteration live migration saves {100 * (1 - t_on / t_off):.2f}% of iteration time "
        "(paper: up to 4.6%)"
    )
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for lab, colour in (("on", "tab:blue"), ("off", "tab:red")):
        pts = [(r["cycles"], r["iteration_s"] / 60) for r in rows if r["migration"] == lab]
        ax.plot(*zip(*pts), "o-", color=colour, label=f"live migration {lab}")
    ax.set_xlabel("preemption-recovery cycles per iteration")
    ax.set_ylabel("iteration time (min, simulated)")
    ax.set_title("8 -> 4 -> 8 spot GPUs per cycle")
    ax.legend(fontsize=8)
    out = save_result(fig, args.out, {"args": vars(args), "iteration_window_s": iteration_s, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
