"""`spotlight keys init` on paths that cannot be a keys directory: one line naming the path."""

from __future__ import annotations

from typer.testing import CliRunner

from spotlight.cli import app


def test_keys_init_on_a_file_or_under_one_is_one_line(tmp_path):
    """Was: `error: [Errno 17] File exists: '…/afile'`."""
    (tmp_path / "afile").write_text("")
    res = CliRunner().invoke(app, ["keys", "init", str(tmp_path / "afile")])
    assert res.exit_code == 2 and res.output.strip() == f"error: {tmp_path / 'afile'} is a file, not a keys directory"
    res = CliRunner().invoke(app, ["keys", "init", str(tmp_path / "afile" / "keys")])
    assert res.exit_code == 2 and "Errno" not in res.output and "Not a directory" in res.output, res.output


def test_keys_init_names_every_key_it_creates(tmp_path):
    """Was: the status.local client key it also allow-lists went unmentioned, so a user saw a
    secret key in the directory no command had told them about."""
    keys = tmp_path / "keys"
    res = CliRunner().invoke(app, ["keys", "init", str(keys)], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    created = sorted(str(p.relative_to(keys)) for p in keys.rglob("*") if p.is_file())
    assert created == ["clients/status.local.key", "server.key", "server.key_secret", "status.local.key_secret"]
    for name in created:
        assert str(keys / name) in res.output, (name, res.output)
    assert "allow-listed status.local" in res.output
