"""``spotlight status RUN --coordinator ENDPOINT`` that gets no answer: the endpoint was given by
hand (no pid known, maybe not the run's coordinator at all), so the note says the coordinator at
that endpoint did not answer; it printed ``the coordinator (pid None) is running but did not
answer``. The run's own coordinator, alive but silent, keeps its pid and "is running"."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.net.security import add_client, init_keys
from tests.unit.cli.test_status import mid_snapshot

DEAD_PID = 2**22 + 12345  # beyond pid_max on Linux: a process that cannot exist
OWN = "tcp://127.0.0.1:7499"


def _run_dir(tmp_path, pid: int):
    rd = tmp_path / "run"
    init_keys(rd / "keys")
    add_client(rd / "keys", "status", "local")
    (rd / "coordinator.json").write_text(json.dumps({"endpoint": OWN, "pid": pid, "keys_dir": str(rd / "keys")}))
    (rd / "status.json").write_text(json.dumps(mid_snapshot()))
    return rd


def _status(*args) -> tuple[int, str]:
    """The exit status and the line that says where the snapshot came from."""
    res = CliRunner().invoke(app, ["status", *args], env={"COLUMNS": "300"})
    return res.exit_code, next((line for line in res.output.splitlines() if "showing" in line), res.output[:500])


def _silent(monkeypatch):
    def fetch(endpoint, keys, timeout_s=3.0):
        raise TimeoutError(f"no answer from {endpoint} within {timeout_s}s")

    monkeypatch.setattr("spotlight.cli.status.fetch_snapshot", fetch)


def test_an_endpoint_given_by_hand_that_does_not_answer_names_no_pid(tmp_path):
    """The user's command as is (a real CURVE request to a closed port: about 3 s)."""
    rd = _run_dir(tmp_path, DEAD_PID)
    code, out = _status(str(rd), "--coordinator", "tcp://127.0.0.1:1")
    assert code == 1, out
    assert "the coordinator at tcp://127.0.0.1:1 did not answer within 3.0s" in out, out
    assert "pid None" not in out and "is running" not in out, out


@pytest.mark.parametrize("pid", [os.getpid(), DEAD_PID], ids=["run-alive", "run-stopped"])
def test_a_hand_endpoint_other_than_the_runs_claims_nothing_runs_there(tmp_path, monkeypatch, pid):
    _silent(monkeypatch)
    rd = _run_dir(tmp_path, pid)
    code, out = _status(str(rd), "--coordinator", "127.0.0.1:7498")
    assert code == 1, out
    assert "the coordinator at tcp://127.0.0.1:7498 did not answer" in out, out
    assert "pid" not in out.split("showing")[0] and "is running" not in out, out


def test_the_runs_own_coordinator_alive_but_silent_keeps_its_pid(tmp_path, monkeypatch):
    _silent(monkeypatch)
    rd = _run_dir(tmp_path, os.getpid())
    for args in ((str(rd),), (str(rd), "--coordinator", OWN), (str(rd), "--coordinator", "127.0.0.1:7499")):
        code, out = _status(*args)
        assert code == 1, out
        assert f"the coordinator (pid {os.getpid()}) is running but did not answer" in out, (args, out)
