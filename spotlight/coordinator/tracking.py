"""Experiment tracking: TensorBoard event files (default) and Weights & Biases (offline).

The coordinator feeds a :class:`Tracker` once with the resolved config (TOML text) and at the
end of every iteration with its metrics row (``metrics.jsonl``) and, when one was written, its
sample grid (PNG). Steps are 1-based iteration numbers, as on the console and in
``spotlight status``. A tracker that fails is logged once and then left alone: tracking must
never stop a run.

TensorBoard's writer (``torch.utils.tensorboard``) and ``wandb`` are imported only when a
tracker of that kind is opened, so ``import spotlight`` stays light.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import pathlib
from typing import Protocol, Sequence

from spotlight.errors import SpotlightError

log = logging.getLogger("spotlight.coordinator.tracking")

KINDS = ("tensorboard", "wandb")


class TrackingError(SpotlightError):
    """A tracker that cannot be used (unknown kind, package not installed)."""


class Tracker(Protocol):
    def log_config(self, text: str) -> None:
        """The resolved run config (TOML text), once at start."""

    def log_metrics(self, step: int, row: dict) -> None:
        """The finite numeric values of a metrics row (keys as in ``metrics.jsonl``) at ``step``."""

    def log_image(self, step: int, tag: str, path: pathlib.Path) -> None:
        """A picture (PNG, e.g. the sample grid) at ``step``."""

    def close(self) -> None:
        """Flush and close."""


def scalars(row: dict) -> dict[str, float]:
    """The finite int/float values of ``row`` (booleans, strings, nested dicts and NaN left out),
    without its ``iteration`` key (that is the step)."""
    out = {}
    for k, v in row.items():
        if k == "iteration" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


def check_trackers(kinds: Sequence[str]) -> None:
    """Raise :class:`TrackingError` (one line) if a tracker in ``kinds`` is unknown or its
    package is not installed; call it before a run starts."""
    for k in kinds:
        if k not in KINDS:
            raise TrackingError(f"unknown tracker {k!r}: expected one of {', '.join(KINDS)} (or none)")
        if k == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            raise TrackingError(
                "tracker 'tensorboard' needs the tensorboard package: pip install tensorboard "
                "(or run.trackers = [] / --tracker none)"
            )
        if k == "wandb" and importlib.util.find_spec("wandb") is None:
            raise TrackingError(
                "tracker 'wandb' needs the wandb package: pip install wandb "
                "(it logs offline into <run_dir>/wandb; `wandb sync` uploads later)"
            )


class TensorBoardTracker:
    """Event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``): every metric as a
    scalar, images as ``[H, W, 3] uint8`` image summaries, the config as text.

    Args:
        log_dir: directory of the event files (``<run_dir>/tensorboard``).
        first_step: the first step this writer logs; events of an earlier writer at this step
            or later are discarded by TensorBoard (a resumed run repeats an iteration).
    """

    def __init__(self, log_dir: pathlib.Path, *, first_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step if first_step > 1 else None)

    def log_config(self, text: str) -> None:
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)  # markdown code block
        self.writer.flush()

    def log_metrics(self, step: int, row: dict) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_image(self, step: int, tag: str, path: pathlib.Path) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
        self.writer.add_image(tag, arr, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run in offline mode under ``run_dir/wandb`` (``wandb sync`` uploads it).

    Args:
        run_dir: the run directory (its name is the W&B run name).
        config_text: the resolved config (TOML), parsed into the run's config.
    """

    def __init__(self, run_dir: pathlib.Path, *, config_text: str = ""):
        import tomllib

        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project="spotlight",
            name=run_dir.name,
            config=tomllib.loads(config_text) if config_text else None,
            reinit=True,
        )

    def log_config(self, text: str) -> None:
        pass  # given to wandb.init

    def log_metrics(self, step: int, row: dict) -> None:
        self.run.log(scalars(row), step=step)

    def log_image(self, step: int, tag: str, path: pathlib.Path) -> None:
        self.run.log({tag: self.wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Fans each call out to several trackers; one that raises is logged and dropped."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self.trackers = list(trackers)

    def _each(self, method: str, *args) -> None:
        for t in list(self.trackers):
            try:
                getattr(t, method)(*args)
            except Exception as exc:  # tracking must never stop a run
                log.warning(
                    "tracker %s failed (%s: %s): no more tracking with it in this run",
                    type(t).__name__,
                    type(exc).__name__,
                    exc,
                )
                self.trackers.remove(t)

    def log_config(self, text: str) -> None:
        self._each("log_config", text)

    def log_metrics(self, step: int, row: dict) -> None:
        self._each("log_metrics", step, row)

    def log_image(self, step: int, tag: str, path: pathlib.Path) -> None:
        self._each("log_image", step, tag, path)

    def close(self) -> None:
        self._each("close")
        self.trackers.clear()


def open_trackers(
    kinds: Sequence[str], run_dir: pathlib.Path, *, config_text: str = "", first_step: int = 1
) -> Trackers:
    """The trackers ``kinds`` of a run in ``run_dir``, already given ``config_text``.

    Args:
        kinds: subset of :data:`KINDS` (empty: a :class:`Trackers` that does nothing).
        run_dir: the run directory (TensorBoard writes ``run_dir/tensorboard``, W&B ``run_dir/wandb``).
        config_text: the resolved config as TOML.
        first_step: the first step (1-based iteration) this run will log (> 1 after a resume).

    Raises:
        TrackingError: an unknown kind or a missing package (:func:`check_trackers`).
    """
    check_trackers(kinds)
    made: list[Tracker] = []
    for k in dict.fromkeys(kinds):
        if k == "tensorboard":
            made.append(TensorBoardTracker(pathlib.Path(run_dir) / "tensorboard", first_step=first_step))
        else:
            made.append(WandbTracker(pathlib.Path(run_dir), config_text=config_text))
    out = Trackers(made)
    if config_text:
        out.log_config(config_text)
    return out
