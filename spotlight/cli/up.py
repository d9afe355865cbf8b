"""``spotlight up``: start the coordinator (and, with ``--local``, agents on this machine)."""

from __future__ import annotations

import datetime
import logging
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape

console = Console(emoji=False, soft_wrap=True)


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "spotlight"


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
        console.print(
            f"[yellow]warning:[/yellow] {escape(str(prompt_set.path))} changed since this run started (sha256 {before[:12]} → {record['sha256'][:12]})"
        )
    if message:
        console.print(f"[yellow]warning:[/yellow] {escape(message)}")
    path.write_text(json.dumps(record, indent=1) + "\n")


UNCAPPED_CANDIDATES = 1_000_000
"""``explore.max_candidates_per_prompt`` of ``--uncapped-exploration``: more candidates than
any training window can explore, i.e. no cap (paper §6.7 Fig. 15 measures peak throughput so)."""

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


def _spawn_agent(
    endpoint: str,
    gpus: list[int],
    node_id: str,
    *,
    reserved: bool,
    keys_dir: pathlib.Path,
    extra: list[str] | None = None,
) -> subprocess.Popen:
    from spotlight.util.procs import scrubbed_env, spawn_logged

    env = scrubbed_env()
    cmd = [
        sys.executable,
        "-m",
        "agent.main",
        "join",
        "--coordinator",
        endpoint,
        "--gpus",
        ",".join(map(str, gpus)),
        "--node-id",
        node_id,
        "--keys",
        str(keys_dir),
        "--key",
        "local",
    ]
    if reserved:
        cmd.append("--reserved")
    cmd += extra or []
    return spawn_logged(cmd, f"agent-{node_id}", env=env)


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
    for t in trackers or []:
        cmd += ["--tracker", t]
    if verbose:
        cmd.append("--verbose")
    if log_level.upper() != "WARNING":
        cmd += ["--log-level", log_level.upper()]
    return shlex.join(cmd)


def _checkpointed_iterations(run_dir: pathlib.Path) -> int | None:
    """Iterations held by ``run_dir``'s latest complete checkpoint
    (:func:`spotlight.store.checkpoint.latest_checkpoint`), or None without one."""
    from spotlight.store.checkpoint import latest_checkpoint

    try:
        got = latest_checkpoint(run_dir, cleanup=False)
    except OSError:
        return None
    return None if got is None else got[0] + 1


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
        why = f"Iteration 1 was stopped before its checkpoint was written, so there is nothing to continue from ({run_dir / 'checkpoints'})"
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


