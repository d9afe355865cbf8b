"""What a run leaves on disk: metrics, the request log and per-iteration checkpoints.

The coordinator's third part (with the server shell :mod:`spotlight.coordinator.server` and the
iteration machine in :mod:`spotlight.coordinator.coordinator`): it owns every file the run writes
about itself, so the iteration logic never opens files and a resumed run continues the
same files without a gap (docs/architecture.md, "Crash and resume").

* ``metrics.jsonl`` — one strict-JSON row per finished iteration (NaN → null). Its byte
  length after iteration n is recorded in iteration n's checkpoint; a resumed run cuts the
  file back to it, so rows of a lost iteration never appear twice.
* ``requests.jsonl`` — final status and transition history of every request, appended as
  requests are retired (the terminal ones of iterations before the one just finished, at
  each checkpoint; the rest when the run ends). Its byte length is recorded in each
  checkpoint like the metrics', and a resumed run cuts it back the same way.
* ``checkpoints/`` — :mod:`spotlight.store.checkpoint` (atomic, newest two kept).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any

from spotlight.store.checkpoint import latest_checkpoint, load_checkpoint, next_epoch, write_checkpoint


def finite(obj):
    """NaN/inf → None, recursively, so files are strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def unfinite(row: dict) -> dict:
    """Inverse of :func:`finite` for one metrics row: top-level None → NaN."""
    return {k: (float("nan") if v is None else v) for k, v in row.items()}


class RunRecorder:
    """Files of one run directory.

    Args:
        run_dir: the run directory (exists).
        resume: keep existing files (a resumed run); otherwise start ``metrics.jsonl`` empty.
    """

    def __init__(self, run_dir: pathlib.Path, *, resume: bool = False):
        self.run_dir = pathlib.Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.epoch = next_epoch(self.run_dir)
        """How many coordinators ran this run before this one (0 for a fresh run)."""
        self.requests_path = self.run_dir / "requests.jsonl"
        if not resume or not self.metrics_path.exists():
            self.metrics_path.write_text("")
        if not resume or not self.requests_path.exists():
            self.requests_path.write_text("")

    # ------------------------------------------------------------ metrics
    def append_metrics(self, row: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(finite(row)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def metrics_bytes(self) -> int:
        return self.metrics_path.stat().st_size

    def truncate_metrics(self, size_bytes: int) -> list[dict]:
        """Cut ``metrics.jsonl`` back to ``size_bytes`` (the checkpoint's position); returns
        the rows that remain, NaN restored."""
        with self.metrics_path.open("r+b") as f:
            f.truncate(size_bytes)
        return [unfinite(json.loads(line)) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    # ------------------------------------------------------------ requests
    def append_requests(self, requests) -> None:
        """Append one JSON line per request (final status, attempts and transition history)
        to ``requests.jsonl`` and fsync it; ``requests``: iterable of
        :class:`spotlight.core.request_scheduler.Request`."""
        with self.requests_path.open("a") as f:
            for r in requests:
                f.write(
                    json.dumps(
                        {
                            "request_id": r.request_id,
                            "kind": r.kind.value,
                            "iteration": r.iteration,
                            "prompt_index": r.prompt_index,
                            "status": r.status.value,
                            "attempts": r.attempts,
                            "history": [(s.value, round(t, 4), d) for s, t, d in r.history],
                        }
                    )
                    + "\n"
                )
            f.flush()
            os.fsync(f.fileno())

    def requests_bytes(self) -> int:
        return self.requests_path.stat().st_size if self.requests_path.exists() else 0

    def truncate_requests(self, size_bytes: int) -> None:
        """Cut ``requests.jsonl`` back to ``size_bytes`` (the checkpoint's position): requests
        retired after that checkpoint are in its scheduler state again."""
        if not self.requests_path.exists():
            self.requests_path.write_text("")
            return
        with self.requests_path.open("r+b") as f:
            f.truncate(size_bytes)

    # ------------------------------------------------------------ checkpoints
    def checkpoint(self, iteration: int, state: dict[str, Any]) -> pathlib.Path:
        """Atomically write the checkpoint taken after iteration ``iteration``."""
        return write_checkpoint(self.run_dir, iteration, finite(state), keep=2)

    def latest(self) -> tuple[int, dict] | None:
        """``(iteration, state)`` of the last complete checkpoint, or None.

        Raises:
            CheckpointError: the newest checkpoint is unreadable.
        """
        got = latest_checkpoint(self.run_dir)
        if got is None:
            return None
        return got[0], load_checkpoint(got[1])
