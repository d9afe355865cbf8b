"""True classifier-free guidance of the tiny family (the shapes base model is pretrained with
caption dropout to the empty caption, spotlight/tasks/shapes/pretrain.py)."""

from __future__ import annotations

import torch

from spotlight.config import load_config
from spotlight.models.families import get_family


def _family(scale: float, negative: str = ""):
    return get_family(load_config(overrides={"model.guidance_scale": scale, "model.negative_prompt": negative}).model)


def test_cfg_conditioning_carries_the_empty_caption_as_one_shared_negative_row():
    fam = _family(3.0)
    cond = fam.encode_prompts(["a photo of a red circle", "a photo of two squares"])
    assert cond.extra["neg.embeds"].shape[0] == 1 and int(cond.extra["neg.mask"].sum()) == 2  # [CLS] [SEP]
    assert "neg.embeds" not in _family(1.0).encode_prompts(["a photo of a red circle"]).extra


def test_cfg_velocity_is_neg_plus_scale_times_the_difference():
    fam = _family(3.0)
    model = fam.build_transformer()
    cond = fam.encode_prompts(["a photo of a red circle", "a photo of a blue square"])
    x = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.7])
    plain = _family(1.0)
    pos = plain.velocity(model, x, sigma, cond)
    neg_cond = type(cond)(cond.rows("neg.embeds", 2), cond.rows("neg.mask", 2))
    neg = plain.velocity(model, x, sigma, neg_cond)
    got = fam.velocity(model, x, sigma, cond)
    # one [2B] forward against two [B] forwards: fp32 rounding differs by ~1e-6 per branch, and the
    # combination scales it by up to 2w - 1 = 5
    torch.testing.assert_close(got, neg + 3.0 * (pos - neg), rtol=1e-4, atol=1e-4)


def test_the_negative_prompt_and_scale_are_part_of_the_prompt_cache_key():
    assert _family(1.0).identity() != _family(3.0).identity() != _family(3.0, "blurry").identity()
