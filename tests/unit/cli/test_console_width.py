"""A command's console takes ``$COLUMNS`` when it prints, not when its module was imported.

Was: ``spotlight keys`` (and ``up``, ``init``) made their rich console at import, and rich reads
``$COLUMNS`` once, when a console is made; in a process without a terminal that had imported the
CLI before (a pytest-xdist worker) ``keys list`` folded a 40-character key over two lines although
the caller set ``COLUMNS=300``."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from rich.console import Console
from typer.testing import CliRunner

import spotlight.cli
from spotlight.cli.messages import CallTimeConsole


def test_a_call_time_console_follows_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # set when it is made
    console = CallTimeConsole(emoji=False, soft_wrap=True)
    assert console.width == 40
    assert Console(emoji=False).width == 40
    monkeypatch.setenv("COLUMNS", "300")
    assert console.width == 300
    with console:  # a Console: rich's live displays enter it (spotlight up's progress)
        console.print("x")


def test_no_command_module_keeps_a_console_made_at_import():
    held = []
    for info in pkgutil.iter_modules(spotlight.cli.__path__):
        if info.name == "__main__":  # runs the CLI
            continue
        module = importlib.import_module(f"spotlight.cli.{info.name}")
        held += [
            f"{info.name}.{k}"
            for k, v in vars(module).items()
            if isinstance(v, Console) and not isinstance(v, CallTimeConsole)
        ]
    assert held == []


@pytest.mark.parametrize("columns_at_first_use", ["40", "300"])
def test_keys_list_prints_a_key_whole_at_the_callers_width(tmp_path, monkeypatch, columns_at_first_use):
    from spotlight.cli import app
    from spotlight.net.security import add_client, init_keys

    monkeypatch.setenv("COLUMNS", columns_at_first_use)  # whatever the process had before
    runner = CliRunner()
    runner.invoke(app, ["keys", "list", str(tmp_path / "none")])
    init_keys(tmp_path / "k")
    add_client(tmp_path / "k", "agent", "spot-7")
    key = (tmp_path / "k" / "clients" / "agent.spot-7.key").read_text().split('public-key = "')[1][:40]
    res = runner.invoke(app, ["keys", "list", str(tmp_path / "k")], env={"COLUMNS": "300"})
    assert res.exit_code == 0 and key in res.stdout, res.stdout
