"""Every error line of `spotlight` and `spotlight-agent` starts the same way, click's own
usage errors included (click/typer would print 'Error:' or a boxed 'Error' panel)."""

from __future__ import annotations

from spotlight.cli import app
from spotlight.util.cli_run import run_app


def test_a_usage_error_is_one_error_line_after_the_usage(capsys):
    assert run_app(app, "error:", ["init", "--train-gpus", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: Invalid value for '--train-gpus'" in err, err
    assert "Error" not in err and "╭" not in err, err
    assert "Usage:" in err and "--help' for help." in err


def test_an_unknown_command_and_the_agents_prefix(capsys):
    from agent.main import app as agent_app

    assert run_app(app, "error:", ["nosuch"]) == 2
    assert "error: No such command 'nosuch'." in capsys.readouterr().err
    assert run_app(agent_app, "spotlight-agent: error:", ["revoke", "--node-id", "x"]) == 2
    err = capsys.readouterr().err
    assert "spotlight-agent: error: Missing option '--gpu'." in err, err
    assert "Error:" not in err


def test_success_and_our_own_errors_keep_their_status(capsys):
    assert run_app(app, "error:", ["init"]) == 0
    assert "[model]" in capsys.readouterr().out
    assert run_app(app, "error:", ["init", "--family", "sd4"]) == 2
    assert capsys.readouterr().err.startswith("error: --family 'sd4'")


def test_a_tilde_after_equals_is_expanded_as_the_shell_would_before_a_space(monkeypatch, tmp_path):
    from spotlight.util.cli_run import expand_option_tilde

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    given = ["--out=~/runs/x", "--out=~", "-o=~/a", "--name=a~b", "~/pos", "--x=~nosuchuser9/y"]
    assert expand_option_tilde(given) == [
        f"--out={home}/runs/x",
        f"--out={home}",
        "-o=~/a",
        "--name=a~b",
        "~/pos",
        "--x=~nosuchuser9/y",
    ]
    assert expand_option_tilde(["--", "--out=~/x"]) == ["--", "--out=~/x"]


def test_init_out_with_a_tilde_after_equals_writes_under_home_not_a_folder_named_tilde(monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert run_app(app, "error:", ["init", "--out=~/run.toml"]) == 0
    assert (home / "run.toml").is_file()
    assert not (tmp_path / "~").exists()
