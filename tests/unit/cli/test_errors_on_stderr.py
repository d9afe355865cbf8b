"""A command's ``error:`` line goes to stderr, never to stdout: ``spotlight plan --json > plan.json``
or ``spotlight eval … > log`` holds no refusal, and a script reads the exit status and stderr.
Each command in-process (click's ``CliRunner`` keeps the two streams apart), then a few through
the real entry point in a subprocess; ``warning:`` lines take the same way."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from spotlight.cli import app

REPO = pathlib.Path(__file__).resolve().parents[3]

REFUSALS = [
    pytest.param(["plan", "{tmp}/nosuch.toml", "--json"], "config file not found", id="plan-config"),
    pytest.param(["plan", "--device", "tpu", "--json"], "--device tpu: choose cuda or cpu", id="plan-device"),
    pytest.param(["eval", "--run-dir", "{tmp}/nosuch"], "no such directory", id="eval-run-dir"),
    pytest.param(["keys", "list", "{tmp}/nosuch"], "no such directory", id="keys-list"),
    pytest.param(
        ["simulate", "--profile", "{tmp}/nosuch.json", "--out", "{tmp}/sim", "--json"],
        "cannot read profile",
        id="simulate-profile",
    ),
    pytest.param(["status", "--run-dir", "{tmp}/nosuch"], "no such directory", id="status-run-dir"),
    pytest.param(["status", "--run-dir", "{tmp}/nosuch", "--json"], "no such directory", id="status-json"),
    pytest.param(["status", "--coordinator", "nope:x"], "expected HOST:PORT", id="status-coordinator"),
    pytest.param(["status", "{tmp}/a", "--run-dir", "{tmp}/b"], "name different runs", id="status-two-runs"),
    pytest.param(
        ["bench", "stale-ranking", "--run-dir", "{tmp}/nosuch"], "run directory not found", id="bench-run-dir"
    ),
    pytest.param(
        ["profile", "--out", "{tmp}/p.json", "--run-dir", "{tmp}"], "give --out or --run-dir", id="profile-both"
    ),
    pytest.param(["profile", "--thresholds", "abc", "--out", "{tmp}/p.json"], "'abc' is not a number", id="profile"),
    pytest.param(["reward-server", "--log-level", "nope"], "unknown --log-level 'nope'", id="reward-server"),
    pytest.param(["up", "--resume", "{tmp}/nosuch"], "no such directory", id="up-resume"),
    pytest.param(["up", "--config", "{tmp}/nosuch.toml"], "config file not found", id="up-config"),
]


@pytest.mark.parametrize("args, says", REFUSALS)
def test_a_refusal_is_one_line_on_stderr_and_nothing_on_stdout(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)  # a default runs/ folder, were one made, lands here
    res = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.stdout == "", res.stdout
    assert res.stderr.startswith("error: ") and says in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_warnings_and_errors_of_a_running_command_go_to_stderr(capsys):
    """``spotlight up``'s running lines (a local agent that failed, a replay's notes): warnings
    and errors to stderr, the rest to the command's console."""
    from spotlight.cli.messages import say_to

    say = say_to(Console(emoji=False, soft_wrap=True))
    say("[yellow]warning:[/yellow] local agent spot-0 exited with code 2")
    say("iter 1/2 reward 0.5")
    say("[red]error:[/red] the run failed")
    out, err = capsys.readouterr()
    assert out == "iter 1/2 reward 0.5\n", out
    assert err == "warning: local agent spot-0 exited with code 2\nerror: the run failed\n", err


@pytest.mark.procs  # the real `spotlight` entry point, as a script runs it
def test_the_entry_point_keeps_errors_off_stdout(tmp_path):
    for args in (
        ["plan", str(tmp_path / "nosuch.toml"), "--json"],
        ["status", "--run-dir", str(tmp_path / "nosuch"), "--json"],
        ["keys", "list", str(tmp_path / "nosuch")],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "spotlight.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "error:" not in proc.stdout, (args, proc.stdout)
        assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, (args, proc.stderr)
