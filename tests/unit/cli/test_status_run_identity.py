"""Which run ``spotlight status`` shows, and what it says when it cannot (a tester's findings):

* a copied run (``cp -r runs/two w/c/r4``) was named by the path recorded inside it, not the
  directory given; a copy of a running run was shown as that run, live;
* a bare pid in ``coordinator.json`` was trusted: pid 1, or a pid another process got after a
  reboot, made a finished run "running but did not answer" (exit 1);
* a client key the coordinator does not know (CURVE drops it without a word) got "the run has
  finished, or its coordinator is not reachable", naming neither the keys nor the allow-list;
* a ``coordinator.json`` without ``endpoint`` said ``not readable ('endpoint')`` with exit 2,
  other broken run files exit 1 (now: all exit 1, the message in words);
* a ``coordinator.json`` that is empty, not JSON or lacks ``endpoint`` hid the run's saved
  ``status.json`` behind an error, when a stopped or crashed run's saved status is just what is
  wanted (now: shown, with a ``warning:`` naming the fault; an error only with neither file);
* "(written HH:MM:SS)" was the time of the copy, not the time the snapshot records;
* with no RUN_DIR the newest ``runs/*/coordinator.json`` was taken even when it was garbage.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.net.security import add_client, init_keys, reload_allow_list
from tests.unit.cli.test_status import mid_snapshot

DEAD_PID = 2**22 + 12345  # beyond pid_max on Linux: a process that cannot exist
ENDPOINT = "tcp://127.0.0.1:7499"


def _status(*args) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``spotlight status ARGS`` (wide: no line is wrapped)."""
    res = CliRunner().invoke(app, ["status", *args], env={"COLUMNS": "1000"})
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.stdout, res.stderr


def _run(rd, pid=DEAD_PID, *, snap=None, meta=None):
    """A run directory: ``coordinator.json`` (``meta`` as is, else the endpoint and ``pid``) and
    ``status.json`` (``snap``, else a finished run's snapshot that records ``rd`` as its directory)."""
    rd.mkdir(parents=True, exist_ok=True)
    init_keys(rd / "keys", exist_ok=True)
    if not list((rd / "keys").glob("status.*.key_secret")):
        add_client(rd / "keys", "status", "local")
    info = {"endpoint": ENDPOINT, "pid": pid, "keys_dir": str(rd / "keys")}
    (rd / "coordinator.json").write_text(meta if meta is not None else json.dumps(info))
    if snap is None:
        snap = mid_snapshot() | {"run_dir": str(rd.resolve()), "finished": True, "iterations_done": 10}
        snap |= {"iteration": 10, "eta_s": 0.0, "session_elapsed_s": 3730.0}
    (rd / "status.json").write_text(json.dumps(snap))
    return rd


def _silent(monkeypatch):
    """Every STATUS request times out (as one to a coordinator that drops it); records the asks."""
    asked = []

    def fetch(endpoint, keys, timeout_s=3.0):
        asked.append(endpoint)
        raise TimeoutError(f"no answer from {endpoint} within {timeout_s}s")

    monkeypatch.setattr("spotlight.cli.status.fetch_snapshot", fetch)
    return asked


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# ---------------------------------------------------------------- 1. the directory given


def test_a_copied_run_is_named_by_the_directory_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    orig = _run(tmp_path / "runs" / "two")
    shutil.copytree(orig, tmp_path / "w" / "c" / "r4")
    copy = (tmp_path / "w" / "c" / "r4").resolve()
    code, out, err = _status("w/c/r4")
    assert code == 0, out + err
    assert f"run dir {copy}\n" in out, out
    assert str(orig.resolve()) not in out, out
    code, out, err = _status("w/c/r4", "--json")
    assert code == 0 and json.loads(out)["run_dir"] == str(copy), out + err
    # the run itself, given by a relative path: its directory, resolved
    code, out, err = _status("runs/two")
    assert code == 0 and f"run dir {orig.resolve()}\n" in out, out + err


@pytest.fixture
def live_run(tmp_path):
    """A real coordinator (in this process) of ``tmp_path/orig/run``, with a status key, and a
    status.json as after an iteration."""
    from tests.unit.store.test_weight_sync import _Run

    run = _Run(tmp_path / "orig")
    add_client(tmp_path / "orig" / "keys", "status", "local")
    reload_allow_list(run.coord.keys)
    rd = tmp_path / "orig" / "run"
    (rd / "status.json").write_text(json.dumps(mid_snapshot() | {"run_dir": str(rd.resolve())}))
    yield run
    run.close()


