"""``spotlight status`` without a run directory: it shows the run whose coordinator is running and
names its directory; with several running it names them and asks for one, instead of picking
one of them silently. Real coordinators (``test_weight_sync._Run``) in this process."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.net.security import add_client, reload_allow_list
from tests.unit.store.test_weight_sync import _Run

DEAD_PID = 2**22 + 12345  # beyond pid_max on Linux: a process that cannot exist


def _start(tmp_path, name: str) -> _Run:
    """A live run at ``tmp_path/runs/<name>`` (a link to the coordinator's run directory)."""
    run = _Run(tmp_path / name)
    add_client(tmp_path / name / "keys", "status", "local")
    reload_allow_list(run.coord.keys)  # the key `spotlight up` creates for status
    (tmp_path / "runs").mkdir(exist_ok=True)
    (tmp_path / "runs" / name).symlink_to(tmp_path / name / "run")
    return run


def _stopped(tmp_path, run: _Run, name: str) -> None:
    run.close()
    meta = tmp_path / name / "run" / "coordinator.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "pid": DEAD_PID}))


def _status(*args) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["status", *args], env={"COLUMNS": "300"})
    return res.exit_code, res.output


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = {name: _start(tmp_path, name) for name in ("a", "b")}
    # b is the newer (moved later, not a back to 1970: a coordinator.json older than the process
    # whose pid it holds was not written by that process)
    later = (tmp_path / "b" / "run" / "coordinator.json").stat().st_mtime + 60
    os.utime(tmp_path / "b" / "run" / "coordinator.json", (later, later))
    yield runs
    for run in runs.values():
        if not run.stop.is_set():
            run.close()


def test_two_running_runs_are_named_not_picked(tmp_path, two_runs):
    code, out = _status()
    assert code == 2, out
    assert " ".join(out.split()) == "error: 2 runs are running (runs/b, runs/a): name one, e.g. spotlight status runs/b"


def test_the_only_running_run_is_shown_with_its_directory(tmp_path, two_runs):
    _stopped(tmp_path, two_runs["b"], "b")  # the newer run has stopped: the running one is shown
    code, out = _status()
    assert code == 0, out
    assert f"run dir {(tmp_path / 'a' / 'run').resolve()}  (the only running run under runs/)" in out, out
    assert "phase starting" in out  # live, from the coordinator
    code, out = _status("--json")
    snap = json.loads(out)
    assert snap["run_dir"] == str((tmp_path / "a" / "run").resolve()) and "running" not in snap


def test_with_none_running_the_newest_is_shown_and_named(tmp_path, two_runs):
    _stopped(tmp_path, two_runs["a"], "a")
    _stopped(tmp_path, two_runs["b"], "b")
    code, out = _status()
    assert code == 0, out
    assert "(the newest run of 2 under runs/; none is running)" in out and "run dir " in out, out
    assert str((tmp_path / "b" / "run").resolve()) in out and "not running" in out


def test_watch_off_a_terminal_or_of_a_stopped_run_shows_one_snapshot_and_returns(tmp_path, two_runs):
    """``status --watch`` redrew a live view forever: into a pipe or file (where rich draws nothing:
    0 bytes) and for a run whose coordinator is not running (nothing will change)."""
    _stopped(tmp_path, two_runs["a"], "a")
    code, out = _status("runs/b", "--watch", "--interval-s", "0.1")  # CliRunner's output is no terminal
    assert code == 0, out
    assert "--watch needs a terminal: one snapshot instead" in out and "phase starting" in out, out
    code, out = _status("runs/a", "--watch", "--interval-s", "0.1")
    assert code == 0, out
    assert "--watch: the coordinator is not running; its last saved status:" in out and "not running" in out, out


def test_off_a_terminal_the_tables_are_not_cut_to_80_columns(tmp_path, two_runs, monkeypatch):
    """Into a file or pipe rich assumed 80 columns and cut node and column names ("reserv…")."""
    _stopped(tmp_path, two_runs["a"], "a")
    monkeypatch.delenv("COLUMNS", raising=False)
    res = CliRunner().invoke(app, ["status", "runs/a"])
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) > 80, res.output
