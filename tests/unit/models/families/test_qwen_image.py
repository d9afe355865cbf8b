"""The qwen-image family on a tiny random checkpoint of the real diffusers/transformers classes.

Checks the family against diffusers' ``QwenImagePipeline`` itself: the sigma schedule, the
prompt encoding, true CFG with norm rescaling, the decode, and a whole 3-step Euler run
compared with ``pipe(...)`` given the same initial latents.
"""

from __future__ import annotations

import json
import logging
import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spotlight.config import ModelConfig  # noqa: E402
from spotlight.models.families import ModelLoadError, get_family  # noqa: E402
from spotlight.models.families.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG, QwenImageFamily, make_random_checkpoint  # noqa: E402
from spotlight.rl.sampler import Conditioning  # noqa: E402

T = 16
PROMPTS = ["a cat", "a red dog"]
LONG_PROMPT = "a very long prompt " * 8


def _family(path, **kw) -> QwenImageFamily:
    kw = {"image_size": 32, "max_text_tokens": T, **kw}
    return get_family(ModelConfig(family="qwen-image", pretrained_path=str(path), **kw))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("qwen-image-ckpt"), seed=3)


@pytest.fixture(scope="module")
def family(ckpt):
    return _family(ckpt)


@pytest.fixture(scope="module")
def pipe(ckpt):
    from diffusers import QwenImagePipeline

    p = QwenImagePipeline.from_pretrained(str(ckpt))
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def transformer(family):
    return family.build_transformer(torch.float32)


@pytest.fixture(scope="module")
def cond(family):
    return family.encode_prompts(PROMPTS)


