"""The console script ``spotlight`` (pyproject ``[project.scripts]``); ``spotlight-agent``'s is
``agent/entry.py``, through :func:`interruptible_import` too.

Importing the command-line apps takes a moment (typer, rich and every command's module); a
Ctrl-C or SIGTERM in that moment would print a traceback of the import. Here it prints
``interrupted`` and exits with status 128 + the signal's number (130 for Ctrl-C), as an
interruption while a command runs does (:mod:`spotlight.util.cli_run`)."""

from __future__ import annotations

import signal
import sys


def interruptible_import(load):
    got = {"signum": signal.SIGINT}

    def stop(signum, frame) -> None:
        got["signum"] = signum
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):  # SIGINT raises KeyboardInterrupt already
        signal.signal(sig, stop)
    try:
        main = load()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(128 + got["signum"])  # as cli_run.INTERRUPTED_STATUS
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    return main


def spotlight_main() -> None:
    def load():
        from spotlight.cli import main

        return main

    interruptible_import(load)()
