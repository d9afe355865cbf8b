"""End to end: `spotlight up --local --mode NAME` for the paper baselines whose behaviour only a
real run shows, each a configuration of the same code, at toy scale.

* ``reserved-only``: the one local layout without spot agents (reserved GPUs do everything);
* ``verl-omni-spot``: best-of-N on the critical path, the selected candidates trained on as
  the rollout (exploration results carrying log-probs through the coordinator and trainer);
* ``rlboost``: restart reconfiguration of a node whose GPU is revoked mid-request.

What the other modes change is proven without a run: the mode table against the config
(tests/unit/core/test_modes.py) and the simulator's policies (tests/unit/sim/); Spotlight's own
mode is the default every other end-to-end run uses (tests/integration/test_up_local.py),
and ``rlboost+explore`` combines stale exploration (those runs) with the restart below.

Real processes (coordinator, train worker, reserved + spot agents, rollout workers) over
real ZeroMQ sockets; the request log (``requests.jsonl``) says what each mode generated.
"""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess

import pytest

from tests.factories import write_config
from tests.integration.runs import read_jsonl, up_command

REPO = pathlib.Path(__file__).resolve().parents[2]

P_, K, N = 4, 4, 8  # prompts per batch, group size, candidates per explored prompt
OVERRIDES = {
    "data.prompts_per_iteration": P_,
    "data.num_control_prompts": 2,
    "data.group_size": K,
    "explore.planner": "fixed",
    "explore.num_candidates": N,
    "explore.stream_extra": False,
    "sampler.num_steps": 6,
    "sampler.sde_window_size": 4,
    "run.trackers": [],
    "run.sample_grid_every": 0,
}


