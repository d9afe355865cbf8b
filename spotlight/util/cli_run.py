"""Run a typer app so that every error line starts the same way: ``error:`` (``spotlight``)
or ``spotlight-agent: error:``, click's own usage errors (a missing option, an out-of-range
value) included, which click and typer would print as ``Error:`` or in a boxed "Error" panel.
Never imports torch."""

from __future__ import annotations

import os
import re
import sys

import typer

try:  # typer >= 0.26 carries its own click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import Abort, ClickException, NoArgsIsHelpError, UsageError


_TILDE_VALUE = re.compile(r"~[\w.-]*(/|$)")


def expand_option_tilde(args: list[str]) -> list[str]:
    """``--name=~/path`` with the ``~`` expanded, as a shell does for ``--name ~/path`` (pure).

    bash and zsh (by default) leave a ``~`` after ``=`` in an argument as it is, so
    ``--out=~/runs`` would make a folder named ``~`` in the working directory. A value that is
    ``~`` or starts with ``~/`` or ``~user/`` is expanded (an unknown user stays as given);
    nothing after a bare ``--`` is touched."""
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        name, eq, value = arg.partition("=")
        if eq and name.startswith("--") and _TILDE_VALUE.match(value):
            arg = f"{name}={os.path.expanduser(value)}"
        out.append(arg)
    return out


_SIGNAL_NAMES = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM", "SIGHUP": "SIGHUP"}
INTERRUPTED_STATUS = {"Ctrl-C": 130, "SIGTERM": 143, "SIGHUP": 129}
"""The exit status of a command stopped by each signal: 128 + the signal's number, as a shell
reports a process the signal killed (systemd's ``SuccessExitStatus`` of the units lists them)."""
_interrupt: dict = {"by": None, "reported": False}


def interrupt_reported() -> None:
    """A command that caught an interruption and printed its own line calls this, so that
    :func:`run_app` adds none."""
    _interrupt["reported"] = True


def run_app(app: typer.Typer, prefix: str = "error:", args: list[str] | None = None) -> int:
    """Run ``app`` on ``args`` (default ``sys.argv[1:]``); return the exit status.

    ``--name=~/path`` values have their ``~`` expanded (:func:`expand_option_tilde`). A usage
    error prints the usage line, the ``--help`` hint and ``<prefix> <message>`` on stderr
    (status 2, as click); another click error prints ``<prefix> <message>``."""
    args = expand_option_tilde(sys.argv[1:] if args is None else list(args))
    try:
        rv = app(args=args, standalone_mode=False)
    except NoArgsIsHelpError as exc:  # `spotlight` alone: its help, as click prints it
        exc.show()
        return exc.exit_code
    except UsageError as exc:
        if exc.ctx is not None:
            typer.echo(exc.ctx.get_usage(), err=True)
            typer.echo(f"Try '{exc.ctx.command_path} {exc.ctx.help_option_names[0]}' for help.\n", err=True)
        typer.echo(f"{prefix} {exc.format_message()}", err=True)
        return exc.exit_code
    except ClickException as exc:
        typer.echo(f"{prefix} {exc.format_message()}", err=True)
        return exc.exit_code
    except Abort:
        typer.echo("aborted", err=True)
        return 1
    if isinstance(rv, str):  # typer.Exit("message") would print the bare message
        typer.echo(f"{prefix} {rv}", err=True)
        return 1
    if rv == 130 and _interrupt["by"] is not None:  # typer's status (or a command's) for any interruption
        if not _interrupt["reported"]:  # typer turns an interruption no command caught into a silent exit
            typer.echo(f"interrupted ({_interrupt['by']})", err=True)
        return INTERRUPTED_STATUS[_interrupt["by"]]
    return rv if isinstance(rv, int) else 0


def interrupt_on_signals() -> None:
    """Make SIGTERM and SIGHUP (the terminal closed) raise KeyboardInterrupt, as Ctrl-C does, so
    that a command stopped by ``kill`` or a closed terminal cleans up as after Ctrl-C (``simulate``
    removes the ``--out`` it created; ``up`` installs its own handler, which also records the
    signal). Without it they end the process at once, whatever it left half-made. Each of the
    three is recorded, so that :func:`run_app` can say what stopped a command that did not say so
    itself."""
    import signal

    def handler(signum, frame) -> None:
        _interrupt["by"] = _SIGNAL_NAMES.get(signal.Signals(signum).name, signal.Signals(signum).name)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def main_of(app: typer.Typer, prefix: str = "error:", *, interrupt: bool = False) -> None:
    """A console-script entry point: :func:`run_app`, then exit with its status; with
    ``interrupt``, SIGTERM and SIGHUP first become Ctrl-C (:func:`interrupt_on_signals`)."""
    if interrupt:
        interrupt_on_signals()
    sys.exit(run_app(app, prefix))
