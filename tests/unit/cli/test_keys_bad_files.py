"""`spotlight keys` with a bad file in the keys directory: an allow-list file that is no client key
(empty, garbage, a corrupt key, a name that is no ``<role>.<name>.key``, a directory) is listed
as unreadable next to the good keys and warned about on stderr, not a ``ValueError`` traceback; a
``server.key`` no client could use (corrupt, or another key than ``server.key_secret``'s) is
refused by ``keys add`` -- which tells the operator to copy that file -- in one line, and warned
about by ``keys list`` and ``keys revoke`` (a revocation is never held up). Real key files."""

from __future__ import annotations

import pathlib

import pytest
from typer.testing import CliRunner

from spotlight.cli import app

runner = CliRunner()

BAD_CLIENT_FILES = [
    pytest.param("agent.bad.key", lambda f: f.write_text(""), "no public key in it", id="empty"),
    pytest.param("agent.junk.key", lambda f: f.write_bytes(b"\x00\xffjunk\n"), "no public key in it", id="garbage"),
    pytest.param(
        "trainer.t1.key", lambda f: f.write_text('public-key = "abc"\n'), "not a CurveZMQ key", id="corrupt-key"
    ),
    pytest.param("foo.key", lambda f: f.write_text(""), "bad principal 'foo'", id="bad-name"),
    pytest.param("status.dir.key", lambda f: f.mkdir(), "a directory, not a key file", id="directory"),
]


def _keys(*args: str):
    return runner.invoke(app, ["keys", *args], env={"COLUMNS": "300"})


@pytest.fixture
def keys(tmp_path) -> pathlib.Path:
    """A keys directory with the status key and one agent key."""
    d = tmp_path / "keys"
    assert _keys("init", str(d)).exit_code == 0
    assert _keys("add", str(d), "agent", "n1").exit_code == 0
    return d


@pytest.mark.parametrize("name, make, says", BAD_CLIENT_FILES)
def test_keys_list_shows_the_good_keys_and_marks_a_bad_file(keys, name, make, says):
    """Was (empty file): `ValueError: No public key found in …/clients/agent.bad.key` as a Rich
    traceback; a bad name hid every key behind one error; a corrupt key was listed as a key."""
    bad = keys / "clients" / name
    make(bad)
    res = _keys("list", str(keys))
    assert res.exit_code == 0, (res.output, res.exception)
    rows = {line.split("│")[1].strip(): line for line in res.stdout.splitlines() if line.startswith("│")}
    assert {"agent.n1", "status.local", name[: -len(".key")]} <= set(rows), res.stdout
    assert "unreadable" not in rows["agent.n1"] and "unreadable" not in rows["status.local"]
    row = " ".join(rows[name[: -len(".key")]].split())
    assert "unreadable: " in row and says in row, res.stdout
    warning = res.stderr.strip()
    assert warning.startswith(f"warning: {bad}: ") and says in warning and "\n" not in warning, res.stderr
    assert "cannot (re)load the allow-list until the file is removed" in warning
    assert "Traceback" not in res.output


def test_the_removal_hint_is_revoke_for_a_principal_and_rm_otherwise(keys):
    (keys / "clients" / "agent.bad.key").write_text("")
    (keys / "clients" / "foo.key").write_text("")
    res = _keys("list", str(keys))
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2, res.stderr
    assert f"`spotlight keys revoke {keys} agent.bad` (then `spotlight keys add {keys} agent bad`" in lines[0]
    assert lines[1].endswith(f"`rm {keys / 'clients' / 'foo.key'}`"), lines[1]
    assert _keys("revoke", str(keys), "agent.bad").exit_code == 0  # the hint works
    assert not (keys / "clients" / "agent.bad.key").exists()


@pytest.mark.parametrize("name, make, says", BAD_CLIENT_FILES)
def test_list_keys_names_a_bad_allow_list_file_as_keys_error(keys, name, make, says):
    """What ``spotlight up --external-trainers`` reads: a KeysError it reports in one line (was a
    ValueError traceback), naming the file as the coordinator does."""
    from spotlight.net.security import KeysError, list_keys, load_server_keys

    make(keys / "clients" / name)
    for read in (list_keys, load_server_keys):
        with pytest.raises(KeysError) as info:
            read(keys)
        assert str(info.value).startswith(f"allow-list file {keys / 'clients' / name}: ") and says in str(info.value)


