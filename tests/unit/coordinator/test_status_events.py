"""The coordinator's snapshot tells the story: events with reasons, GPU counts, 1-based
iterations, and ``status.json`` for a run whose coordinator has ended.

A real Coordinator (CURVE sockets) and a real agent-keyed DEALER (``test_weight_sync._Run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from spotlight import protocol as P
from tests.unit.store.test_weight_sync import _register, _Run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _ask_status(run) -> dict:
    run.agent.send_multipart(P.encode(P.StatusRequest()))
    while True:
        mtype, body, _ = run.recv(run.agent)
        if mtype == P.MsgType.STATUS:
            return body.snapshot


def test_snapshot_events_and_status_file(tmp_path):
    run = _Run(tmp_path)
    try:
        snap = _ask_status(run)
        assert snap["iteration"] == 1 and snap["iterations_done"] == 0  # 1-based, as on screen (was 0)
        assert snap["version"] == -1 and snap["eta_s"] is None  # no weights yet, no estimate yet
        session = _register(run)
        hb = P.Heartbeat(
            node_id="spot-a", session=session, workers=[P.WorkerInfo(worker_id="spot-a/g0", gpus=[0, 1])], gpus=[0, 1]
        )
        run.agent.send_multipart(P.encode(hb))
        assert run.recv(run.agent)[0] == P.MsgType.HEARTBEAT
        snap = _ask_status(run)
        node = snap["nodes"][0]
        # the trainer's reserved GPU is billed from the start: it is counted too (it was not)
        assert node["num_gpus"] == 2 and snap["gpus"] == {"spot": 2, "reserved": 1, "train": 1, "reserved_rollout": 0}
        # the agent gave up a GPU whose workers failed every start: an event and the node's record
        gave_up = "workers on GPUs [1] failed 5 starts in a row (last exit code 1); not starting them again"
        for _ in range(2):  # said on every heartbeat from then on: one event
            hb = P.Heartbeat(node_id="spot-a", session=session, workers_error=gave_up, gpus_given_up=[1])
            run.agent.send_multipart(P.encode(hb))
            assert run.recv(run.agent)[0] == P.MsgType.HEARTBEAT
        node = _ask_status(run)["nodes"][0]
        assert node["workers_error"] == gave_up and node["gpus_given_up"] == [1] and node["num_gpus"] == 2
        notice = P.Notice(
            node_id="spot-a",
            session=session,
            source="gcp",
            scope="node",
            deadline_unix_s=time.time() + 30,
            key="k1",
            kind="preempt",
        )
        run.agent.send_multipart(P.encode(notice))
        run.agent.send_multipart(P.encode(P.Bye(node_id="spot-a", session=session, reason="preempted: committed")))
        deadline = time.monotonic() + 20
        while (snap := _ask_status(run))["nodes"][0]["status"] != "dead":
            assert time.monotonic() < deadline, snap
        assert snap["nodes"][0]["why"] == "bye: preempted: committed"
        kinds = [(e["kind"], e["node"]) for e in snap["events"]]
        assert kinds == [
            ("join", "spot-a"),
            ("add", "spot-a"),
            ("gave-up", "spot-a"),
            ("notice", "spot-a"),
            ("leave", "spot-a"),
        ], kinds
        assert snap["events"][2]["detail"] == gave_up
        assert "gcp preempt" in snap["events"][3]["detail"] and snap["events"][4]["detail"] == "preempted: committed"
        assert all(e["t_s"] >= 0 for e in snap["events"])
        assert snap["gpus"] == {"spot": 0, "reserved": 1, "train": 1, "reserved_rollout": 0}
    finally:
        run.close()
    saved = json.loads((tmp_path / "run" / "status.json").read_text())  # written at close
    assert saved["events"][-1]["kind"] == "finish" and "stopped after 0/" in saved["events"][-1]["detail"]
    assert saved["nodes"][0]["why"] == "bye: preempted: committed"
    assert saved["gpus"]["train"] == 1  # saved before the trainers' GPUs are released: as held when it stopped


def test_status_cli_shows_a_finished_run_from_its_directory(tmp_path):
    """`spotlight status --run-dir` of a run whose coordinator is gone renders status.json and
    the curve from metrics.jsonl (before, it needed a live coordinator and a status key)."""
    run = _Run(tmp_path)
    run.close()
    rd = tmp_path / "run"
    meta = json.loads((rd / "coordinator.json").read_text())
    meta["pid"] = 2**22 + 12345  # beyond pid_max on Linux: a process that cannot exist
    (rd / "coordinator.json").write_text(json.dumps(meta))
    (rd / "metrics.jsonl").write_text(
        json.dumps({"iteration": 0, "reward/mean": 0.25})
        + "\nnot json\n"
        + json.dumps({"iteration": 1, "reward/mean": 0.75})
        + "\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO, COLUMNS="200")
    res = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "status", "--run-dir", str(rd)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "is not running" in out and "status.json" in out
    assert "min +0.2500" in out and "max +0.7500" in out
    assert "stopped after 0/" in out
    assert "stopped at " in out and "(not running): 0/" in out and "nodes as last seen at" in out  # not shown as live
    assert "ETA" not in out and "GPUs now" not in out
    res = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "status", "--run-dir", str(rd), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    snap = json.loads(res.stdout)
    assert snap["reward_curve"] == [0.25, 0.75] and snap["last_metrics"]["reward/mean"] == 0.75
    assert (
        snap["running"] is False
        and snap["eta_s"] is None
        and snap["saved_unix_s"] == snap["started_unix_s"] + snap["elapsed_s"]
    )


def test_eta_of_a_resumed_run_uses_the_earlier_iterations_until_one_of_its_own_ends():
    """A resumed run showed "ETA after the first iteration" although iterations were done
    (new-user trial): until this coordinator finishes one, the earlier ones' times count."""
    from spotlight.coordinator.status import RunClock

    total = 10
    assert RunClock(0.0, 0.0).eta_s(5.0, [], total) is None  # a fresh run: no estimate before an iteration ends
    history = [{"reward/mean": 0.0, "time/iteration_s": t} for t in (10.0, float("nan"), 20.0)]
    clock = RunClock(0.0, 0.0, iterations_before_start=3)
    assert clock.eta_s(5.0, history, total) == 15.0 * (total - 3)
    assert clock.eta_s(40.0, history + [{}], total) == 40.0 * (total - 4)  # its own iteration took 40 s
    assert clock.eta_s(40.0, [{}] * total, total) == 0.0


