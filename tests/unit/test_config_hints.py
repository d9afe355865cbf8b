"""A config with a mistake is refused with a line that says how to fix it: an unknown key
names the key it was probably meant to be, and a GPU listed twice is refused at load time
(the coordinator refused the agent's registration before, at run time)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.config import ConfigError, load_config


def _error(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_a_key_in_the_wrong_section_points_to_its_section(tmp_path):
    msg = _error(tmp_path, "[model]\nlora_rank = 8\n")
    assert msg.endswith("model.lora_rank: unknown key; lora_rank belongs in [train]: did you mean train.lora_rank?")


def test_a_misspelt_key_gets_the_closest_one(tmp_path):
    assert _error(tmp_path, "[train]\nlearning_rat = 1e-4\n").endswith(
        "train.learning_rat: unknown key; did you mean train.learning_rate?"
    )
    # misspelt and in the wrong section
    assert _error(tmp_path, "[model]\nsde_window_siz = 2\n").endswith("did you mean sampler.sde_window_size?")


def test_an_unknown_section_gets_the_closest_one(tmp_path):
    assert _error(tmp_path, "[trian]\nlora_rank = 8\n").endswith("[trian]: unknown section; did you mean [train]?")
    msg = _error(tmp_path, "lora_rank = 8\n")
    assert msg.endswith("lora_rank: unknown top-level key; lora_rank belongs in [train]"), msg


def test_a_key_nothing_resembles_says_where_the_keys_are(tmp_path):
    msg = _error(tmp_path, "[train]\nzzqqx = 1\n")
    assert msg.endswith("train.zzqqx: unknown key (`spotlight init` prints every key with its documentation)"), msg


def test_a_reserved_gpu_listed_twice_is_refused(tmp_path):
    msg = _error(tmp_path, "[cluster]\nreserved_rollout_gpus = [0, 0]\n")
    assert msg.endswith("cluster.reserved_rollout_gpus: GPU 0 listed twice: [0, 0]"), msg
    msg = _error(tmp_path, "[cluster]\nreserved_rollout_gpus = [1, -1]\n")
    assert msg.endswith("cluster.reserved_rollout_gpus: GPU indices must be >= 0: [1, -1]"), msg
    assert load_config(overrides={"cluster.reserved_rollout_gpus": []}).cluster.reserved_rollout_gpus == []


def test_up_refuses_such_a_config_in_one_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nlora_rank = 8\n")
    res = CliRunner().invoke(app, ["up", "--local", "--config", str(path), "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert out.startswith("error: ") and out.endswith("did you mean train.lora_rank?"), res.output
    assert not (tmp_path / "run").exists()
