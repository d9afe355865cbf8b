"""Write a small state file so that a reader never sees half of it (torch-free).

A run's state files (``coordinator.json``, ``status.json``, ``local_agents.json``,
``prompts.json``) are read by other processes (``spotlight status``, a resuming ``spotlight
up``) while, or after, the coordinator writes them; a crash or a full disk during a plain
``write_text`` leaves an empty or cut file. The text goes to a temporary file in the same
directory first, which then replaces the target in one step (``os.replace``, atomic on POSIX):
the target holds the old text or the new, never a part (docs/architecture.md, §13 "Crash and resume").
A folder of model files (``final/``, ``best/``) is written the same way, through
:func:`replace_dir_atomic`."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
from collections.abc import Iterator


def write_text_atomic(path: pathlib.Path | str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and ``os.replace``.

    Raises what the write raises (``OSError``); the temporary file is then removed and
    ``path`` keeps its earlier contents."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def replace_dir_atomic(path: pathlib.Path | str) -> Iterator[pathlib.Path]:
    """Yield an empty folder beside ``path`` (``<name>.tmp``) to write into; when the block ends
    without an error, it replaces ``path`` (an earlier ``path`` is moved to ``<name>.old`` first
    and then removed). A reader that checks for ``path`` so sees no folder or a whole one, never
    one a crash or a full disk cut short; on an error the temporary folder is removed and
    ``path`` keeps what it had. A temporary folder an earlier crash left is removed first."""
    path = pathlib.Path(path)
    tmp, old = path.with_name(f"{path.name}.tmp"), path.with_name(f"{path.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
