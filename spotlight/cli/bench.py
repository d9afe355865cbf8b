"""``spotlight bench``: studies on a finished run directory.

``spotlight bench stale-ranking --run-dir runs/X`` measures Insight 1 (paper §3.2.1,
Fig. 5): whether the within-group reward ranking of seeds under the stale weights v_n
predicts the ranking under the updated weights v_{n+1}.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from spotlight.cli.messages import print_error
from spotlight.cli.progress import working
from spotlight.util.atomic_file import write_text_atomic
from spotlight.util.cli_paths import path_option

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
    if versions is not None:
        from spotlight.cli.profile import parse_list

        wanted = parse_list("--versions", versions, _version, VERSIONS_ALLOWED)
        if len(wanted) < 2:
            raise ValueError(f"--versions {versions!r}: needs at least two versions; allowed: {VERSIONS_ALLOWED}")
        if wanted != sorted(wanted):  # each entry is the stale v_n of the next, a later version
            raise ValueError(
                f"--versions {versions!r}: not in increasing order; list the versions oldest first "
                f"(each is compared with the next, newer one), e.g. {','.join(map(str, sorted(wanted)))}"
            )
        missing = [v for v in wanted if v not in available]
        if missing:
            raise ValueError(
                f"version(s) {missing} not in the run directory (available: v{available[0]}..v{available[-1]})"
            )
        return wanted, [(i, i + 1) for i in range(len(wanted) - 1)]
    have = set(available)
    consecutive = [(v, v + 1) for v in available if v + 1 in have]
    if not consecutive:
        raise ValueError(f"no two consecutive weight versions in the run directory (have {available})")
    chosen = consecutive[-max(1, num_pairs) :]
    vers = sorted({v for p in chosen for v in p})
    pos = {v: i for i, v in enumerate(vers)}
    return vers, [(pos[a], pos[b]) for a, b in chosen]


VERSIONS_ALLOWED = "comma-separated weight versions (integers >= 0), oldest first, at least two, e.g. 3,4,5"
"""What ``--versions`` takes, as its refusals say."""

MIN_SEEDS = 3
"""Fewest ``--num-seeds`` a rank correlation needs: the Spearman ρ of two seeds is always ±1 (or
undefined when they tie), whatever the weights do."""


RESULT_JSON = "stale_ranking.json"
"""The study's result in ``--out``."""

HEATMAP_PNG = "stale_ranking_heatmap.png"
"""The study's rank-vs-rank heat map in ``--out``."""


def _version(text: str) -> int:
    """One ``--versions`` element. Raises ValueError: why it is not allowed."""
    try:
        value = int(text.removeprefix("v"))
    except ValueError:
        raise ValueError("not an integer") from None
    if value < 0:
        raise ValueError("negative")
    return value


def out_problem(out_dir: pathlib.Path) -> Optional[str]:
    """Why the study's files could not be written in ``out_dir`` (None: they can), found
    before any sampling and leaving nothing behind."""
    from spotlight.util.disk import unwritable_dir

    problem = unwritable_dir(out_dir)
    if problem:
        return problem
    for name in (RESULT_JSON, HEATMAP_PNG):
        f = out_dir / name
        if f.is_dir():
            return f"{f} is a directory"
        if f.exists() and not os.access(f, os.W_OK):
            return f"{f} is not writable"
    return None


def spread_indices(n_total: int, n: int) -> list[int]:
    """``n`` prompt indices spread evenly over ``range(n_total)``."""
    import numpy as np

    n = max(1, min(n, n_total))
    return sorted({int(round(x)) for x in np.linspace(0, n_total - 1, n)})


