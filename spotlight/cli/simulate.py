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

from spotlight.cli.messages import print_error
from spotlight.cli.progress import working
from spotlight.util.atomic_file import write_text_atomic
from spotlight.util.cli_paths import path_option
from spotlight.util.cli_run import interrupt_reported


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        trace: Optional[pathlib.Path] = path_option(
            None,
            "--trace",
            help="Spot trace (any format --trace of `spotlight up` reads, e.g. the Bamboo p3-trace.csv in "
            "examples/traces/bamboo/); replayed whole, looped forward/backward when the job outlasts it. "
            "Without it: a static spot pool.",
        ),
        profile: Optional[pathlib.Path] = path_option(
            None,
            "--profile",
            help="Simulation profile TOML (default: the shipped Qwen-Image 20B / H100 profile, "
            "qwen-image-h100.toml in spotlight/sim/profiles/).",
        ),
        policy: Optional[List[str]] = typer.Option(
            None,
            "--policy",
            help="Policy to simulate (repeatable): spotlight, rlboost, rlboost+explore, verl-omni-spot, "
            "reserved-only. Default: the four of the paper's comparison.",
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
        out: pathlib.Path = path_option(
            pathlib.Path("runs/simulate"), "--out", help="Directory for simulate.json and simulate.png."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table."),
    ) -> None:
        """Discrete-event simulation of the job under each policy: cost and wall time to target.

        Also GPU-hours by kind, spot utilisation, critical-path share, preemptions and lost work."""
        from spotlight.errors import SpotlightError

        console = _console()
        names = list(dict.fromkeys(policy or ["spotlight", "rlboost", "verl-omni-spot", "reserved-only"]))
        try:
            prof, actions, trace_note = _setup(
                names,
                trace=trace,
                profile=profile,
                iterations=iterations,
                spot_nodes=spot_nodes,
                gpus_per_node=gpus_per_node,
                trace_replicas=trace_replicas,
                trace_seed=trace_seed,
            )
            created = _make_out(out)  # last: a refused simulation leaves no empty --out behind
        except (SpotlightError, ValueError, OSError, UnicodeDecodeError) as exc:
            print_error(f"[red]error:[/red] {escape(_setup_error(exc, trace))}")
            raise typer.Exit(2)
        try:
            results = _simulate_all(console, prof, names, actions, iterations, seed=seed, max_candidates=max_candidates)
        except KeyboardInterrupt:  # nothing written yet: leave no empty --out behind either
            _remove_empty(created)
            print_error("interrupted: nothing written")  # on stderr, as every "interrupted" line
            interrupt_reported()
            raise typer.Exit(130)
        _report(
            console,
            prof,
            results,
            trace=trace,
            trace_note=trace_note,
            out=out,
            as_json=as_json,
            iterations_given=iterations is not None,
        )


def _console() -> Console:
    """The console of ``simulate``: 170 columns when stdout is not a terminal (the table fits a file)."""
    import sys

    if sys.stdout.isatty():
        return Console(emoji=False, soft_wrap=True)
    return Console(emoji=False, soft_wrap=True, width=170)


def _setup_error(exc: Exception, trace: Optional[pathlib.Path]) -> str:
    """The error line (without ``error:``) of a simulation :func:`_setup` refused with ``exc``;
    an unreadable ``--trace`` is named as ``spotlight up --trace`` names it."""
    if isinstance(exc, OSError) and trace is not None and exc.filename is not None and str(exc.filename) == str(trace):
        return f"--trace {trace}: {exc.strerror or exc}"
    return (f"{trace}: " if isinstance(exc, UnicodeDecodeError) else "") + str(exc)


def _setup(
    names: list[str],
    *,
    trace: Optional[pathlib.Path],
    profile: Optional[pathlib.Path],
    iterations: Optional[int],
    spot_nodes: Optional[int],
    gpus_per_node: Optional[int],
    trace_replicas: int,
    trace_seed: int,
):
    """``(profile, trace actions or None, setup note)`` of a simulation of policies ``names``
    (``--out`` is made afterwards, by :func:`_make_out`).

    Raises:
        ValueError: an unknown policy, ``--trace-replicas`` without ``--trace``, a spot node
            override too small for the profile's SP degree, or a policy without iterations to
            target.
        SpotlightError, OSError, UnicodeDecodeError: a bad profile or cluster size, an
            unreadable or malformed trace.
    """
    import dataclasses

    from spotlight.sim.profile import DEFAULT_PROFILE, load_profile
    from spotlight.sim.simulator import POLICIES

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
        from spotlight.sim.profile import ProfileError, check_cluster

        try:
            check_cluster(prof)
        except ProfileError:
            flags = " and ".join(
                f for f, v in (("--spot-nodes", spot_nodes), ("--gpus-per-node", gpus_per_node)) if v is not None
            )
            raise ValueError(
                f"{flags}: {prof.gpus_per_spot_node} GPU(s) per spot node cannot host the profile's SP degree "
                f"{prof.spot_sp} ([cluster] spot_sp in {prof.source}); give --gpus-per-node {prof.spot_sp} or more"
            ) from None
    if trace is None and trace_replicas > 1:
        raise ValueError("--trace-replicas needs --trace")
    if trace is not None:  # readable, before --out is created
        with open(trace, "rb"):
            pass
    missing = [n for n in names if iterations is None and n not in prof.iterations_to_target]
    if missing:
        raise ValueError(
            f"profile {prof.source} has no [iterations_to_target] for {', '.join(missing)}; "
            "add them or pass --iterations"
        )
    pool = f"{prof.spot_nodes}×{prof.gpus_per_spot_node} spot GPUs"
    if trace is None:
        actions, note = None, f"static pool of {pool}"
    else:
        from spotlight.traces.actions import trace_actions

        actions = trace_actions(
            trace,
            spot_nodes=prof.spot_nodes,
            gpus_per_node=prof.gpus_per_spot_node,
            seed=trace_seed,
            replicas=trace_replicas,
        )
        note = f"trace {trace.name} on {pool}" + (f" ({trace_replicas} placements)" if trace_replicas > 1 else "")
    return prof, actions, note


def _make_out(out: pathlib.Path) -> list[pathlib.Path]:
    """Create ``out`` (and its missing parents) and check that it takes files: the directories
    this call created, deepest first; on failure they are removed again.

    Raises:
        ValueError: ``out`` cannot be created or written to.
    """
    created = [d for d in (out, *out.parents) if not d.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        _remove_empty(created)
        raise ValueError(f"--out {out}: not a writable directory ({exc.strerror or exc})") from None
    return created


def _remove_empty(created: list[pathlib.Path]) -> None:
    """Remove the directories :func:`_make_out` created, deepest first, as far as they are empty."""
    for d in created:
        try:
            d.rmdir()
        except OSError:
            return


def _simulate_all(console: Console, prof, names: list[str], actions, iterations, *, seed: int, max_candidates: int):
    """The :func:`spotlight.sim.simulator.simulate` result of each policy in ``names``, one
    spinner each; a policy that did not finish in the simulated time limit is warned about on stderr."""
    from spotlight.sim.simulator import simulate as run_policy

    err = Console(emoji=False, stderr=True, soft_wrap=True)
    results = []
    for name in names:
        with working(err, f"simulating {name} …"):
            r = run_policy(
                prof, name, actions, iterations=iterations, seed=seed, max_candidates_per_prompt=max_candidates
            )
        results.append(r)
        if not r.finished:
            err.print(
                f"[yellow]warning:[/yellow] {name} did not finish {iterations or prof.iterations_to_target[name]} "
                f"iterations: it stopped after {r.iterations}, at {r.wall_s / 3600:,.1f} h, because "
                f"{escape(r.stopped_because or 'the simulation stopped early')}; its wall time and cost are "
                "where it stopped, not to target"
            )
    return results


def _report(
    console: Console,
    prof,
    results: list,
    *,
    trace: Optional[pathlib.Path],
    trace_note: str,
    out: pathlib.Path,
    as_json: bool,
    iterations_given: bool = False,
) -> None:
    """Write ``out/simulate.json`` and ``out/simulate.png``, then print the JSON (``as_json``)
    or the comparison table (:func:`render_table`) with where its numbers come from."""
    from spotlight.sim.report import comparison_rows, plot_comparison

    out.mkdir(parents=True, exist_ok=True)
    payload = _finite(
        {
            "profile": prof.name,
            "profile_path": prof.source,
            "trace": str(trace) if trace else None,
            "setup": trace_note,
            "results": comparison_rows(results),
            "sim": [r.summary() for r in results],
        }
    )
    write_text_atomic(out / "simulate.json", json.dumps(payload, indent=2))
    plot_comparison(results, out / "simulate.png", title=f"{prof.name}; {trace_note}")
    if as_json:
        print(json.dumps(payload, indent=2))
        Console(stderr=True, emoji=False).print(
            f"wrote {escape(str(out / 'simulate.json'))} and {escape(str(out / 'simulate.png'))}", highlight=False
        )
        return
    console.print(render_table(payload["results"], f"cost to target — {prof.name}; {trace_note}", console.width))
    speed = sum(r.wall_s for r in results) / max(1e-9, sum(r.sim_elapsed_s for r in results))
    origin = (
        f"iterations from --iterations, every cost from {escape(prof.source)}"
        if iterations_given
        else f"iterations to target and every cost come from {escape(prof.source)}"
    )
    console.print(f"{origin} (each number with its source); simulated {speed:,.0f}× faster than real time")
    console.print(f"wrote {escape(str(out / 'simulate.json'))} and {escape(str(out / 'simulate.png'))}")


def _finite(x):
    """``x`` with every non-finite float (nested in dicts and lists) None: JSON has no NaN, so
    "not applicable" values become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


COLUMNS = (
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
"""The comparison table's columns, one per :func:`spotlight.sim.report.comparison_rows` quantity."""


def _pct(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _cells(row: dict) -> list[str]:
    """The :data:`COLUMNS` cells of one comparison row (a ``simulate.json`` ``results`` entry)."""
    return [
        row["policy"],
        str(row["iterations_to_target"]) + ("" if row["finished"] else " (unfinished)"),
        f"{row['wall_h']:.1f} h" + ("" if row["finished"] else " (stopped)"),
        f"${row['cost_usd']:,.0f}" + ("" if row["finished"] else " (stopped)"),
        f"{row['cost_vs_baseline']:.2f}×" if row["cost_vs_baseline"] is not None else "—",
        f"{row['spot_gpu_hours']:.0f}",
        f"{row['reserved_gpu_hours']:.0f}",
        _pct(row["spot_utilisation"]),
        _pct(row["spot_busy_training"]),
        _pct(row["critical_path_share"]),
        str(row["preemptions"]),
        f"{row['work_lost_steps']:.0f} steps",
    ]


def render_table(rows: list[dict], title: str, width: int) -> Table:
    """The comparison table of ``rows`` (``simulate.json``'s ``results``) for a console
    ``width`` columns wide (pure): one row per policy when it fits, else one column per
    policy, so nothing is cut."""
    cells = [_cells(row) for row in rows]
    table = Table(title=title)
    need = sum(max(len(c), *(len(r[k]) for r in cells)) + 3 for k, c in enumerate(COLUMNS)) + 1
    if width >= need:  # wide enough: one row per policy
        for col in COLUMNS:
            table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
        for r in cells:
            table.add_row(*r)
    else:  # narrower: one column per policy, so nothing is cut
        table.add_column("", justify="left", no_wrap=True)
        for r in cells:
            table.add_column(r[0], justify="right", no_wrap=True)
        for k, col in enumerate(COLUMNS[1:], start=1):
            table.add_row(col, *[r[k] for r in cells])
    return table
