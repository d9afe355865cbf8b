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
