"""Pictures a person would rather look at than read: sample grids and curves."""

from __future__ import annotations

import math
import pathlib
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

from spotlight.util.fonts import TextFont, text_font

GRID_GAP_PX = 8
"""Gap between tiles (and around the grid), in pixels of the written PNG."""
GRID_BACKGROUND = (236, 236, 236)
"""Light grey, so tiles with white backgrounds still show their edges."""


def wrap_to_width(text: str, font: TextFont, width_px: float) -> list[str]:
    """``text`` broken at spaces into lines at most ``width_px`` wide in ``font`` (a word wider
    than that is cut by characters); at least one line."""
    fits = lambda t: font.width(t) <= width_px  # noqa: E731
    lines: list[str] = []
    cur = ""
    for word in text.split():
        cand = f"{cur} {word}" if cur else word
        if fits(cand):
            cur = cand
            continue
        if cur:
            lines.append(cur)
        while not fits(word) and len(word) > 1:  # one word wider than the line
            k = len(word) - 1
            while k > 1 and not fits(word[:k]):
                k -= 1
            lines.append(word[:k])
            word = word[k:]
        cur = word
    lines.append(cur)
    return lines


def labelled_grid(
    rows: Sequence[tuple[str, Sequence, Sequence[str]]],
    path: pathlib.Path,
    *,
    title: str = "",
    scale: int = 4,
    colors: Sequence[Sequence[str]] | None = None,
) -> None:
    """A grid a person can judge: each row is ``(prompt, images, captions)``; the prompt is
    written above its row (wrapped to the grid's width), each caption (a verdict, a reward)
    under its image, tiles ``GRID_GAP_PX`` apart on a light grey background.

    Args:
        rows: ``(label, [3, H, W] uint8 images, one caption per image)`` per row.
        path: PNG to write (its folder is created).
        title: first line of the picture.
        scale: nearest-neighbour upscaling, so 32-pixel shapes stay sharp.
        colors: optional caption colour per image (e.g. green for a pass, red for a fail).
    """
    if not rows:
        return
    h, w = np.asarray(rows[0][1][0]).shape[1:]
    font, small = text_font(13), text_font(11)  # any script: spotlight.util.fonts
    tw, th = w * scale, h * scale
    gap, line_h, cap_h = GRID_GAP_PX, 16, 15
    ncol = max(len(r[1]) for r in rows)
    width = max(ncol * (tw + gap) + gap, 360)
    labels = [wrap_to_width(label, font, width - 2 * gap) for label, _, _ in rows]
    title_h = 22 if title else 0
    height = title_h + sum(len(lines) * line_h + 2 + th + cap_h + gap for lines in labels) + gap
    canvas = Image.new("RGB", (width, height), GRID_BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    if title:
        font.draw(draw, (gap, 4), title, fill="black")
    y = title_h + gap
    for r, (_, images, captions) in enumerate(rows):
        for line in labels[r]:
            font.draw(draw, (gap, y), line, fill=(20, 20, 120))
            y += line_h
        y += 2
        for c, img in enumerate(images):
            arr = np.asarray(img).transpose(1, 2, 0)
            x = gap + c * (tw + gap)
            canvas.paste(Image.fromarray(arr).resize((tw, th), Image.NEAREST), (x, y))
            color = colors[r][c] if colors is not None else "black"
            if c < len(captions):
                small.draw(draw, (x + 1, y + th + 1), captions[c], fill=color)
        y += th + cap_h + gap
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
    """Reward mean ± std per iteration (numbered from 1), and iteration times, from
    ``metrics.jsonl`` rows; written as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    it = [h["iteration"] + 1 for h in history]  # 1-based, as on screen (metrics.jsonl keeps the 0-based index)
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
    for key, label in (
        ("time/rollout_s", "rollout"),
        ("time/train_s", "train"),
        ("time/explore_critical_path_s", "exploration on critical path"),
    ):
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