def test_a_copy_of_a_running_run_is_not_shown_as_that_run(tmp_path, live_run):
    orig = (tmp_path / "orig" / "run").resolve()
    copy = tmp_path / "w" / "c" / "r4"
    shutil.copytree(orig, copy, ignore=shutil.ignore_patterns("tensor_store"))
    code, out, err = _status(str(copy))
    assert code == 0, out + err
    assert f"run dir {copy.resolve()}\n" in out, out
    assert f"runs {orig}, not this directory" in out and "not running" in out, out  # the copy does not run
    assert "phase starting" not in out, out  # not the live view of the original
    # the original's coordinator named by hand: live, under the directory it runs, said to be another
    keys = str(tmp_path / "orig" / "keys")
    code, out, err = _status(str(copy), "--coordinator", live_run.coord.endpoint, "--keys", keys)
    assert code == 0, out + err
    endpoint = live_run.coord.endpoint
    assert f"run dir {orig}  (the coordinator at {endpoint} runs this directory, not {copy.resolve()})" in out, out
    assert "phase starting" in out, out
    code, out, err = _status(str(orig))  # the run itself: live, its own directory
    assert code == 0 and f"run dir {orig}\n" in out and "phase starting" in out, out + err


# ---------------------------------------------------------------- 2. a pid is not a coordinator


def _sleeper(*, spotlight: bool) -> subprocess.Popen:
    """A process that sleeps; ``spotlight``: its command line mentions spotlight, as a coordinator's does."""
    code = "import time; time.sleep(120)" + ("  # spotlight" if spotlight else "")
    proc = subprocess.Popen([sys.executable, "-c", code])
    psutil.Process(proc.pid).cmdline()  # started
    return proc


def _saved_view(code, out, err, pid):
    assert code == 0, out + err
    assert f"the coordinator (pid {pid}) is not running" in out and "is running but" not in out, out
    assert "finished: 10/10 iterations" in out, out


def test_pid_1_is_not_the_coordinator(tmp_path, monkeypatch):
    try:
        init = " ".join(psutil.Process(1).cmdline())
    except psutil.Error:
        pytest.skip("pid 1 is not visible here")
    if "spotlight" in init:
        pytest.skip("pid 1 here runs spotlight")
    asked = _silent(monkeypatch)
    code, out, err = _status(str(_run(tmp_path / "run", pid=1)))
    _saved_view(code, out, err, 1)
    assert "pid 1 is now " in out and "not a Spotlight coordinator" in out and not asked, out


def test_a_pid_taken_after_coordinator_json_was_written_is_not_the_coordinator(tmp_path, monkeypatch):
    """As after a reboot: the process with the file's pid (here this very one, whose command line
    would pass) started after coordinator.json was written (dated an hour before it started)."""
    asked = _silent(monkeypatch)
    rd = _run(tmp_path / "run", pid=os.getpid())
    before = psutil.Process().create_time() - 3600
    os.utime(rd / "coordinator.json", (before, before))
    code, out, err = _status(str(rd))
    _saved_view(code, out, err, os.getpid())
    assert "started after coordinator.json was written" in out and not asked, out


@pytest.mark.procs
def test_a_process_that_is_not_spotlight_is_not_the_coordinator_one_that_is_is(tmp_path, monkeypatch):
    asked = _silent(monkeypatch)
    other = _sleeper(spotlight=False)
    try:
        code, out, err = _status(str(_run(tmp_path / "other", pid=other.pid)))
    finally:
        other.kill()
        other.wait()
    _saved_view(code, out, err, other.pid)
    assert "not a Spotlight coordinator" in out and not asked, out
    # the check refuses no real coordinator: one that wrote coordinator.json is asked, and when it
    # does not answer it is "running but did not answer"
    coord = _sleeper(spotlight=True)
    try:
        code, out, err = _status(str(_run(tmp_path / "run", pid=coord.pid)))
    finally:
        coord.kill()
        coord.wait()
    assert code == 1 and asked == [ENDPOINT], out + err
    assert f"the coordinator (pid {coord.pid}) is running but did not answer" in out, out


# ---------------------------------------------------------------- 3. a key the coordinator does not know


def test_a_client_key_the_coordinator_does_not_know_is_named_as_a_cause(tmp_path, live_run):
    """The user's command as is: a real CURVE request that the coordinator drops (about 3 s)."""
    k2 = tmp_path / "k2"
    init_keys(k2)
    add_client(k2, "status", "alice")  # on k2's allow-list, not on the coordinator's
    shutil.copy(tmp_path / "orig" / "keys" / "server.key", k2 / "server.key")
    code, out, err = _status("--coordinator", live_run.coord.endpoint, "--keys", str(k2))
    assert code == 1 and not out, out + err
    line = err.strip()
    assert line.startswith("error: no answer from") and "within 3.0s" in line and "\n" not in line, err
    assert "the run has finished, its coordinator is not reachable" in line, line
    assert f"the key status.alice of {k2}: that key is not on its allow-list" in line, line
    assert f"or {k2 / 'server.key'} is not this coordinator's" in line, line


