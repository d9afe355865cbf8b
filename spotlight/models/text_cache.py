"""Prompt encodings kept uncut and packed, cut to ``model.max_text_tokens`` when read.

A causal text encoder (Qwen2.5-VL: each token attends only to the tokens before it) gives a
prompt's first ``T`` token embeddings the same values whatever follows them, so the encoding
cut to ``T`` tokens is the first ``T`` rows of the uncut one. The prompt cache of such a family
(:attr:`~spotlight.models.families.base.ModelFamily.text_encoding_is_causal`) therefore
stores every prompt's whole encoding, and a run with another ``model.max_text_tokens`` cuts
(or zero-pads) it on load instead of encoding the prompt set again. Bidirectional encoders
(T5, CLIP, BERT-like: every token sees the padding up to ``T``) cannot be cut, and their cache
entries stay per ``max_text_tokens`` (docs/planning.md §6).

Layout (a safetensors file's tensors): for each text stream ``NAME`` (``embeds`` and, with
true CFG, ``neg.embeds``), ``packed.NAME [sum of lengths, D]`` holds the real tokens of every
row one after the other and ``lengths.NAME [rows] int64`` their counts; other tensors keep
their :meth:`~spotlight.rl.sampler.Conditioning.to_tensors` names (``cond.<extra>``).
Packing stores no padding, so the file is at most the size of the longest cut it serves.
"""

from __future__ import annotations

import torch

from spotlight.rl.sampler import Conditioning

PACKED = "packed."
LENGTHS = "lengths."


def pack_rows(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """Rows of ``embeds [n, L, D]`` cut to their real tokens (``mask [n, L]``: ones, then
    zeros), as a list of ``[len_i, D]`` tensors and the lengths.

    Raises:
        ValueError: a mask row is not a run of ones followed by zeros (padding on the left
            or holes: the cut would keep the wrong tokens).
    """
    lengths = mask.to(torch.int64).sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    if not bool(((positions[None, :] < lengths[:, None]).to(mask.dtype) == mask).all()):
        raise ValueError("a text mask row is not ones followed by zeros; its encoding cannot be packed")
    lens = [int(n) for n in lengths]
    return [embeds[i, :n] for i, n in enumerate(lens)], lens


def packed_stream(name: str, rows: list[torch.Tensor], lengths: list[int], dim: int) -> dict[str, torch.Tensor]:
    """The cache tensors of text stream ``name`` from :func:`pack_rows`' pieces (float32)."""
    data = torch.cat(rows) if rows else torch.zeros(0, dim)
    return {f"{PACKED}{name}": data.float().contiguous(), f"{LENGTHS}{name}": torch.tensor(lengths, dtype=torch.int64)}


def unpack_stream(packed: torch.Tensor, lengths: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embeds [n, T, D] float32, mask [n, T] int64)``: each row's first ``min(len, T)``
    tokens, zero-padded to ``T = max_tokens`` (what an encoder run with ``T`` gives when it is
    causal)."""
    n, dim = int(lengths.shape[0]), int(packed.shape[1])
    embeds = torch.zeros(n, max_tokens, dim, dtype=torch.float32)
    mask = torch.zeros(n, max_tokens, dtype=torch.int64)
    start = 0
    for i, length in enumerate(int(x) for x in lengths):
        keep = min(length, max_tokens)
        embeds[i, :keep] = packed[start : start + keep]
        mask[i, :keep] = 1
        start += length
    return embeds, mask


def is_packed(tensors: dict[str, torch.Tensor]) -> bool:
    return f"{PACKED}embeds" in tensors


def unpack_conditioning(tensors: dict[str, torch.Tensor], max_tokens: int) -> Conditioning:
    """The :class:`Conditioning` of a packed cache, every text stream cut or padded to
    ``max_tokens`` (``neg.embeds`` / ``neg.mask`` for ``packed.neg.embeds``)."""
    embeds, mask = unpack_stream(tensors[f"{PACKED}embeds"], tensors[f"{LENGTHS}embeds"], max_tokens)
    cond = Conditioning.from_tensors(
        {k: v for k, v in tensors.items() if k.startswith("cond.")} | {"cond.embeds": embeds}
    )
    cond.mask = mask
    for key in tensors:
        if key.startswith(PACKED) and key != f"{PACKED}embeds":
            name = key[len(PACKED) :]  # e.g. "neg.embeds"
            e, m = unpack_stream(tensors[key], tensors[f"{LENGTHS}{name}"], max_tokens)
            cond.extra[name] = e
            cond.extra[name.removesuffix("embeds") + "mask"] = m
    return cond