SERVER_KEY_FAULTS = [
    pytest.param(lambda d: (d / "server.key").write_text(""), "no public key in it", id="empty"),
    pytest.param(lambda d: (d / "server.key").write_text("garbage\n"), "no public key in it", id="garbage"),
    pytest.param(
        lambda d: (d / "server.key").write_text('public-key = "short"\n'), "not a CurveZMQ key", id="corrupt-key"
    ),
    pytest.param(
        lambda d: (d / "server.key").write_text((d / "clients" / "agent.n1.key").read_text()),
        "holds another public key than the coordinator's",
        id="another-key",
    ),
]


@pytest.mark.parametrize("make, says", SERVER_KEY_FAULTS)
def test_keys_add_refuses_a_server_key_no_client_could_use(keys, make, says):
    """Was: `allow-listed agent.n2 … copy to the client's keys directory: …/server.key`, the broken
    file; the client failed only when it joined."""
    make(keys)
    res = _keys("add", str(keys), "agent", "n2")
    assert res.exit_code == 2, (res.output, res.exception)
    text = res.stderr.strip()
    assert text.startswith(f"error: {keys / 'server.key'}") and says in text and "\n" not in text, text
    assert f"rewrite it from {keys / 'server.key_secret'}" in text
    assert res.stdout == ""
    assert not (keys / "clients" / "agent.n2.key").exists() and not (keys / "agent.n2.key_secret").exists()


@pytest.mark.parametrize("make, says", SERVER_KEY_FAULTS)
def test_keys_revoke_and_list_warn_about_a_bad_server_key(keys, make, says):
    make(keys)
    res = _keys("revoke", str(keys), "agent.n1")
    assert res.exit_code == 0 and not (keys / "clients" / "agent.n1.key").exists(), res.output
    assert res.stderr.strip().startswith(f"warning: {keys / 'server.key'}") and says in res.stderr, res.stderr
    res = _keys("list", str(keys))
    assert res.exit_code == 0 and "status.local" in res.stdout, res.output
    assert res.stderr.strip().startswith(f"warning: {keys / 'server.key'}") and says in res.stderr, res.stderr


def test_a_good_keys_directory_gives_no_warning(keys):
    for args in (("list", str(keys)), ("add", str(keys), "agent", "n2"), ("revoke", str(keys), "agent.n2")):
        res = _keys(*args)
        assert res.exit_code == 0 and res.stderr == "", (args, res.output)


def test_a_client_with_a_corrupt_server_key_copy_is_told_which_file(keys, tmp_path):
    """The join side: the agent's keys directory with a broken server.key names server.key (was:
    the client's own secret file, with pyzmq's `No public key found` after it)."""
    import shutil

    from spotlight.net.security import KeysError, load_client_keys

    client = tmp_path / "client"
    client.mkdir()
    shutil.copy(keys / "agent.n1.key_secret", client)
    (client / "server.key").write_text("")
    with pytest.raises(KeysError) as info:
        load_client_keys(client)
    assert str(info.value).startswith(f"{client / 'server.key'}: no public key in it"), info.value


def test_a_public_key_with_brackets_is_listed_verbatim_not_read_as_markup(tmp_path):
    """Was: a Z85 key holding '[/{e+k2]' made `keys list` fail with a MarkupError traceback, and
    one holding '[@Q{]' was listed with those characters dropped."""
    from typer.testing import CliRunner

    from spotlight.cli import app
    from spotlight.net.security import add_client, init_keys

    d = tmp_path / "k"
    init_keys(d)
    add_client(d, "agent", "spot-7")
    f = d / "clients" / "agent.spot-7.key"
    key = "+Eh#E+KdPe{DQ)y:e[/{e+k2]/P9p!Ubp(0Zo{jq"
    f.write_text(f'metadata\ncurve\n    public-key = "{key}"\n')
    res = CliRunner().invoke(app, ["keys", "list", str(d)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert key in res.stdout, res.stdout
    res = CliRunner().invoke(app, ["keys", "list", str(d)], env={"COLUMNS": "60"})  # folded, not cut with …
    assert res.exit_code == 0 and "…" not in res.stdout, res.stdout
