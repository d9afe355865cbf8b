"""The console scripts ``spotlight`` and ``spotlight-agent`` (pyproject ``[project.scripts]``).

Importing the command-line apps takes a moment (typer, rich and every command's module); a
Ctrl-C or SIGTERM in that moment would print a traceback of the import. Here it prints
``interrupted`` and exits with status 130, as an interruption while a command runs does
(:mod:`spotlight.util.cli_run`)."""

from __future__ import annotations

import signal
import sys


def _interruptible_import(load):
    def stop(signum, frame) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):  # SIGINT raises KeyboardInterrupt already
        signal.signal(sig, stop)
    try:
        main = load()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    return main


def spotlight_main() -> None:
    def load():
        from spotlight.cli import main

        return main

    _interruptible_import(load)()


def agent_main() -> None:
    def load():
        from agent.main import main

        return main

    _interruptible_import(load)()
