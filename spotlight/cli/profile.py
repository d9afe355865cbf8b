"""``spotlight profile``: the Planner's latency and cache-accuracy table."""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

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
            help="Where to write the profile JSON (default: the cache the coordinator reads for this config).",
        ),
        weights: Optional[pathlib.Path] = typer.Option(
            None,
            "--weights",
            help="Profile these weights (a safetensors file, e.g. a version in the run's tensor_store/weights/) "
            "instead of the initial ones.",
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
        """:data:`PROFILE_HELP`; the result is written as JSON to ``--out`` (default: the config's
        :func:`~spotlight.studies.profiling.default_profile_path`) and shown as a table."""
        console = Console(emoji=False, soft_wrap=True)
        from spotlight.cli.up import _cache_dir, load_prompts
        from spotlight.config import load_config
        from spotlight.errors import SpotlightError

        try:
            cfg = load_config(config)
            prompts = load_prompts(cfg.data, config)
            ths = [float(t) for t in thresholds.split(",") if t.strip()]
            degrees = [int(d) for d in sp_degrees.split(",") if d.strip()]
            if cfg.model.family != "tiny":
                raise ValueError(
                    "`spotlight profile` measures the tiny family only so far "
                    f"(model.family = {cfg.model.family!r}); the planner falls back to uncached full-step "
                    "exploration without a profile"
                )
        except (SpotlightError, ValueError) as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        import torch

        torch.set_num_threads(max(1, cfg.cluster.torch_threads))
        from spotlight.models.text_encoder import cached_prompt_embeddings
        from spotlight.studies.profiling import default_profile_path, run_profile

        embeds, mask = cached_prompt_embeddings(prompts, _cache_dir(), cfg.model.max_text_tokens)
        sd = None
        if weights is not None:
            from safetensors.torch import load_file

            sd = load_file(str(weights))
        result = run_profile(
            cfg,
            embeds,
            mask,
            thresholds=ths,
            num_prompts=num_prompts,
            num_seeds=num_seeds,
            state_dict=sd,
            sp_degrees=degrees,
            progress=console.print,
            prompts=prompts,
        )
        path = out or default_profile_path(cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        table = Table(title=f"profile ({path})")
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
