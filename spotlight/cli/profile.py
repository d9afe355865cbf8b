"""``spotlight profile``: the Planner's latency and cache-accuracy table."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shlex
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from spotlight.cli.messages import print_error
from spotlight.cli.progress import working
from spotlight.util.atomic_file import write_text_atomic
from spotlight.util.cli_paths import path_option

PROFILE_HELP = (
    "Measure t_step, effective steps per cache threshold, and exploration accuracy (Spearman ρ vs full rollout)."
)
"""``spotlight profile --help``'s text (one line: typer keeps a help text's line breaks)."""


def register(app: typer.Typer) -> None:
    @app.command(help=PROFILE_HELP)
    def profile(
        config: Optional[pathlib.Path] = path_option(
            None, "--config", help="Run config TOML (default: the embedded example)."
        ),
        out: Optional[pathlib.Path] = path_option(
            None,
            "--out",
            help="Where to write the profile JSON (default: profile.json here). A run uses it when its config "
            "names it (explore.profile_path) or it is the run directory's profile.json.",
        ),
        run_dir: Optional[pathlib.Path] = path_option(
            None,
            "--run-dir",
            help="Write the profile as RUN_DIR/profile.json, which the run in that directory uses "
            "(a new `spotlight up --run-dir RUN_DIR`, or --resume) unless its config names another.",
        ),
        weights: Optional[pathlib.Path] = path_option(
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
            print_error("[red]error:[/red] give --out or --run-dir, not both")
            raise typer.Exit(2)
        cfg, prompts, ths, degrees, path = _inputs(
            config, thresholds, sp_degrees, out=out, run_dir=run_dir, weights=weights, num_prompts=num_prompts
        )
        result = _measure(cfg, prompts, weights, ths, degrees, num_prompts, num_seeds, console)
        path = _write(result, path)
        _show(console, cfg, result)
        console.print(escape(_how_to_use(path, run_dir is not None)))


THRESHOLDS_ALLOWED = "comma-separated finite numbers >= 0 (0 is the full rollout), at least one, e.g. 0.3,0.5,0.7"
"""What ``--thresholds`` takes, as its refusals say."""

SP_DEGREES_ALLOWED = "comma-separated integers >= 1, at least one, e.g. 1,2"
"""What ``--sp-degrees`` takes, as its refusals say."""


def _inputs(
    config,
    thresholds: str,
    sp_degrees: str,
    *,
    out: Optional[pathlib.Path] = None,
    run_dir: Optional[pathlib.Path] = None,
    weights: Optional[pathlib.Path] = None,
    num_prompts: int = 2,
):
    """``(config, prompts, thresholds, SP degrees, profile path)`` of the command line, every
    option checked before anything is built or measured.

    Raises:
        typer.Exit: 2 with one line: a bad list, an output path that cannot be written, weights
            that are not a readable safetensors file or no weight version of the config's
            transformer (another model size, LoRA rank), an SP degree that cannot split the
            model, a bad config or prompt file, more
            ``--num-prompts`` than the prompt file has, a checkpoint that is missing, or prompts
            the reward cannot score or a reward service that does not answer.
    """
    from spotlight.cli.up import load_prompts
    from spotlight.config import load_config
    from spotlight.errors import SpotlightError

    try:
        ths = parse_list("--thresholds", thresholds, _threshold, THRESHOLDS_ALLOWED)
        degrees = parse_list("--sp-degrees", sp_degrees, _sp_degree, SP_DEGREES_ALLOWED)
        path = profile_path(out, run_dir)
        if weights is not None:
            check_weights(weights)
        cfg = load_config(config)
        prompts = load_prompts(cfg.data, config)
        if num_prompts > len(prompts):
            raise ValueError(
                f"--num-prompts {num_prompts}: the prompt file ({cfg.data.prompts_path}) has only "
                f"{len(prompts)} prompts; use at most {len(prompts)}"
            )
        from spotlight.models.families import get_family

        family = get_family(cfg.model)
        family.check()  # a missing or incomplete checkpoint: one line, before any work
        if any(k > 1 for k in degrees):  # a degree that cannot split the model: before any measurement
            from spotlight.workers.sp.degrees import degree_problem, sp_shape

            shape = sp_shape(family)
            for k in degrees:
                if (problem := degree_problem(shape, k)) is not None:
                    raise ValueError(f"--sp-degrees {k}: {problem}")
        if weights is not None:  # another model size or LoRA rank: one line, not a size-mismatch traceback
            check_weights(weights, cfg)
        from spotlight.cli.eval import reward_problem

        # prompts the reward cannot score, a reward service that does not answer: before any encoding
        problem = reward_problem(cfg, prompts[:num_prompts], what="the profile's prompts")
        if problem:
            raise ValueError(problem)
    except (SpotlightError, ValueError) as exc:
        print_error(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    return cfg, prompts, ths, degrees, path


def _threshold(text: str) -> float:
    """One ``--thresholds`` element as a float. Raises ValueError: why it is not allowed."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    if value < 0:
        raise ValueError("negative")
    return value


