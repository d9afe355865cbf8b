"""End to end: a rollout request that makes every worker fail stops `spotlight up` with one
line, instead of being re-run forever (docs/architecture.md §4).

The failure is planted with the rollout worker's test hook (``$SPOTLIGHT_TEST_FAIL_PROMPTS``):
every batch holding a rollout request of prompt 2 raises. The prompt's requests are parked
(failures on ``cluster.max_request_failures`` = 3 workers or, with the run's two workers,
2 x 3 failures; each is run alone after its first, so the other prompts' requests complete),
the iteration's other rollout requests end, and the run stops: exit status 1, one ``error:``
line naming the request, its prompt, the worker and the error.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.runs import Up, toy_config, up_env

pytestmark = pytest.mark.e2e

PROMPTS = ["a red apple", "a blue car", "a green bench", "a yellow kite"]


def test_always_failing_rollout_request_stops_the_run_with_one_message(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = toy_config(
        tmp_path / "config.toml",
        **{
            "data.prompts_path": str(prompts),
            "data.prompts_per_iteration": 4,
            "data.num_control_prompts": 2,
            "data.group_size": 2,
            "explore.num_candidates": 4,
            "cluster.max_request_failures": 3,
        },
    )
    rd = tmp_path / "run"
    up = Up(rd, ["--local", "--agents", "1", "--config", str(cfg)], env=up_env(SPOTLIGHT_TEST_FAIL_PROMPTS="rollout:2"))
    try:
        rc = up.finish()
    finally:
        up.close()
    out = (tmp_path / "run.stdout").read_text() + (tmp_path / "run.stderr").read_text()
    assert rc == 1, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    (line,) = errors
    assert "rollout request r0-" in line and "prompt 2 'a green bench'" in line, line
    assert re.search(r"failed \d+ times on [12] workers \(cluster.max_request_failures\)", line), line
    assert "RuntimeError: planted failure for prompt 2" in line, line
    assert "Traceback" not in out
    status = json.loads((rd / "status.json").read_text())
    parked = [e for e in status["events"] if e["kind"] == "parked"]
    assert len(parked) == 2 and all("planted failure" in e["detail"] for e in parked)  # group_size 2
    assert status["requests"]["rollout"]["parked"] == 2
    assert status["requests"]["rollout"]["done"] == 6  # the other three prompts x group_size 2: none lost
    assert "last on " in line and "/gpu" in line, line
    assert not (rd / "metrics.jsonl").is_file() or not (rd / "metrics.jsonl").read_text().strip()
