"""What a run leaves on disk and on the console: metrics, the request log, checkpoints, the
progress line, sample grids, rollouts and the status file.

It owns every file the run writes about itself, so the iteration logic never opens files and
a resumed run continues the same files without a gap (docs/architecture.md, "Crash and resume").

* ``metrics.jsonl`` — one strict-JSON row per finished iteration (NaN → null). Its byte
  length after iteration n is recorded in iteration n's checkpoint; a resumed run cuts the
  file back to it, so rows of a lost iteration never appear twice.
* ``requests.jsonl`` — final status and transition history of every request, appended as
  requests are retired (the terminal ones of iterations before the one just finished, at
  each checkpoint; the rest when the run ends). Its byte length is recorded in each
  checkpoint like the metrics', and a resumed run cuts it back the same way.
* ``checkpoints/`` — :mod:`spotlight.store.checkpoint` (atomic, newest two kept).
* ``status.json`` — the last ``spotlight status`` snapshot (:func:`write_status`).
* ``samples/iter_NNNN.png`` — rollout sample grids (:func:`write_sample_grid`).
* ``rollouts/iter_NNNN.safetensors`` — with ``run.save_rollouts`` (:func:`save_rollouts`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from typing import Any, Sequence

from spotlight.store.checkpoint import latest_checkpoint, load_checkpoint, next_epoch, write_checkpoint
from spotlight.util.atomic_file import write_text_atomic

log = logging.getLogger("spotlight.coordinator")


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
        run_dir: the run directory.
        resume: keep existing files (a resumed run); otherwise :meth:`open` starts
            ``metrics.jsonl`` and ``requests.jsonl`` empty.
    """

    def __init__(self, run_dir: pathlib.Path, *, resume: bool = False):
        self.run_dir = pathlib.Path(run_dir)
        self.resume = resume
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.requests_path = self.run_dir / "requests.jsonl"
        self.epoch = 0
        """How many coordinators ran this run before this one (0 for a fresh run; set by :meth:`open`)."""

    def open(self) -> None:
        """Create the run's files (keep them on resume) and count the earlier coordinators."""
        self.epoch = next_epoch(self.run_dir)
        (self.run_dir / "samples").mkdir(parents=True, exist_ok=True)
        if not self.resume or not self.metrics_path.exists():
            self.metrics_path.write_text("")
        if not self.resume or not self.requests_path.exists():
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
                            "failures": r.failures,
                            "error": r.error,
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


def format_progress(row: dict, iterations: int) -> str:
    """One line for iteration ``row["iteration"]`` (0-based in the row, shown 1-based) of a
    run of ``iterations``: reward mean, rollout / train / exploration time, spot busy share of
    the training window, share of the iteration spent exploring on the critical path, the run's
    cost so far (USD); dropped or skipped work is flagged at the end. At most 100 characters for
    runs of up to 999 iterations with phases under 1000 s, a critical-path share under 10% and a
    cost under $1000."""

    def dur(s: float) -> str:
        if not math.isfinite(s):
            return "?"
        if s < 9.95:
            return f"{s:.1f}s"
        if s < 999.5:
            return f"{s:.0f}s"
        return f"{s / 60:.0f}m" if s < 5970 else f"{s / 3600:.1f}h"

    def pct(x: float | None) -> str:
        return "-" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"

    line = (
        f"iter {row['iteration'] + 1:>{len(str(iterations))}}/{iterations} reward {row['reward/mean']:+.3f}"
        f"  rollout {dur(row['time/rollout_s'])} train {dur(row['time/train_s'])}"
        f" explore {dur(row['time/explore_s'])}"
        f"  spot busy {pct(row.get('spot/busy_fraction'))} critical {pct(row.get('time/critical_path_share'))}"
        f" ${row.get('cost/usd', float('nan')):.2f}"
    )
    if row.get("train/nonfinite_samples"):
        line += f"  [{int(row['train/nonfinite_samples'])} non-finite dropped]"
    if row.get("train/skipped_steps"):
        line += f"  [{int(row['train/skipped_steps'])} steps skipped]"
    if isinstance(row.get("train/rolled_back_to"), (int, float)) and row["train/rolled_back_to"] >= 0:
        line += f"  [rolled back to v{int(row['train/rolled_back_to'])}, lr {row.get('train/learning_rate', 0):.3g}]"
    return line