def test_the_last_event_says_why_a_run_stopped_early(tmp_path):
    """A run stopped by --timeout-s showed only "interrupted or timed out" (new-user trial)."""
    run = _Run(tmp_path)
    run.coord.stop_reason = "run did not finish within 40s (phase rollout, iteration 1)"
    run.close()
    saved = json.loads((tmp_path / "run" / "status.json").read_text())
    assert saved["events"][-1]["kind"] == "finish"
    assert (
        saved["events"][-1]["detail"]
        == "stopped after 0/%d iterations (run did not finish within 40s (phase rollout, iteration 1))"
        % saved["iterations"]
    )


@pytest.mark.parametrize(
    "coordinator", ["garbage", "tcp://host:abc", "127.0.0.1:99999", "127.0.0.1:0", "tcp://", ":5555"]
)
def test_status_with_a_bad_coordinator_address_is_one_line(tmp_path, coordinator):
    """Was: a 37-line ZMQError traceback (garbage, host:abc) or a 3 s wait (port 99999)."""
    from typer.testing import CliRunner

    from spotlight.cli import app

    res = CliRunner().invoke(app, ["status", "--coordinator", coordinator, "--keys", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert (
        " ".join(res.output.split()) == f"error: --coordinator {coordinator}: expected HOST:PORT (port 1 to 65535)"
    ), res.output  # rich wraps at 80 columns


def test_status_of_a_missing_run_directory_says_so(tmp_path):
    from typer.testing import CliRunner

    from spotlight.cli import app

    res = CliRunner().invoke(app, ["status", str(tmp_path / "nonexistent")])
    assert res.exit_code == 2, res.output
    assert " ".join(res.output.split()) == f"error: {tmp_path / 'nonexistent'}: no such directory", (
        res.output
    )  # rich wraps at 80 columns
    f = tmp_path / "file"
    f.write_text("")
    res = CliRunner().invoke(app, ["status", str(f)])
    assert res.exit_code == 2 and " ".join(res.output.split()) == f"error: {f}: not a directory", res.output
