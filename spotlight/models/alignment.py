"""CPU weights a model computes with start on a 64-byte boundary.

CPU kernels take another vector path for data off that boundary and round differently: a
one-row GEMM (a time embedding at batch 1) with its weight 8 bytes off the boundary gave a
result 1.2e-7 away from the same GEMM on an aligned copy, and one 4 bytes off 3.8e-6. Workers
must compute a rollout bit for bit alike however they got their weights (loaded by diffusers,
memory-mapped from a weight cache or a checkpoint, received into a flat buffer: paper §3.2.2,
docs/architecture.md §6), so every tensor a model computes with on the CPU is
either already on the boundary, as torch's allocator places every tensor of its own, or
replaced by an aligned copy. Tensors of a memory-mapped safetensors file (diffusers'
``from_pretrained`` on the CPU, our weight caches) sit wherever the file's data offsets put
them, so on the CPU most become private copies. Callers realign where a model computes on the
CPU, after moving it to its device (a Rollout Worker's model, an SP group member's weights),
never in a loader: a GPU worker would otherwise copy a whole 41 GB Qwen-Image out of the page
cache on its way to the device, where the allocator aligns the copy anyway.
"""

from __future__ import annotations

import torch

ALIGN_BYTES = 64


def is_aligned(t: torch.Tensor) -> bool:
    """True for a tensor off the CPU, an empty one, or one whose data starts on the boundary."""
    return t.device.type != "cpu" or t.numel() == 0 or t.data_ptr() % ALIGN_BYTES == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when :func:`is_aligned`, else a contiguous copy in memory of torch's own
    (aligned) allocation."""
    return t if is_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def realign_(module: torch.nn.Module) -> torch.nn.Module:
    """Give every parameter and buffer of ``module`` that is off the boundary an aligned copy
    (in place: the parameter objects stay, so optimisers and hooks built on them still hold).
    Returns ``module``."""
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None and not is_aligned(p):
                p.data = aligned(p.data)
        for name, b in sub._buffers.items():
            if b is not None and not is_aligned(b):
                sub._buffers[name] = aligned(b)
    return module
