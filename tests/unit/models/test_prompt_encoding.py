"""The prompt cache across ``model.max_text_tokens`` and where ``spotlight up`` encodes prompts
(spotlight/models/text_cache.py, spotlight/models/prompt_encoding.py), on tiny random
checkpoints of the real classes.

A causal encoder's (Qwen2.5-VL) cache keeps uncut encodings and serves every
``max_text_tokens`` bit for bit; a bidirectional one's (FLUX's and SD3's T5) cannot be cut, which
the FLUX test shows, so its cache stays per ``max_text_tokens``.
"""

from __future__ import annotations

import pytest
import torch

from spotlight.config import ModelConfig
from spotlight.models.families import cached_conditioning, get_family
from spotlight.models.families.base import prompt_cache_path
from spotlight.models.families.qwen_image import make_random_checkpoint
from spotlight.models.prompt_encoding import EncodeError, encode_run_prompts, pick_gpu
from spotlight.models.text_cache import pack_rows, unpack_stream

PROMPTS = ["a cat", "a red dog on a very long and winding road under the stars", "x"]


def _qwen(path, t: int):
    return get_family(ModelConfig(family="qwen-image", pretrained_path=str(path), image_size=32, max_text_tokens=t))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("qwen-ckpt"), seed=1)


def _same(a, b) -> None:
    assert torch.equal(a.embeds, b.embeds) and torch.equal(a.mask, b.mask)
    assert sorted(a.extra) == sorted(b.extra)
    for k in a.extra:
        assert torch.equal(a.extra[k], b.extra[k]), k


def test_a_causal_cache_serves_every_max_text_tokens_without_encoding_again(ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = cached_conditioning(_qwen(ckpt, 16), PROMPTS, cache)
    (path,) = cache.iterdir()
    assert path == prompt_cache_path(_qwen(ckpt, 80), PROMPTS, cache)  # the key has no max_text_tokens
    direct = {t: _qwen(ckpt, t).encode_prompts(PROMPTS) for t in (8, 16, 80)}  # the encoder run with each T
    _same(first, direct[16])
    lengths = sorted(int(n) for n in direct[80].mask.sum(1))
    assert lengths[0] <= 8 < lengths[1] and 16 < lengths[2] < 80  # cut at 8 and at 16, padded at 80
    from spotlight.models.families.qwen_image import QwenImageFamily

    def no_encoder(*a, **k):
        raise AssertionError("the text encoder was loaded for a cached prompt set")

    monkeypatch.setattr(QwenImageFamily, "_load_text_pipeline", no_encoder)
    for t in (8, 80):  # a shorter and a longer max_text_tokens: cut or padded on load, bit for bit
        got = cached_conditioning(_qwen(ckpt, t), PROMPTS, cache)
        _same(got, direct[t])
        assert got.embeds.shape == (3, t, 32) and got.extra["neg.embeds"].shape == (1, t, 32)


def test_a_bidirectional_encoder_cannot_be_cut_so_its_cache_is_per_length(tmp_path):
    from spotlight.models.families.flux import FluxFamily

    flux_dir = FluxFamily.make_random_checkpoint(tmp_path / "flux", seed=0, image_size=32)

    def flux(t):
        return get_family(ModelConfig(family="flux", pretrained_path=str(flux_dir), image_size=32, max_text_tokens=t))

    short, long = flux(8).encode_prompts(PROMPTS[:1]), flux(16).encode_prompts(PROMPTS[:1])
    # T5 attends over the padding to max_text_tokens: the first 8 tokens of the 16-token encoding differ
    assert not torch.allclose(short.embeds[0], long.embeds[0, :8])
    assert prompt_cache_path(flux(8), PROMPTS, tmp_path) != prompt_cache_path(flux(16), PROMPTS, tmp_path)
    tiny = [get_family(ModelConfig(max_text_tokens=t)) for t in (8, 16)]  # MiniLM: bidirectional too
    assert prompt_cache_path(tiny[0], PROMPTS, tmp_path) != prompt_cache_path(tiny[1], PROMPTS, tmp_path)


def test_pack_and_unpack():
    embeds = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    rows, lengths = pack_rows(embeds, mask)
    assert lengths == [2, 4] and torch.equal(rows[0], embeds[0, :2])
    e, m = unpack_stream(torch.cat(rows), torch.tensor(lengths), 3)
    assert torch.equal(m, torch.tensor([[1, 1, 0], [1, 1, 1]])) and torch.equal(e[1], embeds[1, :3])
    assert torch.equal(e[0, 2], torch.zeros(3))
    with pytest.raises(ValueError, match="ones followed by zeros"):
        pack_rows(embeds, torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]]))  # left padding


def test_pick_gpu():
    gib = 1 << 30
    assert pick_gpu([10 * gib, 30 * gib, 20 * gib], 18 * gib) == 1
    assert pick_gpu([10 * gib, 12 * gib], 18 * gib) is None  # the trainers hold them: the CPU
    assert pick_gpu([], 1) is None


@pytest.mark.procs  # a spawned encoding process (on the CPU here: the GPU route's process)
def test_encoding_in_a_child_process_reports_progress_and_fills_the_cache(ckpt, tmp_path):
    prompts = [f"prompt number {i}" for i in range(20)]  # two batches of 16
    model = ModelConfig(family="qwen-image", pretrained_path=str(ckpt), image_size=32, max_text_tokens=8)
    starts, done = [], []
    cond = encode_run_prompts(
        model,
        prompts,
        tmp_path / "cache",
        on_start=lambda where, n: starts.append((where, n)),
        on_progress=done.append,
        child_device="cpu",
    )
    assert starts == [("cpu (float32)", 20)] and done == [16, 20]
    _same(cond, get_family(model).encode_prompts(prompts))
    again = encode_run_prompts(model, prompts, tmp_path / "cache", on_start=starts.append, child_device="cpu")
    assert len(starts) == 1  # a cache hit: no child, no progress
    _same(again, cond)
    missing = ModelConfig(family="qwen-image", pretrained_path=str(tmp_path / "nowhere"), image_size=32)
    with pytest.raises(EncodeError, match="nowhere"):
        encode_run_prompts(missing, prompts, tmp_path / "cache", child_device="cpu")
