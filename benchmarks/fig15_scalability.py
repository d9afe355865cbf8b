"""Paper Fig. 15: throughput and cost per 1,000 requests as the number of spot GPUs grows
(4 reserved GPUs fixed; exploration uncapped so spot GPUs explore for the whole training
window; throughput counts rollout and exploration requests; paper §6.7).

Simulated through the real cores (``spotlight.sim``) with the shipped Qwen-Image / H100
profile; static spot pools (8 GPUs = 4 nodes × 2, larger = 8-GPU nodes). Cost counts every
GPU the job holds for as long as it holds it: the reserved GPUs (training and rollout) and the
spot GPUs, at the profile's prices.

    python benchmarks/fig15_scalability.py                       # 8 -> 256 spot GPUs, ~3 min
    python benchmarks/fig15_scalability.py --gpus 8,16,32,64 --iterations 4

Paper: 7 -> 50 req/s from 8 to 64 spot GPUs (7.7x for 8x) and $2.72 -> $1.25 per 1,000
requests (2.18x). Real scale: the same numbers come from real runs' ``metrics.jsonl``
(``sim/requests_done`` is ``requests/done`` there) — run Spotlight with
``explore.max_candidates_per_prompt`` large and pass different spot pool sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance_line, save_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="8,16,32,64,128,256")
    ap.add_argument(
        "--iterations",
        type=int,
        default=4,
        help=">= 3: measured from the end of the first to the end of the second-to-last iteration",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig15_scalability.png"))
    args = ap.parse_args()

    from spotlight.sim.profile import load_profile
    from spotlight.sim.simulator import simulate

    base = load_profile()
    rows = []
    print(
        f"Fig. 15: {base.name}, {base.reserved_gpus} reserved GPUs, exploration uncapped, {args.iterations} iterations"
    )
    print(
        f"{'spot GPUs':>9} {'req/s':>8} {'scaling':>8} {'$ / 1k req':>10} {'spot busy':>9} {'spot $/h':>9} "
        f"{'reserved $/h':>12}"
    )
    for n in [int(x) for x in args.gpus.split(",")]:
        nodes, per = (n // 2, 2) if n <= 8 else (n // 8, 8)
        prof = dataclasses.replace(base, spot_nodes=nodes, gpus_per_spot_node=per)
        r = simulate(prof, "spotlight", None, iterations=args.iterations, max_candidates_per_prompt=10**7)
        a, b = r.rows[0], r.rows[-2]
        dt = b["t_s"] - a["t_s"]
        done = b["sim/requests_done"] - a["sim/requests_done"]
        cost = b["cost/usd"] - a["cost/usd"]
        rps = done / dt
        row = {
            "spot_gpus": n,
            "req_per_s": rps,
            "usd_per_1k_requests": 1000 * cost / done,
            "spot_busy_training": r.spot_busy_training,
            "spot_usd_per_h": n * prof.spot_usd_per_gpu_hour,
            "reserved_usd_per_h": prof.reserved_gpus * prof.reserved_usd_per_gpu_hour,
        }
        rows.append(row)
        print(
            f"{n:>9} {rps:>8.3f} {rps / rows[0]['req_per_s']:>7.1f}x {row['usd_per_1k_requests']:>10.2f} "
            f"{r.spot_busy_training:>9.3f} {row['spot_usd_per_h']:>9.2f} {row['reserved_usd_per_h']:>12.2f}"
        )
    first, at64 = rows[0], next((r for r in rows if r["spot_gpus"] == 64), rows[-1])
    print(
        f"{first['spot_gpus']} -> {at64['spot_gpus']} spot GPUs: "
        f"throughput x{at64['req_per_s'] / first['req_per_s']:.2f} "
        f"(paper x7.7 for 8 -> 64), cost per request /{first['usd_per_1k_requests'] / at64['usd_per_1k_requests']:.2f} "
        "(paper /2.18)"
    )
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    xs = [r["spot_gpus"] for r in rows]
    a.plot(xs, [r["req_per_s"] for r in rows], "o-", label="Spotlight (simulated)")
    a.plot(xs, [rows[0]["req_per_s"] * x / xs[0] for x in xs], ":", color="grey", label="linear")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("spot GPUs")
    a.set_ylabel("requests / s (rollout + exploration)")
    a.set_title("(a) throughput")
    a.legend(fontsize=8)
    b.plot(xs, [r["usd_per_1k_requests"] for r in rows], "o-", color="tab:green")
    b.set_xscale("log", base=2)
    b.set_xlabel("spot GPUs")
    b.set_ylabel("$ per 1,000 requests")
    b.set_title("(b) cost per request")
    out = save_result(fig, args.out, {"args": vars(args), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
