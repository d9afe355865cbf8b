"""The Planner's cached arms for a real family: `spotlight profile` measures Qwen-Image (a saved
tiny checkpoint of its real classes, LoRA) into a run directory, `spotlight up` in that
directory plans exploration from it (metrics.jsonl's ``planner`` field and
``explore/cache_threshold``: a First-Block-Cache arm), and `spotlight bench stale-ranking` runs
on the finished run's versions. Before, both commands refused every family but the tiny one, so
a real model's Planner only ever varied the number of candidates and ran every step.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import tomli_w

from tests.integration.runs import read_jsonl, up_env
from tests.integration.test_families_up import _checkpoint, _config

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "spotlight.cli", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=up_env())
    assert proc.returncode == 0, f"{' '.join(args[:2])} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_a_profiled_family_explores_with_cached_arms_and_its_seed_ranking_is_measured(tmp_path):
    ckpt = _checkpoint("qwen-image", tmp_path)
    conf = _config("qwen-image", "lora", ckpt)
    conf["eval"]["every"] = 0
    conf["explore"] = {"planner": "bandit"}
    # random weights rank seeds at random: let the Planner use the cached arm whatever its accuracy
    conf["planner"] = {"min_exploration_accuracy": -1.0, "max_sequences": 6, "sequence_step": 2}
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(conf))
    rd = tmp_path / "run"
    _cli(
        "profile",
        "--config",
        str(path),
        "--run-dir",
        str(rd),
        "--thresholds",
        "100",
        "--num-prompts",
        "2",
        "--num-seeds",
        "3",
        "--sp-degrees",
        "1",
    )
    profile = json.loads((rd / "profile.json").read_text())
    assert profile["family"] == "qwen-image"
    assert {r["cache_threshold"] for r in profile["steps"]} == {0.0, 100.0}
    # The cached row's cost is a wall-clock measurement: on a loaded machine it came out at the
    # full rollout's, so the Planner's first pick (every arm unseen: the cheapest) went uncached
    # and no cached candidate followed. Pin it to its effective steps (what an idle machine
    # measures) so the pick does not depend on load.
    for row in profile["steps"]:
        if row["cache_threshold"] > 0:
            row["cost_steps"] = row["effective_steps"]
    (rd / "profile.json").write_text(json.dumps(profile))
    up = _cli("up", "--local", "--agents", "1", "--iterations", "2", "--config", str(path), "--run-dir", str(rd))
    assert f"planner profile {rd / 'profile.json'} (from the run directory" in up.stdout
    rows = read_jsonl(rd / "metrics.jsonl")
    planned = [r for r in rows if "planner" in r]
    assert planned, rows
    cached = [r for r in planned if r.get("explore/cache_threshold", 0.0) > 0]
    assert cached, [(r["planner"]["action"], r.get("explore/cache_threshold")) for r in planned]
    action = cached[0]["planner"]["action"]
    assert action is None or action["cache_threshold"] == 100.0  # chosen, or streamed as the cheapest arm

    _cli("bench", "stale-ranking", "--run-dir", str(rd), "--num-prompts", "2", "--num-seeds", "3")
    result = json.loads((rd / "bench" / "stale_ranking.json").read_text())
    assert result["pairs"] and result["num_seeds"] == 3
