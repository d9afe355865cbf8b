"""What a Train Worker publishes and saves for the SD3.5 and FLUX families, full fine-tuning and
LoRA, from a saved random-weight checkpoint of the family's real classes (the path a user's
``model.pretrained_path`` takes). The end-to-end family runs (tests/integration/
test_families_up.py) train these families with LoRA; full fine-tuning runs end to end for
Qwen-Image and the tiny default, and here, in the trainer, for these two."""

from __future__ import annotations

import importlib

import pytest
import torch

from spotlight.config import ModelConfig, SpotlightConfig, TrainConfig
from spotlight.store.tensor_wire import save_version
from spotlight.util.weights_file import check_weights_dir
from spotlight.workers.train.train_worker import FlowGRPOTrainer

pytestmark = [pytest.mark.procs, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]  # a gloo process group


def _trainer(model: ModelConfig, **train) -> FlowGRPOTrainer:
    cfg = SpotlightConfig(model=model, train=TrainConfig(steps_per_iteration=2, learning_rate=1e-3, **train))
    return FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"))


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_lora_versions_are_the_adapter_and_smaller_than_full_ones_and_full_saves_load(pg, tmp_path, family):
    import diffusers

    from spotlight.models.families import get_family

    mod = importlib.import_module(f"spotlight.models.families.{family}")
    ckpt = mod.make_random_checkpoint(tmp_path / "ckpt", seed=1)
    model = ModelConfig(family=family, pretrained_path=str(ckpt), image_size=32, max_text_tokens=8)
    full_trainer = _trainer(model)
    full = full_trainer.version_state_dict()
    lora_trainer = _trainer(model, lora_rank=4, kl_beta=0.01)
    lora = lora_trainer.version_state_dict()
    # a published LoRA version is the adapter alone; a full one is the transformer without adapter
    assert lora and all("lora_" in k for k in lora)
    assert full and not any("lora_" in k for k in full)
    lora_bytes, _ = save_version(lora, tmp_path / "lora.safetensors")
    full_bytes, _ = save_version(full, tmp_path / "full.safetensors")
    assert 0 < lora_bytes < full_bytes
    # full fine-tuning's result loads with the family's diffusers class and is the version
    full_trainer.save_pretrained(tmp_path / "final")
    cls = getattr(diffusers, get_family(model).transformer_class)
    final = cls.from_pretrained(tmp_path / "final").state_dict()
    assert set(final) == set(full)
    assert all(torch.equal(final[k], full[k]) for k in full)
    # the LoRA result is the adapter in diffusers format
    lora_trainer.save_pretrained(tmp_path / "final-lora")
    assert (tmp_path / "final-lora" / "pytorch_lora_weights.safetensors").is_file()
    # both carry the SHA-256 of each file they hold (docs/evaluation.md, "What it writes")
    assert (tmp_path / "final-lora" / "SHA256SUMS").read_text().endswith("  pytorch_lora_weights.safetensors\n")
    assert "  config.json\n" in (tmp_path / "final" / "SHA256SUMS").read_text()
    check_weights_dir(tmp_path / "final")
    check_weights_dir(tmp_path / "final-lora")
