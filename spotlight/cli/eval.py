"""``spotlight eval``: the shapes task's GenEval-style test score, base model vs ``final/``."""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

EVAL_HELP = "Sample every test prompt with the ODE sampler and report the strict GenEval-style score per task kind."
"""``spotlight eval --help``'s text (one line: typer keeps a help text's line breaks)."""


def register(app: typer.Typer) -> None:
    @app.command("eval", help=EVAL_HELP)
    def eval_(
        run_dir: Optional[pathlib.Path] = typer.Option(
            None,
            "--run-dir",
            help="A finished run: evaluates its base model and its final/ weights with the run's config.",
        ),
        config: Optional[pathlib.Path] = typer.Option(
            None,
            "--config",
            help="Without --run-dir: evaluate this config's base model only (default: the embedded default).",
        ),
        weights: Optional[pathlib.Path] = typer.Option(
            None, "--weights", help="Also evaluate these weights (a final/ folder) against the base model."
        ),
        prompts: Optional[pathlib.Path] = typer.Option(
            None, "--prompts", help="Prompt file (default: the shapes task's held-out test.jsonl)."
        ),
        num_seeds: int = typer.Option(8, "--num-seeds", min=1, help="Samples per prompt."),
        out: Optional[pathlib.Path] = typer.Option(
            None, "--out", help="Where to write eval.json and eval_grid.png (default: the run directory, or runs/eval)."
        ),
    ) -> None:
        """:data:`EVAL_HELP`: the base model and (``--run-dir``, ``--weights``) trained weights, scored."""
        console = Console(emoji=False, soft_wrap=True)
        from spotlight.errors import SpotlightError

        try:
            cfg, weights, specs = _inputs(run_dir, config, weights, prompts)
        except (SpotlightError, ValueError, OSError) as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        from spotlight.tasks.shapes import evaluate as ev

        out_dir = out or run_dir or pathlib.Path("runs/eval")
        if out_dir.exists() and not out_dir.is_dir():  # found before minutes of sampling, not after
            console.print(f"[red]error:[/red] --out {escape(str(out_dir))}: not a directory")
            raise typer.Exit(2)
        loaded = _load_models(console, cfg, weights)
        results = {}
        for name, model in loaded.items():
            with console.status(f"sampling {len(specs)} test prompts × {num_seeds} seeds with the {name} model…"):
                results[name] = ev.evaluate(model, cfg.model, cfg.sampler, specs, num_seeds=num_seeds)
        console.print(score_table(results, num_prompts=len(specs), num_seeds=num_seeds))
        _write_report(results, out_dir, num_prompts=len(specs), num_seeds=num_seeds, weights=weights)
        n_img = len(specs) * num_seeds
        console.print(
            f"{n_img} images per model: a score's standard error is about ±{0.5 / max(1, n_img) ** 0.5:.3f} overall, "
            "more for kinds with few prompts"
        )
        console.print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval_grid.png'}")


def _inputs(
    run_dir: Optional[pathlib.Path],
    config: Optional[pathlib.Path],
    weights: Optional[pathlib.Path],
    prompts: Optional[pathlib.Path],
):
    """``(config, weights to compare with the base model or None, test prompt specs)``: a run
    directory's config and ``final/`` weights, else ``config`` (default: the embedded one).

    Raises:
        ConfigError: no run directory there, a run without ``final/``, or a config of
            another task than the shapes task.
        ValueError, OSError: the prompts cannot be read.
    """
    from spotlight.config import ConfigError, load_config

    if run_dir is not None:
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(f"{run_dir}: no config.toml (is it a run directory?)")
        cfg = load_config(run_dir / "config.toml")
        if weights is None:
            weights = run_dir / "final"
            if not weights.is_dir():
                raise ConfigError(
                    f"{run_dir}: no final/ folder (the run did not finish); evaluate the base model with "
                    f"--config {run_dir / 'config.toml'}"
                )
    else:
        cfg = load_config(config)
    if cfg.reward.kind != "geneval_shapes" or cfg.model.family != "tiny":
        raise ConfigError(
            "`spotlight eval` scores the shapes task (reward.kind = 'geneval_shapes', model.family = 'tiny'); "
            "this config is another task"
        )
    from spotlight.tasks.shapes import evaluate as ev

    specs = ev.read_prompts(prompts, source="--prompts") if prompts is not None else ev.read_prompts()
    return cfg, weights, specs


def _load_models(console: Console, cfg, weights: Optional[pathlib.Path]) -> dict:
    """``{"base": model, "final": model}`` (``final`` only with ``weights``), every model loaded
    before any sampling, so that a bad ``--weights`` fails at once.

    Raises:
        typer.Exit: 2 with one line: a model cannot be loaded.
    """
    from spotlight.tasks.shapes import evaluate as ev

    models = {"base": None}
    if weights is not None:
        models["final"] = weights
    loaded = {}
    for name, w in models.items():
        try:
            loaded[name] = ev.load_transformer(cfg.model, w)
        except (OSError, FileNotFoundError, ValueError) as exc:
            console.print(f"[red]error:[/red] cannot load {name} weights: {escape(str(exc))}")
            raise typer.Exit(2)
    return loaded


def score_table(results: dict, *, num_prompts: int, num_seeds: int) -> Table:
    """The score per task kind of each model in ``results`` (name → evaluation result), its
    overall mean of kinds and its partial credit (pure)."""
    table = Table(
        title=f"GenEval-style score on {num_prompts} test prompts × {num_seeds} seeds (strict verdict, ODE sampling)"
    )
    table.add_column("task kind")
    table.add_column("prompts", justify="right")
    for name in results:
        table.add_column(name, justify="right")
    first = next(iter(results.values()))
    for tag in first.per_task:
        table.add_row(tag, str(first.per_task_prompts[tag]), *(f"{r.per_task[tag]:.3f}" for r in results.values()))
    table.add_row(
        "[bold]overall[/bold] (mean of kinds)",
        str(num_prompts),
        *(f"[bold]{r.overall:.3f}[/bold]" for r in results.values()),
    )
    table.add_row("partial credit", "", *(f"{r.partial:.3f}" for r in results.values()))
    return table


def _write_report(
    results: dict, out_dir: pathlib.Path, *, num_prompts: int, num_seeds: int, weights: Optional[pathlib.Path]
) -> None:
    """``out_dir/eval.json`` (each model's result, the prompt and seed counts, the weights) and
    ``out_dir/eval_grid.png`` (the models' samples side by side)."""
    from spotlight.tasks.shapes import evaluate as ev

    out_dir.mkdir(parents=True, exist_ok=True)
    report = {name: r.to_json() for name, r in results.items()}
    report["num_prompts"] = num_prompts
    report["num_seeds"] = num_seeds
    if weights is not None:
        report["weights"] = str(weights)
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    ev.comparison_grid(results, out_dir / "eval_grid.png")
