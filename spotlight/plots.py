"""Pictures a person would rather look at than read: sample grids and curves."""

from __future__ import annotations

import math
import pathlib
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed bitmap font
        return ImageFont.load_default()


def labelled_grid(rows: Sequence[tuple[str, Sequence, Sequence[str]]], path: pathlib.Path, *, title: str = "", scale: int = 4, colors: Sequence[Sequence[str]] | None = None) -> None:
    """A grid a person can judge: each row is ``(prompt, images, captions)``; the prompt is
    written above its row and each caption (a verdict, a reward) under its image.

    Args:
        rows: ``(label, [3, H, W] uint8 images, one caption per image)`` per row.
        path: PNG to write.
        title: first line of the picture.
        scale: nearest-neighbour upscaling, so 32-pixel shapes stay sharp.
        colors: optional caption colour per image (e.g. green for a pass, red for a fail).
    """
    if not rows:
        return
    h, w = np.asarray(rows[0][1][0]).shape[1:]
    font, small = _font(13), _font(11)
    tw, th = w * scale, h * scale
    pad, label_h, cap_h = 4, 18, 15
    ncol = max(len(r[1]) for r in rows)
    width = max(ncol * (tw + pad) + pad, 360)
    title_h = 22 if title else 0
    canvas = Image.new("RGB", (width, title_h + len(rows) * (label_h + th + cap_h + pad)), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((pad, 3), title, fill="black", font=font)
    y = title_h
    for r, (label, images, captions) in enumerate(rows):
        draw.text((pad, y + 2), label, fill=(20, 20, 120), font=font)
        y += label_h
        for c, img in enumerate(images):
            arr = np.asarray(img).transpose(1, 2, 0)
            x = pad + c * (tw + pad)
            canvas.paste(Image.fromarray(arr).resize((tw, th), Image.NEAREST), (x, y))
            color = colors[r][c] if colors is not None else "black"
            if c < len(captions):
                draw.text((x + 1, y + th + 1), captions[c], fill=color, font=small)
        y += th + cap_h + pad
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)


def sample_grid(
    images: Sequence,
    slots: Sequence[int],
    rewards: Sequence[float | None],
    path: pathlib.Path,
    *,
    title: str = "",
    scale: int = 4,
    labels: dict[int, str] | None = None,
    verdicts: Sequence[bool | None] | None = None,
) -> None:
    """One row per prompt group (its prompt above it), one column per seed; under each image
    its reward, and its verdict (✓/✗, green/red) when the reward has one.

    Args:
        images: ``[3, H, W] uint8`` tensors or arrays.
        slots: prompt-group index of each image (rows).
        rewards: reward per image (None = not scored).
        path: PNG to write.
        labels: text above each row, by slot (the prompt).
        verdicts: pass/fail per image (None = no verdict).
    """
    order: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        order.setdefault(int(s), []).append(i)
    rows, colors = [], []
    for slot, idx in sorted(order.items()):
        caps, cols = [], []
        for i in idx:
            rew = rewards[i]
            text = "?" if rew is None else f"{rew:.2f}"
            v = None if verdicts is None else verdicts[i]
            if v is not None:
                text = ("pass " if v else "fail ") + text
            caps.append(text)
            cols.append("black" if v is None else ((0, 140, 0) if v else (200, 0, 0)))
        rows.append(((labels or {}).get(slot, f"group {slot}"), [images[i] for i in idx], caps))
        colors.append(cols)
    labelled_grid(rows, path, title=title, scale=scale, colors=colors)


def reward_curve(history: list[dict], path: pathlib.Path) -> None:
    """Reward mean ± std per iteration, plus control-group std, and iteration time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    it = [h["iteration"] for h in history]
    mean = np.array([h["reward/mean"] for h in history])
    std = np.array([h["reward/std"] for h in history])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax = axes[0]
    ax.plot(it, mean, marker="o", label="reward mean")
    ax.fill_between(it, mean - std, mean + std, alpha=0.2, label="± std")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.legend()
    ax.grid(alpha=0.3)
    ax = axes[1]
    for key, label in (("time/rollout_s", "rollout"), ("time/train_s", "train"), ("time/explore_critical_path_s", "exploration on critical path")):
        vals = [h.get(key, math.nan) for h in history]
        ax.plot(it, vals, marker=".", label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
