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


@pytest.fixture
def signal_handlers(monkeypatch):
    """Restores the process's SIGINT, SIGTERM and SIGHUP handlers and cli_run's record of an
    interruption after the test."""
    import spotlight.util.cli_run as cli_run

    monkeypatch.setattr(cli_run, "_interrupt", {"by": None, "reported": False})
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield cli_run
    for s, h in before.items():
        signal.signal(s, h)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_the_signals_raise_keyboard_interrupt_once_installed(sig, signal_handlers):
    signal_handlers.interrupt_on_signals()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler runs at the next bytecode; the sleep is never finished
    assert signal_handlers._interrupt["by"] == {"SIGINT": "Ctrl-C"}.get(sig.name, sig.name)


def _app(reports: bool):
    import typer

    from spotlight.util.cli_run import interrupt_reported

    app = typer.Typer()

    @app.command()
    def work() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            if not reports:
                raise
            print("interrupted: my own line", file=sys.stderr)
            interrupt_reported()
            raise typer.Exit(130)

    @app.command()
    def other() -> None:
        pass

    return app


def test_an_interruption_no_command_caught_is_said(signal_handlers, capfd):
    """Was: typer turned a KeyboardInterrupt that no command caught (e.g. Ctrl-C while `up`
    loads the tokenizer) into exit status 130 without a word, whatever the signal."""
    signal_handlers.interrupt_on_signals()
    assert signal_handlers.run_app(_app(reports=False), args=["work"]) == 143  # 128 + SIGTERM
    assert capfd.readouterr().err == "interrupted (SIGTERM)\n"


def test_a_command_that_says_it_was_interrupted_gets_no_second_line(signal_handlers, capfd):
    signal_handlers.interrupt_on_signals()
    assert signal_handlers.run_app(_app(reports=True), args=["work"]) == 143
    assert capfd.readouterr().err == "interrupted: my own line\n"


def test_the_exit_status_is_128_plus_the_signal():
    from spotlight.util.cli_run import INTERRUPTED_STATUS

    assert INTERRUPTED_STATUS == {
        "Ctrl-C": 128 + signal.SIGINT,
        "SIGTERM": 128 + signal.SIGTERM,
        "SIGHUP": 128 + signal.SIGHUP,
    }
    unit = (REPO / "scripts" / "systemd" / "spotlight-coordinator.service").read_text()
    assert "\nSuccessExitStatus=129 130 143\n" in unit  # `systemctl stop` is no failure of the unit


def test_an_interruption_while_the_cli_is_imported_is_one_line(capfd):
    """Was: Ctrl-C in the first moment of `spotlight …` (while its modules import) printed a
    traceback of the import."""
    from spotlight.entry import interruptible_import

    def load():
        raise KeyboardInterrupt

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(SystemExit) as exc:
            interruptible_import(load)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert exc.value.code == 130 and capfd.readouterr().err == "interrupted\n"


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
    assert proc.returncode == 143, (stdout, stderr)  # 128 + SIGTERM, as a shell reports it
    assert "interrupted: nothing written" in stderr and "Traceback" not in stderr, (stdout, stderr)
    assert "interrupted" not in stdout, stdout
    assert not out.exists()


@pytest.mark.parametrize("sig, name", [(None, "Ctrl-C"), (signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP")])
def test_up_says_it_was_interrupted_on_stderr_as_before_the_run_starts(capfd, sig, name):
    """Was: on stdout once the coordinator had started, on stderr (cli_run's line) before: a
    script that kept stderr saw the interruption only if it came early."""
    from types import SimpleNamespace

    import spotlight.util.cli_run as cli_run
    from spotlight.cli.up import _serve_to_the_end

    class Coordinator:
        stop_reason = None

        def start_trainers(self):
            pass

        def serve(self, **kwargs):
            raise KeyboardInterrupt

    class Cluster:
        def start(self):
            pass

        def check(self):
            pass

        def interrupt(self):
            pass

    run = SimpleNamespace(opts=SimpleNamespace(external_trainers=False, local=True, timeout_s=None))
    coord = Coordinator()
    try:
        code = _serve_to_the_end(run, coord, Cluster(), {"sig": sig})
    finally:
        cli_run._interrupt["reported"] = False
    out, err = capfd.readouterr()
    assert code == cli_run.INTERRUPTED_STATUS[name] and coord.stop_reason == f"interrupted: {name}"
    assert err.strip() == f"interrupted ({name}): stopping agents, workers and trainers…" and out == "", (out, err)
