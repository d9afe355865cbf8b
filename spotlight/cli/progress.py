"""What a command is doing during a long step, on a terminal and off one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console


@contextlib.contextmanager
def working(console: Console, text: str) -> Iterator[None]:
    """A spinner with ``text`` while the block runs, on a terminal. Rich draws nothing when the
    output is a pipe or a file (a log, CI, ``| tee``), which would leave minutes of silence there:
    off a terminal ``text`` is printed once, as a line, when the step starts."""
    if console.is_terminal:
        with console.status(text):
            yield
    else:
        console.print(text, highlight=False)
        yield
