"""``spotlight up`` before anything is written or started: its options resolved into an
:class:`UpRun` (:func:`resolve_options`), then every check that can still refuse the start
(:func:`preflight`). Nothing here prints: a refusal is a :class:`Stop` that carries its one
line and the exit status, and the command prints it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import pathlib
import secrets
import shlex
from typing import TYPE_CHECKING

from rich.markup import escape

if TYPE_CHECKING:
    from spotlight.cli.up import UpOptions
    from spotlight.config import SpotlightConfig
    from spotlight.tasks.prompts import PromptSet
    from spotlight.traces.replay_plan import LocalReplay

UNCAPPED_CANDIDATES = 1_000_000
"""``explore.max_candidates_per_prompt`` of ``--uncapped-exploration``: more candidates than
any training window can explore, i.e. no cap (paper §6.7 Fig. 15 measures peak throughput so),
and no fewer than any ``planner.max_sequences`` the config accepts
(``spotlight.config.MAX_PLANNER_SEQUENCES``)."""

DEFAULT_RESERVED = "127.0.0.1:0"
"""``--reserved`` when not given: a resumed run then listens where its coordinator did."""


class Stop(Exception):
    """``spotlight up`` stops before its run started: ``line`` (rich markup) is printed and the
    command exits with ``code`` (2: the start is refused; 0: there is nothing to do)."""

    def __init__(self, line: str, code: int = 2):
        super().__init__(line)
        self.line = line
        self.code = code


def refuse(message: str) -> Stop:
    """The :class:`Stop` of a refusal: ``error: message`` (``message`` is plain text), exit 2."""
    return Stop(f"[red]error:[/red] {escape(message)}")


@dataclasses.dataclass(frozen=True)
class MemoryCheck:
    """The memory plan of a run as :func:`preflight` checked it (docs/planning.md).

    Attributes:
        plan: :class:`spotlight.core.memory_plan.MemoryPlan` of the config (None: its
            transformer could not be counted, ``note`` says why).
        device: "cuda" (bf16 where ``model.dtype = auto``) or "cpu" (fp32, host memory): where
            this host's trainers will run.
        limit_source: where ``plan.gpu_limit_bytes`` came from (``cluster.gpu_memory_gib`` or
            this host's GPUs as ``nvidia-smi`` reports them); None without a limit.
    """

    plan: object | None
    device: str
    limit_source: str | None
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class UpRun:
    """What ``spotlight up``'s options resolve to (:func:`resolve_options`).

    Attributes:
        opts: the options as given.
        cfg: the run's config, with ``--iterations``, ``--mode``, ``--tracker`` and
            ``--uncapped-exploration`` applied (a resumed run's own ``config.toml``).
        prompt_set: the prompts of ``cfg.data``.
        run_dir: the run directory (``--run-dir``, ``--resume``, or a new ``runs/<timestamp>``).
        fresh: this start creates the run directory (or found it empty): a start that fails
            before its coordinator runs removes it again.
        resuming: the run continues from its checkpoint (``--resume``, or ``--resume-existing``
            on a directory that holds a run).
        reserved: ``HOST:PORT`` the coordinator binds (``tcp://`` stripped; a resumed run
            keeps its earlier address unless ``--reserved`` names one).
        agents: local spot agents (``--agents``, default 2).
        replay: the ``--trace`` or ``--preemption-cycles`` replay, planned by :func:`preflight`
            (None: no replay).
        memory: the memory plan :func:`preflight` checked.
    """

    opts: UpOptions
    cfg: SpotlightConfig
    prompt_set: PromptSet
    run_dir: pathlib.Path
    fresh: bool
    resuming: bool
    reserved: str
    agents: int
    replay: LocalReplay | None = None
    memory: MemoryCheck | None = None
    eval_prompts: int | None = None
    """Set by :func:`preflight` (``eval_prompts``: the held-out prompts the panel scores)."""

    @property
    def prompts(self) -> list[str]:
        return self.prompt_set.prompts

    @property
    def keys_dir(self) -> pathlib.Path:
        """The coordinator's keys directory: ``--keys``, else ``RUN_DIR/keys``."""
        return (self.opts.keys or self.run_dir / "keys").resolve()

    @property
    def replay_flag(self) -> str | None:
        """The option that asks for a replay (``--trace`` or ``--preemption-cycles``), or None."""
        if self.opts.trace is not None:
            return "--trace"
        return "--preemption-cycles" if self.opts.preemption_cycles is not None else None

    @property
    def mock_cloud(self) -> str:
        """The cloud of the local spot agents' mock metadata servers ("none": no server); a
        replay needs one, so it picks aws unless ``--mock-cloud`` names another."""
        if self.replay is not None and self.opts.mock_cloud == "none":
            return "aws"
        return self.opts.mock_cloud

    @property
    def layout(self) -> dict:
        """The keyword arguments of :func:`spotlight.cli.up.resume_command` that repeat this
        start's local layout (``--mock-cloud`` as given, not as a replay picked it)."""
        o = self.opts
        return dict(
            local=o.local,
            agents=self.agents,
            gpus_per_agent=o.gpus_per_agent,
            mock_cloud=o.mock_cloud,
            grace_s=o.grace_s,
            spot_nice=o.spot_nice,
            reserved=self.reserved,
            keys=o.keys,
            verbose=o.verbose,
            log_level=o.log_level,
            trackers=o.tracker,
            spot=self.cfg.cluster.use_spot,
            external_trainers=o.external_trainers,
            trainer_port=o.trainer_port,
        )

    @property
    def trainer_bind(self) -> str:
        """``HOST:PORT`` of the trainer socket with ``--external-trainers``: ``--reserved``'s host,
        ``--trainer-port`` (default: the ``--reserved`` port + 1; port 0 stays 0, any free port)."""
        host, _, port = self.reserved.rpartition(":")
        if self.opts.trainer_port is not None:
            return f"{host}:{self.opts.trainer_port}"
        return f"{host}:{int(port) + 1 if int(port) else 0}"


WRITTEN_DIRS = frozenset({"--run-dir"})
"""Options naming a directory the run writes (the others are only read)."""


def check_options(
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
    external_trainers: bool = False,
    trainer_port: int | None = None,
    trainer_timeout_s: float = 900.0,
) -> list[str]:
    """One-line problems with ``spotlight up``'s plain options, found before anything starts
    or is written (an empty list: none). ``dirs``: ``(flag, path)`` of options naming a
    directory (``--run-dir``, ``--keys``): one that exists as something else is refused, and the
    run directory must be creatable and writable."""
    from spotlight.cloud.mock_metadata import CLOUDS
    from spotlight.coordinator.tracking import KINDS
    from spotlight.net.endpoints import parse_host_port
    from spotlight.traces.replay_plan import TRACE_MODES
    from spotlight.util.disk import unwritable_dir

    problems = []
    if not local:  # options that only mean something for local agents are refused, not ignored
        problems += [
            f"{flag} needs --local"
            for flag, given in (("--agents", agents is not None), ("--mock-cloud", mock_cloud != "none"))
            if given
        ]
    if not external_trainers:
        problems += [
            f"{flag} needs --external-trainers"
            for flag, given in (
                ("--trainer-port", trainer_port is not None),
                ("--trainer-timeout-s", trainer_timeout_s != 900.0),
            )
            if given
        ]
    for flag, value, zero_ok in (
        ("--trainer-timeout-s", trainer_timeout_s, False),
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
        _, port = parse_host_port(reserved, flag="--reserved", any_port=True)
    except ValueError as exc:
        problems.append(str(exc))
    else:
        if external_trainers and trainer_port is None and port == 65535:
            problems.append("--reserved port 65535 leaves no port for the trainers (default --trainer-port: PORT + 1)")
        if external_trainers and trainer_port is not None and trainer_port and trainer_port == port:
            problems.append(f"--trainer-port {trainer_port} is the --reserved port: give the trainers another one")
    if trace_mode not in TRACE_MODES:
        problems.append(f"--trace-mode {trace_mode}: choose from {', '.join(TRACE_MODES)}")
    problems += [
        f"--tracker {t}: choose from {', '.join(KINDS)}, none" for t in tracker or [] if t not in (*KINDS, "none")
    ]
    for flag, path in dirs:
        if path is None:
            continue
        if flag in WRITTEN_DIRS:  # the run writes there: it must be creatable and writable
            problem = unwritable_dir(path)
            if problem:
                problems.append(f"{flag} {path}: {problem}")
        elif path.exists() and not path.is_dir():  # read only (keys may be a read-only mount)
            problems.append(f"{flag} {path}: not a directory")
    return problems


def resolve_options(opts: UpOptions) -> UpRun:
    """``opts`` resolved: the config loaded with the options' overrides, the run directory
    chosen, a resumed run's config and address found.

    Raises:
        Stop: a bad option (the first one found), a ``--resume`` that names no run or
            contradicts ``--run-dir``/``--config``, or a config, prompt file or tracker that
            cannot be used.
    """
    if not isinstance(logging.getLevelName(opts.log_level.upper()), int):
        raise refuse(f"--log-level {opts.log_level}: expected DEBUG, INFO, WARNING or ERROR")
    for problem in check_options(
        mock_cloud=opts.mock_cloud,
        reserved=opts.reserved,
        trace_mode=opts.trace_mode,
        local=opts.local,
        agents=opts.agents,
        timeout_s=opts.timeout_s,
        grace_s=opts.grace_s,
        cycle_down_s=opts.cycle_down_s,
        cycle_iteration_s=opts.cycle_iteration_s,
        tracker=opts.tracker,
        dirs=(("--run-dir", opts.run_dir), ("--resume", opts.resume), ("--keys", opts.keys)),
        external_trainers=opts.external_trainers,
        trainer_port=opts.trainer_port,
        trainer_timeout_s=opts.trainer_timeout_s,
    ):
        raise refuse(problem)
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from spotlight.config import load_config, load_run_config
    from spotlight.coordinator.tracking import TrackingError, check_trackers
    from spotlight.errors import SpotlightError
    from spotlight.tasks.prompts import prompt_set_from_config

    overrides = _config_overrides(opts)
    resume, config, run_dir = _resume_target(opts)
    try:
        cfg = (load_config if resume is None else load_run_config)(config, overrides)  # a run's own: never empty
        prompt_set = prompt_set_from_config(cfg.data, config)
    except SpotlightError as exc:
        raise refuse(str(exc)) from None
    try:
        check_trackers(cfg.run.trackers)
    except TrackingError as exc:
        raise refuse(str(exc)) from None
    n_agents = 2 if opts.agents is None else opts.agents
    if opts.local and cfg.cluster.min_spot_nodes > n_agents:  # it would wait for ever
        flag = "--min-spot-nodes" if opts.min_spot_nodes is not None else "cluster.min_spot_nodes"
        raise refuse(
            f"{flag} {cfg.cluster.min_spot_nodes}: --local starts {n_agents} spot agents; "
            f"wait for at most {n_agents} (or start more with --agents)"
        )
    rd = run_dir or pathlib.Path("runs") / f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    reserved = opts.reserved.removeprefix("tcp://")  # the coordinator binds tcp://HOST:PORT
    if resume is not None and reserved == DEFAULT_RESERVED:
        reserved = _earlier_address(rd) or reserved  # the same address: agents reconnect by themselves
    return UpRun(
        opts=opts,
        cfg=cfg,
        prompt_set=prompt_set,
        run_dir=rd,
        fresh=resume is None and (not rd.exists() or (rd.is_dir() and not any(rd.iterdir()))),
        resuming=resume is not None,
        reserved=reserved,
        agents=2 if opts.agents is None else opts.agents,
    )


def _config_overrides(opts: UpOptions) -> dict:
    """The config keys ``--iterations``, ``--mode``, ``--tracker``, ``--uncapped-exploration`` and
    ``--min-spot-nodes`` set.

    Raises:
        Stop: an unknown ``--mode``.
    """
    overrides = {"run.iterations": opts.iterations} if opts.iterations else {}
    if opts.mode is not None:
        from spotlight.core.modes import MODE_NAMES

        if opts.mode not in MODE_NAMES:
            raise refuse(f"--mode {opts.mode}: choose from {', '.join(MODE_NAMES)}")
        overrides["run.mode"] = opts.mode
    if opts.tracker:
        overrides["run.trackers"] = [] if opts.tracker == ["none"] else opts.tracker
    if opts.uncapped_exploration:
        overrides.update({"explore.max_candidates_per_prompt": UNCAPPED_CANDIDATES, "explore.stream_extra": True})
    if opts.min_spot_nodes is not None:
        overrides["cluster.min_spot_nodes"] = opts.min_spot_nodes
    return overrides


def _resume_target(opts: UpOptions) -> tuple[pathlib.Path | None, pathlib.Path | None, pathlib.Path | None]:
    """``(resume, config, run_dir)``: the run directory to resume (None: a new run), the
    config file to load (a resumed run's own ``config.toml``; None: the embedded default) and
    the run directory (None: a new ``runs/<timestamp>``). ``--resume-existing`` resumes its
    ``--run-dir`` when that holds a run.

    Raises:
        Stop: ``--resume`` with another ``--run-dir`` or with ``--config``, or on a directory
            without ``config.toml``; ``--resume-existing`` without ``--run-dir``.
    """
    resume, config, run_dir = opts.resume, opts.config, opts.run_dir
    if resume is not None and run_dir is not None and pathlib.Path(run_dir).resolve() != pathlib.Path(resume).resolve():
        raise refuse("--resume names the run directory; do not pass a different --run-dir")
    if resume is None and opts.resume_existing:
        if run_dir is None:
            raise refuse("--resume-existing needs --run-dir")
        rd = pathlib.Path(run_dir)
        if (rd / "config.toml").is_file() and (rd / "coordinator.json").is_file():
            resume, config = rd, None  # the run's own config.toml, as with --resume
    if resume is None:
        return None, config, run_dir
    if not pathlib.Path(resume).is_dir():
        raise Stop(f"[red]error:[/red] --resume {resume}: no such directory")
    if not (pathlib.Path(resume) / "config.toml").is_file():
        raise Stop(f"[red]error:[/red] --resume {resume}: no config.toml there; not a Spotlight run directory")
    if config is not None:
        raise refuse("--resume uses the run's own config.toml; drop --config")
    return pathlib.Path(resume), pathlib.Path(resume) / "config.toml", pathlib.Path(resume)


def _earlier_address(run_dir: pathlib.Path) -> str | None:
    """``HOST:PORT`` the earlier coordinator of ``run_dir`` listened on (its ``coordinator.json``),
    or None (no such file, or one that does not say: empty, not JSON, no ``endpoint`` string)."""
    try:
        endpoint = json.loads((run_dir / "coordinator.json").read_text()).get("endpoint")
    except (OSError, ValueError, AttributeError):
        return None
    return (endpoint.removeprefix("tcp://") or None) if isinstance(endpoint, str) else None


def preflight(run: UpRun) -> UpRun:
    """Every check that can refuse ``run`` before anything is written or started, in order:
    the run directory (:func:`check_run_dir`), the model checkpoint, the GPU memory
    (``cluster.gpu_memory_gib``, else this host's GPUs), the reward against the prompts, the
    replay. Returns ``run`` with its replay planned (reading the trace is the replay's check)
    and its memory plan.

    Raises:
        Stop: the first refusal (exit 2), or ``--resume-existing`` of a finished run (exit 0).
    """
    check_run_dir(run)
    _check_train_nodes(run)
    _check_trainer_keys(run)
    _check_sp_backend(run)
    _check_model(run.cfg)
    memory = _check_memory(run.cfg, **_local_processes(run))
    _check_reward(run)
    eval_prompts = _check_eval(run.cfg)
    return dataclasses.replace(run, replay=_plan_replay(run), memory=memory, eval_prompts=eval_prompts)


def check_run_dir(run: UpRun) -> None:
    """Refuse a run directory whose coordinator still runs, a plain start on a directory that
    already holds a run, and the resumption of a finished run.

    Raises:
        Stop: as above; ``--resume-existing`` of a finished run stops with exit 0 (a
            supervisor's restart: nothing to do, and no failure to restart on).
    """
    rd = run.run_dir
    if (running := _running_coordinator(rd)) is not None:  # before --resume is suggested: it would be refused
        raise Stop(
            f"[red]error:[/red] the run in {rd} is still running (coordinator pid {running}); watch it with "
            f"[cyan]spotlight status {shlex.quote(str(rd))}[/cyan] "
            f"(stop it with Ctrl-C in its terminal or kill {running})"
        )
    if not run.resuming and (rd / "metrics.jsonl").is_file() and (rd / "metrics.jsonl").stat().st_size > 0:
        raise Stop(
            f"[red]error:[/red] {rd} already holds a run (metrics.jsonl); {escape(_continue_hint(rd))} "
            "or choose another --run-dir"
        )
    if run.resuming and (why := _finished(rd, run.cfg.run.iterations)) is not None:
        if run.opts.resume_existing:
            raise Stop(f"{escape(why.split(';')[0])}: nothing to do", code=0)
        raise refuse(why)
    if run.resuming and (why := _checkpoints_gone(rd, run.cfg.run.checkpoint_every)):
        raise refuse(why)
    if run.resuming and not run.opts.external_trainers and (why := _trainer_checkpoint_gone(rd)):
        raise refuse(why)


def _check_train_nodes(run: UpRun) -> None:
    """``train.num_train_nodes`` above 1 needs ranks launched on those nodes: the coordinator
    starts its own Train Workers on this host only.

    Raises:
        Stop: without ``--external-trainers``.
    """
    t = run.cfg.train
    if t.num_train_nodes > 1 and not run.opts.external_trainers:
        raise refuse(
            f"train.num_train_nodes = {t.num_train_nodes}: this coordinator would start all "
            f"{t.num_train_workers} train workers on this host; launch them over {t.num_train_nodes} nodes "
            "with torchrun or srun and start the coordinator with --external-trainers (README "
            '"Multi-node training"), or set train.num_train_nodes = 1'
        )


def _check_trainer_keys(run: UpRun) -> None:
    """With ``--external-trainers``: refuse a keys directory whose allow-list holds no trainer key
    (the ranks could not connect: the coordinator serves no other key on its trainer socket).

    Raises:
        Stop: as above, with the commands that make one.
    """
    if not run.opts.external_trainers:
        return
    from spotlight.net.security import KeysError, list_keys

    d = run.keys_dir
    try:
        trainers = [k for k in list_keys(d) if k["role"] == "trainer"] if (d / "clients").is_dir() else []
    except KeysError as exc:
        raise refuse(f"--keys {d}: {exc}") from None
    if not trainers:
        q = shlex.quote(str(d))
        raise refuse(
            f"--external-trainers: the allow-list of {d} holds no trainer key, so no rank could connect; make one "
            f"first (spotlight keys init {q}; spotlight keys add {q} trainer NAME), pass --keys {q}, and give each "
            "reserved node server.key and trainer.NAME.key_secret"
        )


def _check_sp_backend(run: UpRun) -> None:
    """Refuse ``cluster.sp_backend = "xfuser"`` for a local run on a machine without CUDA (xfuser
    cannot even be imported there; its SP groups would never form).

    Raises:
        Stop: as above.
    """
    c = run.cfg.cluster
    if c.sp_backend != "xfuser" or not run.opts.local or max(c.sp_degree, c.reserved_sp_degree) <= 1:
        return
    import torch

    from spotlight.workers.sp.xfuser_backend import xfuser_problem

    problem = xfuser_problem(torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    if problem:
        raise refuse(problem)


def _check_model(cfg: SpotlightConfig) -> None:
    """Refuse a missing or incomplete checkpoint, or LoRA targets it lacks (no weights load).

    Raises:
        Stop: as above.
    """
    if (problem := model_problem(cfg)) is not None:
        raise refuse(problem)


def model_problem(cfg: SpotlightConfig) -> str | None:
    """Why the checkpoint cannot run ``cfg`` (missing or incomplete, another architecture or text
    encoder than the model section's, LoRA targets it lacks, an SP degree it cannot be split by),
    in plain text, or None; reads only its config files."""
    from spotlight.models.families import ModelLoadError, get_family

    try:
        family = get_family(cfg.model)
        family.check()
        if cfg.train.use_lora and cfg.train.lora_target_modules:
            family.check_lora_targets(list(cfg.train.lora_target_modules))
        return _sp_degree_problem(cfg, family)
    except ModelLoadError as exc:
        return str(exc)


def _sp_degree_problem(cfg: SpotlightConfig, family) -> str | None:
    """Refuse an SP degree the checkpoint's transformer cannot be split by (its attention heads,
    its image tokens at ``model.image_size``, unpadded text; :mod:`spotlight.workers.sp.degrees`),
    reading only its config files. Smaller degrees that do not work are never formed (a group of
    survivors splits into groups that do).

    Returns the degree and the reason, or None.

    Raises:
        ModelLoadError: the checkpoint's configs cannot be read.
    """
    from spotlight.workers.sp.degrees import degree_problem, sp_shape

    c = cfg.cluster
    pairs = (("cluster.sp_degree", c.sp_degree), ("cluster.reserved_sp_degree", c.reserved_sp_degree))
    degrees = [(field, k) for field, k in pairs if k > 1]
    if not degrees:
        return None
    shape = sp_shape(family)
    for field, k in degrees:
        problem = degree_problem(shape, k, cfg_parallel=c.sp_cfg_parallel)
        if problem:
            return f"{field} = {k}: {problem} ({family.path})"
    return None


def _check_eval(cfg: SpotlightConfig) -> int | None:
    """With ``eval.every > 0``: refuse an ``eval.device`` this host lacks, a held-out prompt file
    that cannot be read, or (shapes task) prompts its reward cannot score, before minutes of
    training find it out. Returns the number of prompts the panel scores (None: no evaluation).

    Raises:
        Stop: as above.
    """
    if not cfg.eval.every:
        return None
    import torch

    from spotlight.config import eval_device_problem
    from spotlight.errors import SpotlightError
    from spotlight.workers.eval.eval_worker import build_panel

    if (why := eval_device_problem(cfg.eval.device, torch.cuda.device_count())) is not None:
        raise refuse(why)

    try:
        return len(build_panel(cfg).prompts) // cfg.eval.num_seeds  # one row per (prompt, seed)
    except (SpotlightError, ValueError, OSError) as exc:
        why = str(exc)  # most errors name the field already
        raise refuse(why if why.startswith("eval.") else f"eval.prompts_path: {why}") from None


def _local_processes(run: UpRun) -> dict:
    """How many trainer ranks and Rollout Workers ``run`` starts on this host: its Train Workers
    (none with ``--external-trainers``), a Rollout Worker per reserved rollout GPU, and with
    ``--local`` one per GPU of each local spot agent."""
    cfg, opts = run.cfg, run.opts
    spot = run.agents * opts.gpus_per_agent if opts.local and cfg.cluster.use_spot else 0
    return {
        "trainer_ranks": 0 if opts.external_trainers else cfg.train.num_train_workers,
        "rollout_workers": len(cfg.cluster.reserved_rollout_gpus) + spot,
    }


def _check_memory(cfg: SpotlightConfig, *, trainer_ranks: int = 1, rollout_workers: int = 1) -> MemoryCheck:
    """The memory plan of ``cfg`` (:mod:`spotlight.core.memory_plan`, parameters counted on the
    meta device); refuse a config whose GPUs cannot hold it.

    The limit is ``cluster.gpu_memory_gib`` (trainer and rollout GPUs), else the smallest
    of this host's GPUs as ``nvidia-smi`` reports them (the trainer GPUs: the trainers run
    here; spot GPUs are elsewhere). The plan is of bf16 on CUDA where this host has GPUs or
    the limit is given, else of fp32 on the CPU, where the processes this host starts
    (``trainer_ranks``, ``rollout_workers``) are checked against its memory
    (:func:`host_memory_problem`). Without a limit, a transformer that cannot be
    counted gives a check without a plan (its ``note`` says why).

    Raises:
        Stop: the plan exceeds the limit or, on a CPU host, the host's memory (with its
            numbers), or a limit is given and the transformer cannot be counted.
    """
    from spotlight.cli.plan import make_plan
    from spotlight.errors import SpotlightError
    from spotlight.util.gpus import host_gpus

    configured = cfg.cluster.gpu_memory_gib is not None
    gpus = None if configured else host_gpus()
    device = "cuda" if configured or gpus is not None else "cpu"
    try:
        plan, _ = make_plan(cfg, device=device)
    except SpotlightError as exc:
        if configured:
            raise refuse(f"memory check (cluster.gpu_memory_gib): {exc}") from None
        return MemoryCheck(None, device, None, note=str(exc))
    if configured:
        source, kinds = "cluster.gpu_memory_gib", ("trainer GPU", "rollout GPU")
    elif gpus is not None:
        plan = dataclasses.replace(plan, gpu_limit_bytes=gpus.smallest_bytes)
        source, kinds = f"this host's GPU size ({gpus.describe()})", ("trainer GPU",)
        # the GPUs hold the models; this host still holds the reserved side's share
        if (why := host_memory_problem(plan, _host_memory_bytes(), 0, 0)) is not None:
            raise refuse(
                f"the run does not fit this host: {why}; `spotlight plan CONFIG` prints the whole estimate "
                "(docs/planning.md)"
            )
    else:
        host = _host_memory_bytes()
        if (why := host_memory_problem(plan, host, trainer_ranks, rollout_workers)) is not None:
            raise refuse(
                f"the run does not fit this host: {why}; `spotlight plan CONFIG` prints the whole estimate "
                "(docs/planning.md)"
            )
        return MemoryCheck(plan, device, None)
    problems = plan.problems(limit_source=source, kinds=kinds)
    if problems:
        override = "" if configured else "; set cluster.gpu_memory_gib to check against another size"
        raise refuse(
            f"the run does not fit its GPUs: {problems[0]}; `spotlight plan CONFIG` prints the whole estimate "
            "(docs/planning.md: lower train.micro_batch_size, turn on train.activation_checkpointing, use LoRA "
            f"or more trainer GPUs){override}"
        )
    return MemoryCheck(plan, device, source)


PROCESS_BASE_BYTES = 400 << 20
"""Host memory of a trainer rank or Rollout Worker process besides what the plan counts: Python
with torch and diffusers imported is 308 MiB resident on this 2-core machine, and a helper
saw 300-470 MB for the default run's Rollout Workers (``ps``)."""


def host_memory_problem(plan, host_bytes: int | None, trainer_ranks: int = 1, rollout_workers: int = 1) -> str | None:
    """Why ``plan`` cannot run on a host of ``host_bytes``: the reserved host's own memory (the
    coordinator's rollout samples and versions, rank 0's version gather) alone, or in a CPU run
    (fp32, host memory; ``trainer_ranks`` and ``rollout_workers`` this host starts, 0 and 0 where
    they run on GPUs) one trainer rank or one Rollout Worker alone, or all of them together, need
    more than the whole host has (they would be killed, or abort, when they allocate), each
    process with its :data:`PROCESS_BASE_BYTES`; None when they fit, or the size is unknown. Pure."""
    from spotlight.core.memory_plan import MemoryPlan, size_text

    if not host_bytes:
        return None
    have = f"this host has {size_text(host_bytes)}"
    base = PROCESS_BASE_BYTES  # each process's own
    for what, need, n in (
        ("a trainer rank", plan.trainer_gpu_bytes + base, trainer_ranks),
        ("a Rollout Worker", plan.rollout_gpu_bytes + base, rollout_workers),
    ):
        if n and need > host_bytes:
            return f"{what} needs {size_text(need)} of host memory but {have}"
    reserved = MemoryPlan.total(plan.reserved_host)
    if reserved > host_bytes:
        biggest = max(plan.reserved_host, key=lambda line: line.bytes)
        return (
            f"the reserved host needs {size_text(reserved)} of memory ({biggest.name}: {size_text(biggest.bytes)}, "
            f"{biggest.formula}) but {have}"
        )
    processes = trainer_ranks + rollout_workers
    total = trainer_ranks * plan.trainer_gpu_bytes + rollout_workers * plan.rollout_gpu_bytes + processes * base
    total += reserved
    if total > host_bytes:
        return (
            f"its {trainer_ranks} trainer rank(s) (train.num_train_workers), {rollout_workers} Rollout Worker(s) "
            f"and the coordinator on this host need {size_text(total)} of host memory in all but {have}"
        )
    return None


def _host_memory_bytes() -> int | None:
    """This host's memory (``psutil``), None if it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - a check that cannot be made is skipped
        return None


def _check_reward(run: UpRun) -> None:
    """Refuse prompts the shapes-world reward cannot score, and an unreachable reward service.

    Raises:
        Stop: as above.
    """
    cfg = run.cfg
    if cfg.reward.kind == "geneval_shapes":  # every prompt must be a shapes-world caption
        from spotlight.rewards.reward_fn import RewardError, RewardFn

        try:
            RewardFn(cfg.reward).check_prompts(run.prompts, run.prompt_set.metadata)
        except RewardError as exc:
            from spotlight.tasks.prompts import DEFAULT_PROMPTS_PATH, EXAMPLES_DIR

            default = DEFAULT_PROMPTS_PATH.relative_to(EXAMPLES_DIR.parent)
            source = cfg.data.prompts_path or f"the GenEval training set ({default}, data.prompts_path unset)"
            raise Stop(
                f"[red]error:[/red] reward.kind = 'geneval_shapes' cannot score the prompts of {source}: "
                f"{escape(str(exc))}"
            ) from None
    if cfg.reward.kind == "http":  # fail fast on an unreachable reward service
        from spotlight.rewards.reward_fn import RewardError, RewardFn

        try:
            RewardFn(cfg.reward).check_service(cfg.model.image_size, run.prompts[0])
        except RewardError as exc:
            raise refuse(str(exc)) from None


def _plan_replay(run: UpRun) -> LocalReplay | None:
    """The ``--trace`` or ``--preemption-cycles`` replay onto the local spot agents
    (:func:`spotlight.traces.replay_plan.plan_local_replay`), or None without either.

    Raises:
        Stop: a replay without ``--local``, on resume, or in a run without spot GPUs; a trace
            that cannot be read or replayed so.
    """
    opts, cfg, flag = run.opts, run.cfg, run.replay_flag
    if flag is None:
        return None
    if not opts.local:
        raise refuse(f"{flag} needs --local")
    if run.resuming:
        raise refuse(f"--resume cannot replay a {flag} (the trace driver's state is not checkpointed)")
    if not cfg.cluster.use_spot:
        raise refuse(f"{flag} replays spot capacity, but run.mode = {cfg.run.mode!r} uses no spot GPUs")
    from spotlight.traces.formats import EXPECTED_ITERATION_S
    from spotlight.traces.replay_plan import plan_local_replay

    try:
        return plan_local_replay(
            iterations=cfg.run.iterations,
            agents=run.agents,
            gpus_per_agent=opts.gpus_per_agent,
            trace=opts.trace,
            trace_mode=opts.trace_mode,
            time_scale=opts.time_scale,
            trace_start_s=opts.trace_start_s,
            trace_duration_s=opts.trace_duration_s,
            seed=opts.trace_seed,
            preemption_cycles=opts.preemption_cycles,
            cycle_down_s=opts.cycle_down_s,
            cycle_iteration_s=opts.cycle_iteration_s if opts.cycle_iteration_s is not None else EXPECTED_ITERATION_S,
        )
    except OSError as exc:
        raise refuse(f"--trace {opts.trace}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise refuse(str(exc)) from None


def _checkpointed_iterations(run_dir: pathlib.Path) -> int | None:
    """Iterations held by ``run_dir``'s latest complete checkpoint
    (:func:`spotlight.store.checkpoint.latest_checkpoint`), or None without one."""
    from spotlight.store.checkpoint import latest_checkpoint

    try:
        got = latest_checkpoint(run_dir, cleanup=False)
    except OSError:
        return None
    return None if got is None else got[0] + 1


def _running_coordinator(run_dir: pathlib.Path) -> int | None:
    """The pid of the coordinator of ``run_dir`` (its ``coordinator.json``) if it still runs,
    else None: the check ``spotlight status`` makes
    (:func:`spotlight.util.coordinator_pid.coordinator_not_running`: a pid reused by a process that
    started after the file was written, a zombie or a process that is not Spotlight's is no
    coordinator). This very process is none either: it is the one about to start the run."""
    from spotlight.util.coordinator_pid import coordinator_not_running, file_pid

    pid = file_pid(run_dir)
    if isinstance(pid, bool) or not isinstance(pid, int) or pid == os.getpid():
        return None
    return pid if coordinator_not_running(run_dir, pid) is None else None


def _finished(run_dir: pathlib.Path, iterations: int) -> str | None:
    """Why ``--resume run_dir`` must not start: its checkpoints already hold ``iterations``
    iterations and its ``final/`` is written (the run finished; resuming would re-run the last
    one's save and rewrite its results), else None. ``iterations``: the run's, with
    ``--iterations`` applied. A run stopped after its last checkpoint but before ``final/``
    (during the evaluation of the final weights, or the save) is not finished: a resume does
    just what is left (docs/architecture.md §13). Nor is one whose ``final/`` is damaged (a
    file truncated or removed after the save: :func:`~spotlight.coordinator.resume.damaged_final`):
    a resume saves it again."""
    from spotlight.coordinator.resume import damaged_final

    done = _checkpointed_iterations(run_dir) or 0
    final = pathlib.Path(run_dir) / "final"
    if done < iterations or not (final.is_dir() and any(final.iterdir())) or damaged_final(run_dir) is not None:
        return None
    import shlex

    rd = pathlib.Path(run_dir)
    command = shlex.join(["spotlight", "up", "--resume", str(rd), *_local_flags(rd), "--iterations", "N"])
    return (
        f"{run_dir} is finished ({done}/{done} iterations): model in {rd / 'final'}, "
        f"metrics in {rd / 'metrics.jsonl'}; to train it further, resume with {command} (N > {done})"
    )


def _local_agents(run_dir: pathlib.Path) -> dict[str, dict] | None:
    """The agents ``run_dir``'s ``local_agents.json`` lists (a run last run with ``--local``), or None."""
    try:
        agents = json.loads((pathlib.Path(run_dir) / "local_agents.json").read_text()).get("agents", {})
    except (OSError, ValueError, AttributeError):
        return None
    return {k: a for k, a in agents.items() if isinstance(a, dict)} if isinstance(agents, dict) else None


def _local_flags(run_dir: pathlib.Path) -> list[str]:
    """``["--local", "--agents", "N"]`` when ``run_dir`` was last run with ``--local`` (N: its
    spot agents then), else ``[]``: a local run's agents end with it, so only ``--local``
    starts them again (without it, the resumed coordinator waits for agents that never come)."""
    agents = _local_agents(run_dir)
    if agents is None:
        return []
    return ["--local", "--agents", str(sum(1 for a in agents.values() if a.get("spot")))]


def _local_agents_alive(run_dir: pathlib.Path) -> bool:
    """Whether an agent that ``run_dir``'s ``local_agents.json`` lists still runs (a crashed
    coordinator's agents outlive it and reconnect to the resumed one by themselves)."""
    from spotlight.cli.up_local import live_process

    pids = [a["pid"] for a in (_local_agents(run_dir) or {}).values() if isinstance(a.get("pid"), int)]
    return any(live_process(pid, "agent.main") is not None for pid in pids)


def _checkpoints_gone(run_dir: pathlib.Path, every: int) -> str | None:
    """Why ``--resume run_dir`` must not start: ``metrics.jsonl`` proves that a checkpoint newer
    than the newest one left was written (:func:`spotlight.store.checkpoint.missing_checkpoint`),
    so resuming would go back to that older state (with none left: iteration 1) and cut the
    later rows of ``metrics.jsonl`` and ``requests.jsonl``; else None."""
    from spotlight.store.checkpoint import missing_checkpoint

    try:
        with (run_dir / "metrics.jsonl").open("rb") as f:
            recorded = sum(1 for line in f if line.strip())
    except OSError:
        return None
    done = _checkpointed_iterations(run_dir) or 0
    lost = missing_checkpoint(recorded, done, every)
    if lost is None:
        return None
    back_to = f"the checkpoint of iteration {done}" if done else "iteration 1 (no checkpoint is left)"
    return (
        f"--resume {run_dir}: metrics.jsonl records {recorded} iterations and the checkpoint of iteration "
        f"{lost + 1} was written, but {run_dir / 'checkpoints'} no longer holds it (deleted or moved?); "
        f"resuming would go back to {back_to} and erase the later rows of metrics.jsonl and requests.jsonl. "
        "Put the checkpoints back, or start a new run in another --run-dir"
    )


def _trainer_checkpoint_gone(run_dir: pathlib.Path) -> str | None:
    """Why ``--resume run_dir`` must not start: the newest run checkpoint names weights ``v``
    whose Train Worker checkpoint (``checkpoints/train/vNNNNNN``, local trainers) is missing, so
    the resumed trainer would fail after the logs were cut back; else None (also without a run
    checkpoint, or one the resume itself will report as unreadable)."""
    from spotlight.store.checkpoint import (
        TRAIN_METADATA,
        CheckpointError,
        latest_checkpoint,
        load_checkpoint,
        train_checkpoint_dir,
        train_version_path,
    )

    try:
        got = latest_checkpoint(run_dir, cleanup=False)
        version = int(load_checkpoint(got[1])["version"]) if got is not None else None
    except (OSError, CheckpointError, KeyError, TypeError, ValueError):
        return None
    if version is None or version < 1:
        return None
    path = train_version_path(train_checkpoint_dir(run_dir), version)
    if (path / TRAIN_METADATA).is_file():
        return None
    return (
        f"--resume {run_dir}: its last run checkpoint (after iteration {got[0] + 1}) continues from weights "
        f"v{version}, but the Train Worker checkpoint {path} is missing (deleted or moved?); resuming would "
        "cut metrics.jsonl and requests.jsonl back and then fail. Put it back, or start a new run in another --run-dir"
    )


def _continue_hint(run_dir: pathlib.Path) -> str:
    """How to continue the run already in ``run_dir``: ``--resume`` -- and, for a finished run
    (its checkpoints hold all of its config's iterations, which ``--resume`` alone refuses:
    :func:`_finished`), ``--resume … --iterations N`` to train it further."""
    import shlex

    from spotlight.config import ConfigError, load_config

    command = shlex.join(["spotlight", "up", "--resume", str(run_dir), *_local_flags(run_dir)])
    try:
        iterations = load_config(pathlib.Path(run_dir) / "config.toml").run.iterations
    except ConfigError:
        iterations = None
    done = _checkpointed_iterations(run_dir)
    if iterations is not None and done is not None and done >= iterations and _finished(run_dir, iterations):
        return f"it is finished ({done}/{done} iterations); train it further with {command} --iterations N (N > {done})"
    return f"continue it with {command}"
