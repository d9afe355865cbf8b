"""``spotlight eval``: the shapes task's GenEval-style test score, base model vs ``final/``."""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def register(app: typer.Typer) -> None:
    @app.command("eval")
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
        """Sample every test prompt with the ODE sampler and report the strict GenEval-style score per task kind."""
        console = Console(emoji=False, soft_wrap=True)
        from spotlight.config import ConfigError, load_config
        from spotlight.errors import SpotlightError

        try:
            if run_dir is not None:
                if not (run_dir / "config.toml").is_file():
                    raise ConfigError(f"{run_dir}: no config.toml (is it a run directory?)")
                cfg = load_config(run_dir / "config.toml")
                if weights is None:
                    weights = run_dir / "final"
                    if not weights.is_dir():
                        raise ConfigError(
                            f"{run_dir}: no final/ folder (the run did not finish); evaluate the base model with --config {run_dir / 'config.toml'}"
                        )
            else:
                cfg = load_config(config)
            if cfg.reward.kind != "geneval_shapes" or cfg.model.family != "tiny":
                raise ConfigError(
                    "`spotlight eval` scores the shapes task (reward.kind = 'geneval_shapes', model.family = 'tiny'); this config is another task"
                )
            from spotlight.tasks.shapes import evaluate as ev

            specs = ev.read_prompts(prompts, source="--prompts") if prompts is not None else ev.read_prompts()
        except (SpotlightError, ValueError, OSError) as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        out_dir = out or run_dir or pathlib.Path("runs/eval")
        if out_dir.exists() and not out_dir.is_dir():  # found before minutes of sampling, not after
            console.print(f"[red]error:[/red] --out {escape(str(out_dir))}: not a directory")
            raise typer.Exit(2)
        models = {"base": None}
        if weights is not None:
            models["final"] = weights
        loaded = {}
        for name, w in models.items():  # every model loads before any sampling: a bad --weights fails at once
            try:
                loaded[name] = ev.load_transformer(cfg.model, w)
            except (OSError, FileNotFoundError, ValueError) as exc:
                console.print(f"[red]error:[/red] cannot load {name} weights: {escape(str(exc))}")
                raise typer.Exit(2)
        results = {}
        for name, model in loaded.items():
            with console.status(f"sampling {len(specs)} test prompts × {num_seeds} seeds with the {name} model…"):
                results[name] = ev.evaluate(model, cfg.model, cfg.sampler, specs, num_seeds=num_seeds)
        table = Table(
            title=f"GenEval-style score on {len(specs)} test prompts × {num_seeds} seeds (strict verdict, ODE sampling)"
        )
        table.add_column("task kind")
        table.add_column("prompts", justify="right")
        for name in results:
            table.add_column(name, justify="right")
        tags = list(next(iter(results.values())).per_task)
        for tag in tags:
            table.add_row(
                tag,
                str(next(iter(results.values())).per_task_prompts[tag]),
                *(f"{r.per_task[tag]:.3f}" for r in results.values()),
            )
        table.add_row(
            "[bold]overall[/bold] (mean of kinds)",
            str(len(specs)),
            *(f"[bold]{r.overall:.3f}[/bold]" for r in results.values()),
        )
        table.add_row("partial credit", "", *(f"{r.partial:.3f}" for r in results.values()))
        console.print(table)
        out_dir.mkdir(parents=True, exist_ok=True)
        report = {name: r.to_json() for name, r in results.items()}
        report["num_prompts"] = len(specs)
        report["num_seeds"] = num_seeds
        if weights is not None:
            report["weights"] = str(weights)
        (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        ev.comparison_grid(results, out_dir / "eval_grid.png")
        n_img = len(specs) * num_seeds
        console.print(
            f"{n_img} images per model: a score's standard error is about ±{0.5 / max(1, n_img) ** 0.5:.3f} overall, more for kinds with few prompts"
        )
        console.print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval_grid.png'}")