def test_a_request_that_cannot_be_sent_times_out_too(tmp_path, monkeypatch):
    """With a wrong key the CURVE handshake fails; when it failed before the request was queued,
    the DEALER had no peer to send to and ``status`` blocked for ever in the send (seen with the
    test above, now and then). ZMQ_IMMEDIATE (queue only to finished handshakes) makes that
    send block every time."""
    import threading

    import zmq

    from spotlight.cli.status import fetch_snapshot
    from spotlight.net import security

    apply = security.apply_client

    def immediate(sock, keys):
        apply(sock, keys)
        sock.setsockopt(zmq.IMMEDIATE, 1)

    monkeypatch.setattr(security, "apply_client", immediate)
    init_keys(tmp_path / "keys")
    add_client(tmp_path / "keys", "status", "local")
    keys = security.load_client_keys(tmp_path / "keys", role="status")
    got = []

    def ask():
        try:
            fetch_snapshot("tcp://127.0.0.1:1", keys, timeout_s=0.5)
        except Exception as exc:  # noqa: BLE001 - what it raised is the check
            got.append(exc)

    t0 = time.monotonic()
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "fetch_snapshot blocked in its send"
    assert len(got) == 1 and isinstance(got[0], TimeoutError), got
    assert str(got[0]) == "no answer from tcp://127.0.0.1:1 within 0.5s" and time.monotonic() - t0 < 5


def test_a_silent_coordinator_over_a_saved_status_names_the_keys_too(tmp_path, monkeypatch):
    _silent(monkeypatch)
    rd = _run(tmp_path / "run", pid=os.getpid())  # this process wrote it: "running"
    code, out, err = _status(str(rd))
    assert code == 1, out + err
    assert f"the coordinator (pid {os.getpid()}) is running but did not answer" in out, out
    keys = rd / "keys"
    assert f"if it is not busy, it does not take the key status.local of {keys}" in out, out
    code, out, err = _status(str(rd), "--coordinator", "127.0.0.1:7498")  # by hand, not the run's endpoint
    assert code == 1 and "the coordinator at tcp://127.0.0.1:7498 did not answer" in out, out + err
    assert f"it is not running, not reachable, or it does not take the key status.local of {keys}" in out, out


# ---------------------------------------------------------------- 4. broken run files: words, one exit status

BAD_COORDINATOR_JSON = [  # (its text, what status says of it, whether its pid is a running coordinator)
    pytest.param("", "coordinator.json: not JSON (empty)", False, id="empty"),
    pytest.param("{garbage", "coordinator.json: not JSON", False, id="not-json"),
    pytest.param("[]", "coordinator.json: not a JSON object", False, id="not-an-object"),
    pytest.param('{"pid": "DEAD"}', "coordinator.json has no 'endpoint'", False, id="no-endpoint"),
    pytest.param('{"endpoint": 5}', "its 'endpoint' is 5, not HOST:PORT", False, id="endpoint-a-number"),
    pytest.param('{"endpoint": "x", "pid": "SELF"}', "its 'endpoint' \"x\" is not HOST:PORT", True, id="endpoint-x"),
    pytest.param(
        '{"endpoint": "127.0.0.1:1", "pid": "SELF", "keys_dir": 5}', "'keys_dir' is 5, not a path", True, id="keys"
    ),
]


def _meta(text: str) -> str:
    return text.replace('"SELF"', str(os.getpid())).replace('"DEAD"', str(DEAD_PID))


@pytest.mark.parametrize("meta, said, running", BAD_COORDINATOR_JSON)
def test_a_broken_coordinator_json_shows_the_saved_status_with_a_warning(tmp_path, monkeypatch, meta, said, running):
    """A stopped or crashed run is shown from its status.json, as stopped; a warning line (standard
    error) names the fault. A pid in the file that is still the run's coordinator shows it as
    running but not asked (no endpoint to ask): exit 1, as when it does not answer."""
    asked = _silent(monkeypatch)
    crashed = mid_snapshot() | {"run_dir": "/elsewhere"}  # saved after iteration 3 of 10, no "finish" event
    rd = _run(tmp_path / "run", meta=_meta(meta), snap=crashed)
    code, out, err = _status(str(rd))
    assert not asked, asked
    assert err.startswith("warning: ") and err.count("\n") == 1 and said in err, err
    assert "showing the run's last saved status" in err and "KeyError" not in err, err
    assert f"showing {rd / 'status.json'}" in out and f"run dir {rd.resolve()}\n" in out, out
    if running:
        assert code == 1, (code, out, err)
        assert f"the coordinator (pid {os.getpid()}) is running, but" in out and "ask it with" in out, out
    else:
        assert code == 0, (code, out, err)
        assert "does not say where its coordinator listens: the run is shown from its saved status" in out, out
        assert "stopped (not running; last saved at " in out and "3/10 iterations done" in out, out
        assert "ETA" not in out and "nodes as last seen" in out, out
    code, out, err = _status(str(rd), "--json")  # the snapshot on stdout, the warning beside it
    assert code == (1 if running else 0) and err.startswith("warning: ") and said in err, (code, err)
    snap = json.loads(out)
    assert snap["iterations_done"] == 3 and snap.get("running", True) is running, snap


