"""``spotlight up``: start the coordinator (and, with ``--local``, agents on this machine).

The command is a pipeline (:func:`run_up`): its options are resolved and every check that can
refuse the start runs before anything is written or started (:mod:`spotlight.cli.up_preflight`);
then the run is announced, its prompts encoded, the coordinator started, and the run served
with the processes beside it (:class:`spotlight.cli.up_local.LocalCluster`) until it ends.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pathlib
import shlex
import signal
import time
from typing import Optional

import typer
from rich.markup import escape

from spotlight.cli.messages import CallTimeConsole, print_error, say_to
from spotlight.cli.progress import working
from spotlight.cli.up_preflight import (
    DEFAULT_RESERVED,
    Stop,
    UpRun,
    _checkpointed_iterations,
    preflight,
    resolve_options,
)
from spotlight.protocol import MAX_GPUS_PER_NODE
from spotlight.util.atomic_file import write_text_atomic
from spotlight.util.cli_paths import path_option
from spotlight.util.cli_run import INTERRUPTED_STATUS, interrupt_reported

console = CallTimeConsole(emoji=False, soft_wrap=True)  # sized when it prints (messages.py)


def _option(help: str):
    """A field of :class:`UpOptions`; ``help`` is its ``--help`` text."""
    return dataclasses.field(metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class UpOptions:
    """``spotlight up``'s options as given on the command line (each field's metadata holds
    its ``--help`` text); :func:`spotlight.cli.up_preflight.resolve_options` resolves them."""

    local: bool = _option(
        "Also start N spot agents (and the reserved node's rollout agent) on this machine, with CPU 'GPUs'."
    )
    agents: Optional[int] = _option("Number of local spot agents (with --local; default 2).")
    gpus_per_agent: int = _option("Worker 'GPUs' per local spot agent (with --local).")
    iterations: Optional[int] = _option("Training iterations (overrides run.iterations).")
    config: Optional[pathlib.Path] = _option("Run config TOML (default: the embedded shapes task, examples/default/).")
    run_dir: Optional[pathlib.Path] = _option("Output directory (default: runs/<timestamp>).")
    reserved: str = _option("HOST:PORT the coordinator listens on for agents (port 0 = any free port).")
    timeout_s: Optional[float] = _option("Abort if the run takes longer than this many seconds.")
    log_level: str = _option(
        "Log level of the console (INFO shows joins and leases). Every process also logs at INFO to <run-dir>/logs/."
    )
    verbose: bool = _option(
        "Also echo the logs of agents, workers and trainers (the files in <run-dir>/logs/) to the console."
    )
    tracker: Optional[list[str]] = _option(
        "Experiment tracking (repeatable; overrides run.trackers): tensorboard or wandb "
        "(offline; each writes its own folder in the run directory), or none."
    )
    mock_cloud: str = _option(
        "With --local: give each spot agent its own mock metadata server of this cloud "
        "(aws, gcp, azure; none = no detector). "
        "Notices are then issued through it (local_agents.json lists the control URLs)."
    )
    grace_s: float = _option("With --local: seconds a preempted worker gets to commit in-flight state.")
    trace: Optional[pathlib.Path] = _option(
        "With --local: replay a spot trace (Bamboo add/remove CSV, Bamboo GCP/AWS count log or "
        "SkyPilot spot-traces JSON; e.g. the Bamboo p3 trace in examples/traces/) onto the local spot agents' "
        "GPUs, with seeded random placement (paper §6.1)."
    )
    time_scale: Optional[float] = _option(
        "Trace seconds per wall-clock second (default: stretch the slice over the run's expected length)."
    )
    trace_start_s: float = _option("Start of the replayed trace slice, in trace seconds.")
    trace_duration_s: float = _option("Length of the replayed slice, in trace seconds.")
    trace_seed: int = _option("Seed of the random placement of trace GPUs onto agents.")
    trace_mode: str = _option(
        "slice: replay the --trace-start-s and --trace-duration-s slice of the trace, its GPU count scaled "
        "to the local agents' GPUs; full: the whole trace from t=0 unscaled, removals hitting a random node "
        "(paper §3.1/§6.1; --agents × --gpus-per-agent must hold its peak)."
    )
    preemption_cycles: Optional[int] = _option(
        "With --local, instead of --trace: a synthetic preemption trace (paper Fig. 13) with this many "
        "revocation/recovery cycles per iteration, each taking half the spot GPUs for --cycle-down-s seconds."
    )
    cycle_down_s: float = _option("Seconds until a synthetic cycle's revoked GPUs come back (paper: 5).")
    cycle_iteration_s: Optional[float] = _option(
        "Iteration window the synthetic cycles are spread over, in wall seconds "
        "(default: the expected iteration time of the embedded default on CPU, 30 s)."
    )
    uncapped_exploration: bool = _option(
        "Throughput measurements (paper Fig. 15): no cap on exploration candidates per prompt; "
        "spot GPUs stream extra candidates for the whole training window "
        "(sets explore.stream_extra and a cap of 1000000 candidates per prompt)."
    )
    spot_nice: int = _option(
        "With --local: CPU niceness of the simulated spot workers (they share this machine's cores with the trainer)."
    )
    keys: Optional[pathlib.Path] = _option(
        "Coordinator keys directory (server.key_secret + clients/ allow-list; `spotlight keys init`). "
        "Default: <run-dir>/keys, created on first use."
    )
    resume: Optional[pathlib.Path] = _option(
        "Continue the run in this directory from its last complete iteration (after a crash or kill); "
        "its config.toml is used and agents reconnect by themselves."
    )
    mode: Optional[str] = _option(
        "Spotlight or a paper baseline (overrides run.mode): spotlight, rlboost, rlboost+explore, "
        "verl-omni-spot, reserved-only (the names of `spotlight simulate --policy`)."
    )
    resume_existing: bool = _option(
        "With --run-dir: resume it if it already holds a run, else start a new one there "
        "(for supervisors such as systemd)."
    )
    external_trainers: bool = _option(
        "Start no Train Workers: wait for the ranks that torchrun or srun launch on the reserved nodes "
        "(README 'Multi-node training'). They connect to --trainer-port with a trainer key of --keys; "
        "the config's num_train_workers says how many."
    )
    trainer_port: Optional[int] = _option(
        "With --external-trainers: the trainer socket's port, on --reserved's host "
        "(default: the --reserved port + 1; 0 = any free port)."
    )
    trainer_timeout_s: float = _option("With --external-trainers: seconds to wait for every trainer rank to connect.")
    min_spot_nodes: Optional[int] = _option(
        "Start iteration 1 only once this many spot agents are alive (overrides the config's "
        "min_spot_nodes, in the cluster table); nodes that leave later do not stop the run."
    )


HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(UpOptions)}
"""``--help`` text of each ``spotlight up`` option, by :class:`UpOptions` field name."""


UP_HELP = (
    "Post-train a DiT with Flow-GRPO while spot agents explore seeds on stale weights.\n\n"
    "Without --local only the coordinator (Request Scheduler, Planner, Instance Manager, Tensor Store) and the "
    "Train Workers start; agents join with `spotlight-agent join --coordinator HOST:PORT --gpus 0,1`."
)
"""``spotlight up --help``'s text (its second paragraph is one line: typer keeps a help text's line breaks)."""


def register(app: typer.Typer) -> None:
    @app.command(help=UP_HELP)
    def up(
        local: bool = typer.Option(False, "--local", help=HELP["local"]),
        agents: Optional[int] = typer.Option(None, "--agents", min=0, help=HELP["agents"]),
        gpus_per_agent: int = typer.Option(
            1,
            "--gpus-per-agent",
            min=1,
            max=MAX_GPUS_PER_NODE,
            help=HELP["gpus_per_agent"],
        ),
        iterations: Optional[int] = typer.Option(None, "--iterations", min=1, help=HELP["iterations"]),
        config: Optional[pathlib.Path] = path_option(None, "--config", help=HELP["config"]),
        run_dir: Optional[pathlib.Path] = path_option(None, "--run-dir", help=HELP["run_dir"]),
        reserved: str = typer.Option(DEFAULT_RESERVED, "--reserved", help=HELP["reserved"]),
        timeout_s: Optional[float] = typer.Option(None, "--timeout-s", help=HELP["timeout_s"]),
        log_level: str = typer.Option("WARNING", "--log-level", help=HELP["log_level"]),
        verbose: bool = typer.Option(False, "--verbose", "-v", help=HELP["verbose"]),
        tracker: Optional[list[str]] = typer.Option(None, "--tracker", help=HELP["tracker"]),
        mock_cloud: str = typer.Option("none", "--mock-cloud", help=HELP["mock_cloud"]),
        grace_s: float = typer.Option(20.0, "--grace-s", help=HELP["grace_s"]),
        trace: Optional[pathlib.Path] = path_option(None, "--trace", help=HELP["trace"]),
        time_scale: Optional[float] = typer.Option(None, "--time-scale", min=0.01, help=HELP["time_scale"]),
        trace_start_s: float = typer.Option(3000.0, "--trace-start-s", min=0.0, help=HELP["trace_start_s"]),
        trace_duration_s: float = typer.Option(1800.0, "--trace-duration-s", min=1.0, help=HELP["trace_duration_s"]),
        trace_seed: int = typer.Option(0, "--trace-seed", help=HELP["trace_seed"]),
        trace_mode: str = typer.Option("slice", "--trace-mode", help=HELP["trace_mode"]),
        preemption_cycles: Optional[int] = typer.Option(
            None, "--preemption-cycles", min=0, help=HELP["preemption_cycles"]
        ),
        cycle_down_s: float = typer.Option(5.0, "--cycle-down-s", help=HELP["cycle_down_s"]),
        cycle_iteration_s: Optional[float] = typer.Option(None, "--cycle-iteration-s", help=HELP["cycle_iteration_s"]),
        uncapped_exploration: bool = typer.Option(False, "--uncapped-exploration", help=HELP["uncapped_exploration"]),
        spot_nice: int = typer.Option(5, "--spot-nice", min=0, max=19, help=HELP["spot_nice"]),
        keys: Optional[pathlib.Path] = path_option(None, "--keys", envvar="SPOTLIGHT_KEYS", help=HELP["keys"]),
        resume: Optional[pathlib.Path] = path_option(None, "--resume", help=HELP["resume"]),
        mode: Optional[str] = typer.Option(None, "--mode", help=HELP["mode"]),
        resume_existing: bool = typer.Option(False, "--resume-existing", help=HELP["resume_existing"]),
        external_trainers: bool = typer.Option(False, "--external-trainers", help=HELP["external_trainers"]),
        trainer_port: Optional[int] = typer.Option(None, "--trainer-port", min=0, max=65535, help=HELP["trainer_port"]),
        trainer_timeout_s: float = typer.Option(900.0, "--trainer-timeout-s", help=HELP["trainer_timeout_s"]),
        min_spot_nodes: Optional[int] = typer.Option(None, "--min-spot-nodes", min=0, help=HELP["min_spot_nodes"]),
    ) -> None:
        """:data:`UP_HELP`: the options collected into :class:`UpOptions` for :func:`run_up`."""
        run_up(
            UpOptions(
                local=local,
                agents=agents,
                gpus_per_agent=gpus_per_agent,
                iterations=iterations,
                config=config,
                run_dir=run_dir,
                reserved=reserved,
                timeout_s=timeout_s,
                log_level=log_level,
                verbose=verbose,
                tracker=tracker,
                mock_cloud=mock_cloud,
                grace_s=grace_s,
                trace=trace,
                time_scale=time_scale,
                trace_start_s=trace_start_s,
                trace_duration_s=trace_duration_s,
                trace_seed=trace_seed,
                trace_mode=trace_mode,
                preemption_cycles=preemption_cycles,
                cycle_down_s=cycle_down_s,
                cycle_iteration_s=cycle_iteration_s,
                uncapped_exploration=uncapped_exploration,
                spot_nice=spot_nice,
                keys=keys,
                resume=resume,
                mode=mode,
                resume_existing=resume_existing,
                external_trainers=external_trainers,
                trainer_port=trainer_port,
                trainer_timeout_s=trainer_timeout_s,
                min_spot_nodes=min_spot_nodes,
            )
        )


def run_up(opts: UpOptions) -> None:
    """``spotlight up`` with ``opts``: resolve, check, announce, encode the prompts, start the
    coordinator, serve the run to its end.

    Raises:
        typer.Exit: 2 for a refused start (its one line printed), 0 when there is nothing to
            do, 130 / 143 / 129 after Ctrl-C / SIGTERM / SIGHUP and 1 after a failure (both with
            the command that continues the run).
    """
    try:
        run = resolve_options(opts)
        run = preflight(run)  # now with its replay planned
        announce(run)
        cond, token_counts = encode_prompts(run)
        coord = start_coordinator(run, cond, token_counts)
    except Stop as stop:
        if stop.code:  # a refusal: its error line on stderr
            print_error(stop.line)
        else:  # nothing to do: no error
            console.print(stop.line)
        raise typer.Exit(stop.code) from None
    serve(run, coord)


def announce(run: UpRun) -> None:
    """The lines before the start: the replay's notes, options this run ignores, the run
    header and its prompts. Without ``--verbose`` libraries show no loading bars."""
    from spotlight.errors import plural

    opts, cfg = run.opts, run.cfg
    say = say_to(console)  # a replay's notes may be warnings
    for note in run.replay.notes if run.replay is not None else []:
        say(note)
    if opts.agents is not None and opts.local and not cfg.cluster.use_spot:
        print_error(
            f"[yellow]warning:[/yellow] --agents {opts.agents} is ignored: run.mode = {cfg.run.mode!r} uses no spot "
            "GPUs, so no spot agent starts"
        )
    if opts.uncapped_exploration and not (cfg.explore.active and cfg.explore.mode == "stale"):
        print_error(
            "[yellow]warning:[/yellow] --uncapped-exploration streams extra candidates only with explore.mode = "
            f"'stale' (this run: {cfg.explore.mode if cfg.explore.active else 'off'})"
        )
    console.print(
        f"[bold]Spotlight[/bold] run dir [cyan]{run.run_dir}[/cyan]  ({plural(cfg.run.iterations, 'iteration')}, "
        f"{cfg.data.prompts_per_iteration}×{cfg.data.group_size} samples/iteration)"
    )
    console.print(escape(run.prompt_set.summary()))
    _announce_memory(run)
    if len(run.prompts) < cfg.data.prompts_per_iteration:
        print_error(
            f"[yellow]warning:[/yellow] {len(run.prompts)} prompts for data.prompts_per_iteration = "
            f"{cfg.data.prompts_per_iteration}: the same prompts repeat within every batch"
        )
    n = run.eval_prompts
    if n is not None and n < cfg.eval.num_prompts:
        print_error(
            f"[yellow]warning:[/yellow] eval.num_prompts = {cfg.eval.num_prompts}, but the held-out prompt file "
            f"has {plural(n, 'prompt')}: the panel scores all {n}"
        )
    if not opts.verbose:  # the console shows progress lines only: no library loading bars
        from spotlight.util.quiet import hide_loading_bars

        hide_loading_bars()


def _announce_memory(run: UpRun) -> None:
    """The memory plan the preflight checked (:func:`spotlight.cli.plan.plan_summary`), and a
    warning when the disk plan exceeds the run directory's free space."""
    from spotlight.cli.plan import plan_summary
    from spotlight.util.disk import free_bytes

    check = run.memory
    if check is None:
        return
    if check.plan is None:
        console.print(f"memory plan: none ({escape(check.note or 'the transformer could not be counted')})")
        return
    free = free_bytes(run.run_dir)
    for line in plan_summary(check.plan, device=check.device, limit_source=check.limit_source, disk_free_bytes=free):
        console.print(escape(line), highlight=False)
    if check.plan.disk_bytes > free:
        print_error(
            f"[yellow]warning:[/yellow] the run may need up to {check.plan.disk_bytes / (1 << 30):.1f} GiB of disk at "
            f"{escape(str(run.run_dir))} and {free / (1 << 30):.1f} GiB are free (run.keep_weight_versions, "
            "run.keep_train_checkpoints; docs/planning.md §4-5)"
        )


