"""Tiny CLIP and T5 tokenizers built offline (no hub download), for random-weight checkpoints.

The SD3 and FLUX families' test checkpoints (``make_random_checkpoint`` in
``spotlight/models/families/sd3.py`` / ``flux.py``) hold the real diffusers/transformers
classes, so their ``tokenizer*/`` folders must load with the classes the pipelines name:
``CLIPTokenizer.from_pretrained(dir)`` and ``T5TokenizerFast.from_pretrained(dir)``. This
module builds such tokenizers from a small, fixed, deterministic vocabulary and saves them
with ``save_pretrained``.

transformers 5.x notes: ``CLIPTokenizer`` and ``T5Tokenizer`` are both backed by the
*tokenizers* library (``CLIPTokenizerFast is CLIPTokenizer`` and
``T5TokenizerFast is T5Tokenizer``); their constructors take the vocabulary directly
(``vocab=``/``merges=`` for CLIP's byte-level BPE, ``vocab=[(piece, score), ...]`` for T5's
Unigram) and rebuild normaliser, pre-tokeniser and post-processor themselves, and
``from_pretrained`` re-runs that constructor on the vocabulary stored in ``tokenizer.json``.
So the tokenizers are built through those constructors (not from a hand-made
``tokenizers.Tokenizer``), which makes the saved folder reload identically.

Vocabulary sizes (the text encoders' ``vocab_size`` must be at least this):

* :data:`CLIP_VOCAB_SIZE` = 256 byte symbols + 256 ``"</w>"`` variants + len(:data:`CLIP_MERGES`)
  merged symbols + ``<|startoftext|>`` + ``<|endoftext|>`` = 526; ``<|startoftext|>`` is
  id 524, ``<|endoftext|>`` (eos, pad and unk, as in OpenAI CLIP) id 525 — the largest id,
  so CLIP's legacy arg-max pooling and the eos-id pooling agree.
* :data:`T5_VOCAB_SIZE`: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2, then ``"▁"``, the
  printable ASCII characters (bare and ``"▁"``-prefixed) and a few whole words; no
  ``<extra_id_*>`` sentinels (``extra_ids=0``).
"""

from __future__ import annotations

import os
import string

# A handful of merges so the BPE actually merges something (checked by the tests):
# "th", "the</w>", "an", "and</w>", "in", "on</w>", "er", "ca", "cat</w>", "at</w>", "do", "dog</w>".
CLIP_MERGES: tuple[tuple[str, str], ...] = (
    ("t", "h"),
    ("th", "e</w>"),
    ("a", "n"),
    ("an", "d</w>"),
    ("i", "n"),
    ("o", "n</w>"),
    ("e", "r"),
    ("c", "a"),
    ("ca", "t</w>"),
    ("a", "t</w>"),
    ("d", "o"),
    ("do", "g</w>"),
)
CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"
CLIP_MAX_LENGTH = 77
"""``model_max_length`` of the CLIP tokenizers (the pipelines' ``tokenizer_max_length``)."""

T5_WORDS: tuple[str, ...] = ("the", "a", "of", "and", "photo", "cat", "dog", "red", "blue", "on", "in", "with")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte → printable unicode symbol table (256 entries): printable Latin-1
    bytes map to themselves, the others to code points from 256 upward."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The CLIP BPE vocabulary and merges (deterministic).

    Returns:
        ``(vocab, merges)``: ``vocab`` maps the 256 byte symbols (ids 0-255), their
        ``"</w>"`` end-of-word variants (256-511), one symbol per merge (512-523) and the
        two special tokens (524, 525) to ids; ``merges`` is :data:`CLIP_MERGES` as a list.
    """
    symbols = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for s in symbols:
        vocab[s] = len(vocab)
    for s in symbols:
        vocab[s + "</w>"] = len(vocab)
    for a, b in CLIP_MERGES:
        vocab[a + b] = len(vocab)
    vocab[CLIP_BOS] = len(vocab)
    vocab[CLIP_EOS] = len(vocab)
    return vocab, list(CLIP_MERGES)


CLIP_VOCAB_SIZE = len(clip_vocab()[0])


def t5_vocab() -> list[tuple[str, float]]:
    """The T5 Unigram vocabulary: ``[(piece, log-probability score), ...]`` with
    ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2 (T5's fixed special ids).

    Whole words score higher than single characters, so known words stay one piece.
    """
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    chars = [c for c in string.printable if not c.isspace()]
    for c in chars:
        pieces.append(("▁" + c, -6.0))
    for c in chars:
        pieces.append((c, -7.0))
    for w in T5_WORDS:
        pieces.append(("▁" + w, -2.0))
    return pieces


T5_VOCAB_SIZE = len(t5_vocab())


def build_clip_tokenizer(directory: str | os.PathLike | None = None, *, pad_token: str = CLIP_EOS):
    """A byte-level BPE :class:`transformers.CLIPTokenizer` with :data:`CLIP_VOCAB_SIZE` tokens.

    Args:
        directory: when given, the tokenizer is saved there (``save_pretrained``: writes
            ``tokenizer.json``, ``tokenizer_config.json`` …) so that
            ``CLIPTokenizer.from_pretrained(directory)`` loads it offline.
        pad_token: padding token (``<|endoftext|>`` like CLIP-L; SD3's CLIP-G pads with
            ``"!"``, id 0 here).

    Returns:
        The ``CLIPTokenizer`` (``model_max_length`` = 77, bos id 524, eos id 525).
    """
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab()
    tok = CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=CLIP_EOS,
        bos_token=CLIP_BOS,
        eos_token=CLIP_EOS,
        pad_token=pad_token,
        model_max_length=CLIP_MAX_LENGTH,
    )
    if directory is not None:
        tok.save_pretrained(os.fspath(directory))
    return tok


def build_t5_tokenizer(directory: str | os.PathLike | None = None, *, model_max_length: int = 512):
    """A Unigram :class:`transformers.T5TokenizerFast` (``T5Tokenizer`` in transformers 5)
    with :data:`T5_VOCAB_SIZE` tokens and no sentinel ``<extra_id_*>`` tokens.

    Args:
        directory: when given, the tokenizer is saved there so that
            ``T5TokenizerFast.from_pretrained(directory)`` loads it offline.
        model_max_length: the tokenizer's ``model_max_length`` (T5-XXL in SD3/FLUX: 512).

    Returns:
        The tokenizer; it appends ``</s>`` (id 1) and pads with ``<pad>`` (id 0).
    """
    from transformers import T5TokenizerFast

    tok = T5TokenizerFast(
        vocab=t5_vocab(),
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=model_max_length,
    )
    if directory is not None:
        tok.save_pretrained(os.fspath(directory))
    return tok


__all__ = [
    "CLIP_MAX_LENGTH",
    "CLIP_MERGES",
    "CLIP_VOCAB_SIZE",
    "T5_VOCAB_SIZE",
    "build_clip_tokenizer",
    "build_t5_tokenizer",
    "clip_vocab",
    "t5_vocab",
]
