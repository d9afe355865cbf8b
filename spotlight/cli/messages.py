"""Where a command's ``error:`` and ``warning:`` lines go: standard error, never standard output.

Standard output holds what a command produces (a table, ``--json``, progress, the next steps),
so that ``spotlight plan --json > plan.json`` or ``spotlight eval … > log`` never mixes a
refusal into it; a script reads the exit status and standard error."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console

ERROR = "[red]error:[/red]"
"""How an error line starts (rich markup)."""

WARNING = "[yellow]warning:[/yellow]"
"""How a warning line starts (rich markup)."""


class CallTimeConsole(Console):
    """A module's console whose size follows ``$COLUMNS``/``$LINES`` when it prints. A plain
    ``Console`` made while ``$COLUMNS`` is set keeps that width for good, so one made at import
    kept the width of whatever environment imported the module first (``keys list`` folded a key
    at 80 columns for a caller that set 300) instead of the caller's. Without an explicit
    ``width``/``height`` rich reads them at each use (``Console.size``). Otherwise a ``Console``:
    ``spotlight up``'s live progress display uses it as one."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        if options.get("width") is None:
            self._width = None
        if options.get("height") is None:
            self._height = None


def error_console() -> Console:
    """A console on standard error, made at each call: with no ``file`` rich looks ``sys.stderr``
    up at every print, so a runner that swaps it (pytest's ``capsys``, click's ``CliRunner``)
    sees what it prints. ``soft_wrap``: a long line stays one line, as a script greps it."""
    return Console(emoji=False, soft_wrap=True, stderr=True)


def print_error(markup: str, **kwargs) -> None:
    """Print one ``error:`` or ``warning:`` line (rich markup; ``kwargs`` as
    :meth:`rich.console.Console.print` takes them) on standard error."""
    error_console().print(markup, **kwargs)


def say_to(console: Console) -> Callable[[str], None]:
    """A ``say`` (one line of rich markup) for code that reports as it goes without knowing
    the streams (``spotlight up``'s local agents, a trace replay's notes): ``error:`` and
    ``warning:`` lines on standard error, every other line on ``console``."""

    def say(line: str) -> None:
        if line.startswith((ERROR, WARNING)):
            print_error(line)
        else:
            console.print(line)

    return say