def test_checkpoint_layout_and_family(ckpt, family, pipe):
    assert isinstance(family, QwenImageFamily)
    assert family.name == "qwen-image" and family.guidance_scale == 4.0 and family.negative_prompt == " "
    for sub in family.components():
        assert (ckpt / sub).is_dir(), sub
    index = json.loads((ckpt / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert type(pipe.transformer).__name__ == "QwenImageTransformer2DModel"
    assert type(pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(pipe.tokenizer).__name__ == "Qwen2Tokenizer"
    # joint attention width follows the text encoder, channels follow the VAE
    assert pipe.transformer.config.joint_attention_dim == pipe.text_encoder.config.get_text_config().hidden_size
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.z_dim
    assert pipe.text_encoder.config.get_text_config().vocab_size == len(pipe.tokenizer)


def test_random_checkpoint_is_seeded_and_restores_rng(tmp_path):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = make_random_checkpoint(tmp_path / "a", seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    b = make_random_checkpoint(tmp_path / "b", seed=5)
    c = make_random_checkpoint(tmp_path / "c", seed=6)
    name = "transformer/diffusion_pytorch_model.safetensors"
    assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / name).read_bytes() != (c / name).read_bytes()
    with pytest.raises(ValueError, match="in_channels"):
        make_random_checkpoint(tmp_path / "d", transformer_kwargs={"in_channels": 64})


def test_tokenizer_round_trips_and_matches_template(pipe):
    tok = pipe.tokenizer
    text = "A photo of a café, 2 dogs!\n\t日本 <|im_end|>"
    assert tok.decode(tok(text).input_ids) == text
    ids = tok("<|im_start|>user\nthe<|im_end|>").input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(tok(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34


def test_latent_shape(family, ckpt):
    assert family.latent_shape == (4, 16)  # (32/16)², 4·z_dim (z_dim = 4)
    assert _family(ckpt, image_size=64).latent_shape == (16, 16)


def test_missing_folder_raises(tmp_path, ckpt):
    with pytest.raises(ModelLoadError, match="checkpoint directory not found: .*nowhere"):
        _family(tmp_path / "nowhere").build_transformer()
    (tmp_path / "empty").mkdir()
    fam = _family(tmp_path / "empty")  # a folder without the checkpoint's parts: each named
    with pytest.raises(ModelLoadError, match="transformer"):
        fam.build_transformer()
    with pytest.raises(ModelLoadError, match="vae"):
        _ = fam.latent_shape


def test_sigmas_follow_the_pipeline(family, pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    steps = 10
    sig = family.sigmas(steps, shift=3.0)
    assert sig.dtype == torch.float32 and sig.shape == (steps + 1,)
    assert sig[0].item() == pytest.approx(1.0) and sig[-1].item() == 0.0
    assert torch.all(sig[1:] < sig[:-1])
    # the pipeline's own computation
    conf = pipe.scheduler.config
    mu = calculate_shift(
        family.latent_shape[0],
        conf["base_image_seq_len"],
        conf["max_image_seq_len"],
        conf["base_shift"],
        conf["max_shift"],
    )
    retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    torch.testing.assert_close(sig, pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    # written out: exponential time shift, then the stretch to shift_terminal
    c = QWEN_IMAGE_SCHEDULER_CONFIG
    m = (c["max_shift"] - c["base_shift"]) / (c["max_image_seq_len"] - c["base_image_seq_len"])
    mu2 = c["base_shift"] + m * (4 - c["base_image_seq_len"])
    lin = np.linspace(1.0, 1 / steps, steps)
    shifted = math.exp(mu2) / (math.exp(mu2) + (1 / lin - 1))
    one_minus = 1 - shifted
    stretched = 1 - one_minus / (one_minus[-1] / (1 - c["shift_terminal"]))
    torch.testing.assert_close(sig[:-1], torch.tensor(stretched, dtype=torch.float32), rtol=0, atol=1e-5)
    assert sig[-2].item() == pytest.approx(c["shift_terminal"], abs=1e-6)
    assert not torch.allclose(sig[:-1], torch.tensor(lin, dtype=torch.float32), atol=1e-3)


def test_encode_prompts_shapes_padding_and_negative(family, cond, pipe):
    assert cond.embeds.shape == (2, T, 32) and cond.embeds.dtype == torch.float32
    assert cond.mask.shape == (2, T) and cond.mask.dtype == torch.int64
    assert set(cond.extra) == {"neg.embeds", "neg.mask"}
    # the negative prompt is stored once and shared by every row
    assert cond.extra["neg.embeds"].shape == (1, T, 32) and cond.extra["neg.mask"].shape == (1, T)
    rows = cond.index([0, 1])
    assert rows.extra["neg.embeds"].shape == (2, T, 32) and rows.extra["neg.mask"].shape == (2, T)
    assert torch.equal(rows.extra["neg.embeds"][0], rows.extra["neg.embeds"][1])
    for row in range(2):
        n = int(cond.mask[row].sum())
        assert 0 < n < T and torch.all(cond.mask[row, :n] == 1) and torch.all(cond.mask[row, n:] == 0)
        assert torch.all(cond.embeds[row, n:] == 0) and torch.all(cond.embeds[row, :n].abs().sum(-1) > 0)
    # exactly the pipeline's own encode_prompt, per prompt
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS + [" "]):
            ref, _ = pipe.encode_prompt(prompt=[prompt], device="cpu", max_sequence_length=T)
            got = cond.embeds[row] if row < 2 else cond.extra["neg.embeds"][0]
            n = ref.shape[1]
            torch.testing.assert_close(got[:n], ref[0].float(), rtol=1e-5, atol=1e-5)


def test_no_negative_without_cfg(ckpt):
    fam = _family(ckpt, guidance_scale=1.0)
    out = fam.encode_prompts(PROMPTS)
    assert out.extra == {} and out.embeds.shape == (2, T, 32)


def test_long_prompt_is_cut_and_counted_before_encoding(family, caplog):
    counts = family.prompt_token_counts([LONG_PROMPT, "a cat"])  # what `spotlight up` reports, once
    assert counts[0] > T >= counts[1]
    with caplog.at_level(logging.INFO, logger="spotlight.models.qwen_image"):
        out = family.encode_prompts([LONG_PROMPT, "a cat"])
    assert out.embeds.shape == (2, T, 32)
    assert int(out.mask[0].sum()) == T and int(out.mask[1].sum()) == counts[1]
    assert any("cut" in r.getMessage() and "1 of 2" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # not a second report
    # the uncut count is the mask length of an encoding with room for every token
    wide = _family(family.path, max_text_tokens=counts[0] + 3).encode_prompts([LONG_PROMPT])
    assert int(wide.mask[0].sum()) == counts[0]


def test_velocity_shapes(family, transformer, cond):
    x = torch.randn(2, *family.latent_shape)
    v = family.velocity(transformer, x, torch.tensor([0.9, 0.4]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    plain = Conditioning(cond.embeds, cond.mask)
    v1 = family.velocity(transformer, x, torch.tensor([0.9, 0.4]), plain)
    assert v1.shape == x.shape and not torch.allclose(v, v1)


def test_cfg_equals_two_separate_unpadded_calls(family, transformer, cond):
    torch.manual_seed(0)
    x = torch.randn(2, *family.latent_shape)
    sigma = torch.tensor([0.8, 0.3])
    v = family.velocity(transformer, x, sigma, cond)

    def single(row, embeds, mask):
        n = int(mask.sum())
        with torch.no_grad():
            return transformer(
                hidden_states=x[row : row + 1],
                encoder_hidden_states=embeds[None, :n],
                encoder_hidden_states_mask=None,
                timestep=sigma[row : row + 1],
                img_shapes=[(1, 2, 2)],
                return_dict=False,
            )[0][0]

    w = family.guidance_scale
    for row in range(2):
        pos = single(row, cond.embeds[row], cond.mask[row])
        neg = single(row, cond.extra["neg.embeds"][0], cond.extra["neg.mask"][0])
        comb = neg + w * (pos - neg)
        expect = comb * (pos.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
        torch.testing.assert_close(v[row], expect, rtol=0, atol=1e-5)
        assert not torch.allclose(expect, pos, atol=1e-4)  # CFG changed something


def test_decode(family, pipe):
    torch.manual_seed(1)
    lat = torch.randn(2, *family.latent_shape)
    img = family.decode(lat)
    assert img.shape == (2, 3, 32, 32) and img.dtype == torch.uint8 and img.device.type == "cpu"
    assert img.float().std() > 0
    # the pipeline's own unpack / de-normalise / decode / postprocess
    vae = pipe.vae
    z = pipe._unpack_latents(lat, 32, 32, pipe.vae_scale_factor)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        ref = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
    ref = pipe.image_processor.postprocess(ref, output_type="np")  # [B, H, W, 3] in [0, 1]
    ref = torch.from_numpy(np.round(ref * 255)).permute(0, 3, 1, 2)
    assert (img.float() - ref).abs().max() <= 1


def test_euler_run_matches_the_pipeline(family, transformer, cond, pipe):
    """3 Euler steps with the family's sigmas + CFG velocity == ``pipe(...)`` (same latents)."""
    steps = 3
    torch.manual_seed(2)
    x0 = torch.randn(2, *family.latent_shape)
    with torch.no_grad():
        ref = pipe(
            prompt=PROMPTS,
            negative_prompt=" ",
            true_cfg_scale=4.0,
            height=32,
            width=32,
            num_inference_steps=steps,
            latents=x0.clone(),
            max_sequence_length=T,
            output_type="latent",
        ).images
    sig = family.sigmas(steps, 1.0)
    x = x0.clone()
    with torch.no_grad():
        for k in range(steps):
            v = family.velocity(transformer, x, sig[k].expand(2), cond)
            x = x + (sig[k + 1] - sig[k]) * v
    torch.testing.assert_close(x, ref.float(), rtol=1e-4, atol=1e-4)
