"""Commands Spotlight prints for the user to copy are shell-quoted: a path with a space (or any
shell character) pastes as one argument (``spotlight init --out``, the ``next:`` line after
``spotlight up``, ``spotlight status`` naming one of several running runs)."""

from __future__ import annotations

import json
import os
import shlex

from rich.console import Console
from typer.testing import CliRunner

from spotlight.cli import app


def test_init_out_with_a_space_is_quoted_in_the_closing_line_and_the_header(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["init", "--out", "new cfg.toml"])
    assert res.exit_code == 0, res.output
    closing = " ".join(res.stderr.split())
    assert "start with spotlight up --local --config 'new cfg.toml'" in closing, closing
    header = (tmp_path / "new cfg.toml").read_text().split("\n[", 1)[0]
    assert "--config 'new cfg.toml'" in header and "--config new cfg.toml" not in header


def test_init_cluster_out_with_a_space_is_quoted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["init", "--family", "sd3", "--out", "my run.toml"])
    assert res.exit_code == 0, res.output
    assert "spotlight up --config 'my run.toml' --reserved" in " ".join(res.stderr.split())
    assert "spotlight up --config 'my run.toml' --reserved" in (tmp_path / "my run.toml").read_text()


def test_up_next_line_quotes_the_run_directory(tmp_path):
    from spotlight.cli.up import next_steps
    from spotlight.config import EXAMPLES_DIR, load_config

    for example in ("default/config.toml", "jpeg-toy/config.toml"):  # eval accepts it / needs --prompts
        rd = tmp_path / "with space" / example.split("/")[0]
        rd.mkdir(parents=True)
        cfg = load_config(EXAMPLES_DIR / example)
        console = Console(record=True, width=1000, color_system=None)
        console.print(next_steps(rd, cfg))
        text = console.export_text()
        assert f"spotlight eval --run-dir {shlex.quote(str(rd))}" in text, text
        assert f"spotlight status {shlex.quote(str(rd))} shows" in text, text


def test_status_names_one_of_several_running_runs_quoted(tmp_path, capsys):
    from spotlight.cli.status import pick_run

    for name in ("a b", "c d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "coordinator.json").write_text(json.dumps({"endpoint": "x", "pid": os.getpid()}))
    try:
        pick_run(tmp_path)
    except Exception as exc:  # typer.Exit(2)
        assert getattr(exc, "exit_code", None) == 2
    else:
        raise AssertionError("pick_run picked one of two running runs")
    out, text = capsys.readouterr()
    assert not out, out
    assert "e.g. spotlight status '" in text and f"'{tmp_path}/" in text, text


def test_keys_and_profile_hints_quote_their_paths(tmp_path):
    """The commands inside error messages (keys, explore.profile_path) quote their paths too."""
    import pytest

    from spotlight.errors import SpotlightError
    from spotlight.net.security import KeysError, add_client, init_keys, load_client_keys, load_server_keys
    from spotlight.studies.profiling import load_profile

    d = tmp_path / "my keys"
    d.mkdir()
    q = shlex.quote(str(d))
    for call in (lambda: add_client(d, "agent", "n1"), lambda: load_server_keys(d)):
        with pytest.raises(KeysError) as info:
            call()
        assert f"spotlight keys init {q}" in str(info.value), str(info.value)
    init_keys(d, exist_ok=True)
    with pytest.raises(KeysError) as info:
        load_client_keys(d, role="agent")
    assert f"spotlight keys add {q} agent NAME" in str(info.value), str(info.value)
    from spotlight.config import load_config

    missing = tmp_path / "a run" / "profile.json"
    with pytest.raises(SpotlightError) as info:
        load_profile(load_config(overrides={"explore.profile_path": str(missing)}))
    assert f"spotlight profile --out {shlex.quote(str(missing))}" in str(info.value), str(info.value)