@bench_app.command("stale-ranking")
def stale_ranking(
    run_dir: pathlib.Path = path_option(
        ...,
        "--run-dir",
        help="Run directory (reads its config.toml and the weight versions v*.safetensors in tensor_store/weights).",
    ),
    pairs: int = typer.Option(3, "--pairs", min=1, help="Use the last N consecutive pairs (v_n, v_{n+1}) of the run."),
    versions: Optional[str] = typer.Option(
        None,
        "--versions",
        help="Explicit versions, oldest first, e.g. 3,4,5 (pairs adjacent entries: v3→v4, v4→v5; overrides --pairs).",
    ),
    num_prompts: int = typer.Option(8, "--num-prompts", min=1, help="Prompt groups (spread over the prompt set)."),
    num_seeds: int = typer.Option(
        16,
        "--num-seeds",
        min=MIN_SEEDS,
        help=f"Seeds per prompt group (same seeds for both versions; at least {MIN_SEEDS}: "
        "the rank correlation of two seeds is always ±1).",
    ),
    out: Optional[pathlib.Path] = path_option(None, "--out", help="Output folder (default: RUN_DIR/bench)."),
    threads: int = typer.Option(
        0, "--threads", min=0, help="torch threads (0 = cluster.torch_threads of the run config)."
    ),
) -> None:
    """Insight 1 (paper Fig. 5): does the seed ranking under stale weights v_n survive the update to v_{n+1}?"""
    console = Console(emoji=False, soft_wrap=True)
    from spotlight.cli.eval import reward_problem
    from spotlight.cli.up import _cache_dir, load_prompts
    from spotlight.config import load_run_config
    from spotlight.errors import SpotlightError
    from spotlight.studies.profiling import version_layout
    from spotlight.util.weights_file import (
        check_loaded_version,
        check_safetensors,
        check_weight_version,
        load_safetensors,
    )

    out_dir = out or (run_dir / "bench")
    try:  # every input checked before the prompts are encoded and minutes are spent sampling
        if run_dir.is_file():
            raise ValueError(f"{run_dir} is a file, not a run directory")
        if not run_dir.is_dir():
            raise ValueError(f"run directory not found: {run_dir}")
        cfg = load_run_config(run_dir / "config.toml")
        found = available_versions(run_dir)
        vers, pair_idx = choose_pairs(list(found), pairs, versions)
        for v in vers:
            check_safetensors(found[v])
        prompts = load_prompts(cfg.data, run_dir / "config.toml")
        from spotlight.models.families import get_family

        get_family(cfg.model).check()  # the run's checkpoint must still be where its config says
        layout = version_layout(cfg)  # another model size or LoRA rank: one line, not a size-mismatch traceback
        for v in vers:
            check_weight_version(found[v], layout)
        problem = out_problem(out_dir)
        if problem:
            option = "--out" if out is not None else "the default --out"
            raise ValueError(f"{option} {out_dir}: {problem}")
        prompt_idx = spread_indices(len(prompts), num_prompts)
        problem = reward_problem(cfg, [prompts[i] for i in prompt_idx], what="the run's prompts")
        if problem:
            raise ValueError(problem)
    except (SpotlightError, ValueError) as exc:
        print_error(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    import torch

    from spotlight.util.quiet import hide_loading_bars

    hide_loading_bars()  # the console shows the study's progress lines, not the libraries' loading bars
    torch.set_num_threads(max(1, threads or cfg.cluster.torch_threads))
    from spotlight.models.families import cached_conditioning, get_family
    from spotlight.rewards.reward_fn import RewardError
    from spotlight.studies.stale_ranking import plot_heatmap, rho_text, run_stale_ranking

    try:
        weights = [load_safetensors(found[v]) for v in vers]  # a file may change after its check
        for v, sd in zip(vers, weights):
            check_loaded_version(sd, layout, found[v])
    except SpotlightError as exc:
        print_error(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    with working(console, f"encoding prompts ({cfg.model.family} text encoder, cached after the first run)…"):
        cond = cached_conditioning(get_family(cfg.model), prompts, _cache_dir())
    pair_txt = ", ".join(f"v{vers[a]}→v{vers[b]}" for a, b in pair_idx)
    console.print(f"stale ranking on {run_dir}: pairs {pair_txt}; {len(prompt_idx)} prompts × {num_seeds} seeds")
    try:
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
    except RewardError as exc:  # the reward service stopped answering while the versions sampled
        print_error(f"[red]error:[/red] scoring the samples failed: {escape(str(exc))}")
        raise typer.Exit(1)
    result["run_dir"] = str(run_dir)
    result["prompts"] = [prompts[i] for i in prompt_idx]

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / RESULT_JSON
    png_path = out_dir / HEATMAP_PNG
    write_text_atomic(json_path, json.dumps(result, indent=2))
    ov = result["overall"]
    groups = len(prompt_idx) * len(pair_idx)
    rho_title = f"ρ = {ov['rho_mean']:.3f}" if ov["num_valid"] else "ρ undefined (tied rewards)"
    plot_heatmap(
        result["heatmap"],
        png_path,
        f"{run_dir.name}: {pair_txt}\n{len(prompt_idx)} prompts × {num_seeds} seeds, Spearman {rho_title}",
    )

    table = Table(title="stale-weight ranking (within-group Spearman ρ)")
    for col in ("stale", "updated", "ρ mean", "ρ std", "prompts", "|Δrank|≤1", "top/bottom overlap"):
        table.add_column(col)
    for row in result["pairs"]:
        valid = row["num_valid_prompts"]
        table.add_row(
            f"v{row['stale_version']}",
            f"v{row['updated_version']}",
            f"{row['rho_mean']:.3f}" if valid else "n/a (tied)",
            f"{row['rho_std']:.3f}" if valid else "n/a",
            f"{valid} of {len(prompt_idx)}",
            f"{row['near_diagonal_frac']:.2f}",
            "n/a" if row["selection_overlap"] != row["selection_overlap"] else f"{row['selection_overlap']:.2f}",
        )
    console.print(table)
    console.print(f"overall Spearman ρ = {rho_text(ov['rho_mean'], ov['rho_std'], ov['num_valid'], groups)}")
    if ov["num_valid"] < groups:
        console.print(
            "a prompt group whose seeds got equal rewards under a version has no rank correlation and is left out; "
            "more --num-seeds or --num-prompts, or a reward with finer grades, give more groups to average"
        )
    console.print(f"wrote {json_path} and {png_path}")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
