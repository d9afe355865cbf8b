"""Aesthetic score (Flow-GRPO's ``aesthetic`` reward): the LAION improved aesthetic predictor,
an MLP over the L2-normalised CLIP ViT-L/14 image embedding that predicts a 1-10 rating.

Both parts load from local paths: a ``transformers`` ``CLIPModel`` directory (OpenAI CLIP
ViT-L/14 for the published head) and the head's weights (the published
``sac+logos+ava1-l14-linearMSE.pth``, read with ``torch.load(weights_only=True)`` so no code in
it runs, or a ``.safetensors`` file with the same keys). The head's layers (``layers.0`` …
``layers.7``: Linear 768→1024, Dropout, Linear →128, Dropout, Linear →64, Dropout, Linear →16,
Linear →1; no activations, as published) are built from the weights' shapes, so a head for
another CLIP width loads too.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from spotlight.errors import SpotlightError

LINEAR_LAYERS = (0, 2, 4, 6, 7)
"""Indices of the head's Linear layers in its ``nn.Sequential`` (the others are Dropout)."""


def load_head_state(path: str | pathlib.Path) -> dict:
    """The head's state dict from ``path`` (``.safetensors``, or a ``.pth``/``.pt`` of tensors only).

    Raises:
        SpotlightError: a missing file, a file that is not a tensor state dict, or missing layers.
    """
    import torch

    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise SpotlightError(f"--aesthetic-head {p}: no such file")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p))
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle/safetensors raise many kinds
        raise SpotlightError(f"--aesthetic-head {p}: not a tensor state dict ({type(exc).__name__}: {exc})") from None
    sd = {k.removeprefix("model."): v for k, v in dict(sd).items()}
    missing = [f"layers.{i}.weight" for i in LINEAR_LAYERS if f"layers.{i}.weight" not in sd]
    if missing:
        raise SpotlightError(f"--aesthetic-head {p}: not an aesthetic predictor head (missing {', '.join(missing)})")
    return sd


def build_head(sd: dict):
    """The head as ``nn.Sequential`` with ``sd`` loaded (layer widths from its weights)."""
    import torch
    from torch import nn

    drop = {1: 0.2, 3: 0.2, 5: 0.1}
    layers: list[nn.Module] = []
    for i in range(8):
        if i in LINEAR_LAYERS:
            w = sd[f"layers.{i}.weight"]
            layers.append(nn.Linear(w.shape[1], w.shape[0]))
        else:
            layers.append(nn.Dropout(drop[i]))
    head = nn.Sequential()
    head.add_module("layers", nn.Sequential(*layers))
    head.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()})
    return head.eval()


class AestheticScorer:
    """The aesthetic predictor's rating of each image (the prompt is not used)."""

    thread_safe = False

    def __init__(self, clip_path, head_path, *, device: str | None = None, batch_size: int = 32):
        from spotlight.rewards.server import ClipScorer

        self.clip = ClipScorer(clip_path, device=device, batch_size=batch_size)
        self.head = build_head(load_head_state(head_path)).to(self.clip.device)
        width = self.head.layers[0].in_features
        proj = int(self.clip.model.config.projection_dim)
        if width != proj:
            raise SpotlightError(
                f"--aesthetic-head expects {width}-wide CLIP embeddings but the CLIP model gives {proj} "
                "(the published head is for CLIP ViT-L/14)"
            )

    def __call__(self, images: Sequence, prompts: Sequence[str]) -> list[float]:
        import torch

        from spotlight.rewards.server import _pooled

        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        out: list[float] = []
        with torch.no_grad():
            for lo in range(0, len(images), self.clip.batch_size):
                imgs = [im.convert("RGB") for im in images[lo : lo + self.clip.batch_size]]
                pixels = self.clip.image_processor(images=imgs, return_tensors="pt")["pixel_values"]
                emb = _pooled(self.clip.model.get_image_features(pixel_values=pixels.to(self.clip.device))).float()
                emb = emb / emb.norm(dim=-1, keepdim=True)
                out.extend(float(v) for v in self.head(emb).squeeze(-1).cpu().tolist())
        return out
