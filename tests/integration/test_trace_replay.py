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
    # per-iteration spot event counts (issue 11): the slice's notices, revocations and arrivals show up
    total = {k: sum(r[f"spot/{k}"] for r in rows) for k in ("notices", "revocations", "additions", "work_lost_steps")}
    assert (
        total["notices"] >= 1
        and total["revocations"] >= 1
        and total["additions"] >= 2
        and total["work_lost_steps"] >= 0
    ), total


def _up_with_trace(tmp_path, trace, *extra):
    rd = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "up",
        "--local",
        "--config",
        str(EXAMPLES_DIR / "jpeg-toy" / "config.toml"),
        "--run-dir",
        str(rd),
        "--trace",
        str(trace),
        "--timeout-s",
        "60",
        *extra,
    ]
    return rd, subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "COLUMNS": "400"}
    )


def test_bad_trace_refused_before_anything_starts(tmp_path):
    # issue 11: an unreadable trace was checked after the coordinator started (half-made run
    # directory), its path printed twice, and a one-line Python list dumped whole
    bad = tmp_path / "trace.txt"
    bad.write_text(repr(list(range(4000))) + "\n")
    rd, proc = _up_with_trace(tmp_path, bad)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert not rd.exists(), sorted(p.name for p in rd.iterdir())
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unknown trace format" in errors[0], out[-2000:]
    assert errors[0].count(str(bad)) == 1 and len(errors[0]) < 600
    assert "Traceback" not in out and "coordinator listening" not in out


def test_malformed_trace_line_refused_before_anything_starts(tmp_path):
    bad = tmp_path / "gcp.txt"
    bad.write_text("2021-12-11, 11:11:30, 4\n2021-12-11, 11:13:10, four\n")
    rd, proc = _up_with_trace(tmp_path, bad)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and not rd.exists(), out[-2000:]
    assert "gcp.txt:2:" in out and out.count(str(bad)) == 1, out[-2000:]


def _up(tmp_path, *extra):
    rd = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "up",
        "--local",
        "--config",
        str(EXAMPLES_DIR / "jpeg-toy" / "config.toml"),
        "--run-dir",
        str(rd),
        "--timeout-s",
        "60",
        *extra,
    ]
    return rd, subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "COLUMNS": "400"}
    )


def test_replay_options_refused_with_one_line_before_anything_starts(tmp_path):
    """Issue 12: `--trace-mode full` says how many agents the trace's peak needs; synthetic
    preemption cycles that overlap are refused by name; nothing is started or written."""
    p3 = REPO / "examples" / "traces" / "bamboo" / "p3-trace.csv"
    for extra, want in (
        (
            ("--trace", str(p3), "--trace-mode", "full", "--agents", "2"),
            "at least 32 agents of 1 GPU (or slice the trace)",
        ),
        (
            ("--preemption-cycles", "8", "--cycle-down-s", "5"),
            "--preemption-cycles 8: 8 cycles of 5.0s per 30.0s iteration overlap",
        ),
    ):
        rd, proc = _up(tmp_path, *extra)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and not rd.exists(), out[-2000:]
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and want in errors[0], out[-2000:]
        assert "Traceback" not in out and "coordinator listening" not in out
