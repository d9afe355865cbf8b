"""CPU weights a model computes with start on a 64-byte boundary (spotlight/models/alignment.py):
a tensor off it is replaced by an aligned copy with the same values, in place for a module's
parameters; an aligned one is left as it is."""

from __future__ import annotations

import torch

from spotlight.models.alignment import ALIGN_BYTES, aligned, is_aligned, realign_


def _off_boundary(t: torch.Tensor, offset_elems: int = 2) -> torch.Tensor:
    """A copy of ``t`` inside a larger buffer, ``offset_elems`` elements past a 64-byte boundary."""
    flat = torch.empty(t.numel() + 64)
    start = (-flat.data_ptr() % ALIGN_BYTES) // flat.element_size() + offset_elems
    out = flat[start : start + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def test_aligned_copies_only_a_tensor_off_the_boundary():
    t = torch.randn(8, 16)
    assert is_aligned(t) and aligned(t) is t  # torch's own allocation: no copy
    off = _off_boundary(t)
    assert not is_aligned(off)
    fixed = aligned(off)
    assert fixed.data_ptr() % ALIGN_BYTES == 0 and torch.equal(fixed, t)
    assert is_aligned(torch.empty(0)) and is_aligned(torch.empty(3, device="meta"))


def test_realign_keeps_the_parameter_objects_and_their_values():
    lin = torch.nn.Linear(16, 8)
    lin.register_buffer("scale", torch.randn(8))
    want = {n: t.detach().clone() for n, t in lin.state_dict().items()}
    weight = lin.weight
    with torch.no_grad():
        lin.weight.data = _off_boundary(lin.weight.data)
        lin.scale = _off_boundary(lin.scale)
    assert not is_aligned(lin.weight) and not is_aligned(lin.scale)
    assert realign_(lin) is lin
    assert lin.weight is weight and lin.weight.requires_grad  # the same Parameter, still trainable
    assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in lin.state_dict().values())
    assert all(torch.equal(lin.state_dict()[n], want[n]) for n in want)


def test_a_rollout_worker_computes_with_aligned_weights(tmp_path):
    """diffusers loads a checkpoint's tensors where the file puts them (off the boundary); the
    Rollout Worker realigns its model on the CPU, as an SP group member does its weights."""
    from spotlight.config import ModelConfig, SamplerConfig
    from spotlight.models.families import flux, get_family
    from spotlight.workers.rollout.worker import RolloutExecutor

    flux.make_random_checkpoint(tmp_path / "flux", seed=1)
    cfg = ModelConfig(family="flux", pretrained_path=str(tmp_path / "flux"), image_size=32, max_text_tokens=8)
    loaded = get_family(cfg).build_transformer(torch.float32)
    assert not all(is_aligned(t) for t in loaded.state_dict().values())  # what realigning is for
    ex = RolloutExecutor(cfg, SamplerConfig(num_steps=4, sde_window_size=2))
    ex.add_version(0, loaded.state_dict())
    ex._use(0)
    assert all(is_aligned(t) for t in ex.transformer.state_dict().values())
