"""``spotlight plan``: the memory and disk a config needs, per GPU, per host and on disk.

The numbers are :func:`spotlight.core.memory_plan.plan_memory`'s, for parameters counted on
the meta device (:mod:`spotlight.models.param_count`): the config's checkpoint, or
``--preset`` for a published architecture when the weights are not at hand. Formulas in
docs/planning.md.
"""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from spotlight.cli.messages import print_error
from spotlight.util.cli_paths import path_argument

PLAN_HELP = (
    "Memory per trainer and rollout GPU, host memory and disk of a config; with cluster.gpu_memory_gib, "
    "whether it fits (exit 1 when it does not)."
)
"""``spotlight plan --help``'s text (one line: typer keeps a help text's line breaks)."""


def plan_table(plan, title: str) -> Table:
    """The rich table of ``plan`` (a :class:`~spotlight.core.memory_plan.MemoryPlan`)."""
    from spotlight.core.memory_plan import MemoryPlan, gib_as_given

    unit, scale = table_unit(plan)
    table = Table(title=title, show_lines=False)
    for col, kw in (("where", {}), ("item", {}), (unit, {"justify": "right"}), ("formula", {})):
        table.add_column(col, **kw)
    limit = plan.gpu_limit_bytes
    for where, lines in (
        ("trainer GPU", plan.trainer_gpu),
        ("rollout GPU", plan.rollout_gpu),
        ("reserved host", plan.reserved_host),
        ("spot host", plan.spot_host),
        ("disk", plan.disk),
    ):
        for i, line in enumerate(lines):
            table.add_row(where if i == 0 else "", line.name, f"{line.bytes / scale:.2f}", escape(line.formula))
        total = MemoryPlan.total(lines)
        over = where.endswith("GPU") and limit is not None and total > limit
        mark = f"[red](over {gib_as_given(limit)} GiB)[/red]" if over else ""
        table.add_row("", "[bold]total[/bold]", f"[bold]{total / scale:.2f}[/bold]", mark, end_section=True)
    return table


def table_unit(plan) -> tuple[str, int]:
    """``("GiB", 2**30)``, or ``("MiB", 2**20)`` when no term but the fixed CUDA reserve reaches
    1 GiB (the tiny family), so the plan's rows do not all read 0.00."""
    from spotlight.core.memory_plan import GIB

    lines = [*plan.trainer_gpu, *plan.rollout_gpu, *plan.reserved_host, *plan.spot_host, *plan.disk]
    largest = max((line.bytes for line in lines if line.name != "CUDA reserve"), default=0)
    return ("GiB", GIB) if largest >= GIB else ("MiB", 1 << 20)