def _live_process(pid: int, marker: str):
    """The ``psutil.Process`` of ``pid`` if it is running (not a zombie) and its command line
    contains ``marker``, else None."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p if p.status() != psutil.STATUS_ZOMBIE and marker in " ".join(p.cmdline()) else None
    except psutil.Error:
        return None


def _adopt(entry: dict | None):
    """The still-running local agent process of ``entry`` (from a crashed run's
    local_agents.json), or None. Agents with a mock cloud are not adopted: their mock
    metadata server died with the old coordinator process."""
    if not entry or entry.get("cloud") or not entry.get("pid"):
        return None
    return _live_process(int(entry["pid"]), "agent.main")


def _check_options(
    *,
    mock_cloud: str,
    reserved: str,
    trace_mode: str,
    local: bool = True,
    agents: int | None = None,
    timeout_s: float | None = None,
    grace_s: float = 20.0,
    cycle_down_s: float = 5.0,
    cycle_iteration_s: float | None = None,
    tracker: list[str] | None = None,
    dirs: tuple[tuple[str, pathlib.Path | None], ...] = (),
) -> list[str]:
    """One-line problems with ``spotlight up``'s plain options, found before anything starts
    or is written (an empty list: none). ``dirs``: ``(flag, path)`` of options naming a
    directory (``--run-dir``, ``--keys``): one that exists as something else is refused."""
    from spotlight.cloud.mock_metadata import CLOUDS
    from spotlight.coordinator.tracking import KINDS
    from spotlight.net.endpoints import parse_host_port
    from spotlight.traces.replay_plan import TRACE_MODES

    problems = []
    if not local:  # options that only mean something for local agents are refused, not ignored
        problems += [
            f"{flag} needs --local"
            for flag, given in (("--agents", agents is not None), ("--mock-cloud", mock_cloud != "none"))
            if given
        ]
    for flag, value, zero_ok in (
        ("--timeout-s", timeout_s, False),
        ("--grace-s", grace_s, True),
        ("--cycle-down-s", cycle_down_s, False),
        ("--cycle-iteration-s", cycle_iteration_s, False),
    ):
        if value is not None and not (value >= 0 if zero_ok else value > 0):  # NaN fails both
            problems.append(f"{flag} {value:g}: must be {'>=' if zero_ok else '>'} 0 seconds")
    if mock_cloud not in (*CLOUDS, "none"):
        problems.append(f"--mock-cloud {mock_cloud}: choose from {', '.join(CLOUDS)}, none")
    try:
        parse_host_port(reserved, flag="--reserved", any_port=True)
    except ValueError as exc:
        problems.append(str(exc))
    if trace_mode not in TRACE_MODES:
        problems.append(f"--trace-mode {trace_mode}: choose from {', '.join(TRACE_MODES)}")
    problems += [
        f"--tracker {t}: choose from {', '.join(KINDS)}, none" for t in tracker or [] if t not in (*KINDS, "none")
    ]
    problems += [
        f"{flag} {path}: not a directory"
        for flag, path in dirs
        if path is not None and path.exists() and not path.is_dir()
    ]
    return problems


def patience_handler(alive: Callable[[], int], say: Callable[[str], None]):
    """The SIGINT handler while ``up`` stops its processes after a Ctrl-C: every further
    Ctrl-C is answered with one line (``alive()``: processes still to stop) and changes nothing."""

    def handler(signum, frame) -> None:
        try:
            n = alive()
        except Exception:  # a process table read must not break the clean-up
            n = None
        say(
            f"still stopping agents, workers and trainers{'' if n is None else f' ({n} process' + ('es' if n != 1 else '') + ')'}, please wait"
        )

    return handler


def replay_note(replay_flag: str | None, command: str) -> str | None:
    """The line under the stop hint of a run that replayed ``--trace`` or ``--preemption-cycles``
    (``replay_flag``; None: no replay): ``command`` (from :func:`next_command`) does not repeat it."""
    if replay_flag is None:
        return None
    if " --resume " in f" {command} ":
        return f"note: the {replay_flag} replay does not continue on resume (its driver's state is not checkpointed): the resumed run's spot agents see no revocations"
    return f"note: add the {replay_flag} options again to replay it from the start"


def _running_coordinator(run_dir: pathlib.Path) -> int | None:
    """The pid of the coordinator of ``run_dir`` (its ``coordinator.json``) if that process
    is still alive and a Spotlight process, else None."""
    import json

    try:
        pid = json.loads((pathlib.Path(run_dir) / "coordinator.json").read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    return pid if _live_process(pid, "spotlight") is not None else None


def _finished(run_dir: pathlib.Path, iterations: int) -> str | None:
    """Why ``--resume run_dir`` must not start: its checkpoints already hold ``iterations``
    iterations (the run finished; resuming would re-run the last one's save and rewrite its
    results), else None. ``iterations``: the run's, with ``--iterations`` applied."""
    done = _checkpointed_iterations(run_dir) or 0
    if done < iterations:
        return None
    return (
        f"{run_dir} is finished ({done}/{done} iterations): model in {pathlib.Path(run_dir) / 'final'}, metrics in {pathlib.Path(run_dir) / 'metrics.jsonl'}; "
        f"to train it further, resume with --iterations N (N > {done})"
    )


def _continue_hint(run_dir: pathlib.Path) -> str:
    """How to continue the run already in ``run_dir``: ``--resume`` -- and, for a finished run
    (its checkpoints hold all of its config's iterations, which ``--resume`` alone refuses:
    :func:`_finished`), ``--resume … --iterations N`` to train it further."""
    import shlex

    from spotlight.config import ConfigError, load_config

    command = f"spotlight up --resume {shlex.quote(str(run_dir))}"
    try:
        iterations = load_config(pathlib.Path(run_dir) / "config.toml").run.iterations
    except ConfigError:
        iterations = None
    done = _checkpointed_iterations(run_dir)
    if iterations is not None and done is not None and done >= iterations:
        return f"it is finished ({done}/{done} iterations); train it further with spotlight up --resume {shlex.quote(str(run_dir))} --iterations N (N > {done})"
    return f"continue it with {command}"


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


