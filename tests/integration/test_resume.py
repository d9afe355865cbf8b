"""Coordinator crash and resume (issue: "a control plane nobody can stop", item 5).

A real local run (coordinator, Train Worker, one reserved and one spot agent) is killed
with SIGKILL in the middle of its second iteration — only the coordinator process; its
agents and their workers live on — then ``spotlight up --resume RUN_DIR --local`` finishes
it. Checked: every request of the run ended Done exactly once in ``requests.jsonl``, at
most one iteration ran twice, ``metrics.jsonl`` has one row per iteration in order (no
gap, no duplicate), the surviving agents reconnected by themselves and kept their
processes, and the resumed Train Worker continued from the checkpointed optimizer state.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess

import psutil

from tests.integration.runs import Up, freeze, gone, read_jsonl, toy_config, up_command, up_env

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_sigkill_mid_iteration_then_resume(tmp_path):
    from spotlight.cli.status import fetch_snapshot
    from spotlight.net.security import load_client_keys

    cfg = toy_config(tmp_path / "config.toml", **{"run.iterations": 4, "explore.mode": "stale"})
    rd = tmp_path / "run"
    up = Up(rd, ["--config", str(cfg), "--local", "--agents", "1", "--log-level", "INFO"])
    agents_before: dict = {}
    try:
        up.wait_for(
            lambda: (rd / "checkpoints" / "LATEST").is_file() and (rd / "local_agents.json").is_file(),
            "the checkpoint of iteration 0",
        )
        info = json.loads((rd / "coordinator.json").read_text())
        keys = load_client_keys(rd / "keys", role="status")

        def mid_iteration():
            try:
                snap = fetch_snapshot(info["endpoint"], keys, timeout_s=2.0)
            except TimeoutError:
                return None
            # past the first checkpoint, inside an iteration's rollout or training: mid-iteration
            return snap["iterations_done"] >= 1 and snap["phase"] in ("rollout", "train") and snap

        up.wait_for(mid_iteration, "an iteration after the first to be under way", interval_s=0.2)
        agents_before = json.loads((rd / "local_agents.json").read_text())["agents"]
        trainers = [p for p in up.ps.children(recursive=True) if "train_worker" in " ".join(p.cmdline())]
        # freeze the coordinator, then read what it checkpointed: an iteration that ended
        # since the snapshot above cannot make the count stale before the kill
        freeze([up.ps])
        from spotlight.cli.up import _checkpointed_iterations

        killed_at = _checkpointed_iterations(rd)  # = 0-based index of the iteration under way
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(timeout=30)
        for name, a in agents_before.items():
            assert not gone(a["pid"]), f"agent {name} died with the coordinator"
        psutil.wait_procs(trainers, timeout=60)  # orphaned trainers notice and exit
    finally:
        up.out.close()
        up.err.close()
    metrics_before = read_jsonl(rd / "metrics.jsonl")
    assert [m["iteration"] for m in metrics_before] in ([*range(killed_at)], [*range(killed_at + 1)])

    err = open(tmp_path / "resume.stderr", "w")
    try:
        res = subprocess.run(
            up_command(
                "--resume",
                str(rd),
                "--local",
                "--agents",
                "1",
                "--timeout-s",
                "900",
                "--log-level",
                "INFO",
            ),
            cwd=REPO,
            env=up_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=1000,
        )
    finally:
        err.close()
        for a in agents_before.values():  # never leak the adopted agents on a failure
            try:
                psutil.Process(a["pid"]).kill()
            except psutil.NoSuchProcess:
                pass
    logs = (
        res.stdout[-3000:]
        + (tmp_path / "resume.stderr").read_text()[-5000:]
        + (rd.parent / f"{rd.name}.stderr").read_text()[-3000:]
    )
    assert res.returncode == 0, logs
    assert "resumed" in res.stdout and f"continuing with iteration {killed_at + 1}" in res.stdout, logs
    # the agents of the first coordinator were adopted: same processes, re-registered by themselves
    agents_after = json.loads((rd / "local_agents.json").read_text())["agents"]
    assert {k: v["pid"] for k, v in agents_after.items()} == {k: v["pid"] for k, v in agents_before.items()}
    agent_logs = "".join(
        f.read_text(errors="replace") for f in sorted((rd / "logs").glob("agent-*.log"))
    )  # agents log to <run-dir>/logs/
    assert agent_logs.count("re-registered with the coordinator") >= 2, logs + agent_logs[-3000:]

    metrics = read_jsonl(rd / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3]
    reqs = read_jsonl(rd / "requests.jsonl")
    ids = [r["request_id"] for r in reqs]
    assert len(ids) == len(set(ids))
    rollouts = [r for r in reqs if r["kind"] == "rollout"]
    assert len(rollouts) == 4 * 6 * 8
    for r in reqs:
        dones = [h for h in r["history"] if h[0] == "done"]
        assert r["status"] in ("done", "cancelled") and len(dones) == (r["status"] == "done"), r
    assert all(r["status"] == "done" for r in rollouts)
    assert collections.Counter(r["iteration"] for r in rollouts) == {0: 48, 1: 48, 2: 48, 3: 48}
    # iterations before the checkpoint came from it untouched: nothing before the killed one ran twice
    assert all(not any("restarted" in h[2] for h in r["history"]) for r in rollouts if r["iteration"] < killed_at)
    # the resumed trainer loaded the checkpointed optimizer state and went on
    assert (rd / "final").is_dir()
    trainer_logs = "".join(
        f.read_text(errors="replace") for f in sorted((rd / "logs").glob("trainer-*.log"))
    )  # trainers log to <run-dir>/logs/
    assert "loaded trainer checkpoint" in trainer_logs, trainer_logs[-3000:]
