"""``spotlight simulate``: cost and time to target of each policy on a spot trace."""

from __future__ import annotations

import json
import math
import pathlib
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        trace: Optional[pathlib.Path] = typer.Option(
            None,
            "--trace",
            help="Spot trace (any format --trace of `spotlight up` reads, e.g. the Bamboo p3-trace.csv in examples/traces/bamboo/); replayed whole, looped forward/backward when the job outlasts it. Without it: a static spot pool.",
        ),
        profile: Optional[pathlib.Path] = typer.Option(
            None,
            "--profile",
            help="Simulation profile TOML (default: the shipped Qwen-Image 20B / H100 profile, qwen-image-h100.toml in spotlight/sim/profiles/).",
        ),
        policy: Optional[List[str]] = typer.Option(
            None,
            "--policy",
            help="Policy to simulate (repeatable): spotlight, rlboost, rlboost+explore, verl-omni-spot, reserved-only. Default: the four of the paper's comparison.",
        ),
        iterations: Optional[int] = typer.Option(
            None,
            "--iterations",
            min=1,
            help="Iterations per policy (default: the profile's iterations to target for each policy).",
        ),
        spot_nodes: Optional[int] = typer.Option(
            None, "--spot-nodes", min=1, help="Spot nodes (default: the profile's)."
        ),
        gpus_per_node: Optional[int] = typer.Option(
            None, "--gpus-per-node", min=1, help="GPUs per spot node (default: the profile's)."
        ),
        trace_replicas: int = typer.Option(
            1,
            "--trace-replicas",
            min=1,
            help="Superpose this many independent placements of the trace (for clusters larger than the trace's peak).",
        ),
        trace_seed: int = typer.Option(
            0, "--trace-seed", help="Seed of the random placement of trace events onto nodes."
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of the synthetic rewards and the Planner."),
        max_candidates: int = typer.Option(
            256,
            "--max-candidates",
            min=1,
            help="Cap on planned + streamed exploration candidates per prompt (large = uncapped, paper §6.6).",
        ),
        out: pathlib.Path = typer.Option(
            pathlib.Path("runs/simulate"), "--out", help="Directory for simulate.json and simulate.png."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table."),
    ) -> None:
        """Discrete-event simulation of the job under each policy: cost and wall time to the target
        score, GPU-hours by kind, spot utilisation, critical-path share, preemptions and lost work."""
        import dataclasses
        import sys

        console = (
            Console(emoji=False, soft_wrap=True)
            if sys.stdout.isatty()
            else Console(emoji=False, soft_wrap=True, width=170)
        )
        from spotlight.errors import SpotlightError
        from spotlight.sim.profile import DEFAULT_PROFILE, load_profile
        from spotlight.sim.report import comparison_rows, plot_comparison
        from spotlight.sim.simulator import POLICIES
        from spotlight.sim.simulator import simulate as run_policy

        names = list(dict.fromkeys(policy or ["spotlight", "rlboost", "verl-omni-spot", "reserved-only"]))
        err = Console(emoji=False, stderr=True, soft_wrap=True)
        try:
            unknown = [n for n in names if n not in POLICIES]
            if unknown:
                raise ValueError(f"unknown policy {', '.join(map(repr, unknown))}; choose from {', '.join(POLICIES)}")
            prof = load_profile(profile or DEFAULT_PROFILE)
            if spot_nodes is not None or gpus_per_node is not None:
                prof = dataclasses.replace(
                    prof,
                    spot_nodes=spot_nodes or prof.spot_nodes,
                    gpus_per_spot_node=gpus_per_node or prof.gpus_per_spot_node,
                )
                from spotlight.sim.profile import check_cluster

                check_cluster(prof)
            if trace is None and trace_replicas > 1:
                raise ValueError("--trace-replicas needs --trace")
            if trace is not None:  # readable, before --out is created
                with open(trace, "rb"):
                    pass
            try:
                out.mkdir(parents=True, exist_ok=True)
                probe = out / ".write-test"
                probe.write_text("")
                probe.unlink()
            except OSError as exc:
                raise ValueError(f"--out {out}: not a writable directory ({exc.strerror or exc})") from None
            missing = [n for n in names if iterations is None and n not in prof.iterations_to_target]
            if missing:
                raise ValueError(
                    f"profile {prof.source} has no [iterations_to_target] for {', '.join(missing)}; add them or pass --iterations"
                )
            actions = None
            trace_note = f"static pool of {prof.spot_nodes}×{prof.gpus_per_spot_node} spot GPUs"
            if trace is not None:
                from spotlight.traces.actions import trace_actions

                actions = trace_actions(
                    trace,
                    spot_nodes=prof.spot_nodes,
                    gpus_per_node=prof.gpus_per_spot_node,
                    seed=trace_seed,
                    replicas=trace_replicas,
                )
                trace_note = f"trace {trace.name} on {prof.spot_nodes}×{prof.gpus_per_spot_node} spot GPUs" + (
                    f" ({trace_replicas} placements)" if trace_replicas > 1 else ""
                )
        except (SpotlightError, ValueError, OSError, UnicodeDecodeError) as exc:
            where = f"{trace}: " if isinstance(exc, UnicodeDecodeError) else ""
            if (
                isinstance(exc, OSError)
                and trace is not None
                and exc.filename is not None
                and str(exc.filename) == str(trace)
            ):
                why = f"--trace {trace}: {exc.strerror or exc}"  # as `spotlight up --trace` says it
            else:
                why = where + str(exc)
            console.print(f"[red]error:[/red] {escape(why)}")
            raise typer.Exit(2)
        results = []
        for name in names:
            with console.status(f"simulating {name} …"):
                r = run_policy(
                    prof, name, actions, iterations=iterations, seed=seed, max_candidates_per_prompt=max_candidates
                )
            results.append(r)
            if not r.finished:
                err.print(
                    f"[yellow]warning:[/yellow] {name} did not finish {iterations or prof.iterations_to_target[name]} iterations in the simulated time limit"
                )
        rows = comparison_rows(results)
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "profile": prof.name,
            "profile_path": prof.source,
            "trace": str(trace) if trace else None,
            "setup": trace_note,
            "results": rows,
            "sim": [r.summary() for r in results],
        }

        def finite(x):  # JSON has no NaN: "not applicable" values become null
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, dict):
                return {k: finite(v) for k, v in x.items()}
            if isinstance(x, list):
                return [finite(v) for v in x]
            return x

        payload = finite(payload)
        (out / "simulate.json").write_text(json.dumps(payload, indent=2))
        plot_comparison(results, out / "simulate.png", title=f"{prof.name}; {trace_note}")
        if as_json:
            print(json.dumps(payload, indent=2))
            return

        def pct(x: float | None) -> str:
            return "—" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"

        cols = (
            "policy",
            "iterations",
            "wall time",
            "cost",
            "vs spotlight",
            "spot GPU-h",
            "reserved GPU-h",
            "spot util.",
            "spot busy (training)",
            "critical path",
            "preemptions",
            "work lost",
        )
        cells = [
            [
                row["policy"],
                str(row["iterations_to_target"]) + ("" if row["finished"] else " (unfinished)"),
                f"{row['wall_h']:.1f} h",
                f"${row['cost_usd']:,.0f}",
                f"{row['cost_vs_baseline']:.2f}×" if row["cost_vs_baseline"] is not None else "—",
                f"{row['spot_gpu_hours']:.0f}",
                f"{row['reserved_gpu_hours']:.0f}",
                pct(row["spot_utilisation"]),
                pct(row["spot_busy_training"]),
                pct(row["critical_path_share"]),
                str(row["preemptions"]),
                f"{row['work_lost_steps']:.0f} steps",
            ]
            for row in payload["results"]
        ]
        table = Table(title=f"cost to target — {prof.name}; {trace_note}")
        need = sum(max(len(c), *(len(r[k]) for r in cells)) + 3 for k, c in enumerate(cols)) + 1
        if console.width >= need:  # wide enough: one row per policy
            for col in cols:
                table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
            for r in cells:
                table.add_row(*r)
        else:  # narrower: one column per policy, so nothing is cut
            table.add_column("", justify="left", no_wrap=True)
            for r in cells:
                table.add_column(r[0], justify="right", no_wrap=True)
            for k, col in enumerate(cols[1:], start=1):
                table.add_row(col, *[r[k] for r in cells])
        console.print(table)
        speed = sum(r.wall_s for r in results) / max(1e-9, sum(r.sim_elapsed_s for r in results))
        console.print(
            f"iterations to target and every cost come from {escape(prof.source)} (each number with its source); simulated {speed:,.0f}× faster than real time"
        )
        console.print(f"wrote {escape(str(out / 'simulate.json'))} and {escape(str(out / 'simulate.png'))}")
