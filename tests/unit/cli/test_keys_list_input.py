"""`spotlight keys list` on a path that is not a keys directory: one line naming the path (exit 2),
as `keys init` and `keys add` give, not an empty allow-list table (exit 0)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from spotlight.cli import app


def _keys(*args):
    res = CliRunner().invoke(app, ["keys", *args], env={"COLUMNS": "300"})
    return res.exit_code, res.output


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda p: None, "no such directory"),
        (lambda p: p.write_text(""), "is a file, not a keys directory"),
        (lambda p: p.mkdir(), "is not a keys directory (no server.key)"),
    ],
    ids=["missing", "file", "empty-dir"],
)
@pytest.mark.parametrize("command", [["list"], ["revoke", "agent.n1"]], ids=["list", "revoke"])
def test_keys_list_of_a_path_that_is_not_a_keys_directory_is_one_line(tmp_path, make, says, command):
    """``revoke`` said "agent.n1 is not on the allow-list of PATH", hiding that PATH is wrong."""
    path = tmp_path / "keys"
    make(path)
    code, out = _keys(command[0], str(path), *command[1:])
    assert code == 2, out
    assert out.startswith(f"error: {path}") and says in out and len(out.strip().splitlines()) == 1, out
    assert "allow-list of" not in out


def test_keys_list_of_a_keys_directory_still_shows_the_table(tmp_path):
    path = tmp_path / "keys"
    assert _keys("init", str(path))[0] == 0
    code, out = _keys("list", str(path))
    assert code == 0 and f"allow-list of {path}" in out and "status.local" in out, out


def test_keys_init_suggests_keys_add_shell_quoted(tmp_path):
    path = tmp_path / "with space" / "keys"
    code, out = _keys("init", str(path))
    assert code == 0, out
    assert f"next: spotlight keys add '{path}' agent NODE" in out, out
    code, out = _keys("list", str(tmp_path / "with space"))  # its hint is quoted too
    assert code == 2 and f"`spotlight keys init '{tmp_path / 'with space'}'`" in out, out
