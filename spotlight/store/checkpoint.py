"""Run checkpoints of the coordinator: one consistent directory per finished iteration.

Pure file logic (no torch, no sockets, no clocks); the coordinator decides what goes in.
Layout (docs/architecture.md, "Crash and resume")::

    RUN_DIR/checkpoints/
        LATEST                 text "iter_000007\\n": the last complete checkpoint
        iter_000006/           an older complete checkpoint (kept by retention)
        iter_000007/
            state.json         {"format": 1, "iteration": 7, "state": {...the caller's dict...}}
            <name>             any extra files the caller passed (raw bytes)
        .tmp-iter_000008-<hex>/  a write in progress (or a crashed one: ignored, cleaned up)
        EPOCH                  text "2\n": how many times a coordinator started on this run, minus 1
        train/                 the Train Workers' DCP checkpoints (not managed here)

Atomicity: every file is written into a temporary directory inside ``checkpoints/``,
fsynced, the directory fsynced, then renamed to ``iter_NNNNNN`` in one ``os.rename``
(atomic on POSIX within one file system), and the parent fsynced. Only then is
``LATEST`` replaced (temp file + fsync + ``os.replace``). A crash at any point leaves
either the previous complete checkpoint or the new one, never a half-written
``iter_NNNNNN``: a directory without a readable ``state.json`` of the current format is
not complete and is skipped by :func:`latest_checkpoint`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import sys
import uuid
from collections.abc import Iterable
from typing import Any

from spotlight.errors import SpotlightError

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "checkpoint_dir",
    "complete_checkpoints",
    "is_checkpoint_iteration",
    "latest_checkpoint",
    "load_checkpoint",
    "next_epoch",
    "prune_train_versions",
    "retire_train_versions",
    "train_checkpoint_dir",
    "train_version_path",
    "train_versions",
    "write_checkpoint",
]

CHECKPOINT_FORMAT = 1
"""Version of the ``state.json`` envelope; bump when its meaning changes."""

STATE_FILE = "state.json"
LATEST_FILE = "LATEST"
EPOCH_FILE = "EPOCH"
_TMP_PREFIX = ".tmp-"
_ITER_RE = re.compile(r"^iter_(\d{6,})$")


class CheckpointError(SpotlightError):
    """A checkpoint is missing, corrupt, or of an unknown format version."""


def checkpoint_dir(run_dir: str | os.PathLike) -> pathlib.Path:
    """``RUN_DIR/checkpoints`` (not created)."""
    return pathlib.Path(run_dir) / "checkpoints"


def _iter_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _check_name(name: str) -> None:
    p = pathlib.PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or name == STATE_FILE or name.startswith(_TMP_PREFIX):
        raise ValueError(f"invalid checkpoint file name {name!r}")


def is_checkpoint_iteration(iteration: int, every: int, iterations: int) -> bool:
    """Whether 0-based ``iteration`` of a run of ``iterations`` is checkpointed
    (``run.checkpoint_every = every``): every ``every``-th iteration counted from 1, and the last."""
    return (iteration + 1) % every == 0 or iteration + 1 >= iterations


def missing_checkpoint(recorded: int, checkpointed: int, every: int) -> int | None:
    """The 0-based iteration whose checkpoint must have been written but is gone, or None.

    ``recorded``: the rows of the run's ``metrics.jsonl`` (one per finished iteration);
    ``checkpointed``: the iterations its newest complete checkpoint holds (0 without one). The
    coordinator writes iteration ``n``'s checkpoint after its metrics row and before iteration
    ``n + 1`` starts (``spotlight/coordinator/resume.py``), so a row after an iteration that
    ``run.checkpoint_every = every`` checkpoints proves that checkpoint was complete; only the
    last row may lack its checkpoint (a crash between the two writes). The newest such iteration
    is returned when it is past ``checkpointed`` (the checkpoint was deleted or moved). A run's
    last iteration, also checkpointed, is not counted: a resume with ``--iterations`` may have
    moved it."""
    proven = [n for n in range(checkpointed, recorded - 1) if (n + 1) % every == 0]
    return proven[-1] if proven else None


def write_checkpoint(
    run_dir: str | os.PathLike,
    iteration: int,
    state: dict[str, Any],
    files: dict[str, bytes] | None = None,
    *,
    keep: int = 2,
) -> pathlib.Path:
    """Atomically write ``RUN_DIR/checkpoints/iter_NNNNNN`` and point ``LATEST`` at it.

    Args:
        run_dir: the run directory (``checkpoints/`` is created inside if missing).
        iteration: the last iteration whose effects ``state`` includes (>= 0); the name
            is zero-padded to 6 digits.
        state: JSON-able dict (strict JSON: NaN/inf are rejected), stored under
            ``"state"`` in ``state.json``.
        files: extra files, name (relative, may contain ``/``) → raw bytes.
        keep: complete checkpoints to keep after writing (>= 1); older ones are
            deleted, never the one ``LATEST`` names. Stale temp dirs are removed too.

    Returns:
        The final checkpoint directory.

    Raises:
        ValueError: ``iteration < 0``, ``keep < 1``, a non-JSON-able ``state``
            (including NaN/inf), or an invalid file name.
        CheckpointError: a complete checkpoint for ``iteration`` already exists.
        OSError: the file system failed (the previous checkpoint stays intact).
    """
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    files = dict(files or {})
    for name in files:
        _check_name(name)
    try:
        text = json.dumps({"format": CHECKPOINT_FORMAT, "iteration": iteration, "state": state}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint state is not strict JSON: {exc}") from exc
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _iter_name(iteration)
    if final.exists():
        if _is_complete(final):
            raise CheckpointError(f"checkpoint {final} already exists")
        shutil.rmtree(final)  # an incomplete leftover with the final name (should not happen)
    tmp = root / f"{_TMP_PREFIX}{_iter_name(iteration)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, data in files.items():
            p = tmp / name
            p.parent.mkdir(parents=True, exist_ok=True)
            _write_bytes(p, bytes(data))
        _write_bytes(tmp / STATE_FILE, text.encode())
        for d in sorted({(tmp / n).parent for n in files} | {tmp}, key=lambda x: -len(x.parts)):
            _fsync_dir(d)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _write_latest(root, final.name)
    _apply_retention(root, keep)
    return final


def _write_latest(root: pathlib.Path, name: str) -> None:
    tmp = root / f"{_TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:8]}"
    _write_bytes(tmp, (name + "\n").encode())
    os.replace(tmp, root / LATEST_FILE)
    _fsync_dir(root)


def _read_state(path: pathlib.Path) -> dict[str, Any]:
    f = path / STATE_FILE
    try:
        doc = json.loads(f.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{f} is missing") from exc
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{f} is unreadable or corrupt: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT:
        fmt = doc.get("format") if isinstance(doc, dict) else None
        raise CheckpointError(f"{f}: unknown checkpoint format {fmt!r} (this version reads {CHECKPOINT_FORMAT})")
    if not isinstance(doc.get("state"), dict) or not isinstance(doc.get("iteration"), int):
        raise CheckpointError(f"{f}: malformed checkpoint (needs an int 'iteration' and a dict 'state')")
    return doc


def _is_complete(path: pathlib.Path) -> bool:
    try:
        _read_state(path)
    except CheckpointError:
        return False
    return True


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, pathlib.Path]]:
    """Every complete checkpoint as ``(iteration, path)``, oldest first (reads each state.json)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _ITER_RE.match(p.name)
        if m and p.is_dir() and _is_complete(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(run_dir: str | os.PathLike, *, cleanup: bool = True) -> tuple[int, pathlib.Path] | None:
    """The last complete checkpoint as ``(iteration, path)``, or None when there is none.

    ``LATEST`` is trusted when it names a complete checkpoint; otherwise (missing,
    corrupt, or naming a missing/incomplete directory) the newest complete
    ``iter_NNNNNN`` wins. With ``cleanup`` (default), temp dirs left by a crashed
    write are removed (call it only when no write is in progress, i.e. at resume).
    """
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return None
    if cleanup:
        _remove_temps(root)
    try:
        name = (root / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    m = _ITER_RE.match(name)
    if m and _is_complete(root / name):
        return int(m.group(1)), root / name
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The ``state`` dict that :func:`write_checkpoint` stored in ``path/state.json``.

    Extra files are read by the caller from ``path`` directly.

    Raises:
        CheckpointError: ``state.json`` missing, not JSON, malformed, or of a format
            other than :data:`CHECKPOINT_FORMAT`.
    """
    return _read_state(pathlib.Path(path))["state"]


def _remove_temps(root: pathlib.Path) -> None:
    """Delete temp dirs/files of crashed writes (single writer: none is in progress)."""
    for p in root.iterdir():
        if p.name.startswith(_TMP_PREFIX):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _apply_retention(root: pathlib.Path, keep: int) -> None:
    try:
        protected = (root / LATEST_FILE).read_text().strip()
    except OSError:
        protected = ""
    _remove_temps(root)
    done = complete_checkpoints(root.parent)
    for _, p in done[:-keep]:
        if p.name != protected:
            shutil.rmtree(p, ignore_errors=True)


def next_epoch(run_dir: str | os.PathLike) -> int:
    """Durably count coordinator starts of a run; returns this start's epoch.

    0 on the first call for ``run_dir`` (no ``checkpoints/EPOCH`` yet), then 1, 2, ...:
    every call returns a number greater than all earlier calls returned, even when a
    resumed coordinator crashed before writing any checkpoint. Pass it to
    ``RequestScheduler.load_state_dict(epoch=...)`` so lease ids never repeat across
    processes. Call it once per start, before granting any lease.

    Raises:
        CheckpointError: ``EPOCH`` exists but does not hold a non-negative integer.
        OSError: the file system failed.
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / EPOCH_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        epoch = 0
    else:
        if not text.isdigit():
            raise CheckpointError(f"{path} holds {text!r}, not a non-negative integer")
        epoch = int(text) + 1
    tmp = root / f"{_TMP_PREFIX}{EPOCH_FILE}-{uuid.uuid4().hex[:8]}"
    _write_bytes(tmp, f"{epoch}\n".encode())
    os.replace(tmp, path)
    _fsync_dir(root)
    return epoch


# ------------------------------------------------------------------ Train Worker checkpoints
#
# RUN_DIR/checkpoints/train/v000004/   a complete trainer checkpoint for weights v_4:
#     .metadata, __0_0.distcp, ...     torch.distributed.checkpoint (model + optimizer, sharded)
#     rng_rank0.json, ...              per-rank RNG states and step counters
# RUN_DIR/checkpoints/train/.tmp-v000005/  being written (all ranks), renamed by rank 0.

_TRAIN_RE = re.compile(r"^v(\d{6,})$")
TRAIN_METADATA = ".metadata"  # written last by DCP's coordinator rank


def train_checkpoint_dir(run_dir: str | os.PathLike) -> pathlib.Path:
    """``RUN_DIR/checkpoints/train`` (not created): where Train Workers keep their state."""
    return checkpoint_dir(run_dir) / "train"


def train_version_path(ckpt_dir: str | os.PathLike, version: int) -> pathlib.Path:
    """``ckpt_dir/vNNNNNN``: the trainer checkpoint that produced weights ``v_version``."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return pathlib.Path(ckpt_dir) / f"v{version:06d}"


def train_versions(ckpt_dir: str | os.PathLike) -> list[int]:
    """Weight versions with a complete trainer checkpoint in ``ckpt_dir``, ascending.

    Complete = a ``vNNNNNN`` directory (they appear only by rename after every rank
    wrote) holding DCP's ``.metadata``. Temp dirs of crashed saves are ignored.
    """
    root = pathlib.Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _TRAIN_RE.match(p.name)
        if m and (p / TRAIN_METADATA).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def prune_train_versions(
    ckpt_dir: str | os.PathLike, keep: int, *, protect: int | Iterable[int] | None = None
) -> list[int]:
    """Delete all but the newest ``keep`` complete trainer checkpoints (never ``protect``: a version
    or several, e.g. the best held-out version a collapse-guard rollback may return to).

    Also removes temp dirs of crashed saves. Call on one rank, with no save in
    progress. Returns the deleted versions.

    Raises:
        ValueError: ``keep < 1``.
    """
    kept = {protect} if isinstance(protect, int) else set(protect or ())
    return retire_train_versions(ckpt_dir, keep, committed=sys.maxsize, protect=kept)  # every version is committed


def retire_train_versions(
    ckpt_dir: str | os.PathLike, keep: int, *, committed: int, protect: Iterable[int] = ()
) -> list[int]:
    """Trainer checkpoint retention (``run.keep_train_checkpoints = keep``), given that the
    run's checkpoints name only versions up to ``committed``: keep the newest ``keep`` complete
    checkpoints of versions <= ``committed`` and delete the older ones, and delete every
    version > ``committed`` (written by an iteration that a resume runs again, so never
    named by a run checkpoint). Versions in ``protect`` (<= ``committed``) are kept whatever
    their age: the base model, the best held-out version and those being evaluated, which a
    collapse-guard rollback may return to. Also removes the temp dirs of crashed saves.

    The resume point is never deleted: a run checkpoint that names version v is written only
    after the trainer's checkpoint of v is complete, so the newest complete version <=
    ``committed`` is what the newest run checkpoint names. Call on one rank, with no save in
    progress (a Train Worker calls it when a TRAIN_BATCH arrives, ``committed`` = the batch's
    version, and before the final save). Returns the deleted versions.

    Raises:
        ValueError: ``keep < 1``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = pathlib.Path(ckpt_dir)
    if not root.is_dir():
        return []
    _remove_temps(root)
    versions = train_versions(root)
    named = [v for v in versions if v <= committed]
    kept = set(protect)
    drop = [v for v in versions if v > committed] + [v for v in named[:-keep] if v not in kept]
    for v in drop:
        shutil.rmtree(train_version_path(root, v), ignore_errors=True)
    return sorted(drop)
