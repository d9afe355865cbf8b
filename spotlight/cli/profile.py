"""``spotlight profile``: the Planner's latency and cache-accuracy table."""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from spotlight.cli.progress import working

PROFILE_HELP = (
    "Measure t_step, effective steps per cache threshold, and exploration accuracy (Spearman ρ vs full rollout)."
)
"""``spotlight profile --help``'s text (one line: typer keeps a help text's line breaks)."""


def register(app: typer.Typer) -> None:
    @app.command(help=PROFILE_HELP)
    def profile(
        config: Optional[pathlib.Path] = typer.Option(
            None, "--config", help="Run config TOML (default: the embedded example)."
        ),
        out: Optional[pathlib.Path] = typer.Option(
            None,
            "--out",
            help="Where to write the profile JSON (default: profile.json here). A run uses it when its config "
            "names it (explore.profile_path) or it is the run directory's profile.json.",
        ),
        run_dir: Optional[pathlib.Path] = typer.Option(
            None,
            "--run-dir",
            help="Write the profile as RUN_DIR/profile.json, which the run in that directory uses "
            "(a new `spotlight up --run-dir RUN_DIR`, or --resume) unless its config names another.",
        ),
        weights: Optional[pathlib.Path] = typer.Option(
            None,
            "--weights",
            help="Profile these weights (a safetensors file, e.g. a version in the run's tensor_store/weights/: "
            "the whole transformer, or the adapter in a LoRA run) instead of the initial ones.",
        ),
        thresholds: str = typer.Option(
            "0.3,0.5,0.7,1.0,1.5", "--thresholds", help="Comma-separated First-Block-Cache thresholds to profile."
        ),
        num_prompts: int = typer.Option(8, "--num-prompts", min=2, help="Prompts used for the accuracy estimate."),
        num_seeds: int = typer.Option(16, "--num-seeds", min=3, help="Seeds per prompt for the accuracy estimate."),
        sp_degrees: str = typer.Option(
            "1,2",
            "--sp-degrees",
            help="Comma-separated SP degrees whose t_step to measure "
            "(each > 1 runs a real context-parallel group of that many processes).",
        ),
    ) -> None:
        """:data:`PROFILE_HELP`; the result is written as JSON to ``--out`` (default ``profile.json``)
        or ``--run-dir``'s ``profile.json``, shown as a table, with how a run uses it."""
        console = Console(emoji=False, soft_wrap=True)
        if out is not None and run_dir is not None:
            console.print("[red]error:[/red] give --out or --run-dir, not both")
            raise typer.Exit(2)
        cfg, prompts, ths, degrees = _inputs(console, config, thresholds, sp_degrees)
        result = _measure(cfg, prompts, weights, ths, degrees, num_prompts, num_seeds, console)
        path = _write(console, result, run_dir, out)
        _show(console, cfg, result)
        console.print(escape(_how_to_use(path, run_dir is not None)))


def _inputs(console: Console, config, thresholds: str, sp_degrees: str):
    """``(config, prompts, thresholds, SP degrees)`` of the command line.

    Raises:
        typer.Exit: 2 with one line: a bad config, prompt file or list, or a checkpoint that is missing.
    """
    from spotlight.cli.up import load_prompts
    from spotlight.config import load_config
    from spotlight.errors import SpotlightError

    try:
        cfg = load_config(config)
        prompts = load_prompts(cfg.data, config)
        ths = [float(t) for t in thresholds.split(",") if t.strip()]
        degrees = [int(d) for d in sp_degrees.split(",") if d.strip()]
        from spotlight.models.families import get_family

        get_family(cfg.model).check()  # a missing or incomplete checkpoint: one line, before any work
    except (SpotlightError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    return cfg, prompts, ths, degrees


def _measure(cfg, prompts, weights, ths, degrees, num_prompts: int, num_seeds: int, console: Console) -> dict:
    """:func:`spotlight.studies.profiling.run_profile` of the initial weights (the run's version 0:
    the family's transformer, or its initial LoRA adapter) or ``weights``, on the prompts as the
    family's own text encoder encodes them (cached, as ``spotlight up`` caches them)."""
    import torch

    from spotlight.cli.up import _cache_dir
    from spotlight.models.families import cached_conditioning, get_family
    from spotlight.studies.profiling import run_profile

    torch.set_num_threads(max(1, cfg.cluster.torch_threads))
    with working(console, f"encoding prompts ({cfg.model.family} text encoder, cached after the first run)…"):
        cond = cached_conditioning(get_family(cfg.model), prompts, _cache_dir())
    sd = None
    if weights is not None:
        from safetensors.torch import load_file

        sd = load_file(str(weights))
    return run_profile(
        cfg,
        cond,
        thresholds=ths,
        num_prompts=num_prompts,
        num_seeds=num_seeds,
        state_dict=sd,
        sp_degrees=degrees,
        progress=console.print,
        prompts=prompts,
    )


def _write(console: Console, result: dict, run_dir, out) -> pathlib.Path:
    """Write ``result`` to ``run_dir/profile.json``, else ``out``, else ``profile.json``; its path.

    Raises:
        typer.Exit: 1 with one line: the file cannot be written.
    """
    from spotlight.studies.profiling import RUN_DIR_PROFILE

    path = run_dir / RUN_DIR_PROFILE if run_dir is not None else out or pathlib.Path("profile.json")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot write {escape(str(path))}: {escape(exc.strerror or str(exc))}")
        raise typer.Exit(1)
    return path


def _show(console: Console, cfg, result: dict) -> None:
    """The table: per threshold its effective steps, cost, accuracy and whether the Planner may use it."""
    table = Table(title="profile")
    for col in ("threshold", "effective steps", "cost (full-step equiv.)", "accuracy (Spearman)", "eligible"):
        table.add_column(col)
    for row in result["steps"]:
        acc = row["accuracy"]
        ok = acc is not None and acc >= cfg.planner.min_exploration_accuracy
        table.add_row(
            f"{row['cache_threshold']:.3f}",
            f"{row['effective_steps']:.2f}",
            f"{row.get('cost_steps', row['effective_steps']):.2f}",
            "unknown (tied rewards)" if acc is None else f"{acc:.3f}",
            "yes" if ok else "[red]no (accuracy)[/red]",
        )
    console.print(table)
    console.print(f"t_step: {json.dumps(result['t_step_s'])}")


def _how_to_use(path: pathlib.Path, in_run_dir: bool) -> str:
    """The line after a profile is written: which runs use it (none but those told to)."""
    if in_run_dir:
        return (
            f"wrote {path}: the run in {path.parent} uses it (`spotlight up --run-dir {path.parent}` or "
            "--resume), unless its config sets explore.profile_path"
        )
    return (
        f'wrote {path}: a run uses it when its config says so: [explore] profile_path = "{path.resolve()}" '
        "(or copy it into the run directory as profile.json)"
    )
