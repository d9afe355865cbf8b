"""Degree-invariant Ulysses: an SP group computes what one worker computes, bit for bit.

Why (paper §3.2.2, docs/architecture.md §6): a rollout interrupted at SP k and
resumed at another degree must end with the latents an uninterrupted run ends with, so a
preemption never changes what the trainer learns from. In exact arithmetic Ulysses gives one
worker's result; in float32 two things made it differ (~1e-6 after a 6-step rollout, measured
on the CPU for Qwen-Image, FLUX.1 and the tiny model):

* **key order.** Each rank holds ``[text shard r; image shard r]`` of a joint-attention
  sequence (Qwen-Image, FLUX.1 and the tiny model put text before image tokens, and diffusers'
  context-parallel plan splits both streams). The all-to-all hands every rank the whole
  sequence for its heads as ``[t_0, i_0, t_1, i_1, …]``; one worker attends over
  ``[t_0, t_1, …, i_0, i_1, …]``. Softmax's sum and the ``P·V`` reduction run over the keys
  in the order they come, so the rounding differs. Text padded to a multiple of the degree
  (:func:`~spotlight.workers.sp.group.pad_text`) adds masked keys, which change how the kernel
  blocks its sums even though they weigh zero.
* **strided shards.** diffusers' sharder hands each rank a ``chunk`` of the sequence axis: a
  strided view of ``[B, S, C]``. ``F.linear`` on a strided 3-D input with frozen weights runs
  as a batched matmul instead of one ``[B·S, C]`` GEMM, which rounds differently from the
  whole-sequence GEMM of one worker.

Inside :func:`joint_key_order` (the SP group's velocity enters it with the batch's text
length) and without autograd (rollouts), :func:`install`'s two wrappers fix both: the native
attention op gets keys, values and key mask in one worker's order with the padded keys left
out (exact: they are masked), queries staying in the gathered order (each query row is
computed on its own, and the output must go back through the all-to-all as it came); and each
shard is made contiguous (an exact copy). Outside it, diffusers' code runs untouched.
``tests/unit/workers/sp/test_group_families.py`` checks SP 2 → 1 → 2 mid-denoising against one
uninterrupted worker, bit for bit, for every family, LoRA and full fine-tuning.

Scope. Equality holds where the kernels compute a row the same whatever the number of rows or
heads beside it and wherever its weights sit. The CPU's attention kernel does for any number
of heads; its GEMM does from 4 rows up (measured for every shape of the test models and for
3072 × 3072: a GEMM of 1–3 rows takes a small-matrix path that rounds differently), so a rank
needs at least 4 token rows per stream (batch × tokens / degree: hundreds at any real image
size; a 32² FLUX.1 test image at batch 1 has 2); and weights must be 64-byte aligned in every
worker (:mod:`spotlight.models.alignment`). Measured on the CPU: Qwen-Image (LoRA and full,
padded text, true CFG), FLUX.1 and the tiny model are bit for bit across SP 2 → 1 → 2. Padded
text keeps its query rows, so a group's attention has a few more queries than one worker's; the
tests' shapes show no effect, but a kernel that blocks queries could round its last block
differently (not seen; the same row-count caveat as the GEMM's). On GPUs
cuBLAS may pick another GEMM algorithm for another number of rows, so a group there matches
one worker to rounding, not bit for bit.

How: diffusers' Ulysses path (``TemplatedUlyssesAttention``) calls the native backend's
forward op, a module global of ``diffusers.models.attention_dispatch``, after its all-to-all;
the sharder is ``diffusers.hooks.context_parallel.EquipartitionSharder.shard``. :func:`install`
wraps both once per process.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import torch

from spotlight.models.alignment import aligned

log = logging.getLogger(__name__)

_ORDER: contextvars.ContextVar[tuple[int, int, int] | None] = contextvars.ContextVar("sp_key_order", default=None)
_installed: bool | None = None


def canonical_order(x: torch.Tensor, text_tokens_local: int, degree: int, dim: int, text_pad: int = 0) -> torch.Tensor:
    """``x`` whose axis ``dim`` is ``degree`` blocks ``[text_r; image_r]`` (each block
    ``text_tokens_local`` text tokens first) reordered to ``[text_0 … text_{k-1}; image_0 …]``.

    The last ``text_pad`` text tokens (masked padding) are dropped: as keys they are masked
    out, so leaving them out is exact, and the kernel sees the very row one worker sees."""
    dim = dim % x.ndim
    size = x.shape[dim]
    if size % degree:
        raise ValueError(f"sequence of {size} tokens is not {degree} equal blocks")
    block = size // degree
    if not 0 <= text_tokens_local <= block:
        raise ValueError(f"{text_tokens_local} text tokens do not fit a block of {block}")
    blocks = x.unflatten(dim, (degree, block))
    text = blocks.narrow(dim + 1, 0, text_tokens_local).flatten(dim, dim + 1)
    image = blocks.narrow(dim + 1, text_tokens_local, block - text_tokens_local).flatten(dim, dim + 1)
    if not 0 <= text_pad <= text.shape[dim]:
        raise ValueError(f"{text_pad} padding tokens but {text.shape[dim]} text tokens")
    return torch.cat([text.narrow(dim, 0, text.shape[dim] - text_pad), image], dim=dim)


def install() -> bool:
    """Wrap diffusers' native attention forward op and its sequence sharder (idempotent).
    Returns False, with one warning, when this diffusers has neither where expected: groups
    then match one worker to rounding (~1e-6), not bit for bit."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from diffusers.hooks.context_parallel import EquipartitionSharder
        from diffusers.models import attention_dispatch as ad

        attention_op = ad._native_attention_forward_op
        shard = EquipartitionSharder.shard.__func__
    except (ImportError, AttributeError):
        log.warning(
            "this diffusers has no _native_attention_forward_op / EquipartitionSharder.shard: SP "
            "groups match one worker to rounding (~1e-6), not bit for bit"
        )
        _installed = False
        return False

    def forward_op(ctx, query, key, value, attn_mask=None, *args, **kwargs):
        order = _ORDER.get()
        if order is not None:
            text_local, degree, pad = order
            if attn_mask is not None:
                if attn_mask.shape[-1] != key.shape[1]:
                    raise ValueError(f"key mask of {attn_mask.shape[-1]} keys for {key.shape[1]} keys")
                attn_mask = canonical_order(attn_mask, text_local, degree, -1, pad)
            elif pad:  # padded keys need their mask: without one they would be attended to
                raise ValueError("padded text keys reached attention without a key mask")
            key = canonical_order(key, text_local, degree, 1, pad)
            value = canonical_order(value, text_local, degree, 1, pad)
        return attention_op(ctx, query, key, value, attn_mask, *args, **kwargs)

    def contiguous_shard(cls, tensor, dim, mesh):
        out = shard(cls, tensor, dim, mesh)
        # a contiguous chunk (batch 1) can still start off the 64-byte boundary: aligned() copies it
        return aligned(out.contiguous()) if _ORDER.get() is not None else out

    forward_op.__wrapped__ = attention_op
    contiguous_shard.__wrapped__ = shard
    ad._native_attention_forward_op = forward_op
    EquipartitionSharder.shard = classmethod(contiguous_shard)
    _installed = True
    return True


@contextlib.contextmanager
def joint_key_order(text_tokens: int, degree: int, text_pad: int = 0):
    """Inside (and without autograd): Ulysses at ``degree`` computes as one worker does (module
    doc). ``text_tokens``: the batch's text length after padding (a multiple of ``degree``), of
    which the last ``text_pad`` are masked padding."""
    if degree > 1 and text_tokens % degree:
        raise ValueError(f"{text_tokens} text tokens do not split over SP degree {degree}")
    # the grad state is read here, not in the wrapped op: diffusers calls that op inside an
    # autograd Function's forward, where grad is always off; with grad the keys must keep
    # Ulysses' order, which its backward assumes
    active = degree > 1 and not torch.is_grad_enabled()
    token = _ORDER.set((int(text_tokens) // degree, int(degree), int(text_pad)) if active else None)
    try:
        yield
    finally:
        _ORDER.reset(token)
