"""A tiny random-weight CLIP checkpoint, built offline, for tests of CLIP/PickScore scorers.

:func:`make_random_clip` writes a directory that ``transformers.CLIPModel.from_pretrained``
and ``transformers.CLIPProcessor.from_pretrained`` load with ``local_files_only=True``:

* ``config.json`` + ``model.safetensors``: a 2-layer CLIP (text and vision hidden size 32,
  image 32×32 in 8×8 patches, projection 16, 77 text positions), weights from
  ``torch.manual_seed(seed)``, so the same seed gives the same weights;
* a CLIP byte-level BPE tokenizer built here without any download: ``vocab.json`` (the 256
  GPT-2 ``bytes_to_unicode`` symbols, their ``</w>`` end-of-word variants, a few merged
  tokens, ``<|startoftext|>`` and ``<|endoftext|>``), ``merges.txt`` (``#version: 0.2``
  header + merges), and whatever ``save_pretrained`` of the installed transformers adds
  (``tokenizer.json``, ``tokenizer_config.json``);
* the image processor config (``processor_config.json`` in transformers 5,
  ``preprocessor_config.json`` in 4.x): a CLIP image processor (resize shortest edge 32,
  centre crop 32×32, the OpenAI CLIP mean/std).

Scores from this model are meaningless; it exists so that the scoring code path (processor,
tokenizer, projections, ``logit_scale``) runs for real on a CPU in well under a second.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

# Words whose BPE merges are added, so the tokenizer exercises merging (not only bytes).
_MERGE_WORDS = ("a", "photo", "of", "the", "cat", "dog", "red", "blue")
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"
TEXT_MAX_POSITIONS = 77
"""Text context length (PickScore and OpenAI CLIP truncate prompts to 77 tokens)."""
IMAGE_SIZE = 32


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins of GPT-2 byte-level BPE, in byte order 0..255.

    Printable Latin-1 bytes map to themselves; the others (control characters, space, …)
    map to code points 256, 257, … in byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def _bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP-layout vocabulary (bytes, bytes+``</w>``, merges, BOS, EOS) and its merge list."""
    tokens = _byte_symbols()
    tokens += [s + "</w>" for s in tokens]
    merges: list[tuple[str, str]] = []
    seen = set(tokens)
    for word in _MERGE_WORDS:  # ASCII words: each character is its own byte symbol
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        left = parts[0]
        for right in parts[1:]:
            merged = left + right
            if merged not in seen:
                merges.append((left, right))
                tokens.append(merged)
                seen.add(merged)
            left = merged
    tokens += [_BOS, _EOS]
    return {tok: i for i, tok in enumerate(tokens)}, merges


def _write_tokenizer_files(directory: pathlib.Path) -> dict[str, int]:
    vocab, merges = _bpe_vocab_and_merges()
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (directory / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return vocab


def make_random_clip(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write a tiny random-weight CLIP model + tokenizer + image processor into ``path``.

    Args:
        path: output directory (created if missing; existing files of the same names are
            overwritten).
        seed: ``torch.manual_seed`` for the weight initialisation.

    Returns:
        ``path`` as a :class:`pathlib.Path`; load it with ``CLIPModel.from_pretrained(path)``
        and ``CLIPProcessor.from_pretrained(path)`` (offline).
    """
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer

    try:  # transformers 5: the PIL backend (CLIPImageProcessor itself wants torchvision)
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # transformers 4.x
        from transformers import CLIPImageProcessor as ImageProcessor

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tiny-clip-tok-") as tmp:
        vocab = _write_tokenizer_files(pathlib.Path(tmp))
        tokenizer = CLIPTokenizer.from_pretrained(tmp, local_files_only=True)
    image_processor = ImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_resize=True,
        do_center_crop=True,
        do_normalize=True,
    )
    bos, eos = vocab[_BOS], vocab[_EOS]
    text_config = dict(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=TEXT_MAX_POSITIONS,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, projection_dim=16,
    )
    vision_config = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=8, num_channels=3, projection_dim=16,
    )
    config = CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=16)
    torch.manual_seed(seed)
    model = CLIPModel(config).float().eval()
    model.save_pretrained(out)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    _write_tokenizer_files(out)  # keep the plain BPE files too (slow tokenizers of older transformers)
    return out
