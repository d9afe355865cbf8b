"""The console script ``spotlight-agent`` (pyproject ``[project.scripts]``): the agent daemon's
CLI, imported so that an interruption while it loads is one line, not a traceback
(:func:`spotlight.entry.interruptible_import`)."""

from __future__ import annotations

from spotlight.entry import interruptible_import


def main() -> None:
    def load():
        from agent.main import main

        return main

    interruptible_import(load)()
