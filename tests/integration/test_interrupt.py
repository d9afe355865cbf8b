"""Ctrl-C on `spotlight up --local`: every process ends, no traceback, and
the command that continues the run is printed.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the run is started
in its own session and the signal goes to its group, as a terminal would send it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess

import psutil
import pytest

from tests.integration.runs import WAIT_S, toy_config, up_command, up_env

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_ctrl_c_stops_every_process_and_prints_how_to_continue(tmp_path):
    cfg = toy_config(tmp_path / "config.toml", **{"run.iterations": 50})
    rd = tmp_path / "run"
    out_path, err_path = tmp_path / "up.stdout", tmp_path / "up.stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            up_command(
                "--local",
                "--agents",
                "1",
                "--config",
                str(cfg),
                "--run-dir",
                str(rd),
                "--timeout-s",
                "900",
            ),
            cwd=REPO,
            env=up_env(),
            stdout=out,
            stderr=err,
            start_new_session=True,
            # as a terminal's foreground job has it: a test run started in the background by a
            # shell without job control inherits SIGINT ignored, and Python then never raises
            # KeyboardInterrupt (the run went on for 240 s after the "Ctrl-C")
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    leader = psutil.Process(proc.pid)
    try:
        deadline = psutil.time.monotonic() + WAIT_S
        metrics = rd / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, (
                f"spotlight up exited early (rc {proc.returncode}):\n{err_path.read_text()[-3000:]}"
            )
            assert psutil.time.monotonic() < deadline, "no iteration finished in time"
            psutil.time.sleep(0.2)
        children = leader.children(recursive=True)
        cmdlines = [" ".join(p.cmdline()) for p in children]
        assert (
            any("agent.main" in c for c in cmdlines)
            and any("train_worker" in c for c in cmdlines)
            and any("rollout.worker" in c or "spare" in c for c in cmdlines)
        ), cmdlines
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            rc = proc.wait(timeout=240)  # generous: a loaded machine
        except subprocess.TimeoutExpired:
            logs = "".join(
                f"\n--- {f.name}\n" + f.read_text(errors="replace")[-2000:] for f in sorted((rd / "logs").glob("*.log"))
            )
            alive_now = [" ".join(p.cmdline()) for p in leader.children(recursive=True) if p.is_running()]
            pytest.fail(
                f"spotlight up still running 240 s after Ctrl-C; children {alive_now}\n"
                f"stdout:\n{out_path.read_text()[-2000:]}\nstderr:\n{err_path.read_text()[-3000:]}{logs}"
            )
        gone, alive = psutil.wait_procs(children, timeout=60)  # a loaded machine: orphaned workers notice slowly
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert rc == 130, stderr[-3000:]
    assert not alive, f"left running after Ctrl-C: {[(p.pid, p.cmdline()) for p in alive]}"
    leftovers = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if str(rd) in " ".join(p.info["cmdline"] or []):
            leftovers.append(p.info)
    assert not leftovers, leftovers
    assert "Traceback" not in stdout + stderr, stdout + stderr
    for log in (rd / "logs").glob("*.log"):  # children did not die of the Ctrl-C either
        assert "Traceback" not in log.read_text(), log
        assert "KeyboardInterrupt" not in log.read_text(), log
    assert f"spotlight up --resume {rd} --local --agents 1" in " ".join(stdout.split()), stdout
