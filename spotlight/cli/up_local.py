"""The processes ``spotlight up`` runs on its own machine beside the coordinator: the Train
Workers it starts and, with ``--local``, the reserved node's rollout agents, the spot agents
with their mock metadata servers and the trace driver (:class:`LocalCluster`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable

from rich.markup import escape

from spotlight.util.atomic_file import write_text_atomic

if TYPE_CHECKING:
    from spotlight.cli.up_preflight import UpRun

AGENT_STOP_S = 15.0
"""Seconds the agents get to stop by themselves after they were told to, before SIGTERM."""


def live_process(pid: int, marker: str):
    """The ``psutil.Process`` of ``pid`` if it is running (not a zombie) and its command line
    contains ``marker``, else None."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p if p.status() != psutil.STATUS_ZOMBIE and marker in " ".join(p.cmdline()) else None
    except psutil.Error:
        return None


def _adopt(entry: dict | None, listed_unix_s: float | None = None):
    """The still-running local agent process of ``entry`` (from a crashed run's
    local_agents.json, last written at ``listed_unix_s``), or None. Agents with a mock cloud
    are not adopted: their mock metadata server died with the old coordinator process. A pid
    is only a number: a process that started after the listing was written is another one
    that got the pid (another run's agent, say), and is not adopted
    (:func:`spotlight.util.coordinator_pid.started_after`, as for the coordinator's pid)."""
    from spotlight.util.coordinator_pid import started_after

    pid = entry.get("pid") if isinstance(entry, dict) else None
    if not entry or entry.get("cloud") or isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    p = live_process(pid, "agent.main")
    if p is None or listed_unix_s is None:
        return p
    try:
        started = p.create_time()
    except Exception:  # psutil.Error: the check cannot be made, as for the coordinator's pid
        return p
    return None if started_after(started, listed_unix_s) else p


def _spawn_agent(
    endpoint: str,
    gpus: list[int],
    node_id: str,
    *,
    reserved: bool,
    keys_dir,
    extra: list[str] | None = None,
) -> subprocess.Popen:
    """Start ``spotlight-agent join`` for node ``node_id`` with the local client key (its log:
    :func:`spotlight.util.procs.spawn_logged`)."""
    from spotlight.util.procs import scrubbed_env, spawn_logged

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
    return spawn_logged(cmd, f"agent-{node_id}", env=scrubbed_env())


def patience_handler(alive: Callable[[], int], say: Callable[[str], None]):
    """The SIGINT handler while ``up`` stops its processes after a Ctrl-C: every further
    Ctrl-C is answered with one line (``alive()``: processes still to stop) and changes nothing."""

    def handler(signum, frame) -> None:
        try:
            n = alive()
        except Exception:  # a process table read must not break the clean-up
            n = None
        count = "" if n is None else f" ({n} process" + ("es" if n != 1 else "") + ")"
        say(f"still stopping agents, workers and trainers{count}, please wait")

    return handler


def _wait_or_terminate(procs: list[subprocess.Popen], deadline: float) -> None:
    """Wait for ``procs`` until ``deadline`` (``time.monotonic()``), SIGTERM those still
    running, give them 5 s more, then SIGKILL."""
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


