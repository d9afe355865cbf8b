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
    for name in ("sd3", "flux", "qwen-image"):  # every family's default targets are layers LoRA wraps
        if name in ckpts:
            fam = _fam(name, ckpts[name])
            fam.check_lora_targets(list(fam.default_lora_targets))


@pytest.mark.parametrize("target", ["norm_out", "transformer_blocks", "transformer_blocks.0.img_mod", "attn"])
def test_a_lora_target_that_is_no_layer_lora_wraps_is_refused_before_the_run(target):
    """Was: a name that matched a norm, a block or a module list passed the check, and peft refused
    it in the Train Worker after the run had started ("Target module … is not supported")."""
    fam = get_family(ModelConfig())
    with pytest.raises(ModelLoadError, match=r"which LoRA cannot wrap: name Linear layers"):
        fam.check_lora_targets(["to_q", target])
    with pytest.raises(ModelLoadError, match=r"\[''\] match no module"):  # not the model itself
        fam.check_lora_targets([""])
    fam.check_lora_targets(list(fam.default_lora_targets))


def test_what_the_lora_check_accepts_peft_wraps_and_what_it_refuses_peft_refuses():
    """The check and peft agree, on the tiny model built from config."""
    from peft import LoraConfig, inject_adapter_in_model

    fam = get_family(ModelConfig())
    for targets, ok in (
        (["to_q", "img_mlp.net.2"], True),
        (["norm_out"], False),
        (["transformer_blocks.0.img_mod"], False),
    ):
        try:
            fam.check_lora_targets(targets)
            checked = True
        except ModelLoadError:
            checked = False
        try:
            inject_adapter_in_model(LoraConfig(r=2, target_modules=targets), fam.build_transformer())
            injected = True
        except ValueError:
            injected = False
        assert checked == injected == ok, (targets, checked, injected)


def test_config_mistakes_found_in_the_trial():
    with pytest.raises(ConfigError, match="model.source = 'pretrained'"):
        config_from_dict({"model": {"pretrained_path": "/some/folder"}})  # tiny would ignore it
    with pytest.raises(ConfigError, match="sde_window_range"):
        config_from_dict({"sampler": {"num_steps": 10, "sde_window_size": 2, "sde_window_range": [3, 1]}})
