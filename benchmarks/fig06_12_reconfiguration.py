"""Paper Fig. 6 (where a reconfiguration's time goes) and Fig. 12 (a node's rollout throughput
around a GPU revocation and a GPU addition, elastic SP vs engine restart).

Reads the output of ``benchmarks/reconfig.py`` (``--from``, default
``benchmarks/out/reconfig.json``): real ``spotlight-agent`` processes with their real Rollout
Worker processes on one node with 2 CPU "GPUs" (SP 2), reconfigured in place (elastic SP, warm
spare) or by killing and restarting the node's agent and workers (what RLBoost-style engines
do). ``--rerun`` runs that benchmark first (``--repeats``; ~8 min per repeat on 2 busy cores,
the cold-process grant skipped).

* Fig. 6: the time from the event until the group at the new size serves, split into what the
  workers log — process start, imports and registration (the remainder: until the worker's
  group-formation began), ``rendezvous`` (waiting for the group's members), ``weights``
  (receiving the weights: a broadcast from the co-located peer, or the network load from the
  coordinator after a restart), ``build`` (building the parallel model), ``teardown`` — for the
  member whose phases took longest.
* Fig. 12: the node's denoising throughput (normalised to its SP-2 rate) against time around
  the event, *reconstructed* from the measured times: zero while the node stalls (no denoising
  step completes), the old rate before, the new rate after it serves; an SP-1 node is taken to
  run at half the SP-2 node's rate. The script does not record a per-step timeline.

    python benchmarks/fig06_12_reconfiguration.py                      # reads the JSON, ~5 s
    python benchmarks/fig06_12_reconfiguration.py --rerun --repeats 1  # ~8 min on 2 CPU cores

Real scale on a GPU cluster: run ``benchmarks/reconfig.py`` on a GPU node of the cluster (it
starts a real agent there; pass ``--num-layers`` for a bigger model), then this script on its
JSON.

Paper: an engine restart takes ~2 min (Fig. 6: CPU scheduler initialisation and remote weight
loading are 62 % of it, worker launch and communication-group setup 38 %); in Fig. 12 a restart
takes the node's throughput to zero for ~120 s on a revocation and on an addition, while
elastic SP drops it only marginally on a revocation and adds the GPU in ~45 s.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance, provenance_line, save_result  # noqa: E402

SCENARIOS = {
    "elastic_revoke": "revocation 2->1, elastic",
    "restart_revoke": "revocation 2->1, restart",
    "elastic_add": "addition 1->2, elastic + spare",
    "cold_add": "addition 1->2, elastic, cold",
    "restart_add": "addition 1->2, restart",
}
PHASES = ("start + import + register", "rendezvous", "weights", "build", "teardown")


def breakdown(event: dict) -> dict[str, float]:
    """Split ``serve_s`` of one measured event into :data:`PHASES` (seconds), using the member whose
    logged phases took longest; the remainder is everything before its group formation began
    (for an elastic revocation: the survivor finishing the step in progress)."""
    members = event["phases_s"].values()
    worst = max(members, key=lambda p: sum(p.values()))
    logged = {k: float(worst.get(k, 0.0)) for k in PHASES[1:]}
    return {PHASES[0]: max(0.0, event["serve_s"] - sum(logged.values())), **logged}


def throughput_curve(stall_s: float, serve_s: float, before: float, after: float, restart: bool, horizon_s: float):
    """(t, rate) points of the node's throughput around an event at t = 0 (see the docstring)."""
    stall_from = 0.0 if restart else max(0.0, serve_s - stall_s)
    return [
        (-10.0, before),
        (stall_from, before),
        (stall_from, 0.0),
        (serve_s, 0.0),
        (serve_s, after),
        (horizon_s, after),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", default=str(REPO / "benchmarks" / "out" / "reconfig.json"))
    ap.add_argument("--rerun", action="store_true", help="run benchmarks/reconfig.py into --from first")
    ap.add_argument("--repeats", type=int, default=1, help="with --rerun")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig06_12_reconfiguration.png"))
    args = ap.parse_args()
    src = pathlib.Path(args.src)
    if args.rerun:
        cmd = [
            sys.executable,
            str(REPO / "benchmarks" / "reconfig.py"),
            "--repeats",
            str(args.repeats),
            "--skip-cold",
            "--out",
            str(src),
        ]
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    if not src.is_file():
        sys.exit(
            f"error: {src} not found; run `python benchmarks/reconfig.py --out {src}` (or this script with --rerun)"
        )
    data = json.loads(src.read_text())
    raw = {k: v for k, v in data["raw"].items() if v}
    parts = {k: [breakdown(e) for e in v] for k, v in raw.items()}
    mean_parts = {k: {p: sum(b[p] for b in v) / len(v) for p in PHASES} for k, v in parts.items()}
    med = data["median"]
    print(
        f"Fig. 6/12: one node, 2 CPU 'GPUs', {data['weights_mb']:.0f} MB weights, {data['repeats']} repeat(s); "
        "seconds from the event (mean over repeats)"
    )
    print(f"{'scenario':>32} {'serve':>7} {'stall':>7} " + " ".join(f"{p[:12]:>12}" for p in PHASES))
    for k, label in SCENARIOS.items():
        if k in mean_parts:
            print(
                f"{label:>32} {med[k]['serve_s']:7.2f} {med[k]['stall_s']:7.2f} "
                + " ".join(f"{mean_parts[k][p]:12.2f}" for p in PHASES)
            )
    r = data["ratios"]
    print(
        f"restart / elastic: revocation serve {r['revoke_serve_s']:.0f}x, stall {r['revoke_stall_s']:.0f}x; "
        f"addition serve {r['add_serve_s']:.0f}x, stall {r['add_stall_s']:.0f}x"
    )
    for k in ("restart_revoke", "restart_add"):
        if k in mean_parts:
            b = mean_parts[k]
            tot = sum(b.values())
            print(
                f"{SCENARIOS[k]}: start/import/register + weights = {100 * (b[PHASES[0]] + b['weights']) / tot:.0f}% "
                "of the restart (paper Fig. 6: scheduler init + remote weights 62%)"
            )
    prov = provenance()
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    ax = axes[0]
    keys = [k for k in SCENARIOS if k in mean_parts]
    left = [0.0] * len(keys)
    colors = ["#bbbbbb", "#8fb3d9", "#e6a57e", "#9fd89f", "#d9a0d9"]
    for p, c in zip(PHASES, colors):
        vals = [mean_parts[k][p] for k in keys]
        ax.barh(range(len(keys)), vals, left=left, color=c, label=p)
        left = [a + b for a, b in zip(left, vals)]
    for i, k in enumerate(keys):
        ax.text(left[i], i, f" {left[i]:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(keys)), [SCENARIOS[k] for k in keys], fontsize=8)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("seconds until the new group serves (symlog)")
    ax.set_title("Fig. 6: reconfiguration time by component", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    horizon = max(med[k]["serve_s"] for k in med) + 20
    for ax, (ev, before, after, title) in zip(
        axes[1:],
        (("revoke", 1.0, 0.5, "Fig. 12(a): revoking one GPU"), ("add", 0.5, 1.0, "Fig. 12(b): adding one GPU")),
    ):
        for path, style in (("elastic", "-"), ("restart", "--")):
            k = f"{path}_{ev}"
            if k not in med:
                continue
            pts = throughput_curve(med[k]["stall_s"], med[k]["serve_s"], before, after, path == "restart", horizon)
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                label=f"{'Spotlight (elastic SP)' if path == 'elastic' else 'restart (RLBoost)'}",
                linewidth=2,
            )
        ax.set_xlabel("seconds from the event")
        ax.set_ylabel("node throughput / SP-2 rate")
        ax.set_ylim(-0.05, 1.1)
        ax.set_title(title + " (reconstructed)", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    out = save_result(
        fig,
        args.out,
        {
            "provenance": prov,
            "source": str(src),
            "weights_mb": data["weights_mb"],
            "repeats": data["repeats"],
            "median": med,
            "ratios": r,
            "breakdown_s": mean_parts,
            "raw": raw,
        },
        indent=2,
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
