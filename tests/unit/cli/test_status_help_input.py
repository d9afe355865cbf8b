"""``spotlight status RUN_DIR --run-dir OTHER`` refuses two different runs, and no ``--help``
shows a flag as if it took a value (``--json <bool>``)."""

from __future__ import annotations

import json
import os

import pytest
import typer
from typer.testing import CliRunner

from spotlight.cli import app


def _walk(command, path=()):
    yield path, command
    if isinstance(getattr(command, "commands", None), dict):
        for name, sub in command.commands.items():
            yield from _walk(sub, path + (name,))


COMMANDS = [path for path, _ in _walk(typer.main.get_command(app))]


def _help(path) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "spotlight")
def test_help_shows_no_value_for_a_flag(path):
    text = _help(path)
    assert "--help" in text
    assert "<bool>" not in text, [line for line in text.splitlines() if "<bool>" in line]
    assert "<list[" not in text and " range>" not in text, text
    help_line = next(line for line in text.splitlines() if "--help" in line and "Show this message" in line)
    assert "<" not in help_line, help_line


def test_status_help_still_lists_its_flags_and_value_types():
    text = _help(["status"])
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("│ --")}
    assert "--json" in lines and "--watch" in lines
    assert "<" not in lines["--json"] and "<" not in lines["--watch"]
    assert "<str>" in lines["--coordinator"] and "<path>" in lines["--run-dir"]
    assert "<float> [x>=0.1]" in lines["--interval-s"]


def test_simulate_help_shows_a_repeatable_option_by_its_element_type():
    text = _help(["simulate"])
    policy = next(line for line in text.splitlines() if line.startswith("│ --policy"))
    assert "<str>" in policy, policy
    iterations = next(line for line in text.splitlines() if line.startswith("│ --iterations"))
    assert "<int> [x>=1]" in iterations, iterations


def _run(path, pid):
    path.mkdir(parents=True)
    (path / "coordinator.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": pid}))
    return path


def test_status_refuses_a_run_dir_argument_and_a_different_run_dir_option(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(tmp_path / "runs" / "real", 2**22 + 12345)
    result = CliRunner().invoke(app, ["status", "runs/nope", "--run-dir", "runs/real"], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error:") and "runs/nope" in lines[0] and "runs/real" in lines[0], lines[0]


@pytest.mark.parametrize("other", ["runs/real", "runs/real/", "./runs/real", "ABS"])
def test_status_accepts_the_same_run_dir_twice(tmp_path, monkeypatch, other):
    monkeypatch.chdir(tmp_path)
    _run(tmp_path / "runs" / "real", 2**22 + 12345)
    other = os.path.join(tmp_path, "runs", "real") if other == "ABS" else other
    result = CliRunner().invoke(app, ["status", "runs/real", "--run-dir", other], env={"COLUMNS": "400"})
    # past the check: the run's coordinator is not running and it has no status.json
    assert "name different runs" not in result.output, result.output
    assert "runs/real" in result.output, result.output
