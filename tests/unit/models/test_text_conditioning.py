"""The tiny family's text encoders (spotlight/models/text_encoder.py): why ``minilm-bigram``
exists, and a checkpoint's ``text_conditioning.json`` against ``model.text_encoder``."""

from __future__ import annotations

import shutil

import pytest
import torch

from spotlight.config import ModelConfig
from spotlight.models.families import ModelLoadError, get_family
from spotlight.models.families.tiny import TEXT_CONDITIONING_FILE, read_text_conditioning, write_text_conditioning
from spotlight.models.text_encoder import cached_prompt_embeddings, encode_prompts, mix_left_neighbour
from spotlight.tasks.shapes.world import PACKAGE_DIR

RIGHT, SWAPPED = "a photo of a red circle and a blue square", "a photo of a blue circle and a red square"
NOUNS = (6, 10)  # [CLS] a photo of a red circle and a blue square [SEP]: "circle", "square"


def _noun_cosines(text_encoder: str) -> list[float]:
    embeds, _ = encode_prompts([RIGHT, SWAPPED], 16, text_encoder=text_encoder)
    return [float(torch.cosine_similarity(embeds[0, i], embeds[1, i], dim=0)) for i in NOUNS]


def test_minilm_nouns_hardly_carry_their_colour_and_the_bigram_ones_do():
    """The reason for ``minilm-bigram``: MiniLM's state of "circle" is nearly the same after "red"
    and after "blue", so the prompts differ only in where the colour words sit."""
    assert min(_noun_cosines("minilm")) > 0.99
    assert max(_noun_cosines("minilm-bigram")) < 0.95


def test_the_left_neighbour_mix_keeps_cls_and_padding():
    embeds = torch.arange(1.0, 13.0).view(1, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0]])
    embeds[0, 3] = 0.0  # padding is zero
    out = mix_left_neighbour(embeds, mask)
    assert torch.equal(out[0, 0], embeds[0, 0])
    assert torch.equal(out[0, 1], embeds[0, 1] + embeds[0, 0]) and torch.equal(out[0, 2], embeds[0, 2] + embeds[0, 1])
    assert torch.equal(out[0, 3], torch.zeros(3))
    with pytest.raises(ValueError, match="unknown text encoder 'clip'"):
        encode_prompts(["a photo of a circle"], 16, text_encoder="clip")


def test_the_embedding_cache_keeps_the_encoders_apart(tmp_path):
    plain, _ = cached_prompt_embeddings([RIGHT], tmp_path, 16)
    bigram, _ = cached_prompt_embeddings([RIGHT], tmp_path, 16, text_encoder="minilm-bigram")
    assert len(list(tmp_path.glob("*.safetensors"))) == 2 and not torch.equal(plain, bigram)


def _pretrained(path, text_encoder: str) -> ModelConfig:
    arch = {"num_layers": 6, "num_attention_heads": 4, "image_size": 32, "patch_size": 4}
    return ModelConfig(source="pretrained", pretrained_path=str(path), text_encoder=text_encoder, **arch)


def test_a_checkpoint_and_the_config_must_name_the_same_text_encoder(tmp_path):
    folder = tmp_path / "ckpt"
    shipped = PACKAGE_DIR / "base_model"
    shutil.copytree(shipped, folder)
    trained_on = read_text_conditioning(shipped)
    other = "minilm" if trained_on == "minilm-bigram" else "minilm-bigram"
    get_family(_pretrained(folder, trained_on)).check()
    with pytest.raises(ModelLoadError, match=f"trained on '{trained_on}' .* set model.text_encoder = '{trained_on}'"):
        get_family(_pretrained(folder, other)).check()
    (folder / TEXT_CONDITIONING_FILE).unlink(missing_ok=True)  # a folder without the file: minilm
    assert read_text_conditioning(folder) == "minilm"
    get_family(_pretrained(folder, "minilm")).check()
    write_text_conditioning(folder, "minilm-bigram")
    assert read_text_conditioning(folder) == "minilm-bigram"
    (folder / TEXT_CONDITIONING_FILE).write_text('{"text_encoder": "t5"}')
    with pytest.raises(ModelLoadError, match="'t5' is none of minilm, minilm-bigram"):
        read_text_conditioning(folder)
    (folder / TEXT_CONDITIONING_FILE).write_text("{not json")
    with pytest.raises(ModelLoadError, match="unreadable"):
        get_family(_pretrained(folder, "minilm")).check()