def register(app: typer.Typer) -> None:
    @app.command()
    def up(
        local: bool = typer.Option(
            False,
            "--local",
            help="Also start N spot agents (and the reserved node's rollout agent) on this machine, with CPU 'GPUs'.",
        ),
        agents: Optional[int] = typer.Option(
            None, "--agents", min=0, help="Number of local spot agents (with --local; default 2)."
        ),
        gpus_per_agent: int = typer.Option(
            1, "--gpus-per-agent", min=1, help="Worker 'GPUs' per local spot agent (with --local)."
        ),
        iterations: Optional[int] = typer.Option(
            None, "--iterations", min=1, help="Training iterations (overrides run.iterations)."
        ),
        config: Optional[pathlib.Path] = typer.Option(
            None, "--config", help="Run config TOML (default: the embedded shapes task, examples/default/)."
        ),
        run_dir: Optional[pathlib.Path] = typer.Option(
            None, "--run-dir", help="Output directory (default: runs/<timestamp>)."
        ),
        reserved: str = typer.Option(
            "127.0.0.1:0",
            "--reserved",
            help="HOST:PORT the coordinator listens on for agents (port 0 = any free port).",
        ),
        timeout_s: Optional[float] = typer.Option(
            None, "--timeout-s", help="Abort if the run takes longer than this many seconds."
        ),
        log_level: str = typer.Option(
            "WARNING",
            "--log-level",
            help="Log level of the console (INFO shows joins and leases). Every process also logs at INFO to <run-dir>/logs/.",
        ),
        verbose: bool = typer.Option(
            False,
            "--verbose",
            "-v",
            help="Also echo the logs of agents, workers and trainers (the files in <run-dir>/logs/) to the console.",
        ),
        tracker: Optional[list[str]] = typer.Option(
            None,
            "--tracker",
            help="Experiment tracking (repeatable; overrides run.trackers): tensorboard or wandb (offline; each writes its own folder in the run directory), or none.",
        ),
        mock_cloud: str = typer.Option(
            "none",
            "--mock-cloud",
            help="With --local: give each spot agent its own mock metadata server of this cloud (aws, gcp, azure; none = no detector). Notices are then issued through it (local_agents.json lists the control URLs).",
        ),
        grace_s: float = typer.Option(
            20.0, "--grace-s", help="With --local: seconds a preempted worker gets to commit in-flight state."
        ),
        trace: Optional[pathlib.Path] = typer.Option(
            None,
            "--trace",
            help="With --local: replay a spot trace (Bamboo add/remove CSV, Bamboo GCP/AWS count log or SkyPilot spot-traces JSON; e.g. the Bamboo p3 trace in examples/traces/) onto the local spot agents' GPUs, with seeded random placement (paper §6.1).",
        ),
        time_scale: Optional[float] = typer.Option(
            None,
            "--time-scale",
            min=0.01,
            help="Trace seconds per wall-clock second (default: stretch the slice over the run's expected length).",
        ),
        trace_start_s: float = typer.Option(
            3000.0, "--trace-start-s", min=0.0, help="Start of the replayed trace slice, in trace seconds."
        ),
        trace_duration_s: float = typer.Option(
            1800.0, "--trace-duration-s", min=1.0, help="Length of the replayed slice, in trace seconds."
        ),
        trace_seed: int = typer.Option(
            0, "--trace-seed", help="Seed of the random placement of trace GPUs onto agents."
        ),
        trace_mode: str = typer.Option(
            "slice",
            "--trace-mode",
            help="slice: replay the --trace-start-s and --trace-duration-s slice of the trace, its GPU count scaled to the local agents' GPUs; full: the whole trace from t=0 unscaled, removals hitting a random node (paper §3.1/§6.1; --agents × --gpus-per-agent must hold its peak).",
        ),
        preemption_cycles: Optional[int] = typer.Option(
            None,
            "--preemption-cycles",
            min=0,
            help="With --local, instead of --trace: a synthetic preemption trace (paper Fig. 13) with this many revocation/recovery cycles per iteration, each taking half the spot GPUs for --cycle-down-s seconds.",
        ),
        cycle_down_s: float = typer.Option(
            5.0, "--cycle-down-s", help="Seconds until a synthetic cycle's revoked GPUs come back (paper: 5)."
        ),
        cycle_iteration_s: Optional[float] = typer.Option(
            None,
            "--cycle-iteration-s",
            help="Iteration window the synthetic cycles are spread over, in wall seconds (default: the expected iteration time of the embedded default on CPU, 30 s).",
        ),
        uncapped_exploration: bool = typer.Option(
            False,
            "--uncapped-exploration",
            help="Throughput measurements (paper Fig. 15): no cap on exploration candidates per prompt; spot GPUs stream extra candidates for the whole training window (sets explore.stream_extra and a cap of 1000000 candidates per prompt).",
        ),
        spot_nice: int = typer.Option(
            5,
            "--spot-nice",
            min=0,
            max=19,
            help="With --local: CPU niceness of the simulated spot workers (they share this machine's cores with the trainer).",
        ),
        keys: Optional[pathlib.Path] = typer.Option(
            None,
            "--keys",
            envvar="SPOTLIGHT_KEYS",
            help="Coordinator keys directory (server.key_secret + clients/ allow-list; `spotlight keys init`). Default: <run-dir>/keys, created on first use.",
        ),
        resume: Optional[pathlib.Path] = typer.Option(
            None,
            "--resume",
            help="Continue the run in this directory from its last complete iteration (after a crash or kill); its config.toml is used and agents reconnect by themselves.",
        ),
        mode: Optional[str] = typer.Option(
            None,
            "--mode",
            help="Spotlight or a paper baseline (overrides run.mode): spotlight, rlboost, rlboost+explore, verl-omni-spot, reserved-only (the names of `spotlight simulate --policy`).",
        ),
        resume_existing: bool = typer.Option(
            False,
            "--resume-existing",
            help="With --run-dir: resume it if it already holds a run, else start a new one there (for supervisors such as systemd).",
        ),
    ) -> None:
        """Post-train a DiT with Flow-GRPO while spot agents explore seeds on stale weights.

        Without --local only the coordinator (Request Scheduler, Planner, Instance Manager, Tensor Store) and the Train Workers start; agents join with `spotlight-agent join --coordinator HOST:PORT --gpus 0,1`.
        """
        if not isinstance(logging.getLevelName(log_level.upper()), int):
            console.print(f"[red]error:[/red] --log-level {escape(log_level)}: expected DEBUG, INFO, WARNING or ERROR")
            raise typer.Exit(2)
        for problem in _check_options(
            mock_cloud=mock_cloud,
            reserved=reserved,
            trace_mode=trace_mode,
            local=local,
            agents=agents,
            timeout_s=timeout_s,
            grace_s=grace_s,
            cycle_down_s=cycle_down_s,
            cycle_iteration_s=cycle_iteration_s,
            tracker=tracker,
            dirs=(("--run-dir", run_dir), ("--resume", resume), ("--keys", keys)),
        ):
            console.print(f"[red]error:[/red] {escape(problem)}")
            raise typer.Exit(2)
        reserved = reserved.removeprefix("tcp://")  # the coordinator binds tcp://HOST:PORT
        agents_given, agents = agents is not None, 2 if agents is None else agents
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from spotlight.config import load_config
        from spotlight.errors import SpotlightError, plural

        overrides = {"run.iterations": iterations} if iterations else {}
        if mode is not None:
            from spotlight.core.modes import MODE_NAMES

            if mode not in MODE_NAMES:
                console.print(f"[red]error:[/red] --mode {escape(mode)}: choose from {', '.join(MODE_NAMES)}")
                raise typer.Exit(2)
            overrides["run.mode"] = mode
        if tracker:
            overrides["run.trackers"] = [] if tracker == ["none"] else tracker
        if uncapped_exploration:
            overrides.update({"explore.max_candidates_per_prompt": UNCAPPED_CANDIDATES, "explore.stream_extra": True})
        if (
            resume is not None
            and run_dir is not None
            and pathlib.Path(run_dir).resolve() != pathlib.Path(resume).resolve()
        ):
            console.print("[red]error:[/red] --resume names the run directory; do not pass a different --run-dir")
            raise typer.Exit(2)
        if resume is None and resume_existing:
            if run_dir is None:
                console.print("[red]error:[/red] --resume-existing needs --run-dir")
                raise typer.Exit(2)
            if (pathlib.Path(run_dir) / "config.toml").is_file() and (
                pathlib.Path(run_dir) / "coordinator.json"
            ).is_file():
                resume = pathlib.Path(run_dir)
                config = None  # the run's own config.toml, as with --resume
        if resume is not None:
            if not (pathlib.Path(resume) / "config.toml").is_file():
                console.print(
                    f"[red]error:[/red] --resume {resume}: no config.toml there; not a Spotlight run directory"
                )
                raise typer.Exit(2)
            if config is not None:
                console.print("[red]error:[/red] --resume uses the run's own config.toml; drop --config")
                raise typer.Exit(2)
            config = pathlib.Path(resume) / "config.toml"
            run_dir = pathlib.Path(resume)
        try:
            cfg = load_config(config, overrides)
            from spotlight.tasks.prompts import prompt_set_from_config

            prompt_set = prompt_set_from_config(cfg.data, config)
            prompts = prompt_set.prompts
        except SpotlightError as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        from spotlight.coordinator.tracking import TrackingError, check_trackers

        try:
            check_trackers(cfg.run.trackers)
        except TrackingError as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        rd = (
            run_dir
            or pathlib.Path("runs") / f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        )
        fresh = resume is None and (
            not rd.exists() or (rd.is_dir() and not any(rd.iterdir()))
        )  # this start creates the run directory
        if (running := _running_coordinator(rd)) is not None:  # before --resume is suggested: it would be refused
            console.print(
                f"[red]error:[/red] the run in {rd} is still running (coordinator pid {running}); watch it with [cyan]spotlight status {rd}[/cyan] (stop it with Ctrl-C in its terminal or kill {running})"
            )
            raise typer.Exit(2)
        if resume is None and (rd / "metrics.jsonl").is_file() and (rd / "metrics.jsonl").stat().st_size > 0:
            console.print(
                f"[red]error:[/red] {rd} already holds a run (metrics.jsonl); {escape(_continue_hint(rd))} or choose another --run-dir"
            )
            raise typer.Exit(2)
        if resume is not None:
            import json as _json

            try:
                old = _json.loads((rd / "coordinator.json").read_text())
            except (OSError, ValueError):
                old = {}
            if (why := _finished(rd, cfg.run.iterations)) is not None:
                if (
                    resume_existing
                ):  # a supervisor's restart of a finished run: nothing to do, and no failure to restart on
                    console.print(f"{escape(why.split(';')[0])}: nothing to do")
                    raise typer.Exit(0)
                console.print(f"[red]error:[/red] {escape(why)}")
                raise typer.Exit(2)
            if reserved == "127.0.0.1:0" and old.get("endpoint"):
                reserved = old["endpoint"].removeprefix("tcp://")  # the same address: agents reconnect by themselves
        try:  # fail fast on a missing or incomplete checkpoint (no weights load here)
            from spotlight.models.families import ModelLoadError, get_family

            family = get_family(cfg.model)
            family.check()
            if cfg.train.use_lora and cfg.train.lora_target_modules:
                family.check_lora_targets(list(cfg.train.lora_target_modules))
        except ModelLoadError as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2)
        if cfg.reward.kind == "geneval_shapes":  # every prompt must be a shapes-world caption
            from spotlight.rewards.reward_fn import RewardError, RewardFn

            try:
                RewardFn(cfg.reward).check_prompts(prompts)
            except RewardError as exc:
                console.print(
                    f"[red]error:[/red] reward.kind = 'geneval_shapes' cannot score the prompts of {cfg.data.prompts_path or 'the GenEval set (examples/default/prompts)'}: {escape(str(exc))}"
                )
                raise typer.Exit(2)
        if cfg.reward.kind == "http":  # fail fast on an unreachable reward service
            import numpy as np

            from spotlight.rewards.reward_fn import RewardError, RewardFn

            try:
                RewardFn(cfg.reward)(
                    np.zeros((1, 3, cfg.model.image_size, cfg.model.image_size), dtype=np.uint8), [prompts[0]]
                )
            except RewardError as exc:
                console.print(f"[red]error:[/red] reward service check failed: {escape(str(exc))}")
                raise typer.Exit(2)
        actions = None
        asked_cloud = mock_cloud  # before a replay picks one: what the stop hint repeats
        replay_flag = (
            "--trace" if trace is not None else "--preemption-cycles" if preemption_cycles is not None else None
        )
        if (
            trace is not None or preemption_cycles is not None
        ):  # load and check the trace before anything starts or is written
            flag = replay_flag
            if not local:
                console.print(f"[red]error:[/red] {flag} needs --local")
                raise typer.Exit(2)
            if resume is not None:
                console.print(
                    f"[red]error:[/red] --resume cannot replay a {flag} (the trace driver's state is not checkpointed)"
                )
                raise typer.Exit(2)
            if not cfg.cluster.use_spot:
                console.print(
                    f"[red]error:[/red] {flag} replays spot capacity, but run.mode = {cfg.run.mode!r} uses no spot GPUs"
                )
                raise typer.Exit(2)
            from spotlight.traces.formats import EXPECTED_ITERATION_S
            from spotlight.traces.replay_plan import plan_local_replay

            try:
                replay = plan_local_replay(
                    iterations=cfg.run.iterations,
                    agents=agents,
                    gpus_per_agent=gpus_per_agent,
                    trace=trace,
                    trace_mode=trace_mode,
                    time_scale=time_scale,
                    trace_start_s=trace_start_s,
                    trace_duration_s=trace_duration_s,
                    seed=trace_seed,
                    preemption_cycles=preemption_cycles,
                    cycle_down_s=cycle_down_s,
                    cycle_iteration_s=cycle_iteration_s if cycle_iteration_s is not None else EXPECTED_ITERATION_S,
                )
            except OSError as exc:
                console.print(f"[red]error:[/red] --trace {escape(str(trace))}: {escape(exc.strerror or str(exc))}")
                raise typer.Exit(2)
            except ValueError as exc:
                console.print(f"[red]error:[/red] {escape(str(exc))}")
                raise typer.Exit(2)
            actions = replay.actions
            if mock_cloud == "none":
                mock_cloud = "aws"
            for note in replay.notes:
                console.print(note)
        if agents_given and local and not cfg.cluster.use_spot:
            console.print(
                f"[yellow]warning:[/yellow] --agents {agents} is ignored: run.mode = {cfg.run.mode!r} uses no spot GPUs, so no spot agent starts"
            )
        if uncapped_exploration and not (cfg.explore.active and cfg.explore.mode == "stale"):
            console.print(
                f"[yellow]warning:[/yellow] --uncapped-exploration streams extra candidates only with explore.mode = 'stale' (this run: {cfg.explore.mode if cfg.explore.active else 'off'})"
            )
        console.print(
            f"[bold]Spotlight[/bold] run dir [cyan]{rd}[/cyan]  ({plural(cfg.run.iterations, 'iteration')}, {cfg.data.prompts_per_iteration}×{cfg.data.group_size} samples/iteration)"
        )
        console.print(escape(prompt_set.summary()))
        if len(prompts) < cfg.data.prompts_per_iteration:
            console.print(
                f"[yellow]warning:[/yellow] {len(prompts)} prompts for data.prompts_per_iteration = {cfg.data.prompts_per_iteration}: the same prompts repeat within every batch"
            )
        if not verbose:  # the console shows progress lines only: no library loading bars
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
            try:
                import transformers

                transformers.utils.logging.disable_progress_bar()
            except (ImportError, AttributeError):
                pass
        with console.status(f"encoding prompts ({cfg.model.family} text encoder, cached after the first run)…"):
            import torch

            torch.set_num_threads(max(1, cfg.cluster.torch_threads))
            from spotlight.coordinator.coordinator import Coordinator
            from spotlight.models.families import ModelLoadError, cached_conditioning, get_family

            try:
                token_counts = get_family(cfg.model).prompt_token_counts(prompts)
                cond = cached_conditioning(get_family(cfg.model), prompts, _cache_dir())
            except (ModelLoadError, OSError, ValueError) as exc:
                console.print(
                    f"[red]error:[/red] cannot encode prompts with model.family = {cfg.model.family!r} from {cfg.model.pretrained_path or '(built in)'}: {escape(str(exc))}"
                )
                raise typer.Exit(2)
        from spotlight.net.security import KeysError, load_server_keys

        keys_dir = (keys or rd / "keys").resolve()
        try:
            prepare_keys(keys_dir, local=local)
            server_keys = load_server_keys(keys_dir)
        except (KeysError, OSError) as exc:
            console.print(f"[red]error:[/red] keys: {escape(str(exc))}")
            _discard_new_run(rd, fresh)
            raise typer.Exit(2)
        _setup_logging(log_level, rd / "logs", verbose=verbose)
        import zmq

        try:
            coord = Coordinator(
                cfg,
                rd,
                bind=f"tcp://{reserved}",
                keys=server_keys,
                prompts=prompts,
                cond=cond,
                progress=console.print,
                resume=resume is not None,
                trackers=cfg.run.trackers,
            ).start()
        except (SpotlightError, zmq.ZMQError) as exc:
            why = (
                f"cannot listen on {reserved}: {zmq.strerror(exc.errno).lower()}"
                if isinstance(exc, zmq.ZMQError)
                else str(exc)
            )
            console.print(f"[red]error:[/red] {escape(why)}")
            _discard_new_run(rd, fresh)
            raise typer.Exit(2)
        except BaseException:
            _discard_new_run(rd, fresh)
            raise
        _record_prompts(rd, prompt_set, token_counts, cfg.model.max_text_tokens)
        console.print(f"coordinator listening on [cyan]{coord.endpoint}[/cyan]")
        procs: list[subprocess.Popen] = []
        mocks = []
        driver = None
        adopted: list = []  # local agents of a crashed coordinator that survived it (psutil.Process)
        stop = {"sig": None}
        signal.signal(signal.SIGTERM, lambda s, f: stop.update(sig=s) or (_ for _ in ()).throw(KeyboardInterrupt()))
        signal.signal(signal.SIGHUP, signal.getsignal(signal.SIGTERM))  # the terminal closed: stop as on SIGTERM
        layout = dict(
            local=local,
            agents=agents,
            gpus_per_agent=gpus_per_agent,
            mock_cloud=asked_cloud,
            grace_s=grace_s,
            spot_nice=spot_nice,
            reserved=reserved,
            keys=keys,
            verbose=verbose,
            log_level=log_level,
            trackers=tracker,
            spot=cfg.cluster.use_spot,
        )
        interrupted = failed = False
        try:
            coord.start_trainers()
            if local:
                import json as _json

                endpoint = coord.endpoint
                listing = {}
                state_root = rd / "agents"
                os.environ["SPOTLIGHT_AGENT_STATE"] = str(state_root.resolve())
                previous = {}
                if resume is not None and (rd / "local_agents.json").is_file():
                    previous = _json.loads((rd / "local_agents.json").read_text()).get("agents", {})
                rgpus, k = list(cfg.cluster.reserved_rollout_gpus), cfg.cluster.reserved_sp_degree
                for i, gpus in enumerate(rgpus[j : j + k] for j in range(0, len(rgpus), k)):  # one agent per SP group
                    if (p := _adopt(previous.get(f"reserved-{i}"))) is not None:
                        adopted.append(p)
                        listing[f"reserved-{i}"] = previous[f"reserved-{i}"]
                        continue
                    procs.append(_spawn_agent(endpoint, gpus, f"reserved-{i}", reserved=True, keys_dir=keys_dir))
                    listing[f"reserved-{i}"] = {"pid": procs[-1].pid, "spot": False, "gpus": gpus}
                for a in range(0 if actions is not None or not cfg.cluster.use_spot else agents):
                    if (p := _adopt(previous.get(f"spot-{a}"))) is not None:
                        adopted.append(p)
                        listing[f"spot-{a}"] = previous[f"spot-{a}"]
                        continue
                    # simulated spot GPUs share this machine's cores with the trainer: run them
                    # at lower CPU priority so the reserved side trains as if they were separate (nice 5)
                    extra = [
                        "--grace-s",
                        str(grace_s),
                        "--nice",
                        str(spot_nice),
                        "--warm-spare" if cfg.cluster.warm_spare else "--no-warm-spare",
                    ]
                    entry = {"spot": True, "gpus": list(range(gpus_per_agent))}
                    if mock_cloud != "none":
                        from spotlight.cloud.mock_metadata import MockMetadataServer

                        mock = MockMetadataServer(mock_cloud, vm_name=f"spot-{a}").start()
                        mocks.append(mock)
                        extra += ["--cloud", mock_cloud, "--metadata-url", mock.url, "--poll-interval-s", "0.5"]
                        entry.update(cloud=mock_cloud, metadata_url=mock.url, control_url=mock.control_url)
                    procs.append(
                        _spawn_agent(
                            endpoint,
                            list(range(gpus_per_agent)),
                            f"spot-{a}",
                            reserved=False,
                            keys_dir=keys_dir,
                            extra=extra,
                        )
                    )
                    entry["pid"] = procs[-1].pid
                    listing[f"spot-{a}"] = entry
                listing_doc = {"coordinator": endpoint, "state_dir": str(state_root.resolve()), "agents": listing}
                (rd / "local_agents.json").write_text(_json.dumps(listing_doc, indent=2))
                if adopted:
                    console.print(
                        f"{plural(len(adopted), 'local agent')} of the previous coordinator {'is' if len(adopted) == 1 else 'are'} still running: they reconnect by themselves and keep their workers"
                    )
                if actions is not None:
                    from spotlight.traces.driver import TraceDriver

                    driver = TraceDriver(
                        actions,
                        coordinator=endpoint,
                        keys_dir=keys_dir,
                        cloud=mock_cloud,
                        grace_s=grace_s,
                        listing=listing_doc,
                        listing_path=rd / "local_agents.json",
                        nice=spot_nice,
                        warm_spare=cfg.cluster.warm_spare,
                        node_ready=coord.node_registered,
                    )
                    driver.start()
            else:
                port = coord.endpoint.rsplit(":", 1)[1]
                console.print(
                    (
                        "waiting for agents: those of the earlier coordinator reconnect by themselves. To add a node, give it a key: "
                        if resume is not None
                        else "waiting for agents. Give each spot node a key: "
                    )
                    + f"[cyan]spotlight keys add {keys_dir} agent NODE[/cyan], copy "
                    f"[cyan]{keys_dir}/server.key[/cyan] and [cyan]{keys_dir}/agent.NODE.key_secret[/cyan] to the node's keys directory, then run "
                    f"[cyan]spotlight-agent join --coordinator <this-host>:{port} --keys DIR --gpus 0[/cyan]"
                )
            t0 = time.monotonic()
            coord.serve(timeout_s=timeout_s)
            console.print(
                f"[green]done[/green] in {time.monotonic() - t0:.0f}s: metrics {rd / 'metrics.jsonl'}, model {rd / 'final'}, curve {rd / 'reward_curve.png'}"
            )
            console.print(
                f"next: [cyan]spotlight eval --run-dir {rd}[/cyan] scores the base and the trained model on held-out prompts; [cyan]spotlight status {rd}[/cyan] shows the run's summary"
            )
        except KeyboardInterrupt:
            interrupted = True
            # a second Ctrl-C must not cut the clean-up short, but it gets an answer
            signal.signal(
                signal.SIGINT,
                patience_handler(
                    lambda: (
                        sum(
                            p.poll() is None
                            for p in [*procs, *coord.trainers.procs, *(driver.procs if driver is not None else [])]
                        )
                        + sum(p.is_running() for p in adopted)
                    ),
                    console.print,
                ),
            )
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            sig = "SIGTERM" if stop["sig"] == signal.SIGTERM else "SIGHUP" if stop["sig"] == signal.SIGHUP else "Ctrl-C"
            coord.stop_reason = f"interrupted: {sig}"
            console.print(f"[yellow]interrupted[/yellow] ({sig}): stopping agents, workers and trainers…")
            raise typer.Exit(130)
        except RuntimeError as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            coord.stop_reason = str(exc)  # e.g. the --timeout-s limit; a run error is coord.error
            failed = True
            raise typer.Exit(1)
        finally:
            if driver is not None:
                driver.stop_event.set()
            coord.shutdown_agents(reason="interrupted" if interrupted else "run finished")
            deadline = time.monotonic() + 15
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
            if adopted:
                import psutil

                _, alive = psutil.wait_procs(adopted, timeout=max(0.1, deadline - time.monotonic()))
                for p in alive:
                    p.terminate()
                psutil.wait_procs(alive, timeout=5)
            for p in coord.trainers.procs:
                if p.poll() is None:
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
            coord.close()
            if driver is not None:
                driver.close()
            for m in mocks:
                m.stop()
            if interrupted or failed:  # after coord.close(): the checkpoints on disk are final
                sentence, command = next_command(rd, iterations=cfg.run.iterations, **layout)
                console.print(
                    f"{'stopped. ' if interrupted else ''}{escape(sentence)}\n  [cyan]{escape(command)}[/cyan]"
                )
                if (note := replay_note(replay_flag, command)) is not None:
                    console.print(escape(note))
