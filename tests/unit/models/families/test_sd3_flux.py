"""SD3 and FLUX families on tiny random-weight checkpoints of the real diffusers classes.

The checkpoints come from ``make_random_checkpoint`` (``spotlight/models/families/sd3.py``,
``flux.py``) with offline tokenizers (``spotlight/models/offline_tokenizers.py``). Reference
behaviour is diffusers 0.42's ``StableDiffusion3Pipeline`` / ``FluxPipeline``: the family's
Euler loop must reproduce the pipeline's own denoising and decoding, and its sigmas, prompt
embeddings and CFG must match what the pipeline computes. SD3's CFG detaches the
unconditional branch (Flow-GRPO SD3 trainer), checked with autograd.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from spotlight.config import ModelConfig
from spotlight.models import offline_tokenizers as ot
from spotlight.models.families import ModelLoadError, get_family
from spotlight.models.families.flux import FluxFamily
from spotlight.models.families.sd3 import SD3Family
from spotlight.rl.sampler import Conditioning, make_sigmas

PROMPTS = ["a photo of the cat", "The red dog and a blue cat!"]
MAX_T5 = 8
SIZE = 32


def _cfg(family: str, path, **kw) -> ModelConfig:
    return ModelConfig(
        family=family, pretrained_path=str(path), image_size=SIZE, max_text_tokens=MAX_T5, dtype="float32", **kw
    )


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return SD3Family.make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "sd3", seed=0, image_size=SIZE)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return FluxFamily.make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "flux", seed=0, image_size=SIZE)


@pytest.fixture(scope="module")
def sd3(sd3_dir):
    fam = get_family(_cfg("sd3", sd3_dir))
    stored = fam.encode_prompts(PROMPTS)
    # the negative prompt is stored once (one shared row); index() gives it to every row
    assert stored.extra["neg.embeds"].shape[0] == 1 and stored.extra["neg.pooled"].shape[0] == 1
    return fam, fam.build_transformer(torch.float32), stored.index(list(range(len(PROMPTS))))


@pytest.fixture(scope="module")
def flux(flux_dir):
    fam = get_family(_cfg("flux", flux_dir))
    return fam, fam.build_transformer(torch.float32), fam.encode_prompts(PROMPTS)


def _latents(shape, seed=0):
    return torch.randn(len(PROMPTS), *shape, generator=torch.Generator().manual_seed(seed))


def _flat_grads(module) -> torch.Tensor:
    return torch.cat(
        [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in module.parameters()]
    )


# ---------------------------------------------------------------------------- tokenizers
def test_offline_tokenizers_roundtrip(tmp_path):
    from transformers import CLIPTokenizer, T5TokenizerFast

    ot.build_clip_tokenizer(tmp_path / "clip")
    ot.build_t5_tokenizer(tmp_path / "t5")
    clip = CLIPTokenizer.from_pretrained(tmp_path / "clip")
    t5 = T5TokenizerFast.from_pretrained(tmp_path / "t5")
    assert len(clip) == ot.CLIP_VOCAB_SIZE and len(t5) == ot.T5_VOCAB_SIZE
    assert clip.model_max_length == 77
    ids = clip("the cat").input_ids
    assert clip.convert_ids_to_tokens(ids) == [
        "<|startoftext|>",
        "the</w>",
        "cat</w>",
        "<|endoftext|>",
    ]  # merges applied
    assert ids[-1] == ot.CLIP_VOCAB_SIZE - 1 == clip.eos_token_id
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    enc = t5("the dog ~", padding="max_length", max_length=6).input_ids
    assert t5.convert_ids_to_tokens(enc) == ["▁the", "▁dog", "▁~", "</s>", "<pad>", "<pad>"]


# ---------------------------------------------------------------------------- checkpoints
def test_pipelines_load_offline(sd3_dir, flux_dir):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    p = StableDiffusion3Pipeline.from_pretrained(sd3_dir, local_files_only=True)
    assert (
        type(p.transformer).__name__ == "SD3Transformer2DModel" and type(p.text_encoder_3).__name__ == "T5EncoderModel"
    )
    assert p.text_encoder.config.vocab_size == len(p.tokenizer) and p.text_encoder_3.config.vocab_size == len(
        p.tokenizer_3
    )
    assert p.transformer.config.caption_projection_dim == 32 and p.transformer.config.qk_norm == "rms_norm"
    assert p.vae.config.scaling_factor == pytest.approx(1.5305) and p.vae.config.shift_factor == pytest.approx(0.0609)
    f = FluxPipeline.from_pretrained(flux_dir, local_files_only=True)
    assert type(f.transformer).__name__ == "FluxTransformer2DModel" and f.transformer.config.guidance_embeds
    assert type(f.text_encoder).__name__ == "CLIPTextModel"
    assert f.scheduler.config.use_dynamic_shifting and f.vae.config.scaling_factor == pytest.approx(0.3611)


def test_random_checkpoint_is_seeded_and_scoped(tmp_path, sd3_dir):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    SD3Family.make_random_checkpoint(tmp_path / "again", seed=0, image_size=SIZE)
    assert torch.equal(torch.rand(3), expected)  # caller's RNG state restored
    a = SD3Transformer2DModel.from_pretrained(sd3_dir, subfolder="transformer")
    b = SD3Transformer2DModel.from_pretrained(tmp_path / "again", subfolder="transformer")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_load_errors(tmp_path, sd3_dir):
    with pytest.raises(ModelLoadError, match="checkpoint directory not found: .*missing"):
        get_family(_cfg("sd3", tmp_path / "missing")).build_transformer()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no 'transformer/' folder"):
        get_family(_cfg("sd3", tmp_path / "empty")).build_transformer()
    # An SD3 checkpoint is not a FLUX one.
    with pytest.raises(ModelLoadError, match="SD3Transformer2DModel"):
        get_family(_cfg("flux", sd3_dir)).build_transformer()


def test_lora_targets_exist(sd3, flux):
    for fam, tr, _ in (sd3, flux):
        names = [n for n, _ in tr.named_modules()]
        for target in fam.default_lora_targets:
            assert any(n.endswith("." + target) for n in names), (fam.name, target)
        for block in fam.block_names:
            assert len(getattr(tr, block)) >= 1


# ---------------------------------------------------------------------------- latents and sigmas
def test_latent_shapes(sd3, flux):
    assert sd3[0].latent_shape == (16, SIZE // 8, SIZE // 8)
    assert flux[0].latent_shape == ((SIZE // 16) ** 2, 64)


@pytest.mark.parametrize("steps", [1, 4, 10])
def test_sd3_sigmas_static_shift(sd3, steps):
    s = sd3[0].sigmas(steps, shift=1.0)  # the checkpoint's shift 3.0 wins over sampler.shift
    assert s.dtype == torch.float32 and s.shape == (steps + 1,)
    assert s[0] == 1.0 and s[-1] == 0.0 and bool((s[1:] < s[:-1]).all())
    assert torch.equal(s, make_sigmas(steps, 3.0))
    if steps > 1:
        assert not torch.allclose(s, make_sigmas(steps, 1.0))


def test_sd3_sigmas_dynamic_shift(tmp_path, sd3_dir):
    ckpt = tmp_path / "dyn"
    for sub in ("transformer", "vae", "scheduler"):
        (ckpt / sub).mkdir(parents=True)
    shutil.copy(sd3_dir / "transformer" / "config.json", ckpt / "transformer")
    shutil.copy(sd3_dir / "vae" / "config.json", ckpt / "vae")
    sched = json.loads((sd3_dir / "scheduler" / "scheduler_config.json").read_text())
    sched.update(use_dynamic_shifting=True, base_shift=0.4, max_shift=1.2, base_image_seq_len=2, max_image_seq_len=10)
    (ckpt / "scheduler" / "scheduler_config.json").write_text(json.dumps(sched))
    s = get_family(_cfg("sd3", ckpt)).sigmas(5, shift=1.0)
    # StableDiffusion3Pipeline: image_seq_len = (h / patch) * (w / patch) = (4 / 2)**2 = 4.
    mu = 0.4 + (1.2 - 0.4) / (10 - 2) * (4 - 2)
    from diffusers import FlowMatchEulerDiscreteScheduler

    ref = FlowMatchEulerDiscreteScheduler.from_config(sched)
    ref.set_timesteps(5, mu=mu)
    assert torch.allclose(s, ref.sigmas.float()) and s[-1] == 0 and s[0] == 1
    ref.set_timesteps(5, mu=0.0)
    assert not torch.allclose(s, ref.sigmas.float())


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_flux_sigmas_dynamic_shift(flux, steps):
    s = flux[0].sigmas(steps, shift=3.0)
    assert s.dtype == torch.float32 and s.shape == (steps + 1,)
    assert s[0] == pytest.approx(1.0) and s[-1] == 0.0 and bool((s[1:] < s[:-1]).all())
    # FluxPipeline: linspace(1, 1/T, T) through the exponential time shift with mu from
    # calculate_shift(L = 4 tokens, 256, 4096, 0.5, 1.15).
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (4 - 256)
    base = np.linspace(1.0, 1 / steps, steps)
    expected = [math.exp(mu) / (math.exp(mu) + (1 / t - 1)) for t in base] + [0.0]
    assert torch.allclose(s, torch.tensor(expected, dtype=torch.float32), atol=1e-6)
    if steps > 1:
        assert not torch.allclose(s[:-1], torch.tensor(base, dtype=torch.float32), atol=1e-3)


# ---------------------------------------------------------------------------- prompts
def test_sd3_encode_prompts_matches_pipeline(sd3, sd3_dir):
    fam, _, cond = sd3
    n, t = len(PROMPTS), 77 + MAX_T5
    assert cond.embeds.shape == (n, t, 64) and cond.embeds.dtype == torch.float32
    assert cond.mask.dtype == torch.int64 and bool((cond.mask == 1).all()) and cond.mask.shape == (n, t)
    assert set(cond.extra) == {"pooled", "neg.embeds", "neg.pooled"}
    assert cond.extra["pooled"].shape == (n, 48) and cond.extra["neg.embeds"].shape == (n, t, 64)
    assert cond.extra["neg.pooled"].shape == (n, 48)
    assert not torch.allclose(cond.embeds[0], cond.embeds[1])
    # CLIP-L ‖ CLIP-G = 16 + 32 = 48 wide, zero-padded to the T5 width on the 77 CLIP tokens.
    assert bool((cond.embeds[:, :77, 48:] == 0).all()) and bool((cond.embeds[:, 77:, 48:] != 0).any())
    pipe = fam.text_pipeline("cpu")
    pe, ne, pp, npool = pipe.encode_prompt(
        prompt=PROMPTS,
        prompt_2=None,
        prompt_3=None,
        device="cpu",
        do_classifier_free_guidance=True,
        negative_prompt="",
        max_sequence_length=MAX_T5,
    )
    for got, ref in (
        (cond.embeds, pe),
        (cond.extra["pooled"], pp),
        (cond.extra["neg.embeds"], ne),
        (cond.extra["neg.pooled"], npool),
    ):
        assert torch.allclose(got, ref.float(), atol=1e-5)
    # No CFG, no negative tensors; the cache round trip keeps every tensor.
    plain = get_family(_cfg("sd3", sd3_dir, guidance_scale=1.0)).encode_prompts(PROMPTS)
    assert set(plain.extra) == {"pooled"} and torch.allclose(plain.embeds, cond.embeds)
    again = Conditioning.from_tensors(cond.to_tensors())
    assert set(again.extra) == set(cond.extra)


def test_flux_encode_prompts_matches_pipeline(flux):
    fam, _, cond = flux
    n = len(PROMPTS)
    assert cond.embeds.shape == (n, MAX_T5, 64) and cond.embeds.dtype == torch.float32
    assert cond.mask.shape == (n, MAX_T5) and cond.mask.dtype == torch.int64 and bool((cond.mask == 1).all())
    assert set(cond.extra) == {"pooled"} and cond.extra["pooled"].shape == (n, 32)
    pe, pp, text_ids = fam.text_pipeline("cpu").encode_prompt(
        prompt=PROMPTS, prompt_2=None, device="cpu", max_sequence_length=MAX_T5
    )
    assert torch.allclose(cond.embeds, pe.float(), atol=1e-5) and torch.allclose(
        cond.extra["pooled"], pp.float(), atol=1e-5
    )
    assert text_ids.shape == (MAX_T5, 3)


# ---------------------------------------------------------------------------- velocity
def _neg(cond: Conditioning) -> Conditioning:
    return Conditioning(cond.extra["neg.embeds"], cond.mask, {"pooled": cond.extra["neg.pooled"]})


def test_sd3_velocity_cfg_formula(sd3, sd3_dir):
    fam, tr, cond = sd3
    no_cfg = get_family(_cfg("sd3", sd3_dir, guidance_scale=1.0))
    x = _latents(fam.latent_shape)
    sigma = torch.tensor([0.9, 0.35])
    with torch.no_grad():
        v = fam.velocity(tr, x, sigma, cond)
        v_c = no_cfg.velocity(tr, x, sigma, cond)
        v_u = no_cfg.velocity(tr, x, sigma, _neg(cond))
        # The transformer sees the raw scheduler timestep 1000·σ.
        raw = tr(
            hidden_states=x,
            timestep=sigma * 1000,
            encoder_hidden_states=cond.embeds,
            pooled_projections=cond.extra["pooled"],
            return_dict=False,
        )[0]
    assert v.shape == x.shape and v.dtype == torch.float32
    assert torch.allclose(v_c, raw, atol=1e-6)
    assert (v_c - v_u).abs().max() > 1e-3  # the negative prompt matters, so the check has power
    assert torch.allclose(v, v_u + 4.5 * (v_c - v_u), atol=1e-5)
    with pytest.raises(ValueError, match="neg.embeds"):
        fam.velocity(tr, x, sigma, Conditioning(cond.embeds, cond.mask, {"pooled": cond.extra["pooled"]}))


def test_sd3_cfg_uncond_branch_gets_no_gradient(sd3, sd3_dir):
    fam, tr, cond = sd3
    no_cfg = get_family(_cfg("sd3", sd3_dir, guidance_scale=1.0))
    w = fam.guidance_scale
    x = _latents(fam.latent_shape, seed=1)
    sigma = torch.tensor([0.7, 0.2])
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    tr.zero_grad(set_to_none=True)
    (fam.velocity(tr, x, sigma, cond) * r).sum().backward()
    g_cfg = _flat_grads(tr)
    tr.zero_grad(set_to_none=True)
    (w * no_cfg.velocity(tr, x, sigma, cond) * r).sum().backward()
    g_cond = _flat_grads(tr)
    tr.zero_grad(set_to_none=True)
    v_u = no_cfg.velocity(tr, x, sigma, _neg(cond))
    v_c = no_cfg.velocity(tr, x, sigma, cond)
    ((v_u + w * (v_c - v_u)) * r).sum().backward()
    g_both = _flat_grads(tr)
    tr.zero_grad(set_to_none=True)
    assert g_cfg.abs().max() > 0
    # Only w·v_c carries gradient (equal up to float32 batching noise); an undetached v_u differs.
    assert (g_cfg - g_cond).norm() <= 1e-5 * g_cond.norm(), ((g_cfg - g_cond).norm() / g_cond.norm()).item()
    assert (g_cfg - g_both).norm() > 1e-2 * g_both.norm()


def test_flux_velocity_and_guidance(flux):
    from diffusers import FluxTransformer2DModel

    fam, tr, cond = flux
    x = _latents(fam.latent_shape)
    sigma = torch.tensor([1.0, 0.4])
    seen = {}

    def hook(_mod, _args, kwargs):
        seen.update(kwargs)

    handle = tr.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            v = fam.velocity(tr, x, sigma, cond)
    finally:
        handle.remove()
    assert v.shape == x.shape and v.dtype == torch.float32
    assert torch.equal(seen["guidance"], torch.full([2], 3.5))
    assert torch.equal(seen["timestep"], sigma)  # FluxPipeline passes t / 1000 = σ
    assert seen["img_ids"].shape == (fam.latent_shape[0], 3) and seen["txt_ids"].shape == (MAX_T5, 3)
    assert bool((seen["txt_ids"] == 0).all())
    other = FluxFamily(_cfg("flux", fam.path, guidance_scale=7.0))
    with torch.no_grad():
        assert not torch.allclose(other.velocity(tr, x, sigma, cond), v)  # the guidance value reaches the model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        schnell = FluxTransformer2DModel(**{**dict(tr.config), "guidance_embeds": False}).eval()
    seen.clear()
    handle = schnell.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            assert fam.velocity(schnell, x, sigma, cond).shape == x.shape
    finally:
        handle.remove()
    assert seen["guidance"] is None


# ---------------------------------------------------------------------------- against the pipelines
def _euler(fam, tr, cond, x, steps):
    sig = fam.sigmas(steps, shift=1.0)
    with torch.no_grad():
        for i in range(steps):
            v = fam.velocity(tr, x, sig[i].expand(x.shape[0]), cond)
            x = x + (sig[i + 1] - sig[i]) * v
    return x


@pytest.mark.parametrize("which", ["sd3", "flux"])
def test_denoise_and_decode_match_pipeline(which, sd3, flux, sd3_dir, flux_dir):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    fam, tr, cond = sd3 if which == "sd3" else flux
    path = sd3_dir if which == "sd3" else flux_dir
    pipe_cls = StableDiffusion3Pipeline if which == "sd3" else FluxPipeline
    pipe = pipe_cls.from_pretrained(path, transformer=tr, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    x0 = _latents(fam.latent_shape, seed=3)
    steps = 3
    kw = dict(
        prompt=PROMPTS,
        num_inference_steps=steps,
        height=SIZE,
        width=SIZE,
        max_sequence_length=MAX_T5,
        guidance_scale=fam.guidance_scale,
    )
    ref = pipe(latents=x0.clone(), output_type="latent", **kw).images
    assert torch.allclose(pipe.scheduler.sigmas.float(), fam.sigmas(steps, shift=1.0), atol=1e-6)
    ours = _euler(fam, tr, cond, x0.clone(), steps)
    assert torch.allclose(ours, ref.float(), atol=1e-4), (ours - ref).abs().max()
    img = fam.decode(ours)
    assert img.shape == (len(PROMPTS), 3, SIZE, SIZE) and img.dtype == torch.uint8 and img.device.type == "cpu"
    ref_img = pipe(latents=x0.clone(), output_type="pt", **kw).images  # [B, 3, H, W] in [0, 1]
    assert (img.float() - ref_img * 255).abs().max() <= 1.0


@pytest.mark.procs
def test_encoding_long_prompts_does_not_flood_the_console(sd3_dir, tmp_path):
    """CLIP's window is 77 tokens: diffusers warned once per batch with the cut text and its pad
    tokens (224 MB of console in a few minutes for the PickScore prompts); encoding through the
    cache keeps the libraries' warnings down. In a fresh process: the libraries configure their
    loggers on first use, which must not undo the quieting."""
    import subprocess
    import sys

    script = f"""
import logging, pathlib
from spotlight.config import ModelConfig
from spotlight.models.families import cached_conditioning, get_family
fam = get_family(ModelConfig(family="sd3", pretrained_path={str(sd3_dir)!r}, image_size=32, max_text_tokens=64))
long = ["a very long prompt " + " ".join(f"word{{i}}" for i in range(150))] * 3
cached_conditioning(fam, long, pathlib.Path({str(tmp_path)!r}))
levels = [logging.getLogger(name).getEffectiveLevel() for name in ("diffusers", "transformers")]
print("levels", *levels)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "truncated" not in out.stderr and "truncated" not in out.stdout, out.stderr[-2000:]
    assert "levels 30 30" in out.stdout  # the libraries' own levels (WARNING) come back afterwards