def write_sample_grid(run_dir: pathlib.Path, n: int, samples: Sequence, prompts: Sequence[str], *, verdicts: bool):
    """``samples/iter_NNNN.png`` (numbered from 1) of iteration ``n``'s rollout samples
    (:class:`spotlight.rl.batch.Sample`, ordered by slot and seed), the prompt above each row and
    the reward (with ``verdicts``: pass/fail, reward 1 = every clause holds) under each image.
    Returns the path, or None without samples."""
    from spotlight.util.plots import sample_grid

    samples = sorted((s for s in samples if s.iteration == n and s.in_rollout), key=lambda s: (s.slot, s.seed))
    if not samples:
        return None
    labels = {s.slot: prompts[s.prompt_index] for s in samples}
    # strict and partial-credit rewards are both 1 exactly when every clause holds
    passed = [None if s.reward is None else s.reward >= 1.0 for s in samples] if verdicts else None
    title = f"iteration {n + 1} (rollout samples; reward under each image" + (
        ", pass = every clause of the prompt holds)" if verdicts else ")"
    )
    path = pathlib.Path(run_dir) / "samples" / f"iter_{n + 1:04d}.png"
    images, slots, rewards = [s.image for s in samples], [s.slot for s in samples], [s.reward for s in samples]
    sample_grid(images, slots, rewards, path, title=title, labels=labels, verdicts=passed)
    return path


def save_rollouts(run_dir: pathlib.Path, n: int, samples: Sequence) -> None:
    """``rollouts/iter_NNNN.safetensors``: per request id, image, window latents, log-probs, reward, seed."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for s in samples:
        out[f"{s.request_id}.image"] = s.image.contiguous()
        out[f"{s.request_id}.window_latents"] = s.window_latents.contiguous()
        out[f"{s.request_id}.log_probs"] = s.log_probs.contiguous()
        out[f"{s.request_id}.reward"] = torch.tensor([s.reward], dtype=torch.float64)
        out[f"{s.request_id}.seed"] = torch.tensor([s.seed], dtype=torch.int64)
        out[f"{s.request_id}.prompt_index"] = torch.tensor([s.prompt_index], dtype=torch.int64)
    d = pathlib.Path(run_dir) / "rollouts"
    d.mkdir(exist_ok=True)
    save_file(out, d / f"iter_{n:04d}.safetensors")


def write_status(run_dir: pathlib.Path, snapshot: dict) -> None:
    """``status.json``: the last snapshot, so ``spotlight status RUN_DIR`` can show a run whose
    coordinator has ended (written atomically: a reader never sees half a file)."""
    path = pathlib.Path(run_dir) / "status.json"
    try:
        write_text_atomic(path, json.dumps(snapshot, default=str))
    except (OSError, TypeError, ValueError) as exc:  # a status file must never stop the run
        log.warning("could not write %s: %s", path, exc)


def earlier_sessions(run_dir: pathlib.Path, st: dict) -> tuple[float, list[dict]]:
    """Run time and events of the coordinators before this one: from ``status.json`` (the last
    snapshot, saved when the previous coordinator exited or after its last iteration), else from
    the checkpoint ``st``."""
    elapsed, events = st.get("elapsed_s"), st.get("events")
    try:
        snap = json.loads((pathlib.Path(run_dir) / "status.json").read_text())
        if (
            isinstance(snap.get("elapsed_s"), (int, float))
            and snap["elapsed_s"] >= (elapsed or 0.0)
            and isinstance(snap.get("events"), list)
        ):
            elapsed, events = snap["elapsed_s"], snap["events"]
    except (OSError, ValueError, AttributeError):
        pass
    elapsed = float(elapsed) if isinstance(elapsed, (int, float)) and math.isfinite(elapsed) and elapsed > 0 else 0.0
    return elapsed, events if isinstance(events, list) else []


def write_coordinator_json(run_dir: pathlib.Path, endpoint: str, trainer_endpoint: str, keys_dir: str | None) -> None:
    """``coordinator.json``: where this coordinator listens, its pid and its keys directory (read
    by ``spotlight status``, ``spotlight keys`` and a resuming ``spotlight up``; written atomically:
    a crash leaves the old file or the new, never an empty one)."""
    info = {"endpoint": endpoint, "trainer_endpoint": trainer_endpoint, "pid": os.getpid(), "keys_dir": keys_dir}
    write_text_atomic(pathlib.Path(run_dir) / "coordinator.json", json.dumps(info))
