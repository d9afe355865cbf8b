"""Every ``spotlight`` and ``spotlight-agent`` command's ``--help`` reads whole in an 80-column terminal: no option
name or help text is cut short with "…" (rich truncates unbreakable words wider than its
help column), and no line is wider than the terminal."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
COMMANDS = [
    [],
    ["init"],
    ["up"],
    ["status"],
    ["eval"],
    ["profile"],
    ["simulate"],
    ["mock-metadata"],
    ["reward-server"],
    ["keys"],
    ["keys", "init"],
    ["keys", "add"],
    ["keys", "list"],
    ["keys", "revoke"],
    ["plan"],
    ["bench"],
    ["bench", "stale-ranking"],
]
AGENT_COMMANDS = [[], ["join"], ["revoke"], ["add-gpu"], ["agent-status"]]


@pytest.mark.parametrize(
    "module, command",
    [("spotlight", c) for c in COMMANDS] + [("agent.main", c) for c in AGENT_COMMANDS],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_help_fits_80_columns(module, command):
    env = dict(os.environ, COLUMNS="80", PYTHONPATH=str(ROOT), TERM="dumb")
    out = subprocess.run(
        [sys.executable, "-m", module, *command, "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "empty help"
    assert "…" not in out.stdout, [line for line in out.stdout.splitlines() if "…" in line]
    assert max(len(line) for line in out.stdout.splitlines()) <= 80


def _walk(command, path=()):
    yield path, command
    # typer's groups: not click.Group subclasses with every typer version (a check that was
    # `isinstance(command, click.Group)` walked the root command alone)
    if isinstance(getattr(command, "commands", None), dict):
        for name, sub in command.commands.items():
            yield from _walk(sub, path + (name,))


def test_no_help_text_is_eaten_as_rich_markup():
    """Rich reads ``[word]`` in a help string as a style tag and drops it (``(in [explore]: …``
    printed as ``(in : …``); every help text must print as written."""
    import re

    import typer

    from spotlight.cli import app

    tag = re.compile(r"(?<!\\)\[/?[A-Za-z_#@][^\]\n]*\]")
    found = []
    for path, command in _walk(typer.main.get_command(app)):
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        found += [(" ".join(path), m.group(0)) for t in texts for m in tag.finditer(t)]
    assert not found, found


def test_no_command_summary_breaks_mid_sentence():
    """A command's help comes from its docstring when it has no ``help=``; rich keeps the
    docstring's line breaks, so ``spotlight --help`` listed ``simulate`` as "… wall time to the
    target" with "score, GPU-hours …" on the next line. Each command's first paragraph is one line."""
    import typer

    from agent.main import app as agent_app
    from spotlight.cli import app

    broken = [
        " ".join(path)
        for root in (app, agent_app)
        for path, command in _walk(typer.main.get_command(root))
        if "\n" in (command.help or "").strip().split("\n\n")[0]
    ]
    assert not broken, broken


def test_the_walk_reaches_every_command():
    import typer

    from spotlight.cli import app

    paths = {" ".join(path) for path, _ in _walk(typer.main.get_command(app))}
    assert {"simulate", "keys add", "bench stale-ranking"} <= paths, paths


def test_every_option_of_every_command_is_used():
    """An option a command declares but never reads is accepted and silently ignored
    (``spotlight-agent join --config`` was): every parameter of every ``spotlight`` and
    ``spotlight-agent`` command is read in its function's body."""
    import ast
    import inspect
    import textwrap

    import typer

    from agent.main import app as agent_app
    from spotlight.cli import app

    unused = []
    for root in (app, agent_app):
        for path, command in _walk(typer.main.get_command(root)):
            fn = getattr(command.callback, "__wrapped__", command.callback)
            if fn is None:
                continue
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            func = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
            read = {n.id for stmt in func.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
            params = [a.arg for a in func.args.args + func.args.kwonlyargs]
            unused += [f"{' '.join(path)} {p}" for p in params if p not in read and p != "ctx"]
    assert not unused, unused
