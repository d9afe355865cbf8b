"""Write a small state file so that a reader never sees half of it (torch-free).

A run's state files (``coordinator.json``, ``status.json``, ``local_agents.json``,
``prompts.json``) are read by other processes (``spotlight status``, a resuming ``spotlight
up``) while, or after, the coordinator writes them; a crash or a full disk during a plain
``write_text`` leaves an empty or cut file. The text goes to a temporary file in the same
directory first, which then replaces the target in one step (``os.replace``, atomic on POSIX):
the target holds the old text or the new, never a part (docs/architecture.md, §13 "Crash and resume")."""

from __future__ import annotations

import os
import pathlib


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
