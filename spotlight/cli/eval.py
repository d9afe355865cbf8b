"""``spotlight eval``: held-out score, base model vs ``final/``: the shapes task's GenEval-style score per task
kind, or for any family and task the run's reward on its held-out panel (docs/evaluation.md)."""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from spotlight.cli.messages import print_error
from spotlight.cli.progress import working
from spotlight.errors import SpotlightError, plural
from spotlight.util.atomic_file import write_text_atomic
from spotlight.util.cli_paths import path_option
from spotlight.util.disk import unwritable_dir

EVAL_HELP = (
    "Sample held-out prompts with the ODE sampler and score the base model against trained weights: "
    "the shapes task per task kind (strict GenEval-style verdict), any other task and family by its "
    "reward on its held-out panel (eval.prompts_path or --prompts)."
)
"""``spotlight eval --help``'s text (one line: typer keeps a help text's line breaks)."""


def register(app: typer.Typer) -> None:
    @app.command("eval", help=EVAL_HELP)
    def eval_(
        run_dir: Optional[pathlib.Path] = path_option(
            None,
            "--run-dir",
            help="A finished run: evaluates its base model and its final/ weights with the run's config.",
        ),
        config: Optional[pathlib.Path] = path_option(
            None,
            "--config",
            help="Without --run-dir: evaluate this config's base model only (default: the embedded default).",
        ),
        weights: Optional[pathlib.Path] = path_option(
            None, "--weights", help="Also evaluate these weights (a final/ folder) against the base model."
        ),
        prompts: Optional[pathlib.Path] = path_option(
            None, "--prompts", help="Prompt file (default: the shapes task's held-out test.jsonl)."
        ),
        num_seeds: int = typer.Option(8, "--num-seeds", min=1, help="Samples per prompt."),
        out: Optional[pathlib.Path] = path_option(
            None,
            "--out",
            help="Where to write eval.json and eval_grid.png (default: the run directory, whose earlier "
            "eval.json is replaced, or without --run-dir a new runs/eval/<timestamp>).",
        ),
    ) -> None:
        """:data:`EVAL_HELP`: the base model and (``--run-dir``, ``--weights``) trained weights, scored."""
        console = Console(emoji=False, soft_wrap=True)
        if out is not None and (problem := unwritable_dir(out)):  # before the config and models load
            print_error(f"[red]error:[/red] --out {escape(str(out))}: {escape(problem)}")
            raise typer.Exit(2)
        try:
            cfg, weights, specs = _inputs(run_dir, config, weights, prompts)
        except (SpotlightError, ValueError, OSError) as exc:
            print_error(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        from spotlight.tasks.shapes import evaluate as ev
        from spotlight.util.quiet import hide_loading_bars

        hide_loading_bars()  # the console shows the score table, not the libraries' loading bars
        out_dir = out or run_dir or new_eval_dir()
        problem = unwritable_dir(out_dir)  # found before minutes of sampling, not after
        if problem:
            print_error(f"[red]error:[/red] --out {escape(str(out_dir))}: {escape(problem)}")
            raise typer.Exit(2)
        if (earlier := earlier_evaluation(out_dir)) is not None:  # said before minutes of sampling
            print_error(f"[yellow]note:[/yellow] {escape(earlier)}; give --out DIR to keep both")
        if specs is None:  # another task than the shapes world: the run's held-out panel, any family
            _eval_panel(console, cfg, weights, prompts, num_seeds, out_dir)
            return
        _check_weights(weights, console)
        loaded = _load_models(cfg, weights)
        results = {}
        for name, model in loaded.items():
            with working(console, f"sampling {len(specs)} test prompts × {_seeds(num_seeds)} with the {name} model…"):
                results[name] = ev.evaluate(model, cfg.model, cfg.sampler, specs, num_seeds=num_seeds)
        console.print(score_table(results, num_prompts=len(specs), num_seeds=num_seeds))
        _write_report(results, out_dir, num_prompts=len(specs), num_seeds=num_seeds, weights=weights, prompts=prompts)
        n_img = len(specs) * num_seeds
        per_kind = next(iter(results.values())).per_task_prompts
        se = overall_standard_error(per_kind, num_seeds)
        console.print(
            f"{n_img} images per model: the overall score's standard error is up to ±{se:.3f} (a mean over "
            f"{plural(len(per_kind), 'task kind')}, some with few prompts; more seeds narrow it)"
        )
        console.print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval_grid.png'}")


def new_eval_dir(root: pathlib.Path = pathlib.Path("runs/eval")) -> pathlib.Path:
    """A directory under ``root`` no earlier evaluation used: ``<YYYYmmdd-HHMMSS>``, with ``-2``,
    ``-3``… when one from the same second exists (not created here)."""
    import datetime

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def _seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def overall_standard_error(prompts_per_kind: dict[str, int], num_seeds: int) -> float:
    """Upper bound of the standard error of the overall score, a mean over K task kinds of the mean
    of kind k's ``n_k · num_seeds`` strict verdicts (each a 0/1 of variance <= 1/4):
    ``sqrt(Σ_k 1/(4 n_k s)) / K``. A kind with one prompt dominates it, which the standard error of
    one mean over all images (``0.5 / sqrt(N)``) hides."""
    if not prompts_per_kind:
        return 0.0
    var = sum(0.25 / (max(1, n) * max(1, num_seeds)) for n in prompts_per_kind.values())
    return var**0.5 / len(prompts_per_kind)


def refusal(cfg, prompts: Optional[pathlib.Path] = None) -> Optional[str]:
    """Why ``spotlight eval`` refuses a run of ``cfg`` (None: it accepts it). Pure: the shapes task
    has its own test prompts; any other task needs held-out prompts (``--prompts`` or
    ``eval.prompts_path``). ``spotlight up`` asks this before it suggests ``spotlight eval``."""
    if cfg.reward.kind == "geneval_shapes" and cfg.model.family == "tiny":
        return None
    if prompts is None and not cfg.eval.prompts_path:
        return (
            "this config is not the shapes task: give its held-out prompts with --prompts FILE "
            "(or set eval.prompts_path in the config)"
        )
    return None


def _inputs(
    run_dir: Optional[pathlib.Path],
    config: Optional[pathlib.Path],
    weights: Optional[pathlib.Path],
    prompts: Optional[pathlib.Path],
):
    """``(config, weights to compare with the base model or None, test prompt specs)``: a run
    directory's config and ``final/`` weights, else ``config`` (default: the embedded one).

    Raises:
        ConfigError: ``run_dir`` with ``config`` (a run is evaluated with its own config), no run
            directory there, a run without ``final/``, or a config of another task than the
            shapes task without held-out prompts.
        ValueError, OSError: the prompts cannot be read.
    """
    from spotlight.config import ConfigError, eval_device_problem, load_config, load_run_config

    if run_dir is not None and config is not None:  # was: --config silently ignored
        raise ConfigError(
            f"--run-dir and --config cannot be used together: --run-dir evaluates the run with its own "
            f"config ({run_dir / 'config.toml'}); to evaluate {config} instead, give --config alone "
            f"(with --weights {run_dir / 'final'} to compare the run's trained weights)"
        )
    if run_dir is not None:
        if not run_dir.exists():
            raise ConfigError(f"--run-dir {run_dir}: no such directory")
        if not run_dir.is_dir():
            raise ConfigError(f"--run-dir {run_dir}: a file, not a run directory")
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(f"{run_dir}: no config.toml (is it a run directory?)")
        cfg = load_run_config(run_dir / "config.toml")
        if weights is None:
            weights = run_dir / "final"
            if not weights.is_dir():
                from spotlight.cli.up_preflight import _running_coordinator

                if (pid := _running_coordinator(run_dir)) is not None:
                    raise ConfigError(
                        f"{run_dir}: the run is still running (coordinator pid {pid}) and has no final/ folder yet; "
                        f"evaluate it when it finishes, or its base model now with --config {run_dir / 'config.toml'}"
                    )
                raise ConfigError(
                    f"{run_dir}: no final/ folder (the run did not finish); evaluate the base model with "
                    f"--config {run_dir / 'config.toml'}"
                )
    else:
        cfg = load_config(config)
    if (why := refusal(cfg, prompts)) is not None:
        raise ConfigError(why)
    import torch

    if (why := eval_device_problem(cfg.eval.device, torch.cuda.device_count())) is not None:
        raise ConfigError(why)
    if cfg.reward.kind != "geneval_shapes" or cfg.model.family != "tiny":
        return cfg, weights, None
    from spotlight.tasks.shapes import evaluate as ev

    specs = ev.read_prompts(prompts, source="--prompts") if prompts is not None else ev.read_prompts()
    return cfg, weights, specs


def reward_refusal(cfg, panel) -> Optional[str]:
    """Why the run's reward cannot score the held-out ``panel`` (None: it can), found before any
    sampling (:func:`reward_problem`)."""
    return reward_problem(cfg, panel.prompts, panel.metadata or None, what="the held-out prompts")


def reward_problem(
    cfg, prompts: list[str], metadata: Optional[list[dict]] = None, *, what: str = "the prompts"
) -> Optional[str]:
    """Why the run's reward cannot score ``prompts`` (None: it can), found before any encoding or
    sampling: prompts it cannot score (``geneval_shapes``, ``ocr``), and for ``reward.kind =
    "http"`` a reward service that does not answer one probe image (as ``spotlight up`` checks,
    with its wording). ``spotlight eval``, ``profile`` and ``bench stale-ranking`` ask it.

    Args:
        metadata: one record per prompt (``ocr`` reads ``ocr_target``), or None.
        what: the prompts, as the refusal names them.
    """
    from spotlight.rewards.reward_fn import RewardError, RewardFn

    try:
        reward = RewardFn(cfg.reward)
        reward.check_prompts(prompts, metadata)
    except SpotlightError as exc:
        return f"reward.kind = {cfg.reward.kind!r} cannot score {what}: {exc}"
    if prompts:
        try:
            reward.check_service(cfg.model.image_size, prompts[0], metadata[0] if metadata else None)
        except RewardError as exc:
            return str(exc)
    return None


LARGE_WEIGHTS_BYTES = 2**30
"""A weights folder at least this large gets a progress line while its SHA256SUMS is checked."""


def _check_weights(weights: Optional[pathlib.Path], console: Console) -> None:
    """``weights`` (a ``final/`` or ``best/`` folder), when given, holds a LoRA adapter or a
    transformer folder whose safetensors files are all readable: checked before any model is
    built or sampled (:func:`spotlight.util.weights_file.check_weights_dir`).

    Raises:
        typer.Exit: 2 with one line naming the folder or its bad file.
    """
    if weights is None:
        return
    from spotlight.cli.progress import working
    from spotlight.util.weights_file import DIGEST_FILE, WeightsFileError, check_weights_dir, folder_size_bytes

    size = folder_size_bytes(weights)
    checking = (  # ~1.1 s per GiB: say so
        working(console, f"checking {escape(str(weights))} ({size / 2**30:.1f} GiB) against its {DIGEST_FILE}…")
        if size >= LARGE_WEIGHTS_BYTES and (weights / DIGEST_FILE).is_file()
        else contextlib.nullcontext()
    )
    try:
        with checking:
            check_weights_dir(weights)
    except WeightsFileError as exc:
        print_error(f"[red]error:[/red] cannot load final weights: {escape(str(exc))}")
        raise typer.Exit(2)


def _load_models(cfg, weights: Optional[pathlib.Path]) -> dict:
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
    from safetensors import SafetensorError

    for name, w in models.items():
        try:
            loaded[name] = ev.load_transformer(cfg.model, w)
        except (OSError, ValueError, SpotlightError, SafetensorError) as exc:  # a file changed since its check
            print_error(f"[red]error:[/red] cannot load {name} weights: {escape(str(exc))}")
            raise typer.Exit(2)
    return loaded


def score_table(results: dict, *, num_prompts: int, num_seeds: int) -> Table:
    """The score per task kind of each model in ``results`` (name → evaluation result), its
    overall mean of kinds and its partial credit (pure)."""
    table = Table(
        title=f"GenEval-style score on {num_prompts} test prompts × {_seeds(num_seeds)} (strict verdict, ODE sampling)"
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


def earlier_evaluation(out_dir: pathlib.Path) -> str | None:
    """What this evaluation replaces in ``out_dir`` (its ``eval.json``: prompts, seeds, when),
    or None when there is none."""
    import datetime

    path = pathlib.Path(out_dir) / "eval.json"
    try:
        earlier = json.loads(path.read_text())
        when = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d %H:%M")
    except (OSError, ValueError):
        return None if not path.exists() else f"replacing {path} (unreadable)"
    if not isinstance(earlier, dict):
        return f"replacing {path}"
    n, seeds = earlier.get("num_prompts"), earlier.get("num_seeds")
    what = " × ".join(plural(v, w) if isinstance(v, int) else f"? {w}s" for v, w in ((n, "prompt"), (seeds, "seed")))
    if earlier.get("prompts"):
        what += f" of {earlier['prompts']}"
    return f"replacing the evaluation in {path} ({what}, written {when})"


def _write_report(
    results: dict,
    out_dir: pathlib.Path,
    *,
    num_prompts: int,
    num_seeds: int,
    weights: Optional[pathlib.Path],
    prompts: Optional[pathlib.Path] = None,
) -> None:
    """``out_dir/eval.json`` (each model's result, the prompt and seed counts, the prompt file —
    null: the held-out test set — and the weights) and ``out_dir/eval_grid.png`` (the models'
    samples side by side)."""
    from spotlight.tasks.shapes import evaluate as ev

    out_dir.mkdir(parents=True, exist_ok=True)
    report = {name: r.to_json() for name, r in results.items()}
    report["num_prompts"] = num_prompts
    report["num_seeds"] = num_seeds
    report["prompts"] = str(prompts) if prompts is not None else None
    if weights is not None:
        report["weights"] = str(weights)
    write_text_atomic(out_dir / "eval.json", json.dumps(report, indent=2) + "\n")
    ev.comparison_grid(results, out_dir / "eval_grid.png")


def load_weights(cfg, weights: Optional[pathlib.Path], device):
    """The family's transformer: the base model, or with ``weights`` a ``final/`` or ``best/``
    folder (a diffusers transformer folder, or ``pytorch_lora_weights.safetensors`` over the base).

    Raises:
        FileNotFoundError: ``weights`` holds neither.
        ModelLoadError: the LoRA weights are not an adapter of this transformer.
    """
    from spotlight.models.families import get_family
    from spotlight.models.families.base import torch_dtype

    family = get_family(cfg.model)
    dtype = torch_dtype(cfg.model.dtype, device)
    if weights is not None and (weights / "config.json").is_file():
        model = family.transformer_cls().from_pretrained(str(weights), torch_dtype=dtype)
    else:
        model = family.build_transformer(dtype)
        if weights is not None:
            if not weights.exists():
                raise FileNotFoundError(f"{weights}: no such file or directory")
            if not (weights / "pytorch_lora_weights.safetensors").is_file():
                raise FileNotFoundError(
                    f"{weights}: neither a transformer folder (config.json) nor LoRA weights "
                    "(pytorch_lora_weights.safetensors)"
                )
            family.load_lora(model, weights)  # one line for a file of another shape, or one that matches nothing
    return family, model.to(device).eval()


def _eval_panel(console: Console, cfg, weights, prompts, num_seeds: int, out_dir: pathlib.Path) -> None:
    """Any family and task: the held-out panel (``--prompts`` or ``eval.prompts_path``, the first
    ``eval.num_prompts``, ``--num-seeds`` seeds each) sampled with the ODE by the base model and
    by ``weights``, scored by the run's reward (docs/evaluation.md); ``eval.json`` and one panel
    grid per model."""
    import msgspec

    from spotlight.errors import SpotlightError
    from spotlight.models.families import cached_conditioning
    from spotlight.workers.eval import eval_worker as ew

    if prompts is not None:
        cfg = msgspec.structs.replace(cfg, eval=msgspec.structs.replace(cfg.eval, prompts_path=str(prompts)))
    cfg = msgspec.structs.replace(cfg, eval=msgspec.structs.replace(cfg.eval, num_seeds=num_seeds))
    try:
        panel = ew.build_panel(cfg)
    except (SpotlightError, ValueError, OSError) as exc:
        print_error(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)
    if (why := reward_refusal(cfg, panel)) is not None:  # before any model is loaded or sampled
        print_error(f"[red]error:[/red] {escape(why)}")
        raise typer.Exit(2)
    _check_weights(weights, console)  # the final weights too: the base model samples first
    device = ew.eval_device(cfg)
    # the final model first: a weights file that does not fit the transformer is refused before
    # minutes go into sampling the base model; the report lists the base model first
    models = ({"final": weights} if weights is not None else {}) | {"base": None}
    report = {}
    from safetensors import SafetensorError

    from spotlight.cli.up import _cache_dir

    for name, w in models.items():
        try:
            family, model = load_weights(cfg, w, device)
        except (OSError, ValueError, SpotlightError, SafetensorError) as exc:  # a file changed since its check
            print_error(f"[red]error:[/red] cannot load {name} weights: {escape(str(exc))}")
            raise typer.Exit(2)
        with working(console, f"sampling {len(panel.prompts)} panel images with the {name} model…"):
            cond = cached_conditioning(family, panel.unique_prompts, _cache_dir())
            images, nonfinite = ew.sample_panel(family, model, cfg, cond, panel, device)
            try:  # the service may stop answering while the models sample
                scores, rewards = ew.score_panel(cfg, images, panel)
                failed = None
            except SpotlightError as exc:
                failed = exc
        if failed is not None:  # said once the spinner is gone (stderr would draw into it on a terminal)
            print_error(f"[red]error:[/red] scoring the {name} model's panel failed: {escape(str(failed))}")
            raise typer.Exit(1)  # a run error, not bad input (as bench and profile)
        if (note := ew.nonfinite_note(nonfinite, len(panel.prompts), f"{name} model's panel")) is not None:
            print_error(f"[yellow]warning:[/yellow] {escape(note)}")
        report[name] = scores | {"eval/nonfinite_samples": float(nonfinite)}
        out_dir.mkdir(parents=True, exist_ok=True)
        ew.write_grid(out_dir / f"eval_{name}.png", images, panel, rewards, title=f"{name}: {scores['eval/score']:.3f}")
    table = Table(
        title=f"held-out score ({cfg.reward.kind}) on {len(panel.unique_prompts)} prompts × {_seeds(num_seeds)}, ODE"
    )
    table.add_column("model")
    table.add_column("score", justify="right")
    report = {name: report[name] for name in ("base", "final") if name in report}
    for name, scores in report.items():
        table.add_row(name, f"{scores['eval/score']:.4f}")
    console.print(table)
    report |= {
        "num_prompts": len(panel.unique_prompts),
        "num_seeds": num_seeds,
        "prompts": str(prompts) if prompts is not None else None,
        "weights": str(weights) if weights else None,
    }
    write_text_atomic(out_dir / "eval.json", json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {out_dir / 'eval.json'} and the panel grids eval_*.png")
