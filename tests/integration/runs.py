"""Running `spotlight up` in end-to-end tests and acting on its process tree.

:class:`Up` runs one as a subprocess (output to files next to its run directory), :func:`up_command`
is its command line; :func:`freeze`/:func:`thaw` stop and continue processes (SIGSTOP/SIGCONT),
:func:`freeze_mid_denoising` catches a worker inside a request's denoising loop (from the worker
events of ``$SPOTLIGHT_WORKER_EVENTS``) and :func:`hold_training` keeps the Train Workers frozen,
so a fault lands where a test wants it without assuming any timing. :func:`read_jsonl` reads
``requests.jsonl`` / ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Callable

import psutil
import pytest

from tests.factories import write_config
from tests.integration.waiting import wait_until

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 900
WAIT_S = 1000  # deadline for any condition on a run (> RUN_TIMEOUT_S: the run fails first)

# examples/jpeg-toy at the size of the fault tests: 2 iterations x 6 prompts x 8 seeds, 8
# exploration candidates, heartbeats that notice a dead agent within seconds
TOY_RUN = {
    "run.iterations": 2,
    "data.prompts_per_iteration": 6,
    "data.num_control_prompts": 2,
    "explore.planner": "fixed",
    "explore.num_candidates": 8,
    "run.sample_grid_every": 0,
    "cluster.heartbeat_timeout_s": 4.0,
    "cluster.heartbeat_interval_s": 0.5,
}


def up_command(*args: str) -> list[str]:
    """``spotlight up ARGS`` run with this interpreter (``python -m spotlight.cli up ARGS``)."""
    return [sys.executable, "-m", "spotlight.cli", "up", *args]


def toy_config(path: pathlib.Path, **overrides) -> pathlib.Path:
    """:data:`TOY_RUN` (then ``overrides``, dotted keys) written to ``path`` for ``--config``."""
    return write_config(path, "jpeg-toy", {**TOY_RUN, **overrides})


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """Every row of a JSON-lines file (``requests.jsonl``, ``metrics.jsonl``)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def up_env(**extra: str) -> dict[str, str]:
    """This process's environment for a run's processes: one torch thread, offline, unbuffered."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Up:
    """A `spotlight up` subprocess whose stdout/stderr go to files in its run dir."""

    def __init__(self, rd: pathlib.Path, args: list[str], env: dict[str, str] | None = None):
        self.rd = rd
        rd.mkdir(parents=True, exist_ok=True)
        self.out = open(rd.parent / f"{rd.name}.stdout", "w")
        self.err_path = rd.parent / f"{rd.name}.stderr"
        self.err = open(self.err_path, "w")
        cmd = up_command("--run-dir", str(rd), "--timeout-s", str(RUN_TIMEOUT_S), *args)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env or up_env(), stdout=self.out, stderr=self.err)
        self.ps = psutil.Process(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        self.out.flush()
        self.err.flush()
        out = (self.rd.parent / f"{self.rd.name}.stdout").read_text()[-3000:]
        return f"STDOUT\n{out}\nSTDERR\n{self.err_path.read_text()[-6000:]}"

    def wait_for(self, cond, what: str, timeout_s: float = WAIT_S, interval_s: float = 0.1):
        """Poll ``cond()`` until it returns something truthy; fail if the run exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            if not self.alive():
                got = cond()
                if got:
                    return got
                pytest.fail(f"spotlight up exited (rc {self.proc.returncode}) while waiting for {what}\n{self.logs()}")
            time.sleep(interval_s)
        pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{self.logs()}")

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            pytest.fail(f"spotlight up did not exit within {WAIT_S}s\n{self.logs()}")

    def kill_tree(self) -> None:
        """Last-resort cleanup (test failure): SIGKILL the run and every descendant."""
        try:
            procs = [self.ps, *self.ps.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.proc.poll()

    def close(self) -> None:
        if self.alive():
            self.kill_tree()
        self.out.close()
        self.err.close()


def gone(pid: int) -> bool:
    """The process has exited (or is a zombie nobody reaped yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def agent_ctl(state_dir: str, *args: str) -> dict:
    """``spotlight-agent ARGS`` against the agents of ``state_dir``: its JSON answer, or
    ``{"ok": False, "stderr": ...}`` when it printed none."""
    env = dict(os.environ, SPOTLIGHT_AGENT_STATE=state_dir)
    out = subprocess.run(
        [sys.executable, "-m", "agent.main", *args], env=env, capture_output=True, text=True, timeout=60
    )
    return json.loads(out.stdout) if out.stdout.strip().startswith("{") else {"ok": False, "stderr": out.stderr}


def wait_on(pred, timeout_s: float, what: str, proc=None):
    """:func:`wait_until` on ``pred``, failing early if the run ``proc`` exits."""
    return wait_until(
        pred, what, timeout_s=timeout_s, interval_s=0.3, alive=None if proc is None else lambda: proc.poll() is None
    )


def last_events(path: pathlib.Path) -> dict[int, dict]:
    """The last worker event (``$SPOTLIGHT_WORKER_EVENTS``) of each process id."""
    last: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:  # a line being written
                continue
            last[ev["pid"]] = ev
    return last


def freeze(procs: list[psutil.Process]) -> list[psutil.Process]:
    """SIGSTOP ``procs`` and wait until the kernel has stopped each one (the processes that
    are gone by then are dropped)."""
    stopped = []
    for p in procs:
        try:
            p.send_signal(signal.SIGSTOP)
            stopped.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in list(stopped):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    break
            except psutil.NoSuchProcess:
                stopped.remove(p)
                break
            time.sleep(0.001)
    return stopped


def thaw(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass


def freeze_mid_denoising(
    parent_pid: int, events: pathlib.Path, max_step: int
) -> tuple[list[psutil.Process], list[psutil.Process]] | None:
    """Freeze every descendant of ``parent_pid``. If the last event of some of them is a
    denoising step ``<= max_step`` (each is then inside the denoising loop of a leased
    request), keep them all frozen and return (all frozen, those mid-denoising); else thaw
    them and return None."""
    try:
        kids = psutil.Process(parent_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    got = freeze(kids)
    last = last_events(events)
    mid = [p for p in got if last.get(p.pid, {}).get("event") == "step" and last[p.pid]["step"] <= max_step]
    if mid:
        return got, mid
    thaw(got)
    time.sleep(0.005)
    return None


def train_workers(up_pid: int) -> list[psutil.Process]:
    """The run's Train Worker processes."""
    out = []
    for p in psutil.Process(up_pid).children(recursive=True):
        try:
            if "spotlight.workers.train.train_worker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def hold_training(rd: pathlib.Path, up_pid: int, alive: Callable[[], bool]) -> list[psutil.Process]:
    """Freeze the run's Train Workers as soon as they published weights v0: the run cannot get
    past iteration 0's training before the caller thaws them (e.g. once spot workers, which on
    a loaded machine can take longer to start than a whole test run, serve)."""
    v0 = rd / "tensor_store" / "weights" / "v0.safetensors"
    wait_until(v0.is_file, "weights v0", timeout_s=WAIT_S, alive=alive)
    trainers = freeze(train_workers(up_pid))
    assert trainers, "the run has no Train Worker"
    return trainers


def freeze_mid_denoising_holding_training(
    up_pid: int, parent_pid: int, events: pathlib.Path, max_step: int, metrics: pathlib.Path, iterations: int
):
    """:func:`freeze_mid_denoising`, with the run's Train Workers frozen too, at a moment when
    not all ``iterations`` are done (``metrics`` rows): while the trainers are frozen at most
    one more iteration can end (its TRAIN_DONE may be on its way) and the final model cannot
    be saved, so the run cannot finish before the caller thaws them. Returns (trainers, all
    frozen, those mid-denoising) or None."""
    got = freeze_mid_denoising(parent_pid, events, max_step)
    if got is None:
        return None
    trainers = freeze(train_workers(up_pid))
    done = metrics.read_text().count("\n") if metrics.is_file() else 0
    if trainers and done < iterations:
        return trainers, *got
    thaw(got[0] + trainers)
    return None
