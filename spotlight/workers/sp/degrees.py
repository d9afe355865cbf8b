"""Which sequence-parallel (SP) degrees a model can run at (docs/architecture.md §6).

Ulysses (diffusers' ``ContextParallelConfig(ulysses_degree=k)``) splits every sequence the
model's ``_cp_plan`` names into k equal shards and, inside attention, swaps to a split over
heads. So for a degree k:

* the attention head count must be a multiple of k;
* the image-token count must be a multiple of k (image tokens cannot be padded: their RoPE
  positions come from the image grid, and a padded image token would be attended to);
* the text-token count must be a multiple of k, unless the family's transformer takes a
  text mask: Qwen-Image (and the tiny family, the same class) pad the text with masked zero
  tokens to a multiple of k, which changes nothing (padded keys are masked out, text RoPE
  positions are by index). FLUX.1 has no text mask, so ``model.max_text_tokens`` must divide;
* the transformer class needs a ``_cp_plan`` at all: ``SD3Transformer2DModel`` has none in
  diffusers 0.42, and its joint attention calls SDPA directly.

An SP group shrinks and grows one GPU at a time, so a node whose groups have
``cluster.sp_degree = k`` may run any degree from 1 to k. :func:`usable_degrees` lists the ones
that work; the node Scheduler forms only those (a group of survivors whose count does not
work splits into groups that do), and ``spotlight up`` refuses a ``k`` that does not work
itself, with the reason, before anything starts.

Pure: no torch, no files. :func:`sp_shape` reads the numbers off a model family object.
"""

from __future__ import annotations

import dataclasses

CP_FAMILIES = frozenset({"tiny", "qwen-image", "flux"})
"""Families whose diffusers transformer declares a ``_cp_plan`` (Ulysses through diffusers)."""

TEXT_MASK_FAMILIES = frozenset({"tiny", "qwen-image"})
"""Families whose transformer takes a text mask, so text tokens are padded to the degree."""

XFUSER_FAMILIES = frozenset({"tiny", "qwen-image"})
"""Families ``cluster.sp_backend = "xfuser"`` serves (xfuser's Qwen-Image wrapper; the tiny family
is the same diffusers class): :mod:`spotlight.workers.sp.xfuser_backend`."""

NO_CP_REASON = {
    "sd3": (
        "SD3Transformer2DModel has no context-parallel plan in diffusers 0.42 (its JointAttnProcessor2_0 calls "
        "SDPA directly), so an SP group cannot split it; use 1"
    ),
}


@dataclasses.dataclass(frozen=True)
class SPShape:
    """The numbers an SP degree must divide.

    Attributes:
        family: ``model.family``.
        heads: attention heads of the transformer (``num_attention_heads``).
        image_tokens: image tokens per sample (packed latent sequence length).
        text_tokens: text tokens per sample (``model.max_text_tokens``).
        pads_text: the text is padded with masked tokens to a multiple of the degree.
        true_cfg: every forward runs a positive and a negative batch (Qwen-Image with a
            guidance scale > 1), so a CFG-parallel group (``cluster.sp_cfg_parallel``) can run the
            two on different halves of its ranks.
    """

    family: str
    heads: int
    image_tokens: int
    text_tokens: int
    pads_text: bool
    true_cfg: bool = False

    @property
    def has_cp_plan(self) -> bool:
        return self.family in CP_FAMILIES


def cfg_split(shape: SPShape, degree: int, cfg_parallel: bool) -> bool:
    """Whether a group of ``degree`` runs CFG-parallel: asked for, true CFG, an even degree (the
    positive rows on one half of the ranks, the negative rows on the other; each half splits its
    sequence Ulysses-wise ``degree / 2`` ways)."""
    return cfg_parallel and shape.true_cfg and degree >= 2 and degree % 2 == 0


def degree_problem(shape: SPShape, degree: int, *, cfg_parallel: bool = False) -> str | None:
    """Why ``degree`` cannot split ``shape``, as one sentence; None when it can. With
    ``cfg_parallel`` an even degree of a true-CFG model needs only its half to split the sequence."""
    if degree < 1:
        return f"SP degree must be >= 1, got {degree}"
    if degree == 1:
        return None
    if cfg_split(shape, degree, cfg_parallel):
        return degree_problem(shape, degree // 2)
    if not shape.has_cp_plan:
        return NO_CP_REASON.get(shape.family, f"family '{shape.family}' has no context-parallel plan; use 1")
    if shape.heads % degree:
        ok = [d for d in range(1, shape.heads + 1) if shape.heads % d == 0]
        return (
            f"SP degree {degree} does not divide the transformer's {shape.heads} attention heads "
            f"(num_attention_heads; Ulysses splits heads across ranks): use one of {ok}"
        )
    if shape.image_tokens % degree:
        return (
            f"SP degree {degree} does not divide the {shape.image_tokens} image tokens per sample "
            "(model.image_size; image tokens cannot be padded)"
        )
    if not shape.pads_text and shape.text_tokens % degree:
        return (
            f"SP degree {degree} does not divide model.max_text_tokens = {shape.text_tokens} "
            f"({shape.family}'s transformer takes no text mask, so text cannot be padded): use a multiple of {degree}"
        )
    return None


def usable_degrees(shape: SPShape, max_degree: int, *, cfg_parallel: bool = False) -> list[int]:
    """The degrees 1..``max_degree`` that split ``shape`` (always includes 1)."""
    return [d for d in range(1, max(1, max_degree) + 1) if degree_problem(shape, d, cfg_parallel=cfg_parallel) is None]


def sp_shape(family) -> SPShape:
    """:class:`SPShape` of a :class:`~spotlight.models.families.base.ModelFamily` (reads the
    checkpoint's ``transformer/config.json`` and the VAE config; no weights).

    Raises:
        ModelLoadError: the checkpoint's configs cannot be read.
    """
    name = family.name
    config = family.transformer_config()
    heads = int(config.get("num_attention_heads", 1))
    latent = tuple(family.latent_shape)
    if len(latent) == 3:  # (C, h, w): SD3 patchifies inside the transformer
        p = int(config.get("patch_size", 2))
        tokens = (latent[1] // p) * (latent[2] // p)
    else:
        tokens = int(latent[0])
    true_cfg = name == "qwen-image" and family.guidance_scale > 1
    return SPShape(name, heads, tokens, int(family.cfg.max_text_tokens), name in TEXT_MASK_FAMILIES, true_cfg)


def split_into_usable(members: list, usable: list[int]) -> list[list]:
    """``members`` (in order) cut into consecutive groups whose sizes are usable degrees, largest
    first: ``[a, b, c]`` with usable ``[1, 2, 4]`` → ``[[a, b], [c]]``. ``usable`` must hold 1."""
    out, rest = [], list(members)
    while rest:
        size = max(d for d in usable if d <= len(rest))
        out.append(rest[:size])
        rest = rest[size:]
    return out
