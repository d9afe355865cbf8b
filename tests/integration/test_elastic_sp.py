"""Elastic sequence parallelism on a live node: SP 2 → 1 → 2 with requests in flight.

`spotlight up --local --agents 1 --gpus-per-agent 2` with `cluster.sp_degree = 2`: the
node's two worker processes form one diffusers context-parallel group. A GPU is revoked
(the survivor re-forms at SP 1 from the weights in its memory) and granted again (a new
worker joins and receives the weights from its peer by broadcast). Nothing is lost:
every request ends Done exactly once and the iteration completes.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

from spotlight.config import dump_config
from tests.factories import example_config
from tests.integration.accounting import assert_each_request_ended_once
from tests.integration.runs import (
    agent_ctl,
    freeze_mid_denoising_holding_training,
    hold_training,
    read_jsonl,
    thaw,
    up_command,
    up_env,
    wait_on,
)
from tests.integration.waiting import wait_until

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_sp_2_to_1_to_2_loses_nothing(tmp_path):
    cfg = example_config(
        "jpeg-toy",
        {
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
        up_command(
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
        ),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=up_env(SPOTLIGHT_WORKER_EVENTS=str(events)),
    )
    frozen, trainers = [], []
    try:
        listing = wait_on(
            lambda: (rd / "local_agents.json").is_file() and json.loads((rd / "local_agents.json").read_text()),
            120,
            "local_agents.json",
            proc,
        )
        state = listing["state_dir"]
        status = lambda: agent_ctl(state, "agent-status", "--node-id", "spot-0")  # noqa: E731
        # training is held (Train Worker frozen after publishing v0) until the SP=2 group
        # serves: on a loaded machine its workers took 2 minutes to start, most of the run
        trainers = hold_training(rd, proc.pid, alive=lambda: proc.poll() is None)
        wait_on(
            lambda: (s := status()).get("groups") and len(s["groups"][0]["members"]) == 2 and s["groups"][0]["serving"],
            600,
            "SP=2 group serving",
            proc,
        )
        thaw(trainers)
        # the revocation lands while the group's processes are frozen (SIGSTOP) with its leader
        # inside a request's denoising loop, and the Train Worker stays frozen until SP=2 is
        # back, so the run cannot end first (it had nearly ended by then on a loaded machine)
        trainers, frozen, _ = wait_until(
            lambda: freeze_mid_denoising_holding_training(
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
        assert agent_ctl(state, "revoke", "--gpu", "1", "--node-id", "spot-0", "--grace-s", "20")["ok"]
        s = wait_on(lambda: (s := status()).get("gpus") == [0] and s, 60, "revocation", proc)
        assert [len(g["members"]) for g in s["groups"]] == [1]
        thaw(frozen)
        frozen = []
        assert agent_ctl(state, "add-gpu", "--gpu", "1", "--node-id", "spot-0")["ok"]
        wait_on(
            lambda: (
                (s := status()).get("groups")
                and len(s["groups"][0]["members"]) == 2
                and s["groups"][0]["generation"] >= 3
            ),
            600,
            "SP=2 again after the GPU came back",
            proc,
        )
        thaw(trainers)
        trainers = []
        assert proc.wait(timeout=960) == 0
    finally:
        thaw(frozen + trainers)
        if proc.poll() is None:
            proc.kill()
        log.close()
    # worker logs go to <run-dir>/logs/ (the console shows only progress and warnings)
    text = (tmp_path / "up.log").read_text() + "".join(
        f.read_text(errors="replace") for f in sorted((rd / "logs").glob("*.log"))
    )
    assert "weights from memory" in text  # the survivor re-formed without reloading
    assert "weights from broadcast" in text  # the new worker got its weights from the peer
    reqs = read_jsonl(rd / "requests.jsonl")
    assert_each_request_ended_once(reqs)
    assert len((rd / "metrics.jsonl").read_text().splitlines()) == 5
