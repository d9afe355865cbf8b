"""Elastic sequence parallelism on a live node: SP 2 → 1 → 2 with requests in flight.

`spotlight up --local --agents 1 --gpus-per-agent 2` with `cluster.sp_degree = 2`: the
node's two worker processes form one diffusers context-parallel group. A GPU is revoked
(the survivor re-forms at SP 1 from the weights in its memory) and granted again (a new
worker joins and receives the weights from its peer by broadcast). Nothing is lost:
every request ends Done exactly once and the iteration completes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from spotlight.config import EXAMPLES_DIR, dump_config, load_config
from tests.integration.accounting import assert_each_request_ended_once
from tests.integration.test_faults import _env, _freeze_mid_denoising_holding_training, _hold_training, _thaw
from tests.integration.waiting import wait_until

REPO = pathlib.Path(__file__).resolve().parents[2]


def _agent(state_dir: str, *args: str) -> dict:
    env = dict(os.environ, SPOTLIGHT_AGENT_STATE=state_dir)
    out = subprocess.run(
        [sys.executable, "-m", "agent.main", *args], env=env, capture_output=True, text=True, timeout=60
    )
    return json.loads(out.stdout) if out.stdout.strip().startswith("{") else {"ok": False, "stderr": out.stderr}


def _wait(pred, timeout_s: float, what: str, proc=None):
    """:func:`wait_until` on ``pred``, failing early if the run ``proc`` exits."""
    return wait_until(
        pred, what, timeout_s=timeout_s, interval_s=0.3, alive=None if proc is None else lambda: proc.poll() is None
    )


def test_sp_2_to_1_to_2_loses_nothing(tmp_path):
    cfg = load_config(
        EXAMPLES_DIR / "jpeg-toy" / "config.toml",
        overrides={
            "cluster.sp_degree": 2,
            "run.iterations": 5,
            "data.prompts_per_iteration": 6,
            "data.num_control_prompts": 2,
            "explore.num_candidates": 8,
            "run.sample_grid_every": 0,
            "cluster.worker_batch_size": 4,
        },
    )
    conf = tmp_path / "sp2.toml"
    dump_config(cfg, conf)
    rd = tmp_path / "run"
    events = tmp_path / "events.jsonl"
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spotlight.cli",
            "up",
            "--local",
            "--agents",
            "1",
            "--gpus-per-agent",
            "2",
            "--config",
            str(conf),
            "--run-dir",
            str(rd),
            "--timeout-s",
            "900",
            "--log-level",
            "INFO",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_env(SPOTLIGHT_WORKER_EVENTS=str(events)),
    )
    frozen, trainers = [], []
    try:
        listing = _wait(
            lambda: (rd / "local_agents.json").is_file() and json.loads((rd / "local_agents.json").read_text()),
            120,
            "local_agents.json",
            proc,
        )
        state = listing["state_dir"]
        status = lambda: _agent(state, "agent-status", "--node-id", "spot-0")  # noqa: E731
        # training is held (Train Worker frozen after publishing v0) until the SP=2 group
        # serves: on a loaded machine its workers took 2 minutes to start, most of the run
        trainers = _hold_training(rd, proc.pid, alive=lambda: proc.poll() is None)
        _wait(
            lambda: (s := status()).get("groups") and len(s["groups"][0]["members"]) == 2 and s["groups"][0]["serving"],
            600,
            "SP=2 group serving",
            proc,
        )
        _thaw(trainers)
        # the revocation lands while the group's processes are frozen (SIGSTOP) with its leader
        # inside a request's denoising loop, and the Train Worker stays frozen until SP=2 is
        # back, so the run cannot end first (it had nearly ended by then on a loaded machine)
        trainers, frozen, _ = wait_until(
            lambda: _freeze_mid_denoising_holding_training(
                proc.pid,
                listing["agents"]["spot-0"]["pid"],
                events,
                cfg.sampler.num_steps - 3,
                rd / "metrics.jsonl",
                cfg.run.iterations,
            ),
            "the SP=2 group's leader mid-denoising",
            timeout_s=600,
            interval_s=0.0,
            alive=lambda: proc.poll() is None,
        )
        assert _agent(state, "revoke", "--gpu", "1", "--node-id", "spot-0", "--grace-s", "20")["ok"]
        s = _wait(lambda: (s := status()).get("gpus") == [0] and s, 60, "revocation", proc)
        assert [len(g["members"]) for g in s["groups"]] == [1]
        _thaw(frozen)
        frozen = []
        assert _agent(state, "add-gpu", "--gpu", "1", "--node-id", "spot-0")["ok"]
        _wait(
            lambda: (
                (s := status()).get("groups")
                and len(s["groups"][0]["members"]) == 2
                and s["groups"][0]["generation"] >= 3
            ),
            600,
            "SP=2 again after the GPU came back",
            proc,
        )
        _thaw(trainers)
        trainers = []
        assert proc.wait(timeout=960) == 0
    finally:
        _thaw(frozen + trainers)
        if proc.poll() is None:
            proc.kill()
        log.close()
    # worker logs go to <run-dir>/logs/ (the console shows only progress and warnings)
    text = (tmp_path / "up.log").read_text() + "".join(
        f.read_text(errors="replace") for f in sorted((rd / "logs").glob("*.log"))
    )
    assert "weights from memory" in text  # the survivor re-formed without reloading
    assert "weights from broadcast" in text  # the new worker got its weights from the peer
    reqs = [json.loads(line) for line in (rd / "requests.jsonl").read_text().splitlines()]
    assert_each_request_ended_once(reqs)
    assert len((rd / "metrics.jsonl").read_text().splitlines()) == 5
