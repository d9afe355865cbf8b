"""Up-front checkpoint checks (before any process starts): a wrong family, an incomplete
folder, unknown LoRA targets each give one clear error (found by a new-user trial)."""

from __future__ import annotations

import shutil

import pytest

from spotlight.config import ConfigError, ModelConfig, config_from_dict
from spotlight.models.families import ModelLoadError, get_family
from spotlight.models.families import flux as flux_mod
from spotlight.models.families import sd3 as sd3_mod


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    return {"sd3": sd3_mod.make_random_checkpoint(root / "sd3"), "flux": flux_mod.make_random_checkpoint(root / "flux")}


def _fam(family, path):
    return get_family(ModelConfig(family=family, pretrained_path=str(path), image_size=32))


def test_a_complete_checkpoint_passes(ckpts):
    _fam("sd3", ckpts["sd3"]).check()
    _fam("flux", ckpts["flux"]).check()


def test_another_familys_checkpoint_is_named(ckpts):
    with pytest.raises(ModelLoadError, match="StableDiffusion3Pipeline checkpoint.*not flux"):
        _fam("flux", ckpts["sd3"]).check()
    with pytest.raises(ModelLoadError, match="FluxPipeline checkpoint.*not qwen-image"):
        _fam("qwen-image", ckpts["flux"]).check()


def test_empty_component_folder_and_missing_weights(ckpts, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpts["sd3"], bad)
    shutil.rmtree(bad / "vae")
    (bad / "vae").mkdir()
    with pytest.raises(ModelLoadError, match="vae.*no config file"):
        _fam("sd3", bad).check()
    shutil.copytree(ckpts["sd3"] / "vae", bad / "vae", dirs_exist_ok=True)
    for f in (bad / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no weight files"):
        _fam("sd3", bad).check()


def test_tiny_pretrained_folder_must_hold_a_qwen_transformer(ckpts):
    fam = get_family(ModelConfig(source="pretrained", pretrained_path=str(ckpts["sd3"] / "transformer")))
    with pytest.raises(ModelLoadError, match="SD3Transformer2DModel"):
        fam.check()


def test_unknown_lora_targets_are_named(ckpts):
    fam = _fam("flux", ckpts["flux"])
    fam.check_lora_targets(["to_q", "ff.net.2"])
    with pytest.raises(ModelLoadError, match=r"\['to_qq', 'foo'\]"):
        fam.check_lora_targets(["to_q", "to_qq", "foo"])
    get_family(ModelConfig()).check_lora_targets(["to_q", "img_mlp.net.2"])  # tiny, built from config


def test_config_mistakes_found_in_the_trial():
    with pytest.raises(ConfigError, match="model.source = 'pretrained'"):
        config_from_dict({"model": {"pretrained_path": "/some/folder"}})  # tiny would ignore it
    with pytest.raises(ConfigError, match="sde_window_range"):
        config_from_dict({"sampler": {"num_steps": 10, "sde_window_size": 2, "sde_window_range": [3, 1]}})
