"""Pictures a person would rather look at than read: sample grids and curves."""

from __future__ import annotations

import math
import pathlib
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw


def sample_grid(images: Sequence, slots: Sequence[int], rewards: Sequence[float | None], path: pathlib.Path, *, title: str = "", scale: int = 3) -> None:
    """One row per prompt group, one column per seed; reward printed under each image.

    Args:
        images: ``[3, H, W] uint8`` tensors or arrays.
        slots: prompt-group index of each image (rows).
        rewards: reward per image (None = not scored).
        path: PNG to write.
    """
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        rows.setdefault(int(s), []).append(i)
    h, w = np.asarray(images[0]).shape[1:]
    cell_w, cell_h = w * scale, h * scale + 12
    ncol = max(len(v) for v in rows.values())
    canvas = Image.new("RGB", (ncol * cell_w, len(rows) * cell_h + 14), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((2, 1), title, fill="black")
    for r, (slot, idx) in enumerate(sorted(rows.items())):
        for c, i in enumerate(idx):
            arr = np.asarray(images[i]).transpose(1, 2, 0)
            tile = Image.fromarray(arr).resize((w * scale, h * scale), Image.NEAREST)
            x, y = c * cell_w, 14 + r * cell_h
            canvas.paste(tile, (x, y))
            rew = rewards[i]
            draw.text((x + 1, y + h * scale), "?" if rew is None else f"{rew:.2f}", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)


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