BROKEN = [
    *(pytest.param(p.values[0], None, p.values[1], id=p.id) for p in BAD_COORDINATOR_JSON),  # and no status.json
    pytest.param(None, "{garbage", "status.json: not readable as JSON", id="status-not-json"),
    pytest.param(None, '{"nodes": []}', "not a Spotlight status snapshot", id="status-not-a-snapshot"),
]


@pytest.mark.parametrize("meta, snap, said", BROKEN)
def test_a_broken_run_file_is_one_line_in_words_and_exit_1(tmp_path, monkeypatch, meta, snap, said):
    """A broken status.json, or a broken coordinator.json with no status.json to show instead."""
    _silent(monkeypatch)
    rd = _run(tmp_path / "run", meta=_meta(meta) if meta is not None else None)
    if meta is not None:
        (rd / "status.json").unlink()
    if snap is not None:
        (rd / "status.json").write_text(snap)
    code, out, err = _status(str(rd))
    assert code == 1, (code, out, err)
    assert not out and err.startswith("error: ") and err.count("\n") == 1, (out, err)
    assert said in err and "KeyError" not in err and "('endpoint')" not in err, err
    if meta is not None:  # both files' faults, in one line
        assert f"{rd / 'status.json'} not found" in err, err


# ---------------------------------------------------------------- 5. when the snapshot was written


def test_written_is_the_time_the_snapshot_records_not_the_copy_time(tmp_path):
    rd = _run(tmp_path / "run")  # records started_unix_s 1.7e9 + session_elapsed_s 3730, written now
    code, out, err = _status(str(rd))
    assert code == 0, out + err
    assert f"(written {_clock(1.7e9 + 3730.0)})" in out and "finished: 10/10 iterations" in out, out
    assert _clock(time.time())[:13] not in out.split("showing")[1].splitlines()[0], out
    old = mid_snapshot()  # an older snapshot that records no time: the file's
    del old["started_unix_s"]
    (rd / "status.json").write_text(json.dumps(old))
    os.utime(rd / "status.json", (1.6e9, 1.6e9))
    code, out, err = _status(str(rd))
    assert code == 0 and f"(written {_clock(1.6e9)})" in out, out + err


# ---------------------------------------------------------------- 6. picking a run: skip garbage


def test_with_no_run_dir_an_unreadable_newest_run_is_skipped_and_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = _run(tmp_path / "runs" / "good")
    os.utime(good / "coordinator.json", (time.time() - 60, time.time() - 60))
    _run(tmp_path / "runs" / "zz-garbage", meta="{garbage")  # the newest
    _run(tmp_path / "runs" / "no-endpoint", meta='{"pid": 1}')
    code, out, err = _status()
    assert code == 0, out + err
    assert f"run dir {good.resolve()}  (the newest run under runs/; none is running; skipped " in out, out
    assert "runs/no-endpoint, runs/zz-garbage (coordinator.json unreadable))" in out, out
    (good / "coordinator.json").write_text("")  # none readable: the newest saved status is shown
    code, out, err = _status()
    assert code == 0, out + err
    assert f"run dir {good.resolve()}" in out and "finished: 10/10 iterations" in out, out  # emptied last: newest
    assert "that saved its status; no coordinator.json is readable" in out, out
    assert err.startswith("warning: ") and "good/coordinator.json: not JSON (empty)" in err, err
    for run in ("good", "zz-garbage", "no-endpoint"):  # and none saved its status: an error that says why, for each
        (tmp_path / "runs" / run / "status.json").unlink()
    code, out, err = _status()
    assert code == 1 and not out, out + err
    assert err.startswith("error: no --coordinator or RUN_DIR given and no readable runs/*/coordinator.json: "), err
    for why in ("good/coordinator.json: not JSON", "no-endpoint/coordinator.json has no 'endpoint'", "zz-garbage"):
        assert why in err, err
