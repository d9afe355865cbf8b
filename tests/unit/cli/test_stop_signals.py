"""SIGTERM and SIGHUP stop a ``spotlight`` command as Ctrl-C does (``cli_run.interrupt_on_signals``):
the command's own clean-up runs. Was: ``kill`` ended ``spotlight simulate`` at once and left the
empty ``--out`` it had made, where Ctrl-C removed it and said "interrupted: nothing written"."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_the_signals_raise_keyboard_interrupt_once_installed(sig):
    from spotlight.util.cli_run import interrupt_on_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        interrupt_on_signals()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler runs at the next bytecode; the sleep is never finished
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.procs  # the real `spotlight` entry point, as a script runs it
def test_sigterm_stops_simulate_as_ctrl_c_does_and_leaves_no_out(tmp_path):
    out = tmp_path / "sim"
    cmd = [sys.executable, "-m", "spotlight.cli", "simulate", "--trace", "examples/traces/bamboo/p3-trace.csv"]
    cmd += ["--spot-nodes", "100", "--trace-replicas", "4", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not out.exists() and proc.poll() is None:  # --out is made just before the simulation starts
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (stdout, stderr)
    assert "interrupted: nothing written" in stdout and "Traceback" not in stderr, (stdout, stderr)
    assert not out.exists()
