"""`spotlight up`'s start-up checks: bad options and busy run directories are one-line errors
found before anything starts or is written (new-user trial findings)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from spotlight.cli import app

TOY = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "jpeg-toy" / "config.toml")


def _up(*args: str):
    return CliRunner().invoke(app, ["up", *args])


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--mock-cloud", "ibm", "--mock-cloud ibm: choose from aws, gcp, azure, none"),
        ("--reserved", "7400", "--reserved 7400: expected HOST:PORT"),
        ("--reserved", "127.0.0.1:99999", "--reserved 127.0.0.1:99999: expected HOST:PORT"),
        ("--trace-mode", "half", "--trace-mode half: choose from slice, full"),
    ],
)
def test_a_bad_option_is_one_line_before_anything_is_written(tmp_path, flag, value, expected):
    rd = tmp_path / "run"
    res = _up("--local", "--config", TOY, "--run-dir", str(rd), flag, value)
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [f"error: {expected}" + res.output.strip().split(expected, 1)[1]], res.output
    assert "Traceback" not in res.output and not rd.exists()


def test_a_run_whose_coordinator_still_runs_points_to_status_not_resume(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text())
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "spotlight"])
    try:
        (rd / "coordinator.json").write_text(json.dumps({"pid": proc.pid, "endpoint": "tcp://127.0.0.1:1"}))
        for args in (["--config", TOY, "--run-dir", str(rd)], ["--resume", str(rd)]):
            res = _up("--local", *args)
            assert res.exit_code == 2, res.output
            assert f"still running (coordinator pid {proc.pid})" in res.output and f"spotlight status {rd}" in res.output, res.output
            assert "--resume" not in res.output
    finally:
        proc.kill()
        proc.wait()


def _up_on_a_busy_port(*args: str):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        return port, _up("--config", TOY, "--reserved", f"127.0.0.1:{port}", *args)
    finally:
        busy.close()


def test_an_address_in_use_is_one_line_and_leaves_no_run_directory(tmp_path):
    """Was: a ZMQError traceback, exit 1, and a run directory with config.toml, keys/ and logs/."""
    rd = tmp_path / "run"
    port, res = _up_on_a_busy_port("--run-dir", str(rd))
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port}: address already in use", res.output
    assert "Traceback" not in res.output and not rd.exists()


def test_reserved_only_says_once_that_agents_is_ignored(tmp_path):
    _, res = _up_on_a_busy_port("--local", "--mode", "reserved-only", "--agents", "3", "--run-dir", str(tmp_path / "run"))
    assert res.output.count("--agents 3 is ignored") == 1, res.output
    _, res = _up_on_a_busy_port("--local", "--mode", "reserved-only", "--run-dir", str(tmp_path / "run"))
    assert "ignored" not in res.output, res.output
