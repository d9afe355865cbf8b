"""``spotlight plan`` and the memory refusal of ``spotlight up`` (cluster.gpu_memory_gib), in-process."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from spotlight.cli import app


def _toml(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_plan_prints_the_table_and_fits(tmp_path):
    res = CliRunner().invoke(app, ["plan", "--device", "cpu", "--gpu-memory-gib", "4"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for item in ("trainer GPU", "Adam state", "activations", "rollout GPU", "disk", "fits: every GPU within 4.0 GiB"):
        assert item in res.output, res.output


def test_plan_of_a_preset_that_does_not_fit(tmp_path):
    conf = _toml(tmp_path, "[train]\nlora_rank = 0\nnum_train_workers = 4\n[cluster]\ngpu_memory_gib = 80\n")
    res = CliRunner().invoke(app, ["plan", conf, "--preset", "qwen-image-20b", "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.output[: res.output.rindex("}") + 1])
    # full fine-tuning of 20.4 B parameters on 4 GPUs: 16 bytes per parameter / 4 for weights, grads, Adam
    trainer = doc["trainer_gpu"]
    assert abs(trainer["parameters"] + trainer["gradients"] + trainer["Adam state"] - 16 * doc["params"] / 4) < 16
    assert doc["problems"] and "a trainer GPU needs" in doc["problems"][0]


def test_up_refuses_a_config_that_cannot_fit_before_anything_starts(tmp_path):
    conf = _toml(tmp_path, "[cluster]\ngpu_memory_gib = 0.01\n")
    rd = tmp_path / "run"
    res = CliRunner().invoke(app, ["up", "--local", "--config", conf, "--run-dir", str(rd)], env={"COLUMNS": "400"})
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    assert "does not fit its GPUs: a trainer GPU needs" in errors[0]
    assert "cluster.gpu_memory_gib = 0.01" in errors[0] and "Adam state" in errors[0]
    assert not rd.exists()
