"""Paper Fig. 4: spot GPU fragmentation over a spot trace (available vs fragmented GPUs
over time; time-weighted CDF of the fragmentation ratio).

A live GPU is *fragmented* when its node cannot host a complete SP group (paper §3.1):
a node with n live GPUs has ``n % SP`` of them. The trace records when spot capacity
comes and goes but not where, so every arrival and removal is placed on a random node,
seeded (§3.1: "we assume uniform GPU arrivals and revocations across nodes";
``spotlight.traces.formats.TracePlacement``). The paper's setting is 4 nodes × 2 H100 GPUs, SP = 2.

Two ways to fit a trace that peaks above 8 GPUs onto 8 (``TracePlacement``): *proportional*
(the local count follows the trace's availability curve scaled to capacity; the default,
closest to the paper's left panel) and *capped* (real events only; arrivals beyond capacity
are dropped).

    python benchmarks/fig04_fragmentation.py                     # full Bamboo p3 trace, seeds 0-9, ~10 s
    python benchmarks/fig04_fragmentation.py --nodes 4 --gpus-per-node 2 --sp 2 --seeds 20

Real scale: the computation is the same for any cluster; pass ``--nodes/--gpus-per-node``
of yours and ``--trace`` a trace of your provider (any format ``spotlight up --trace`` reads).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance_line, save_result  # noqa: E402

from spotlight.traces.formats import TracePlacement, fragmentation_summary, fragmentation_timeline, load_trace  # noqa: E402


def weighted_ratio_cdf(timeline: list[tuple[float, int, int]], end_s: float) -> list[tuple[float, float]]:
    """Time-weighted CDF of ``fragmented / live`` over the time with >= 1 live GPU.

    Returns ``[(ratio, share of time with ratio <= it)]`` sorted by ratio.
    """
    weights: dict[float, float] = {}
    for k, (t, live, frag) in enumerate(timeline):
        t_next = timeline[k + 1][0] if k + 1 < len(timeline) else end_s
        dt = max(0.0, min(t_next, end_s) - t)
        if dt > 0 and live > 0:
            r = frag / live
            weights[r] = weights.get(r, 0.0) + dt
    total = sum(weights.values()) or 1.0
    out, acc = [], 0.0
    for r in sorted(weights):
        acc += weights[r]
        out.append((r, acc / total))
    return out


def share_above(cdf: list[tuple[float, float]], threshold: float) -> float:
    """Share of (live) time with ratio > ``threshold``."""
    below = max((c for r, c in cdf if r <= threshold), default=0.0)
    return 1.0 - below


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(REPO / "examples" / "traces" / "bamboo" / "p3-trace.csv"))
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--sp", type=int, default=2, help="SP degree")
    ap.add_argument(
        "--seeds",
        type=int,
        default=10,
        help="placement seeds 0..N-1 (the CDF is of seed 0; the table gives mean and range)",
    )
    ap.add_argument("--mode", choices=("proportional", "capped"), default="proportional")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig04_fragmentation.png"))
    args = ap.parse_args()

    events = load_trace(args.trace)
    end_s = events[-1].t_s
    rows = []
    first = None
    for seed in range(args.seeds):
        placement = TracePlacement(args.nodes, args.gpus_per_node, seed, scale_to_capacity=args.mode == "proportional")
        actions = placement.plan(events, end_s=end_s)
        tl = fragmentation_timeline(actions, args.sp)
        summ = fragmentation_summary(actions, args.sp, end_s=end_s)
        cdf = weighted_ratio_cdf(tl, end_s)
        rows.append(
            {
                "seed": seed,
                "time_any_fragmented": summ["time_any_fragmented"],
                "time_ratio_above_0.2": share_above(cdf, 0.2),
                "mean_ratio": summ["mean_ratio"],
                "fragmented_gpu_time_share": summ["gpu_time_share"],
            }
        )
        if first is None:
            first = (tl, cdf)

    def stat(key):
        vals = [r[key] for r in rows]
        return sum(vals) / len(vals), min(vals), max(vals)

    print(
        f"Fig. 4: {pathlib.Path(args.trace).name}, {end_s / 3600:.1f} h, "
        f"{args.nodes} nodes x {args.gpus_per_node} GPUs, SP={args.sp}, {args.mode}, {args.seeds} placement seeds"
    )
    print(f"{'metric':<52} {'mean':>7} {'min':>7} {'max':>7}   paper")
    paper = {
        "time_any_fragmented": ">= 1 GPU fragmented, share of trace time",
        "time_ratio_above_0.2": "> 20 % of live GPUs fragmented, share of live time",
        "mean_ratio": "mean fragmented / live (time-weighted)",
        "fragmented_gpu_time_share": "fragmented GPU-hours / live GPU-hours",
    }
    paper_val = {
        "time_any_fragmented": "~70 %",
        "time_ratio_above_0.2": "> 50 %",
        "mean_ratio": "-",
        "fragmented_gpu_time_share": "-",
    }
    for key, label in paper.items():
        m, lo, hi = stat(key)
        print(f"{label:<52} {100 * m:6.1f}% {100 * lo:6.1f}% {100 * hi:6.1f}%   {paper_val[key]}")
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl, cdf = first
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2.2, 1]})
    ts = [t / 3600 for t, _, _ in tl] + [end_s / 3600]
    live = [n for _, n, _ in tl] + [tl[-1][1]]
    frag = [f for _, _, f in tl] + [tl[-1][2]]
    a.step(ts, live, where="post", label="available spot GPUs", color="tab:blue")
    a.step(ts, frag, where="post", label=f"fragmented (node cannot host SP={args.sp})", color="tab:red")
    a.fill_between(ts, frag, step="post", color="tab:red", alpha=0.25)
    a.set_xlabel("trace time (h)")
    a.set_ylabel("GPUs")
    a.set_ylim(0, args.nodes * args.gpus_per_node + 0.5)
    a.legend(loc="upper right", fontsize=8)
    a.set_title(f"{pathlib.Path(args.trace).name}: {args.nodes}×{args.gpus_per_node} GPUs, seed 0")
    xs = [0.0] + [r for r, _ in cdf]
    ys = [0.0] + [c for _, c in cdf]
    b.step(xs, ys, where="post", color="tab:purple")
    b.axvline(0.2, color="grey", ls=":", lw=1)
    b.set_xlabel("fragmentation ratio (fragmented / available)")
    b.set_ylabel("time-weighted CDF")
    b.set_xlim(0, 1)
    b.set_ylim(0, 1.02)
    b.set_title("CDF (time with >= 1 live GPU)")
    out = save_result(fig, args.out, {"args": vars(args), "seeds": rows})
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
