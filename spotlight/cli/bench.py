"""``spotlight bench``: studies on a finished run directory.

``spotlight bench stale-ranking --run-dir runs/X`` measures Insight 1 (paper §3.2.1,
Fig. 5): whether the within-group reward ranking of seeds under the stale weights v_n
predicts the ranking under the updated weights v_{n+1}.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from spotlight.cli.messages import print_error
from spotlight.cli.progress import working

bench_app = typer.Typer(help="Benchmarks and studies on a finished run directory.", no_args_is_help=True)

_VERSION_RE = re.compile(r"^v(\d+)\.safetensors$")


def available_versions(run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
    """Weight versions stored in ``run_dir/tensor_store/weights`` (version → file)."""
    wdir = run_dir / "tensor_store" / "weights"
    out: dict[int, pathlib.Path] = {}
    if wdir.is_dir():
        for f in wdir.iterdir():
            m = _VERSION_RE.match(f.name)
            if m and f.is_file():
                out[int(m.group(1))] = f
    return dict(sorted(out.items()))


def choose_pairs(
    available: list[int], num_pairs: int, versions: Optional[str]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The versions to generate and the (stale, updated) index pairs into that list.

    ``versions`` (``"3,4,5"``) pairs adjacent entries; otherwise the last ``num_pairs``
    pairs (v, v+1) with both files present.

    Raises:
        ValueError: fewer than two versions, an unknown version, or no consecutive pair.
    """
    if len(available) < 2:
        raise ValueError(
            f"the run directory holds {len(available)} weight version(s); need at least 2 "
            "(tensor_store/weights/v<N>.safetensors)"
        )
    if versions:
        wanted = [int(v) for v in versions.split(",") if v.strip()]
        if len(wanted) < 2:
            raise ValueError("--versions needs at least two versions, e.g. 3,4,5")
        missing = [v for v in wanted if v not in available]
        if missing:
            raise ValueError(
                f"version(s) {missing} not in the run directory (available: v{available[0]}..v{available[-1]})"
            )
        if len(set(wanted)) != len(wanted):
            raise ValueError("--versions lists a version twice")
        return wanted, [(i, i + 1) for i in range(len(wanted) - 1)]
    have = set(available)
    consecutive = [(v, v + 1) for v in available if v + 1 in have]
    if not consecutive:
        raise ValueError(f"no two consecutive weight versions in the run directory (have {available})")
    chosen = consecutive[-max(1, num_pairs) :]
    vers = sorted({v for p in chosen for v in p})
    pos = {v: i for i, v in enumerate(vers)}
    return vers, [(pos[a], pos[b]) for a, b in chosen]


def spread_indices(n_total: int, n: int) -> list[int]:
    """``n`` prompt indices spread evenly over ``range(n_total)``."""
    import numpy as np

    n = max(1, min(n, n_total))
    return sorted({int(round(x)) for x in np.linspace(0, n_total - 1, n)})


@bench_app.command("stale-ranking")
def stale_ranking(
    run_dir: pathlib.Path = typer.Option(
        ...,
        "--run-dir",
        help="Run directory (reads its config.toml and the weight versions v*.safetensors in tensor_store/weights).",
    ),
    pairs: int = typer.Option(3, "--pairs", min=1, help="Use the last N consecutive pairs (v_n, v_{n+1}) of the run."),
    versions: Optional[str] = typer.Option(
        None, "--versions", help="Explicit versions, e.g. 3,4,5 (pairs adjacent entries; overrides --pairs)."
    ),
    num_prompts: int = typer.Option(8, "--num-prompts", min=1, help="Prompt groups (spread over the prompt set)."),
    num_seeds: int = typer.Option(
        16, "--num-seeds", min=2, help="Seeds per prompt group (same seeds for both versions)."
    ),
    out: Optional[pathlib.Path] = typer.Option(None, "--out", help="Output folder (default: RUN_DIR/bench)."),
    threads: int = typer.Option(
        0, "--threads", min=0, help="torch threads (0 = cluster.torch_threads of the run config)."
    ),
) -> None:
    """Insight 1 (paper Fig. 5): does the seed ranking under stale weights v_n survive the update to v_{n+1}?"""
    console = Console(emoji=False, soft_wrap=True)
    from spotlight.cli.up import _cache_dir, load_prompts
    from spotlight.config import load_config
    from spotlight.errors import SpotlightError

    try:
        if run_dir.is_file():
            raise ValueError(f"{run_dir} is a file, not a run directory")
        if not run_dir.is_dir():
            raise ValueError(f"run directory not found: {run_dir}")
        cfg = load_config(run_dir / "config.toml")
        found = available_versions(run_dir)
        vers, pair_idx = choose_pairs(list(found), pairs, versions)
        prompts = load_prompts(cfg.data, run_dir / "config.toml")
        from spotlight.models.families import get_family

        get_family(cfg.model).check()  # the run's checkpoint must still be where its config says
    except (SpotlightError, ValueError) as exc:
        print_error(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    out_dir = out or (run_dir / "bench")
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(max(1, threads or cfg.cluster.torch_threads))
    from spotlight.models.families import cached_conditioning, get_family
    from spotlight.studies.stale_ranking import plot_heatmap, run_stale_ranking

    with working(console, f"encoding prompts ({cfg.model.family} text encoder, cached after the first run)…"):
        cond = cached_conditioning(get_family(cfg.model), prompts, _cache_dir())
    prompt_idx = spread_indices(len(prompts), num_prompts)
    pair_txt = ", ".join(f"v{vers[a]}→v{vers[b]}" for a, b in pair_idx)
    console.print(f"stale ranking on {run_dir}: pairs {pair_txt}; {len(prompt_idx)} prompts × {num_seeds} seeds")
    weights = [load_file(str(found[v])) for v in vers]
    result = run_stale_ranking(
        cfg,
        cond,
        weights,
        prompt_idx,
        num_seeds,
        progress=console.print,
        versions=vers,
        pairs=pair_idx,
        prompts=prompts,
    )
    result["run_dir"] = str(run_dir)
    result["prompts"] = [prompts[i] for i in prompt_idx]

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "stale_ranking.json"
    png_path = out_dir / "stale_ranking_heatmap.png"
    json_path.write_text(json.dumps(result, indent=2))
    ov = result["overall"]
    plot_heatmap(
        result["heatmap"],
        png_path,
        f"{run_dir.name}: {pair_txt}\n{len(prompt_idx)} prompts × {num_seeds} seeds, Spearman ρ = {ov['rho_mean']:.3f}",
    )

    table = Table(title="stale-weight ranking (within-group Spearman ρ)")
    for col in ("stale", "updated", "ρ mean", "ρ std", "prompts", "|Δrank|≤1", "top/bottom overlap"):
        table.add_column(col)
    for row in result["pairs"]:
        table.add_row(
            f"v{row['stale_version']}",
            f"v{row['updated_version']}",
            f"{row['rho_mean']:.3f}",
            f"{row['rho_std']:.3f}",
            str(row["num_valid_prompts"]),
            f"{row['near_diagonal_frac']:.2f}",
            "n/a" if row["selection_overlap"] != row["selection_overlap"] else f"{row['selection_overlap']:.2f}",
        )
    console.print(table)
    console.print(f"overall Spearman ρ = {ov['rho_mean']:.3f} ± {ov['rho_std']:.3f} ({ov['num_valid']} prompt groups)")
    console.print(f"wrote {json_path} and {png_path}")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