class LocalCluster:
    """Every process ``spotlight up`` runs beside its coordinator ``coord``, as a context
    manager that stops them all on exit (a finished run, an error or a Ctrl-C alike).

    :meth:`start` (``--local`` only) is called inside the ``with``, so that a Ctrl-C while
    the agents start still stops the ones that did. It starts one reserved agent per
    sequence-parallel group of ``cluster.reserved_rollout_gpus`` and ``--agents`` spot agents
    (each with its own mock metadata server with ``--mock-cloud``; a replay's trace driver
    starts the spot agents instead), and adopts the agents of a crashed coordinator that
    survived it, on resume: they reconnect by themselves and keep their workers.

    On exit the trace driver stops replaying, every agent and Train Worker is told to stop,
    the agents get :data:`AGENT_STOP_S` seconds to do so before SIGTERM (5 s more before
    SIGKILL), the Train Workers 10 s before SIGKILL, then the coordinator closes (its last
    status and checkpoint are then final), the trace driver stops the agents it started and
    the mock metadata servers stop.

    Args:
        run: the resolved start (:class:`spotlight.cli.up_preflight.UpRun`).
        coord: the started :class:`spotlight.coordinator.coordinator.Coordinator`.
        say: prints one console line (rich markup).
    """

    def __init__(self, run: UpRun, coord, *, say: Callable[[str], None]):
        self.run = run
        self.coord = coord
        self.say = say
        self.procs: list[subprocess.Popen] = []  # the agents started here
        self.agent_logs: dict[int, tuple[str, object]] = {}  # pid -> (node id, its LogMark or None)
        self._reported: set[int] = set()  # pids of agents whose failure was reported
        self.adopted: list = []  # local agents of a crashed coordinator that survived it (psutil.Process)
        self._listed_unix_s: float | None = None  # when the crashed run's local_agents.json was written
        self.mocks: list = []
        self.driver = None
        self.interrupted = False

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        """Start (or adopt) the local agents and the trace driver; list them in
        ``RUN_DIR/local_agents.json`` (their pids, GPUs and mock metadata URLs)."""
        rd = self.run.run_dir
        state_root = rd / "agents"
        os.environ["SPOTLIGHT_AGENT_STATE"] = str(state_root.resolve())
        previous, self._listed_unix_s = {}, None
        if self.run.resuming:
            from spotlight.cli.up_preflight import _local_agents

            previous = _local_agents(rd) or {}  # an unreadable listing: no agent to adopt
            try:
                self._listed_unix_s = (rd / "local_agents.json").stat().st_mtime
            except OSError:
                pass
        listing: dict[str, dict] = {}
        self._start_reserved_agents(listing, previous)
        self._start_spot_agents(listing, previous)
        doc = {"coordinator": self.coord.endpoint, "state_dir": str(state_root.resolve()), "agents": listing}
        write_text_atomic(rd / "local_agents.json", json.dumps(doc, indent=2))
        if self.adopted:
            from spotlight.errors import plural

            n = len(self.adopted)
            self.say(
                f"{plural(n, 'local agent')} of the previous coordinator {'is' if n == 1 else 'are'} still running: "
                "they reconnect by themselves and keep their workers"
            )
        if self.run.replay is not None:
            self._start_driver(doc)

    def _adopted(self, node_id: str, listing: dict, previous: dict) -> bool:
        """Adopt ``node_id``'s agent of the earlier coordinator if it still runs (then listed as before)."""
        if (p := _adopt(previous.get(node_id), self._listed_unix_s)) is None:
            return False
        self.adopted.append(p)
        listing[node_id] = previous[node_id]
        return True

    def _start_reserved_agents(self, listing: dict, previous: dict) -> None:
        cluster = self.run.cfg.cluster
        rgpus, k = list(cluster.reserved_rollout_gpus), cluster.reserved_sp_degree
        for i, gpus in enumerate(rgpus[j : j + k] for j in range(0, len(rgpus), k)):  # one agent per SP group
            node_id = f"reserved-{i}"
            if self._adopted(node_id, listing, previous):
                continue
            self._spawn(node_id, gpus, reserved=True)
            listing[node_id] = {"pid": self.procs[-1].pid, "spot": False, "gpus": gpus}

    def _start_spot_agents(self, listing: dict, previous: dict) -> None:
        run, cluster = self.run, self.run.cfg.cluster
        gpus = list(range(run.opts.gpus_per_agent))
        for a in range(0 if run.replay is not None or not cluster.use_spot else run.agents):
            node_id = f"spot-{a}"
            if self._adopted(node_id, listing, previous):
                continue
            # simulated spot GPUs share this machine's cores with the trainer: run them
            # at lower CPU priority so the reserved side trains as if they were separate (nice 5)
            extra = [
                "--grace-s",
                str(run.opts.grace_s),
                "--nice",
                str(run.opts.spot_nice),
                "--warm-spare" if cluster.warm_spare else "--no-warm-spare",
            ]
            entry = {"spot": True, "gpus": list(gpus)}
            if run.mock_cloud != "none":
                from spotlight.cloud.mock_metadata import MockMetadataServer

                mock = MockMetadataServer(run.mock_cloud, vm_name=node_id).start()
                self.mocks.append(mock)
                extra += ["--cloud", run.mock_cloud, "--metadata-url", mock.url, "--poll-interval-s", "0.5"]
                entry.update(cloud=run.mock_cloud, metadata_url=mock.url, control_url=mock.control_url)
            self._spawn(node_id, gpus, reserved=False, extra=extra)
            entry["pid"] = self.procs[-1].pid
            listing[node_id] = entry

    def _spawn(self, node_id: str, gpus: list[int], *, reserved: bool, extra: list[str] | None = None) -> None:
        from spotlight.util.procs import log_mark

        mark = log_mark(f"agent-{node_id}")
        proc = _spawn_agent(
            self.coord.endpoint, gpus, node_id, reserved=reserved, keys_dir=self.run.keys_dir, extra=extra
        )
        self.procs.append(proc)
        self.agent_logs[proc.pid] = (node_id, mark)

    def check(self) -> None:
        """While the run goes on: an agent started here that exited on its own with an error
        (not a preemption's exit status) is reported once, with the last lines of its log; the
        run goes on without it (its requests are re-enqueued when its heartbeats stop)."""
        from spotlight.protocol import EXIT_NODE_PREEMPTED
        from spotlight.util.procs import ChildExit

        for proc in self.procs:
            rc = proc.poll()
            if rc in (None, 0, EXIT_NODE_PREEMPTED) or proc.pid in self._reported:
                continue
            self._reported.add(proc.pid)
            node_id, mark = self.agent_logs.get(proc.pid, ("?", None))
            failed = ChildExit.of(f"local agent {node_id}", rc, mark)
            self.say(f"[yellow]warning:[/yellow] {escape(failed.report(' (the run goes on without it)'))}")

    def _start_driver(self, listing_doc: dict) -> None:
        from spotlight.traces.driver import TraceDriver

        run = self.run
        self.driver = TraceDriver(
            run.replay.actions,
            coordinator=self.coord.endpoint,
            keys_dir=run.keys_dir,
            cloud=run.mock_cloud,
            grace_s=run.opts.grace_s,
            listing=listing_doc,
            listing_path=run.run_dir / "local_agents.json",
            nice=run.opts.spot_nice,
            warm_spare=run.cfg.cluster.warm_spare,
            node_ready=self.coord.node_registered,
        )
        self.driver.start()

    def alive(self) -> int:
        """Processes still to stop: agents (started, adopted, the trace driver's) and Train Workers."""
        popens = [*self.procs, *self.coord.trainers.procs, *(self.driver.procs if self.driver is not None else [])]
        return sum(p.poll() is None for p in popens) + sum(p.is_running() for p in self.adopted)

    def interrupt(self) -> None:
        """The run was interrupted: the agents are told so when they are stopped, a further
        Ctrl-C while they stop is answered (:func:`patience_handler`) and cuts nothing short,
        and SIGTERM is ignored."""
        signal.signal(signal.SIGINT, patience_handler(self.alive, self.say))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.interrupted = True

    def stop(self) -> None:
        """Stop every process, in the order and within the deadlines of the class docstring."""
        if self.driver is not None:
            self.driver.stop_event.set()
        self.coord.shutdown_agents(reason="interrupted" if self.interrupted else "run finished")
        deadline = time.monotonic() + AGENT_STOP_S
        _wait_or_terminate(self.procs, deadline)
        if self.adopted:
            import psutil

            _, alive = psutil.wait_procs(self.adopted, timeout=max(0.1, deadline - time.monotonic()))
            for p in alive:
                p.terminate()
            psutil.wait_procs(alive, timeout=5)
        for p in self.coord.trainers.procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.coord.close()
        if self.driver is not None:
            self.driver.close()
        for m in self.mocks:
            m.stop()