def encode_prompts(run: UpRun) -> tuple:
    """``(conditioning, token counts)`` of the run's prompts by its model family's text
    encoder (:func:`spotlight.models.prompt_encoding.encode_run_prompts`: from the prompt
    cache, else on this host's GPU in bf16 in a child process that exits before the trainers
    start, else on the CPU; token counts None when the family cannot count). A spinner while
    the libraries load, a progress bar while prompts are encoded.

    Raises:
        Stop: the text encoder cannot be loaded or cannot encode the prompts.
    """
    cfg = run.cfg
    with working(console, f"loading the {cfg.model.family} text encoder's tokenizer…"):
        import torch

        torch.set_num_threads(max(1, cfg.cluster.torch_threads))
        importlib.import_module("spotlight.coordinator.coordinator")  # it imports torch: under the spinner
        from spotlight.models.families import ModelLoadError, get_family
        from spotlight.models.families.base import quiet_text_encoders
        from spotlight.models.prompt_encoding import EncodeError, encode_run_prompts
        from spotlight.util.disk import DiskSpaceError

        try:
            with quiet_text_encoders():  # the counts below say what was cut, once
                token_counts = get_family(cfg.model).prompt_token_counts(run.prompts)
            check_encodings(run, get_family(cfg.model), token_counts)
        except (ModelLoadError, OSError, ValueError) as exc:
            raise _encode_stop(cfg, exc) from None
    progress = _EncodeProgress()
    try:
        cond = encode_run_prompts(
            cfg.model,
            run.prompts,
            _cache_dir(),
            on_start=progress.start,
            on_progress=progress.update,
            torch_threads=cfg.cluster.torch_threads,
        )
    except DiskSpaceError as exc:
        raise Stop(f"[red]error:[/red] {escape(str(exc))}") from None
    except (ModelLoadError, EncodeError, OSError, ValueError) as exc:
        raise _encode_stop(cfg, exc) from None
    finally:
        progress.stop()
    return cond, token_counts


