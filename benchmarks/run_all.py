"""``benchmarks/run-all --budget-min N``: run the paper-figure scripts that fit in N minutes.

Each figure script has an estimated toy-scale run time on a 2-core CPU machine
(:data:`FIGURES`). :func:`select` — pure: figures, budget and what is missing in, decisions
out — takes the figures cheapest first while their estimates fit in what is left of the budget,
and gives every other figure its reason for being skipped (over budget, or an input it reads is
missing). The chosen ones then run in the paper's order; the summary names what ran (with its
real minutes and exit status) and what was skipped and why, under the provenance line (commit,
machine, command, date), and is written to ``benchmarks/results/run_all.json``.

    benchmarks/run-all --budget-min 5          # the simulated and table-only figures
    benchmarks/run-all --budget-min 30         # + the short local runs (Fig. 3, 9, 16a, 6/12 from JSON)
    benchmarks/run-all --budget-min 30 --only fig08,fig14 --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


@dataclasses.dataclass(frozen=True)
class Figure:
    """One figure script: ``name`` (paper numbering), ``script`` (under benchmarks/), estimated
    toy-scale minutes on 2 CPU cores, extra ``args``, and ``needs``: files (relative to the
    repository) it reads, without which it cannot run."""

    name: str
    script: str
    est_min: float
    args: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()


FIGURES: tuple[Figure, ...] = (
    Figure("fig03", "fig03_phase_times.py", 6.0),
    Figure("fig04", "fig04_fragmentation.py", 0.5),
    Figure("fig06_12", "fig06_12_reconfiguration.py", 0.2, needs=("benchmarks/out/reconfig.json",)),
    Figure("fig08", "fig08_cost_to_target.py", 0.5),
    Figure("fig09", "fig09_heldout_score.py", 15.0),
    Figure("fig10_11", "fig10_11_convergence.py", 0.2, needs=("benchmarks/out/convergence/convergence.json",)),
    Figure("fig13", "fig13_preemption_cycles.py", 1.5),
    Figure("fig14", "fig14_ablation.py", 0.5),
    Figure("fig15", "fig15_scalability.py", 3.0),
    Figure("fig16a", "fig16a_candidates.py", 4.0),
    Figure("fig17", "fig17_planner_beta.py", 1.5, ("--seeds", "5")),
    Figure("table2", "table2_configs.py", 0.2),
)
"""Paper order. Estimates: measured toy runs on the project's 2-core machine (rounded up)."""


def select(
    figures: list[Figure] | tuple[Figure, ...], budget_min: float, missing: dict[str, str] | None = None
) -> tuple[list[Figure], list[tuple[Figure, str]]]:
    """Which figures to run within ``budget_min`` minutes.

    Figures named in ``missing`` (name → what is missing) are skipped for that reason; the rest
    are taken cheapest first (ties: paper order) while their estimates fit in the budget left.

    Returns:
        (to run, in the order of ``figures``; [(skipped figure, one-line reason)], in the order of ``figures``).

    Raises:
        ValueError: a negative budget.
    """
    if budget_min < 0:
        raise ValueError(f"--budget-min must be >= 0 (got {budget_min:g})")
    missing = missing or {}
    order = {f.name: i for i, f in enumerate(figures)}
    left = budget_min
    chosen: set[str] = set()
    reasons: dict[str, str] = {}
    for f in sorted(figures, key=lambda f: (f.est_min, order[f.name])):
        if f.name in missing:
            reasons[f.name] = f"input missing: {missing[f.name]}"
        elif f.est_min <= left + 1e-9:
            chosen.add(f.name)
            left -= f.est_min
        else:
            reasons[f.name] = f"needs ~{f.est_min:g} min, {left:.1f} min of the {budget_min:g}-min budget left"
    return [f for f in figures if f.name in chosen], [(f, reasons[f.name]) for f in figures if f.name in reasons]


def missing_inputs(figures, repo: pathlib.Path = REPO) -> dict[str, str]:
    """``{name: first missing file}`` for the figures whose ``needs`` are not all on disk."""
    out = {}
    for f in figures:
        for need in f.needs:
            if not (repo / need).exists():
                out[f.name] = f"{need} (see {f.script}'s --help to produce it)"
                break
    return out


def main(argv: list[str] | None = None) -> int:
    from _provenance import provenance, provenance_line

    ap = argparse.ArgumentParser(
        prog="benchmarks/run-all", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--budget-min", type=float, required=True, help="minutes of wall time to spend")
    ap.add_argument("--only", default=None, help="comma-separated figure names to consider (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="only say what would run")
    args = ap.parse_args(argv)
    figures = list(FIGURES)
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in {f.name for f in FIGURES}]
        if unknown:
            print(
                f"error: unknown figure {', '.join(unknown)}; choose from {', '.join(f.name for f in FIGURES)}",
                file=sys.stderr,
            )
            return 2
        figures = [f for f in FIGURES if f.name in names]
    try:
        run, skipped = select(figures, args.budget_min, missing_inputs(figures))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"run-all: budget {args.budget_min:g} min; running {len(run)} of {len(figures)}: "
        f"{', '.join(f.name for f in run) or '-'} (~{sum(f.est_min for f in run):.1f} min estimated)",
        flush=True,
    )
    done = []
    t_all = time.monotonic()
    for f in run:
        cmd = [sys.executable, str(REPO / "benchmarks" / f.script), *f.args]
        print(f"\n=== {f.name}: python benchmarks/{f.script} {' '.join(f.args)} (~{f.est_min:g} min)", flush=True)
        if args.dry_run:
            continue
        t0 = time.monotonic()
        rc = subprocess.run(cmd, cwd=REPO).returncode
        done.append(
            {
                "name": f.name,
                "script": f.script,
                "rc": rc,
                "minutes": (time.monotonic() - t0) / 60,
                "est_min": f.est_min,
            }
        )
    print(f"\nrun-all summary ({(time.monotonic() - t_all) / 60:.1f} min):")
    for d in done:
        print(
            f"  ran     {d['name']:<9} {d['minutes']:5.1f} min (est. {d['est_min']:g}) "
            f" {'ok' if d['rc'] == 0 else 'FAILED rc=' + str(d['rc'])}"
        )
    for f, why in skipped:
        print(f"  skipped {f.name:<9} {why}")
    print(provenance_line())
    if not args.dry_run:
        out = REPO / "benchmarks" / "results" / "run_all.json"
        out.write_text(
            json.dumps(
                {
                    "provenance": provenance(),
                    "budget_min": args.budget_min,
                    "ran": done,
                    "skipped": [{"name": f.name, "reason": why} for f, why in skipped],
                },
                indent=2,
            )
        )
    return 0 if all(d["rc"] == 0 for d in done) else 1


if __name__ == "__main__":
    sys.exit(main())
