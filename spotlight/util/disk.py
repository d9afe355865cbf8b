"""Free-space checks before large writes (weight versions, trainer checkpoints, the final model,
the prompt-embedding cache): one clear error naming the path, the bytes needed and the bytes
free, instead of a write that fails half-way with ``No space left on device``."""

from __future__ import annotations

import os
import pathlib
import shutil

from spotlight.errors import SpotlightError

ENOSPC_TEXT = "No space left on device"
"""What the OS says when a write finds the disk full (errno 28)."""


class DiskSpaceError(SpotlightError):
    """A write would not fit on its file system."""


def space_problem(path: str | os.PathLike, need_bytes: int, free_bytes: int, what: str = "") -> str | None:
    """The error line when ``need_bytes`` do not fit in ``free_bytes`` at ``path``, else None. Pure."""
    if need_bytes <= free_bytes:
        return None
    what = f" for {what}" if what else ""
    return (
        f"disk full at {path}: {need_bytes} bytes ({need_bytes / (1 << 30):.2f} GiB) needed{what}, "
        f"{free_bytes} bytes ({free_bytes / (1 << 30):.2f} GiB) free"
    )


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) on the file system of ``path``, or of its nearest existing parent."""
    p = pathlib.Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def ensure_free_space(path: str | os.PathLike, need_bytes: int, what: str = "") -> None:
    """Raise :class:`DiskSpaceError` if ``need_bytes`` will not fit at ``path``.

    Raises:
        DiskSpaceError: ``disk full at PATH: N bytes needed …, M bytes free``.
    """
    problem = space_problem(path, int(need_bytes), free_bytes(path), what)
    if problem is not None:
        raise DiskSpaceError(problem)


def unwritable_dir(out_dir: str | os.PathLike) -> str:
    """Why files could not be written in the directory ``out_dir`` ("" if they could), leaving
    nothing behind: it is a directory that takes a file (checked by writing and removing one:
    permissions do not tell for root, or on read-only or virtual file systems such as
    ``/proc``), or it can be created (checked by creating it and removing what was created)."""
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists():
        if not out_dir.is_dir():
            return "not a directory"
        if not os.access(out_dir, os.W_OK | os.X_OK):
            return "not writable"
        probe = out_dir / f".spotlight-write-test-{os.getpid()}"
        try:
            probe.write_bytes(b"")
        except OSError as exc:
            return f"not writable ({exc.strerror or exc})"
        probe.unlink(missing_ok=True)
        return ""
    parent = out_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created ({parent} is not a directory)"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created ({parent} is not writable)"
    try:  # what permissions do not tell (root, read-only or virtual file systems): try, then undo
        os.makedirs(out_dir)
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    made = out_dir.absolute()
    while made != parent:
        made.rmdir()
        made = made.parent
    return ""
