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


def _prompt_file(tmp_path):
    """The prompts as JSON lines in the toy config's category column (``tag``), so its filter keeps them."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": p, "tag": ("single_object", "counting")[i % 2]}) + "\n" for i, p in enumerate(PROMPTS)
        )
    )
    return prompts


def test_always_failing_rollout_request_stops_the_run_with_one_message(tmp_path):
    prompts = _prompt_file(tmp_path)
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


def test_always_failing_exploration_request_is_dropped_and_the_run_finishes(tmp_path):
    """The sd3 + First Block Cache case in kind (every exploration batch of one prompt raises;
    it looped, 37,975 give-backs in 90 s): the candidates are parked, counted in metrics.jsonl
    (``requests/parked``) and the run finishes."""
    from spotlight.config import load_config
    from spotlight.coordinator.coordinator import build_core
    from spotlight.core.request_scheduler import RequestScheduler
    from spotlight.core.seed_bank import SeedBank

    prompts = _prompt_file(tmp_path)
    overrides = {
        "data.prompts_path": str(prompts),
        "data.prompts_per_iteration": 4,
        "data.num_control_prompts": 2,
        "data.group_size": 2,
        "explore.num_candidates": 4,
        "cluster.max_request_failures": 1,  # one failed lease parks (batches of one: no batch-mates)
        "cluster.worker_batch_size": 1,
    }
    cfg = toy_config(tmp_path / "config.toml", **overrides)
    # the first prompt of batch 2, an explored slot (the control prompts are the last slots)
    loaded = load_config(cfg)
    core = build_core(loaded, RequestScheduler(), SeedBank(0, 2), None, num_prompts=len(PROMPTS))
    explored = core.batch_prompts(1)[0]
    rd = tmp_path / "run"
    env = up_env(SPOTLIGHT_TEST_FAIL_PROMPTS=f"explore:{explored}")
    up = Up(rd, ["--local", "--agents", "1", "--config", str(cfg)], env=env)
    try:
        rc = up.finish()
    finally:
        up.close()
    out = (tmp_path / "run.stdout").read_text() + (tmp_path / "run.stderr").read_text()
    assert rc == 0, out
    rows = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    status = json.loads((rd / "status.json").read_text())
    parked = status["requests"]["explore"].get("parked", 0)
    assert parked > 0 and sum(r["requests/parked"] for r in rows) == parked, (rows, status["requests"])
    assert status["requests"]["rollout"]["done"] == 2 * 4 * 2  # every rollout sample was made
