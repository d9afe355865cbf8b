"""``spotlight up --resume`` refuses a run whose coordinator still runs, and trusts the pid in
its ``coordinator.json`` no more than ``spotlight status`` does: a live process that started
after the file was written took a reused pid (a reboot, a coordinator that exited long ago) and
does not block the resume, even when its command line mentions spotlight."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import psutil
import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.cli.up_preflight import _running_coordinator
from tests.fakes import marked_sleeper

pytestmark = pytest.mark.procs

TOY = pathlib.Path(__file__).resolve().parents[3] / "examples" / "jpeg-toy" / "config.toml"


@pytest.fixture
def spotlight_sleeper():
    """A live process whose command line mentions spotlight, as a coordinator's does; and its start time."""
    with marked_sleeper("spotlight") as sleeper:
        yield sleeper


def _run(tmp_path, pid: int, written: float) -> pathlib.Path:
    """A run directory of 5 iterations with no checkpoint left (a resume that gets past the
    coordinator check refuses next, before anything starts) whose coordinator.json names ``pid``,
    dated ``written``."""
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(TOY.read_text())
    (rd / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i}) + "\n" for i in range(5)))
    (rd / "coordinator.json").write_text(json.dumps({"pid": pid, "endpoint": "tcp://127.0.0.1:1"}))
    os.utime(rd / "coordinator.json", (written, written))
    return rd


def test_a_pid_taken_by_a_process_started_after_coordinator_json_does_not_block_resume(tmp_path, spotlight_sleeper):
    pid, started = spotlight_sleeper
    rd = _run(tmp_path, pid, written=started - 3600)  # the file is an hour older than the process
    assert _running_coordinator(rd) is None
    res = CliRunner().invoke(app, ["up", "--resume", str(rd)])
    assert "still running" not in res.output, res.output
    # the next check refuses (nothing starts): the coordinator check let the resume through
    assert res.exit_code == 2 and "no longer holds it" in res.output, res.output


def test_a_spotlight_process_started_before_coordinator_json_still_blocks_resume(tmp_path, spotlight_sleeper):
    pid, started = spotlight_sleeper
    rd = _run(tmp_path, pid, written=started + 1)  # written once it listened
    assert _running_coordinator(rd) == pid
    res = CliRunner().invoke(app, ["up", "--resume", str(rd)])
    assert res.exit_code == 2 and f"still running (coordinator pid {pid})" in res.output, res.output


def test_a_process_that_is_not_spotlight_or_no_pid_does_not_block(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        rd = _run(tmp_path, proc.pid, written=psutil.Process(proc.pid).create_time() + 1)
        assert _running_coordinator(rd) is None
    finally:
        proc.kill()
        proc.wait()
    for text in ("", "{garbage", "[]", '{"pid": true}', '{"pid": null}', json.dumps({"pid": os.getpid()})):
        (rd / "coordinator.json").write_text(text)
        assert _running_coordinator(rd) is None, text


@pytest.mark.parametrize("text", ["", "{garbage", "[]", '{"endpoint": 5}', '{"endpoint": ""}', '{"endpoint": null}'])
def test_a_broken_coordinator_json_is_no_address_to_resume_on_not_a_traceback(tmp_path, text):
    """``--resume`` listens where the earlier coordinator did when coordinator.json says where;
    a file that does not say (a write cut short, a hand edit) leaves the default address."""
    from spotlight.cli.up_preflight import _earlier_address

    rd = _run(tmp_path, 2**22 + 12345, written=1.7e9)
    (rd / "coordinator.json").write_text(text)
    assert _earlier_address(rd) is None
    res = CliRunner().invoke(app, ["up", "--resume", str(rd)])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2 and "no longer holds it" in res.output, res.output
    (rd / "coordinator.json").write_text(json.dumps({"endpoint": "tcp://10.0.0.7:7400"}))
    assert _earlier_address(rd) == "10.0.0.7:7400"


def test_eval_of_a_run_still_running_says_so(tmp_path, spotlight_sleeper):
    """Was: "no final/ folder (the run did not finish)" for a run that was simply not done yet."""
    pid, started = spotlight_sleeper
    rd = _run(tmp_path, pid, written=started + 1)
    res = CliRunner().invoke(app, ["eval", "--run-dir", str(rd)])
    assert res.exit_code == 2, res.output
    assert f"the run is still running (coordinator pid {pid}) and has no final/ folder yet" in res.stderr, res.output
