"""A 30-minute slice of the Bamboo p3 spot trace replayed in local mode (time scale 30:
one minute of wall time). Arrivals start agents or workers, removals arrive as per-GPU
revocations or as real AWS preemption notices through each node's mock metadata server;
training goes on and loses nothing."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys

from spotlight.config import EXAMPLES_DIR, dump_config, load_config
from tests.integration.accounting import assert_each_request_ended_once

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_p3_slice_replays_without_losing_requests(tmp_path):
    cfg = load_config(
        EXAMPLES_DIR / "jpeg-toy" / "config.toml",
        overrides={
            "run.iterations": 14,
            "data.prompts_per_iteration": 6,
            "data.num_control_prompts": 2,
            "explore.num_candidates": 8,
            "run.sample_grid_every": 0,
            "cluster.heartbeat_timeout_s": 6.0,
        },
    )
    conf = tmp_path / "c.toml"
    dump_config(cfg, conf)
    rd = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "up",
        "--local",
        "--agents",
        "2",
        "--gpus-per-agent",
        "2",
        "--config",
        str(conf),
        "--run-dir",
        str(rd),
        "--trace",
        str(REPO / "examples" / "traces" / "bamboo" / "p3-trace.csv"),
        "--time-scale",
        "30",
        "--grace-s",
        "8",
        "--timeout-s",
        "1000",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listing = json.loads((rd / "local_agents.json").read_text())
    applied = collections.Counter(a["kind"] for a in listing["trace_actions"])
    # the default slice [3000 s, +1800 s) on 2 x 2 GPUs has all four kinds of events
    assert (
        applied["start_node"] >= 2
        and applied["add_gpu"] >= 1
        and applied["revoke_gpu"] >= 1
        and applied["preempt_node"] >= 1
    ), applied
    agent_logs = "".join(
        p.read_text() for p in (rd / "logs").glob("agent-*.log")
    )  # agents log to files, not the console
    assert "preemption notice" in agent_logs and "aws terminate" in agent_logs  # a real (mock) IMDS notice was detected
    reqs = [json.loads(line) for line in (rd / "requests.jsonl").read_text().splitlines()]
    assert_each_request_ended_once(reqs)
    rows = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 14
    # per-iteration spot event counts: the slice's notices, revocations and arrivals show up
    total = {k: sum(r[f"spot/{k}"] for r in rows) for k in ("notices", "revocations", "additions", "work_lost_steps")}
    assert (
        total["notices"] >= 1
        and total["revocations"] >= 1
        and total["additions"] >= 2
        and total["work_lost_steps"] >= 0
    ), total