def _encode_stop(cfg, exc: Exception) -> Stop:
    return Stop(
        f"[red]error:[/red] cannot encode prompts with model.family = {cfg.model.family!r} from "
        f"{cfg.model.pretrained_path or '(built in)'}: {escape(str(exc))}"
    )


class _EncodeProgress:
    """The rich progress bar of a prompt encoding (started by its first callback; none on a cache hit)."""

    def __init__(self):
        self.bar = None
        self.task = None

    def start(self, where: str, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("encoding prompts on {task.fields[where]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = self.bar.add_task("encode", total=total, where=where)
        self.bar.start()

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def check_encodings(run: UpRun, family, token_counts: list[int] | None) -> None:
    """Refuse a prompt, or the negative prompt of true CFG, that the family's tokenizer encodes
    to no tokens (the pipeline would fail on an empty sequence): one line naming the prompt
    file's line, or ``model.negative_prompt``.

    Raises:
        Stop: as above.
    """
    from spotlight.config import TRUE_CFG_FAMILIES
    from spotlight.tasks.prompts import empty_encoding_report

    cfg = run.cfg
    if token_counts is not None:
        message = empty_encoding_report(run.prompt_set, token_counts, cfg.model.family)
        if message:
            raise Stop(f"[red]error:[/red] {escape(message)}")
    if cfg.model.family in TRUE_CFG_FAMILIES and family.guidance_scale > 1:
        (n,) = family.prompt_token_counts([family.negative_prompt]) or [1]
        if n <= 0:
            shown = "the default " if not cfg.model.negative_prompt else ""
            raise Stop(
                f"[red]error:[/red] model.negative_prompt: {shown}{family.negative_prompt!r} encodes to no tokens with "
                f"the {cfg.model.family} checkpoint's tokenizer (classifier-free guidance encodes it for every "
                'sample); set a negative prompt that has words, e.g. negative_prompt = "blurry, low quality"'
            )


def start_coordinator(run: UpRun, cond, token_counts: list[int] | None):
    """The started coordinator of ``run``: its keys prepared (:func:`prepare_keys`), its logs
    set up, its sockets bound, then ``prompts.json`` written and its address printed. A start
    that fails here removes the run directory it created (:func:`_discard_new_run`).

    Raises:
        Stop: the keys cannot be prepared or read, the address cannot be bound, or the run
            directory cannot be used (:class:`spotlight.errors.SpotlightError`).
    """
    import zmq

    from spotlight.coordinator.coordinator import Coordinator
    from spotlight.coordinator.trainer_group import ExternalTrainers
    from spotlight.errors import SpotlightError
    from spotlight.net.security import KeysError, load_server_keys

    opts, rd = run.opts, run.run_dir
    try:
        prepare_keys(run.keys_dir, local=opts.local)
        server_keys = load_server_keys(run.keys_dir)
    except (KeysError, OSError) as exc:
        _discard_new_run(rd, run.fresh)
        raise Stop(f"[red]error:[/red] keys: {escape(str(exc))}") from None
    _setup_logging(opts.log_level, rd / "logs", verbose=opts.verbose)
    try:
        coord = Coordinator(
            run.cfg,
            rd,
            bind=f"tcp://{run.reserved}",
            keys=server_keys,
            prompts=run.prompts,
            prompt_metadata=run.prompt_set.metadata,
            cond=cond,
            progress=console.print,
            resume=run.resuming,
            trackers=run.cfg.run.trackers,
            external_trainers=(
                ExternalTrainers(
                    bind=f"tcp://{run.trainer_bind}", timeout_s=opts.trainer_timeout_s, keys_dir=str(run.keys_dir)
                )
                if opts.external_trainers
                else None
            ),
        )
        coord.start()
    except (SpotlightError, zmq.ZMQError) as exc:
        where = f"{run.reserved} (or the trainer port {run.trainer_bind})" if opts.external_trainers else run.reserved
        why = (
            f"cannot listen on {where}: {zmq.strerror(exc.errno).lower()}"
            if isinstance(exc, zmq.ZMQError)
            else str(exc)
        )
        _discard_new_run(rd, run.fresh)
        raise Stop(f"[red]error:[/red] {escape(why)}") from None
    except BaseException:
        _discard_new_run(rd, run.fresh)
        raise
    _record_prompts(rd, run.prompt_set, token_counts, run.cfg.model.max_text_tokens)
    console.print(f"coordinator listening on [cyan]{coord.endpoint}[/cyan]")
    _announce_profile(run, coord.profile)
    return coord


def _announce_profile(run: UpRun, profile) -> None:
    """Say which Planner profile the run uses and why (:func:`spotlight.studies.profiling.load_profile`),
    whether it was measured for another config, and, when it uses none, that a profile an earlier
    ``spotlight profile`` cached for this config is no longer read."""
    from spotlight.studies.profiling import legacy_cache_path, profile_mismatch

    if profile is not None:
        console.print(escape(profile.describe()))
        if (why := profile_mismatch(profile, run.cfg)) is not None:
            print_error(f"[yellow]warning:[/yellow] {escape(why)}")
        return
    old = legacy_cache_path(run.cfg)
    if old.is_file():
        console.print(
            f"note: {escape(str(old))} (cached by an earlier `spotlight profile`) is not read any more: "
            f'set explore.profile_path = "{escape(str(old))}" to use it'
        )


def serve(run: UpRun, coord) -> None:
    """Serve ``run`` until it ends, with its Train Workers and (``--local``) agents running
    beside the coordinator in a :class:`~spotlight.cli.up_local.LocalCluster`, which stops
    them all as the run ends. SIGTERM and SIGHUP (the terminal closed) stop the run as Ctrl-C
    does. A run that stopped early prints the command that continues it, once every process
    stopped (the checkpoints on disk are then final).

    Raises:
        typer.Exit: 130 after Ctrl-C, 143 after SIGTERM, 129 after SIGHUP
            (:data:`spotlight.util.cli_run.INTERRUPTED_STATUS`), 1 after a failure (e.g. ``--timeout-s``).
    """
    from spotlight.cli.up_local import LocalCluster

    received = _stop_on_signals()
    with LocalCluster(run, coord, say=say_to(console)) as cluster:
        code = _serve_to_the_end(run, coord, cluster, received)
    if code:
        _print_stop_hint(run, interrupted=code in INTERRUPTED_STATUS.values())
        raise typer.Exit(code)


def _stop_on_signals() -> dict:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does. Returns a dict whose
    ``"sig"`` is the signal that arrived (None: none, or Ctrl-C)."""
    received = {"sig": None}

    def handler(signum, frame) -> None:
        received["sig"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)  # the terminal closed: stop as on SIGTERM
    return received


def next_steps(rd: pathlib.Path, cfg, activate: str | None = None) -> str:
    """The finished run's ``next:`` line (rich markup). It suggests ``spotlight eval`` as is only
    when eval accepts the run (:func:`spotlight.cli.eval.refusal`); otherwise it says what eval
    needs (held-out prompts). ``activate`` (:func:`activate_hint`): the command that puts
    ``spotlight`` on the PATH first, when it is not (``./scripts/run-local`` runs the venv's)."""
    from spotlight.cli.eval import refusal

    first = f"[cyan]{escape(activate)}[/cyan], then " if activate else ""
    status = f"[cyan]{escape(shlex.join(['spotlight', 'status', str(rd)]))}[/cyan] shows the run's summary"
    evaluate = escape(shlex.join(["spotlight", "eval", "--run-dir", str(rd)]))  # commands to copy: shell-quoted
    if refusal(cfg) is None:
        return (
            f"next: {first}[cyan]{evaluate}[/cyan] scores the base and the trained model on held-out prompts; {status}"
        )
    return (
        f"next: {first}{status}; [cyan]{evaluate} --prompts FILE[/cyan] scores the base and "
        "the trained model on your held-out prompts (this config has no eval.prompts_path)"
    )


def activate_hint(executable: str | None = None, path: str | None = None) -> str | None:
    """``source <venv>/bin/activate`` when the ``spotlight`` on ``path`` is not the one next to
    ``executable`` (default this interpreter) and that directory is a virtual environment's; else
    None. ``path`` defaults to the user's shell's PATH: ``$SPOTLIGHT_CALLER_PATH``, which
    ``scripts/_venv.sh`` sets before it puts the venv first for ``scripts/run-local``, else ``$PATH``."""
    import os
    import shutil
    import sys

    here = pathlib.Path(executable or sys.executable).absolute().parent
    if path is None:
        path = os.environ.get("SPOTLIGHT_CALLER_PATH", os.environ.get("PATH", ""))
    found = shutil.which("spotlight", path=path)
    if found and pathlib.Path(found).absolute().parent == here:
        return None
    activate = here / "activate"
    if not activate.is_file():
        return None
    try:
        shown = activate.relative_to(pathlib.Path.cwd())
    except ValueError:
        shown = activate
    return f"source {shlex.quote(str(shown))}"


def _serve_to_the_end(run: UpRun, coord, cluster, received: dict) -> int:
    """Start the Train Workers and the local agents (or say how agents join), serve the run
    and print its done and next lines. Returns the exit status: 0 done, 130 / 143 / 129
    interrupted by Ctrl-C / SIGTERM / SIGHUP, 1 failed (the coordinator's RuntimeError)."""
    try:
        coord.start_trainers()
        if run.opts.external_trainers:
            console.print(_waiting_trainers_line(run, coord))
        if run.opts.local:
            cluster.start()
        else:
            console.print(_waiting_line(run, coord))
        t0 = time.monotonic()
        coord.serve(timeout_s=run.opts.timeout_s, on_tick=cluster.check)
        rd = run.run_dir
        console.print(
            f"[green]done[/green] in {time.monotonic() - t0:.0f}s: metrics {rd / 'metrics.jsonl'}, "
            f"model {rd / 'final'}, curve {rd / 'reward_curve.png'}"
        )
        console.print(next_steps(rd, run.cfg, activate_hint()))
        return 0
    except KeyboardInterrupt:
        cluster.interrupt()  # a second Ctrl-C must not cut the clean-up short, but it gets an answer
        sig = {signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}.get(received["sig"], "Ctrl-C")
        coord.stop_reason = f"interrupted: {sig}"
        # on stderr, as every "interrupted" line of the CLI (cli_run.run_app's before the run starts)
        print_error(f"[yellow]interrupted[/yellow] ({sig}): stopping agents, workers and trainers…")
        interrupt_reported()
        return INTERRUPTED_STATUS[sig]
    except RuntimeError as exc:
        print_error(f"[red]error:[/red] {escape(str(exc))}")
        coord.stop_reason = str(exc)  # e.g. the --timeout-s limit; a run error is coord.error
        return 1


def _waiting_line(run: UpRun, coord) -> str:
    """What a run without ``--local`` prints while it waits for agents: how to add a node."""
    import shlex

    from spotlight.cli.up_preflight import _local_agents_alive, _local_flags

    port = coord.endpoint.rsplit(":", 1)[1]
    keys_dir = run.keys_dir
    if run.resuming and (local := _local_flags(run.run_dir)) and not _local_agents_alive(run.run_dir):
        # its agents ended with it: none will reconnect
        again = shlex.join(["spotlight", "up", "--resume", str(run.run_dir), *local])
        opening = (
            "waiting for agents: this run was last run with --local, and its local agents stopped with it. "
            f"To run it locally again, stop this (Ctrl-C) and start [cyan]{escape(again)}[/cyan]; to add a "
            "node instead, give it a key: "
        )
    elif run.resuming:
        opening = (
            "waiting for agents: those of the earlier coordinator reconnect by themselves. "
            "To add a node, give it a key: "
        )
    else:
        opening = "waiting for agents. Give each spot node a key: "
    return (
        opening + f"[cyan]spotlight keys add {shlex.quote(str(keys_dir))} agent NODE[/cyan], copy "
        f"[cyan]{keys_dir}/server.key[/cyan] and [cyan]{keys_dir}/agent.NODE.key_secret[/cyan] to the node's keys "
        f"directory, then run [cyan]spotlight-agent join --coordinator <this-host>:{port} --keys DIR --gpus 0[/cyan]"
    )


def _waiting_trainers_line(run: UpRun, coord) -> str:
    """What a run with ``--external-trainers`` prints as it starts: the command that launches its
    ranks on each reserved node (README "Multi-node training")."""
    t = run.cfg.train
    world, nodes, per_node = t.num_train_workers, t.num_train_nodes, t.ranks_per_node
    address = coord.trainers.advertised_endpoint()
    return (
        f"waiting for {world} train worker rank{'s' if world != 1 else ''} (up to {run.opts.trainer_timeout_s:g} s). "
        f"On each reserved node run [cyan]torchrun --nnodes {nodes} --nproc-per-node {per_node} --node-rank N "
        f"--master-addr FIRST_NODE --master-port 29500 -m spotlight.workers.train.launch --coordinator {address} "
        f"--keys DIR[/cyan] (N = 0 … {nodes - 1}: train.num_train_nodes × {per_node} = {world}; DIR holds "
        f"{run.keys_dir}/server.key and a "
        f"trainer.NAME.key_secret from [cyan]spotlight keys add {shlex.quote(str(run.keys_dir))} trainer NAME[/cyan])"
    )


def _print_stop_hint(run: UpRun, *, interrupted: bool) -> None:
    """After a run stopped early: the command that continues it (:func:`next_command`), and
    what it does not repeat of a replay (:func:`replay_note`)."""
    sentence, command = next_command(run.run_dir, iterations=run.cfg.run.iterations, **run.layout)
    console.print(f"{'stopped. ' if interrupted else ''}{escape(sentence)}\n  [cyan]{escape(command)}[/cyan]")
    if (note := replay_note(run.replay_flag, command)) is not None:
        console.print(escape(note))


def _cache_dir() -> pathlib.Path:
    from spotlight.coordinator.evaluation import cache_dir

    return cache_dir()


def load_prompts(data, config_path=None) -> list[str]:
    """The prompts of a ``[data]`` section (:class:`spotlight.config.DataConfig`; a bare path
    string reads that file with no column settings), by :func:`spotlight.tasks.prompts.load_prompt_set`.

    Raises:
        ConfigError: missing file, malformed or ambiguous records, or no prompts in it.
    """
    from spotlight.config import DataConfig
    from spotlight.tasks.prompts import prompt_set_from_config

    return prompt_set_from_config(DataConfig(prompts_path=data) if isinstance(data, str) else data, config_path).prompts


def _record_prompts(rd: pathlib.Path, prompt_set, token_counts: list[int] | None, max_text_tokens: int) -> None:
    """Write ``rd/prompts.json`` (:meth:`spotlight.tasks.prompts.PromptSet.to_json` plus the
    text-encoder cut: ``max_text_tokens``, ``num_cut``, None when the family cannot count)
    and say once how many prompts the text encoder cuts. A resumed run whose prompt file
    changed since is warned about."""
    import json

    from spotlight.tasks.prompts import truncation_report

    record = prompt_set.to_json()
    num_cut, message = truncation_report(token_counts, max_text_tokens) if token_counts is not None else (None, "")
    record.update(max_text_tokens=max_text_tokens, num_cut=num_cut)
    path = rd / "prompts.json"
    try:
        before = json.loads(path.read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        before = None
    if before and before != record["sha256"]:
        print_error(
            f"[yellow]warning:[/yellow] {escape(str(prompt_set.path))} changed since this run started "
            f"(sha256 {before[:12]} → {record['sha256'][:12]})"
        )
    if message:
        print_error(f"[yellow]warning:[/yellow] {escape(message)}")
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")


LOCAL_KEYS = (("agent", "local"), ("reserved", "local"), ("status", "local"))
"""Client keys a local run creates for its own agents and for ``spotlight status``."""


def prepare_keys(keys_dir: pathlib.Path, *, local: bool) -> None:
    """Create the coordinator's keys in ``keys_dir`` if missing; a local run (and every run's
    ``spotlight status``) also gets its client keys there (README "Security model")."""
    from spotlight.net.security import add_client, init_keys

    init_keys(keys_dir, exist_ok=True)
    for role, name in LOCAL_KEYS if local else LOCAL_KEYS[2:]:
        if not (keys_dir / "clients" / f"{role}.{name}.key").exists():
            add_client(keys_dir, role, name)


def resume_command(
    run_dir: pathlib.Path,
    *,
    local: bool,
    agents: int,
    gpus_per_agent: int,
    mock_cloud: str,
    grace_s: float,
    spot_nice: int,
    reserved: str,
    keys: pathlib.Path | None,
    verbose: bool,
    log_level: str,
    trackers: list[str] | None,
    spot: bool = True,
    restart: bool = False,
    external_trainers: bool = False,
    trainer_port: int | None = None,
) -> str:
    """The ``spotlight up --resume RUN_DIR …`` command line that continues an interrupted run
    with the same local layout (the run's own config.toml holds everything else).

    ``spot``: the run uses spot GPUs (False for ``run.mode = "reserved-only"``: a local run
    starts no spot agent, so no spot-agent flag is repeated). ``restart``: the command that
    starts the run again in the same directory from its resolved config
    (``--config RUN_DIR/config.toml --run-dir RUN_DIR``) instead of resuming it."""
    import shlex

    run_dir = pathlib.Path(run_dir)
    cmd = [
        "spotlight",
        "up",
        *(["--config", str(run_dir / "config.toml"), "--run-dir"] if restart else ["--resume"]),
        str(run_dir),
    ]
    if local:
        cmd.append("--local")
    if local and spot:
        cmd += ["--agents", str(agents)]
        if gpus_per_agent != 1:
            cmd += ["--gpus-per-agent", str(gpus_per_agent)]
        if mock_cloud != "none":
            cmd += ["--mock-cloud", mock_cloud]
        if grace_s != 20.0:
            cmd += ["--grace-s", f"{grace_s:g}"]
        if spot_nice != 5:
            cmd += ["--spot-nice", str(spot_nice)]
    if not reserved.endswith(":0"):
        cmd += ["--reserved", reserved]
    if keys is not None:
        cmd += ["--keys", str(keys)]
    if external_trainers:
        cmd.append("--external-trainers")
        if trainer_port is not None:
            cmd += ["--trainer-port", str(trainer_port)]
    for t in trackers or []:
        cmd += ["--tracker", t]
    if verbose:
        cmd.append("--verbose")
    if log_level.upper() != "WARNING":
        cmd += ["--log-level", log_level.upper()]
    return shlex.join(cmd)


def next_command(run_dir: pathlib.Path, *, iterations: int, **layout) -> tuple[str, str]:
    """What to run after ``spotlight up`` stopped early: ``(sentence, command line)``.

    With a complete checkpoint (:func:`spotlight.store.checkpoint.latest_checkpoint`) the command
    continues the run (:func:`resume_command`). Without one (stopped before its first
    iteration ended) there is nothing to continue: the command starts the run again in the
    same directory from its resolved config -- or, when ``metrics.jsonl`` already holds a row
    (stopped between writing it and the checkpoint), with ``--resume``, which restarts a run
    without a checkpoint at iteration 1 (a plain start refuses a directory with metrics).
    ``layout``: the keyword arguments of :func:`resume_command`."""
    run_dir = pathlib.Path(run_dir)
    done = _checkpointed_iterations(run_dir)
    if done is not None:
        return f"Continue the run from its last complete iteration ({done}/{iterations}) with:", resume_command(
            run_dir, **layout
        )
    try:
        has_rows = (run_dir / "metrics.jsonl").stat().st_size > 0
    except OSError:
        has_rows = False
    if has_rows:  # the progress line of iteration 1 was printed, its checkpoint not yet written
        why = (
            "Iteration 1 was stopped before its checkpoint was written, so there is nothing to continue from "
            f"({run_dir / 'checkpoints'})"
        )
    else:
        why = f"No iteration finished, so there is no checkpoint to continue from ({run_dir / 'checkpoints'})"
    return f"{why}. Start the run again with:", resume_command(run_dir, **layout, restart=not has_rows)


def _setup_logging(log_level: str, log_dir: pathlib.Path, *, verbose: bool) -> None:
    """Console: records at ``log_level`` (default WARNING); ``log_dir/coordinator.log``: INFO
    (DEBUG with ``--log-level DEBUG``). Children (agents, their workers, trainers) learn the
    log directory, the echo flag and their level from the environment (:mod:`spotlight.util.procs`).

    Raises:
        ValueError: unknown level name.
    """
    from spotlight.util.procs import LOG_DIR_ENV, LOG_ECHO_ENV, LOG_FORMAT, LOG_LEVEL_ENV

    console_level = logging.getLevelName(log_level.upper())
    file_level = min(console_level, logging.INFO)
    log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    fh = logging.FileHandler(log_dir / "coordinator.log")
    fh.setLevel(file_level)
    fh.setFormatter(logging.Formatter(LOG_FORMAT.format(tag="%(name)s")))
    root.addHandler(fh)
    root.setLevel(min(root.level, file_level))
    for h in root.handlers:
        if h is not fh:
            h.setLevel(console_level)
    os.environ[LOG_DIR_ENV] = str(log_dir.resolve())
    os.environ[LOG_ECHO_ENV] = "1" if verbose else "0"
    os.environ.setdefault(LOG_LEVEL_ENV, logging.getLevelName(file_level))


def replay_note(replay_flag: str | None, command: str) -> str | None:
    """The line under the stop hint of a run that replayed ``--trace`` or ``--preemption-cycles``
    (``replay_flag``; None: no replay): ``command`` (from :func:`next_command`) does not repeat it."""
    if replay_flag is None:
        return None
    if " --resume " in f" {command} ":
        return (
            f"note: the {replay_flag} replay does not continue on resume (its driver's state is not checkpointed): "
            "the resumed run's spot agents see no revocations"
        )
    return f"note: add the {replay_flag} options again to replay it from the start"


def _discard_new_run(run_dir: pathlib.Path, fresh: bool) -> None:
    """Remove what a start that failed before its coordinator ran wrote into ``run_dir`` --
    only when this start created the directory (or found it empty): a retry with the same
    ``--run-dir`` then starts cleanly, and no half run is left behind."""
    import shutil

    if not fresh:
        return
    for h in logging.getLogger().handlers[:]:  # the run's log files (``_setup_logging``)
        if isinstance(h, logging.FileHandler) and pathlib.Path(h.baseFilename).is_relative_to(
            pathlib.Path(run_dir).resolve()
        ):
            logging.getLogger().removeHandler(h)
            h.close()
    shutil.rmtree(run_dir, ignore_errors=True)
