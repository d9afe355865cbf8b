"""The collapse guard's ``rollback`` action end to end (docs/collapse-guard.md): a JPEG-toy run
whose guard is set to fire after iteration 2 replaces iteration 3's update by a rollback to the
best held-out version with half the learning rate; the version it publishes is that version's
weights, bit for bit."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.runs import RUN_TIMEOUT_S, read_jsonl, toy_config, up_command, up_env

pytestmark = pytest.mark.e2e


def test_rollback_publishes_the_best_version_with_a_lower_learning_rate(tmp_path):
    import subprocess

    from tests.integration.runs import REPO

    conf = toy_config(
        tmp_path / "c.toml",
        **{
            "run.iterations": 3,
            "run.keep_weight_versions": 0,  # every version stays, to compare
            "data.prompts_per_iteration": 4,
            "eval.every": 1,
            "eval.prompts_path": "examples/default/prompts/evaluation_metadata.jsonl",
            "eval.num_prompts": 2,
            "eval.num_seeds": 1,
            "guard.action": "rollback",
            "guard.patience": 1,
            "guard.saturation_ratio": 1.000001,  # any change of the samples' saturation: fires after iteration 2
        },
    )
    rd = tmp_path / "run"
    cmd = up_command("--local", "--agents", "1", "--config", str(conf), "--run-dir", str(rd))
    proc = subprocess.run(
        cmd + ["--timeout-s", str(RUN_TIMEOUT_S)], cwd=REPO, env=up_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_jsonl(rd / "metrics.jsonl")
    assert "train/rolled_back_to" not in rows[0] | rows[1]
    target = int(rows[2]["train/rolled_back_to"])
    assert target in (0, 1)  # the best held-out version that had finished its evaluation (v0 before any)
    assert rows[2]["train/learning_rate"] == pytest.approx(0.5 * rows[1]["train/learning_rate"])
    assert rows[1]["train/learning_rate"] == pytest.approx(1e-3)  # examples/jpeg-toy's rate until then
    weights = pathlib.Path(rd) / "tensor_store" / "weights"
    best, published = load_file(weights / f"v{target}.safetensors"), load_file(weights / "v3.safetensors")
    assert set(best) == set(published) and all(torch.equal(best[k], published[k]) for k in best)
    events = json.loads((rd / "status.json").read_text())["events"]
    assert any(e["kind"] == "guard" and f"rollback to v{target}" in e["detail"] for e in events)
    assert f"rolls back to v{target}" in proc.stdout.replace("\n", " ")