def count_text(n: int | float) -> str:
    """A parameter count as people write it: ``20.4 B``, ``3.7 M``, ``12 k``, ``950``."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.{1 if abs(n) < 100 * div else 0}f} {suffix}"
    return f"{n:.0f}"


def plan_summary(plan, *, device: str, limit_source: str | None, disk_free_bytes: int | None = None) -> list[str]:
    """The memory plan in three plain-text lines, as ``spotlight up`` prints it before the run
    starts: each trainer GPU's terms (the CPU's host memory per trainer rank without GPUs),
    the rollout GPU, the reserved host and the disk at its peak (with the free space). In GiB,
    or MiB as in :func:`table_unit` (the tiny family)."""
    from spotlight.core.memory_plan import GIB, MemoryPlan

    unit, scale = table_unit(plan)

    def n(x: int | float) -> str:
        return f"{x / scale:.1f}"

    def terms(lines) -> str:
        return ", ".join(f"{line.name} {n(line.bytes)}" for line in lines if line.bytes)

    where = "trainer GPU" if device == "cuda" else "trainer rank (CPU, fp32, host memory)"
    limit = plan.gpu_limit_bytes
    of = f" of {n(limit)} {unit} ({limit_source})" if limit is not None and limit_source else ""
    act = (
        f"{plan.rows_per_micro_batch} row{'s' if plan.rows_per_micro_batch != 1 else ''} per forward, "
        f"{plan.tokens_per_micro_batch} tokens, "
        f"activation checkpointing {'on' if plan.activation_checkpointing else 'off'}"
    )
    free = f", {disk_free_bytes / GIB:.1f} GiB free" if disk_free_bytes is not None else ""
    rollout = "rollout GPU" if device == "cuda" else "rollout worker"
    return [
        f"memory plan (docs/planning.md; `spotlight plan` shows every formula), {unit}; {act}:",
        f"  {where} {n(plan.trainer_gpu_bytes)}{of}: {terms(plan.trainer_gpu)}",
        f"  {rollout} {n(plan.rollout_gpu_bytes)}; reserved host {n(MemoryPlan.total(plan.reserved_host))}; "
        f"disk up to {n(plan.disk_bytes)} {unit}{free} ({terms(plan.disk)})",
    ]


def plan_notes(cfg, preset: str | None, plan, *, device: str = "cuda", has_cuda: bool = True) -> list[str]:
    """What the plan did not check or assumed from the config: a CUDA plan made on a host
    without a GPU (a run there is fp32 on the CPU: ``--device cpu`` plans that); no GPU size to
    check against; a preset planned at the tiny embedded default's resolution (its activations
    are then those of a 32 px image, not of a real run)."""
    notes = []
    if device == "cuda" and not has_cuda:
        notes.append(
            "planned for CUDA (bf16 where model.dtype = auto); this host has no GPU, and a run here is fp32 "
            "on the CPU: --device cpu plans that"
        )
    if plan.gpu_limit_bytes is None:
        notes.append("no GPU size to check against: give --gpu-memory-gib (or set cluster.gpu_memory_gib)")
    if preset is not None and cfg.model.family == "tiny":
        notes.append(
            f"--preset is planned at this config's {cfg.model.image_size} px (model.image_size of a tiny-model "
            "config): pass your run's config, whose resolution sets the activations"
        )
    return notes


def start_problems(cfg, preset: str | None) -> list[str]:
    """What would make ``spotlight up`` refuse ``cfg`` that the plan does not depend on: a
    checkpoint that does not match the model section (its architecture, its text encoder, LoRA
    targets it lacks, an SP degree it cannot be split by; the plan counts the checkpoint's
    own), and a prompt or profile file that does not exist. Not checked with ``preset`` (the
    plan then counts no checkpoint)."""
    from spotlight.cli.up_preflight import model_problem
    from spotlight.config import resolve_path

    out = []
    if preset is None and (problem := model_problem(cfg)) is not None:
        out.append(problem)
    for field in ("data.prompts_path", "eval.prompts_path", "explore.profile_path"):
        section, key = field.split(".")
        value = getattr(getattr(cfg, section), key)
        if value and not resolve_path(value).exists():
            out.append(f"{field}: file not found: {value}")
    return out


def plan_dict(plan) -> dict:
    """``plan`` as JSON-able data (bytes per line and totals)."""
    from spotlight.core.memory_plan import MemoryPlan

    out = {}
    for where in ("trainer_gpu", "rollout_gpu", "reserved_host", "spot_host", "disk"):
        lines = getattr(plan, where)
        out[where] = {line.name: line.bytes for line in lines} | {"total": MemoryPlan.total(lines)}
    out |= {
        "gpu_limit_bytes": plan.gpu_limit_bytes,
        "tokens_per_micro_batch": plan.tokens_per_micro_batch,
        "rows_per_micro_batch": plan.rows_per_micro_batch,
        "activation_checkpointing": plan.activation_checkpointing,
        "problems": plan.problems(),
    }
    return out


def make_plan(cfg, preset: str | None = None, device: str = "cuda"):
    """``(plan, size)`` of ``cfg`` (parameters of its transformer, or of ``preset``).

    Raises:
        SpotlightError: the transformer cannot be counted (:class:`~spotlight.models.param_count.PlanError`).
    """
    from spotlight.core.memory_plan import plan_memory
    from spotlight.models.param_count import count_model

    size = count_model(cfg, preset)
    return plan_memory(cfg, size, device=device), size


def register(app: typer.Typer) -> None:
    @app.command("plan", help=PLAN_HELP)
    def plan(
        config: Optional[pathlib.Path] = path_argument(None, help="Config file (default: the embedded default)."),
        preset: Optional[str] = typer.Option(
            None,
            "--preset",
            help="Count a published architecture instead of the config's checkpoint: qwen-image-20b, flux-12b, "
            "sd3.5-large.",
        ),
        device: str = typer.Option("cuda", "--device", help="cuda (bf16 where model.dtype = auto) or cpu (fp32)."),
        gpu_memory_gib: Optional[float] = typer.Option(
            None, "--gpu-memory-gib", help="Check against this GPU size (default: cluster.gpu_memory_gib)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    ) -> None:
        """:data:`PLAN_HELP`"""
        import sys

        from spotlight.config import load_config
        from spotlight.core.memory_plan import gib_as_given
        from spotlight.errors import SpotlightError, plural

        console = Console(emoji=False, soft_wrap=True, width=None if sys.stdout.isatty() else 150)
        if device not in ("cuda", "cpu"):
            print_error(f"[red]error:[/red] --device {escape(device)}: choose cuda or cpu")
            raise typer.Exit(2)
        overrides = {} if gpu_memory_gib is None else {"cluster.gpu_memory_gib": gpu_memory_gib}
        try:
            cfg = load_config(config, overrides)
            result, size = make_plan(cfg, preset, device)
        except SpotlightError as exc:
            print_error(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        import torch

        notes = plan_notes(cfg, preset, result, device=device, has_cuda=torch.cuda.is_available())
        notes += [f"spotlight up refuses this config: {why}" for why in start_problems(cfg, preset)]
        problems = result.problems()
        if as_json:
            # "fits": null when there is no GPU size to check against (a note says so)
            fits = None if result.gpu_limit_bytes is None else not problems
            extra = {"params": size.params, "lora_params": size.lora_params, "fits": fits, "notes": notes}
            print(json.dumps(plan_dict(result) | extra, indent=2))
        else:
            t = cfg.train
            gpus = f"{t.num_train_workers} trainer GPU{'s' if t.num_train_workers != 1 else ''}"
            if t.num_train_nodes > 1:  # HSDP: the shard is one node's GPUs
                gpus += f" ({t.num_train_nodes} nodes × {t.ranks_per_node}, HSDP)"
            title = (
                f"{preset or cfg.model.family}: {count_text(size.params)} parameters"
                + (f", LoRA r={t.lora_rank} {count_text(size.lora_params)}" if t.lora_rank else ", full fine-tuning")
                + f", {gpus}, {cfg.model.image_size} px, "
                f"{plural(result.rows_per_micro_batch, 'row')} per training forward "
                f"({result.tokens_per_micro_batch} tokens, "
                "one SDE window step at a time), activation checkpointing "
                f"{'on' if result.activation_checkpointing else 'off'}"
            )
            console.print(plan_table(result, title))
        for line in problems:
            print_error(f"[red]does not fit:[/red] {escape(line)}", highlight=False)
        if not problems and result.gpu_limit_bytes is not None and not as_json:
            console.print(f"fits: every GPU within {gib_as_given(result.gpu_limit_bytes)} GiB")
        if not as_json:
            for line in notes:
                console.print(f"note: {escape(line)}", highlight=False)
        if problems:
            raise typer.Exit(1)