def _run(tmp: pathlib.Path, mode: str) -> pathlib.Path:
    rd = tmp / mode.replace("+", "_")
    conf = write_config(tmp / f"{mode}.toml", None, OVERRIDES)
    cmd = up_command(
        "--local",
        "--agents",
        "1",
        "--iterations",
        "2",
        "--mode",
        mode,
        "--config",
        str(conf),
        "--run-dir",
        str(rd),
        "--timeout-s",
        "900",
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, (
        f"spotlight up --mode {mode} failed:\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-3000:]}"
    )
    return rd


def _requests(rd: pathlib.Path) -> list[dict]:
    return read_jsonl(rd / "requests.jsonl")


@pytest.mark.parametrize("mode", ["reserved-only", "verl-omni-spot"])
def test_mode_runs_end_to_end(tmp_path, mode):
    rd = _run(tmp_path, mode)
    rows = read_jsonl(rd / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1]
    from spotlight.config import load_config

    cfg = load_config(rd / "config.toml")
    assert cfg.run.mode == mode
    reqs = _requests(rd)
    assert all(r["status"] == "done" for r in reqs if r["kind"] == "rollout")
    kinds = collections.Counter((r["iteration"], r["kind"]) for r in reqs)
    agents = json.loads((rd / "local_agents.json").read_text())["agents"]
    if mode == "verl-omni-spot":
        # best-of-N on the critical path: exactly N generations per explored prompt (every
        # prompt is explored), and the selected ones are the rollout: nothing generated again
        per_prompt = collections.Counter((r["iteration"], r["prompt_index"]) for r in reqs if r["kind"] == "explore")
        assert set(per_prompt.values()) == {N} and len(per_prompt) == 2 * P_
        assert all(r["attempts"] == 1 for r in reqs if r["kind"] == "explore")  # each generated once
        assert kinds[(0, "rollout")] == kinds[(1, "rollout")] == 0
        assert all(r["rollout/num_samples"] == P_ * K for r in rows)  # trained on K selected per prompt
    else:
        assert kinds[(0, "rollout")] == kinds[(1, "rollout")] == P_ * K
    if mode in ("rlboost", "reserved-only"):
        assert not any(r["kind"] == "explore" for r in reqs)
    if mode == "reserved-only":
        assert all(not a["spot"] for a in agents.values())
    else:
        assert any(a["spot"] for a in agents.values())


def test_rlboost_restarts_the_node_on_a_revocation_without_live_migration(tmp_path):
    """Restart reconfiguration end to end: a GPU revoked while requests are in flight stops
    every worker of the node (none commits: live migration off) and fresh ones start on the
    GPU left; nothing is lost, every request ends once, the run completes."""
    from spotlight.config import dump_config, load_config
    from tests.integration.accounting import assert_each_request_ended_once
    from tests.integration.runs import (
        agent_ctl,
        freeze_mid_denoising_holding_training,
        hold_training,
        thaw,
        up_env,
        wait_on,
    )
    from tests.integration.waiting import wait_until

    cfg = load_config(
        overrides={**OVERRIDES, "run.iterations": 3, "cluster.live_migration": False, "cluster.worker_batch_size": 2}
    )
    conf = tmp_path / "rlboost.toml"
    dump_config(cfg, conf)
    rd = tmp_path / "run"
    events = tmp_path / "events.jsonl"
    log = open(tmp_path / "up.log", "w")
    cmd = up_command(
        "--local",
        "--agents",
        "1",
        "--gpus-per-agent",
        "2",
        "--mode",
        "rlboost",
        "--config",
        str(conf),
        "--run-dir",
        str(rd),
        "--timeout-s",
        "900",
    )
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=up_env(SPOTLIGHT_WORKER_EVENTS=str(events))
    )
    frozen, trainers = [], []
    try:
        listing = wait_on(
            lambda: (rd / "local_agents.json").is_file() and json.loads((rd / "local_agents.json").read_text()),
            120,
            "local_agents.json",
            proc,
        )
        status = lambda: agent_ctl(listing["state_dir"], "agent-status", "--node-id", "spot-0")  # noqa: E731
        # training is held (Train Worker frozen after publishing v0) until both spot workers
        # serve: on a loaded machine they can take longer to start than the whole run
        trainers = hold_training(rd, proc.pid, alive=lambda: proc.poll() is None)
        wait_on(
            lambda: list(status().get("workers", {}).values()) == ["ready", "ready"],
            600,
            "both spot workers ready",
            proc,
        )
        thaw(trainers)
        # the revocation lands while the node's workers are frozen (SIGSTOP) with one inside a
        # request's denoising loop, and the Train Worker stays frozen until the restart is
        # seen, so the run cannot end first
        trainers, frozen, _ = wait_until(
            lambda: freeze_mid_denoising_holding_training(
                proc.pid,
                listing["agents"]["spot-0"]["pid"],
                events,
                cfg.sampler.num_steps - 3,
                rd / "metrics.jsonl",
                cfg.run.iterations,
            ),
            "a spot worker mid-denoising",
            timeout_s=600,
            interval_s=0.0,
            alive=lambda: proc.poll() is None,
        )
        first = status()
        assert first["in_flight"] and len(first["worker_pids"]) == 2, first
        assert (
            first["reconfiguration"] == "restart" and first["live_migration"] is False and first["warm_spare"] is False
        )
        assert agent_ctl(listing["state_dir"], "revoke", "--gpu", "1", "--node-id", "spot-0", "--grace-s", "5")["ok"]
        thaw(frozen)
        frozen = []
        # every old worker stops (not only GPU 1's); a fresh one is started on GPU 0
        s = wait_on(
            lambda: (s := status()).get("restarts") == 1 and "spot-0/gpu0.r1" in s.get("workers", {}) and s,
            120,
            "a fresh worker after the restart",
            proc,
        )
        assert s["gpus"] == [0] and s["workers"]["spot-0/gpu0"] == "exited" and s["workers"]["spot-0/gpu1"] == "exited"
        thaw(trainers)
        trainers = []
        assert proc.wait(timeout=960) == 0
    finally:
        thaw(frozen + trainers)
        if proc.poll() is None:
            proc.kill()
        log.close()
    reqs = _requests(rd)
    assert_each_request_ended_once(reqs)
    # what `--mode rlboost` means for the whole run (the mode runs' checks, for this mode)
    assert load_config(rd / "config.toml").run.mode == "rlboost"
    assert any(a["spot"] for a in listing["agents"].values())
    assert collections.Counter(r["iteration"] for r in reqs if r["kind"] == "rollout") == {
        n: P_ * K for n in range(cfg.run.iterations)
    }
    assert not any(r["kind"] == "explore" for r in reqs)
    assert not any(h[0] == "recompute" for r in reqs for h in r["history"])  # nothing committed: no live migration
    # what the frozen worker was denoising at the revocation was given back and re-run from scratch
    assert any(h[0] == "aborted" for r in reqs for h in r["history"]), "no request was in flight on the revoked node"
    assert len((rd / "metrics.jsonl").read_text().splitlines()) == 3
