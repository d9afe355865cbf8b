"""``spotlight eval``'s loader for the shapes task reads a LoRA run's ``final/`` as the trainer
wrote it (rank and alpha from the file's peft metadata), and gives the trained velocity."""

from __future__ import annotations

import torch
from peft.utils import get_peft_model_state_dict

from spotlight.config import load_config
from spotlight.models.families import get_family
from spotlight.models.lora import adapter_metadata, add_lora, lora_spec
from spotlight.tasks.shapes.evaluate import load_transformer


def test_a_lora_final_folder_loads_with_its_rank_and_alpha(tmp_path):
    cfg = load_config(overrides={"train.lora_rank": 4, "train.lora_alpha": 16.0})
    family = get_family(cfg.model)
    trained = family.build_transformer()
    add_lora(trained, lora_spec(cfg.train), family.default_lora_targets, seed=0)
    with torch.no_grad():  # an adapter that changes the output (lora_B starts at zero)
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    # what FlowGRPOTrainer.save_final writes for LoRA
    adapter = {k.replace(".default.", "."): v for k, v in get_peft_model_state_dict(trained).items()}
    family.save_lora(tmp_path, adapter, adapter_metadata(trained))

    loaded = load_transformer(cfg.model, tmp_path)
    base = load_transformer(cfg.model)
    cond = family.encode_prompts(["a photo of a red circle"])
    x = torch.randn(1, *family.latent_shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.6])
    with torch.no_grad():
        want = family.velocity(trained.eval(), x, sigma, cond)
        got = family.velocity(loaded, x, sigma, cond)
        plain = family.velocity(base, x, sigma, cond)
    assert (want - plain).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_weights_trained_on_other_prompt_embeddings_are_refused(tmp_path):
    """Was: scored with the config's embeddings, silently wrong (colour attribution 0.233
    instead of 0.617 for the shipped base under text_encoder = "minilm")."""
    import shutil

    import msgspec
    import pytest

    from spotlight.config import load_config
    from spotlight.models.families.base import ModelLoadError
    from spotlight.models.families.tiny import write_text_conditioning
    from spotlight.tasks.shapes import evaluate as ev
    from spotlight.tasks.shapes.world import PACKAGE_DIR

    cfg = load_config(None).model
    plain = msgspec.structs.replace(cfg, text_encoder="minilm")
    with pytest.raises(ModelLoadError, match="set model.text_encoder = 'minilm-bigram'"):
        ev.load_transformer(plain)
    folder = tmp_path / "step_00400"
    shutil.copytree(PACKAGE_DIR / "base_model", folder)
    write_text_conditioning(folder, "minilm")
    with pytest.raises(ModelLoadError, match="trained on 'minilm' prompt embeddings but model.text_encoder"):
        ev.load_transformer(cfg, folder)
    assert ev.load_transformer(plain, folder) is not None
