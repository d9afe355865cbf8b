"""The aesthetic scorer (``spotlight/rewards/aesthetic.py``): the head over normalised CLIP image
embeddings, loaded from safetensors or a tensors-only .pth, and clear errors for bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from spotlight.errors import SpotlightError
from spotlight.rewards.aesthetic import AestheticScorer, build_head, load_head_state


def _head_state(width: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    dims = [width, 32, 16, 8, 4, 1]
    return {
        f"layers.{i}.{kind}": (torch.randn(dims[j + 1], dims[j]) if kind == "weight" else torch.randn(dims[j + 1]))
        for j, i in enumerate((0, 2, 4, 6, 7))
        for kind in ("weight", "bias")
    }


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from spotlight.models.tiny_clip import make_random_clip

    return make_random_clip(tmp_path_factory.mktemp("clip"))


def test_scores_are_the_head_on_normalised_clip_embeddings(clip_dir, tmp_path):
    from safetensors.torch import save_file

    from spotlight.rewards.server import ClipScorer, _pooled

    sd = _head_state(16)
    save_file(sd, tmp_path / "head.safetensors")
    torch.save(sd, tmp_path / "head.pth")
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 255, (32, 32, 3), dtype=np.uint8)) for i in range(3)]
    a = AestheticScorer(clip_dir, tmp_path / "head.safetensors", device="cpu")(images, ["x"] * 3)
    b = AestheticScorer(clip_dir, tmp_path / "head.pth", device="cpu")(images, ["x"] * 3)
    clip = ClipScorer(clip_dir, device="cpu")
    with torch.no_grad():
        px = clip.image_processor(images=images, return_tensors="pt")["pixel_values"]
        emb = _pooled(clip.model.get_image_features(pixel_values=px)).float()
        want = build_head(sd)(emb / emb.norm(dim=-1, keepdim=True)).squeeze(-1).tolist()
    assert a == pytest.approx(want, rel=1e-5) and b == pytest.approx(want, rel=1e-5)
    assert len(set(round(v, 6) for v in a)) == 3  # the images differ, so do their scores


def test_bad_heads_are_one_clear_error(clip_dir, tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(SpotlightError, match="no such file"):
        load_head_state(tmp_path / "missing.pth")
    save_file({"w": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(SpotlightError, match="missing layers.0.weight"):
        load_head_state(tmp_path / "other.safetensors")
    (tmp_path / "junk.pth").write_bytes(b"not a pickle")
    with pytest.raises(SpotlightError, match="not a tensor state dict"):
        load_head_state(tmp_path / "junk.pth")
    save_file(_head_state(768), tmp_path / "vitl.safetensors")
    with pytest.raises(SpotlightError, match="768-wide"):
        AestheticScorer(clip_dir, tmp_path / "vitl.safetensors", device="cpu")
    from spotlight.rewards.server import build_scorer

    with pytest.raises(SpotlightError, match="--aesthetic-head"):
        build_scorer("aesthetic", clip_path=clip_dir)