def _sp_degree(text: str) -> int:
    """One ``--sp-degrees`` element as an int. Raises ValueError: why it is not allowed."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError("not an integer") from None
    if value < 1:
        raise ValueError("less than 1")
    return value


def parse_list(option: str, raw: str, parse: Callable[[str], object], allowed: str) -> list:
    """The comma-separated elements of ``option``'s value ``raw``, each through ``parse``.

    Raises:
        ValueError: one line naming ``option``, the bad element and what is ``allowed`` (an
            empty element, ``raw`` itself empty included, and a repeated one are refused).
    """
    values = []
    for item in raw.split(","):
        text = item.strip()
        if not text:
            raise ValueError(f"{option} {raw!r}: an empty element; allowed: {allowed}")
        try:
            values.append(parse(text))
        except ValueError as exc:
            raise ValueError(f"{option} {raw!r}: {text!r} is {exc}; allowed: {allowed}") from None
        if values[-1] in values[:-1]:  # would be measured twice
            raise ValueError(f"{option} {raw!r}: {text!r} is listed twice; allowed: {allowed}")
    return values


def profile_path(out: Optional[pathlib.Path], run_dir: Optional[pathlib.Path]) -> pathlib.Path:
    """Where the profile goes: ``run_dir/profile.json`` (the directory is created when missing),
    else ``out``, else ``profile.json`` here (its directory is created when missing) -- checked,
    writing nothing, so that a bad path fails before minutes of measuring.

    Raises:
        ValueError: one line naming the option and the path that cannot be written.
    """
    from spotlight.studies.profiling import RUN_DIR_PROFILE
    from spotlight.util.disk import unwritable_dir

    if run_dir is not None:
        if run_dir.exists() and not run_dir.is_dir():
            raise ValueError(f"--run-dir {run_dir}: a file, not a directory")
        problem = unwritable_dir(run_dir)
        if problem:
            raise ValueError(f"--run-dir {run_dir}: {problem}")
        path, name = run_dir / RUN_DIR_PROFILE, f"--run-dir {run_dir}"
        if path.is_dir():
            raise ValueError(f"{name}: {path} is a directory")
    else:
        path = out if out is not None else pathlib.Path(RUN_DIR_PROFILE)
        name = f"--out {path}" if out is not None else f"{path} (the default --out)"
        if path.is_dir():
            raise ValueError(f"{name}: a directory; give a file path, e.g. --out {path / RUN_DIR_PROFILE}")
        problem = unwritable_dir(path.parent)
        if problem:
            raise ValueError(f"{name}: {path.parent}: {problem}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{name}: {path} is not writable")
    return path


def check_weights(weights: pathlib.Path, cfg=None) -> None:
    """``--weights`` names a readable safetensors file holding tensors (only its header is read)
    and, given the run config ``cfg``, a weight version of its transformer: the whole transformer,
    or its LoRA adapter in a LoRA run, with the names and shapes the model has
    (:func:`spotlight.studies.profiling.version_layout`).

    Raises:
        ValueError: one line naming ``--weights``, the path and why not
            (:func:`spotlight.util.weights_file.check_safetensors`,
            :func:`~spotlight.util.weights_file.check_weight_version`).
        SpotlightError: the config's transformer cannot be built to compare with.
    """
    from spotlight.util.weights_file import check_safetensors, check_weight_version

    check_safetensors(weights, option="--weights")
    if cfg is not None:
        from spotlight.studies.profiling import version_layout

        check_weight_version(weights, version_layout(cfg), option="--weights")


def load_weights(weights: pathlib.Path, cfg=None) -> dict:
    """The tensors of the safetensors file ``weights`` (checked again, given the run config
    ``cfg``, against its transformer: the file may have changed since :func:`check_weights`).

    Raises:
        typer.Exit: 2 with one line when the file cannot be read or does not fit the transformer.
    """
    from spotlight.util.weights_file import WeightsFileError, check_loaded_version, load_safetensors

    try:
        sd = load_safetensors(weights, option="--weights")
        if cfg is not None:
            from spotlight.studies.profiling import version_layout

            check_loaded_version(sd, version_layout(cfg), weights, option="--weights")
        return sd
    except WeightsFileError as exc:
        print_error(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None


def _measure(cfg, prompts, weights, ths, degrees, num_prompts: int, num_seeds: int, console: Console) -> dict:
    """:func:`spotlight.studies.profiling.run_profile` of the initial weights (the run's version 0:
    the family's transformer, or its initial LoRA adapter) or ``weights``, on the prompts as the
    family's own text encoder encodes them (cached, as ``spotlight up`` caches them)."""
    import torch

    from spotlight.cli.up import _cache_dir
    from spotlight.models.families import cached_conditioning, get_family
    from spotlight.rewards.reward_fn import RewardError
    from spotlight.studies.profiling import run_profile
    from spotlight.util.quiet import hide_loading_bars

    hide_loading_bars()  # the console shows the profile's progress lines, not the libraries' loading bars
    torch.set_num_threads(max(1, cfg.cluster.torch_threads))
    with working(console, f"encoding prompts ({cfg.model.family} text encoder, cached after the first run)…"):
        cond = cached_conditioning(get_family(cfg.model), prompts, _cache_dir())
    sd = load_weights(weights, cfg) if weights is not None else None
    try:
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
    except RewardError as exc:  # the reward service stopped answering while the profile sampled
        print_error(f"[red]error:[/red] scoring the samples failed: {escape(str(exc))}")
        raise typer.Exit(1) from None


def _write(result: dict, path: pathlib.Path) -> pathlib.Path:
    """Write ``result`` to ``path`` (:func:`profile_path`, checked before measuring), creating its
    directory; ``path``.

    Raises:
        typer.Exit: 1 with one line: the file cannot be written after all.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(result, indent=2))
    except OSError as exc:
        print_error(f"[red]error:[/red] cannot write {escape(str(path))}: {escape(exc.strerror or str(exc))}")
        raise typer.Exit(1)
    return path


def _show(console: Console, cfg, result: dict) -> None:
    """The table: per threshold its effective steps, cost, accuracy and whether the Planner may use it."""
    from spotlight.core.planner import StepOption, costs_full_rollout

    table = Table(title="profile")
    for col in ("threshold", "effective steps", "cost (full-step equiv.)", "accuracy (Spearman)", "eligible"):
        table.add_column(col)
    options = [
        StepOption(r["cache_threshold"], r["effective_steps"], 1.0, r.get("cost_steps") or None)
        for r in result["steps"]
    ]
    for row, option in zip(result["steps"], options):
        acc = row["accuracy"]
        if acc is None or acc < cfg.planner.min_exploration_accuracy:
            eligible = "[red]no (accuracy)[/red]"
        elif costs_full_rollout(option, options):
            eligible = "[yellow]no (costs as much as the full rollout)[/yellow]"
        else:
            eligible = "yes"
        table.add_row(
            f"{row['cache_threshold']:.3f}",
            f"{row['effective_steps']:.2f}",
            f"{row.get('cost_steps', row['effective_steps']):.2f}",
            "unknown (tied rewards)" if acc is None else f"{acc:.3f}",
            eligible,
        )
    console.print(table)
    console.print(f"t_step: {json.dumps(result['t_step_s'])}")


def _how_to_use(path: pathlib.Path, in_run_dir: bool) -> str:
    """The line after a profile is written: which runs use it (none but those told to)."""
    if in_run_dir:
        return (
            f"wrote {path}: the run in {path.parent} uses it "
            f"(`spotlight up --run-dir {shlex.quote(str(path.parent))}` or "
            "--resume), unless its config sets explore.profile_path"
        )
    return (
        f'wrote {path}: a run uses it when its config says so: [explore] profile_path = "{path.resolve()}" '
        "(or copy it into the run directory as profile.json)"
    )
