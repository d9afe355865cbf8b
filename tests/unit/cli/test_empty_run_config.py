"""A run directory's ``config.toml`` is written in full when the run starts, so one that sets
nothing (0 bytes, whitespace, comments) is damage: ``spotlight eval --run-dir`` and ``spotlight
up --resume`` / ``--resume-existing`` refuse it in one line rather than merge it on the embedded
default and evaluate, or go on training, another model (``spotlight.config.load_run_config``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.config import ConfigError, load_run_config

EMPTY = {"zero-bytes": "", "whitespace": " \n\n", "comments": "# nothing here\n"}


@pytest.fixture(params=list(EMPTY), ids=list(EMPTY))
def run(tmp_path, request):
    rd = tmp_path / "run"
    (rd / "final").mkdir(parents=True)
    (rd / "config.toml").write_text(EMPTY[request.param])
    (rd / "metrics.jsonl").write_text(json.dumps({"iteration": 1}) + "\n")
    (rd / "coordinator.json").write_text(json.dumps({"pid": None, "endpoint": "tcp://127.0.0.1:1"}))
    return rd


def test_load_run_config_refuses_an_empty_file(run):
    with pytest.raises(ConfigError, match="is empty"):
        load_run_config(run / "config.toml")


def _refused(res, run):
    assert res.exit_code != 0, res.output
    assert f"{run / 'config.toml'} is empty" in res.output, res.output
    assert "Traceback" not in res.output


def test_eval_refuses_a_run_whose_config_is_empty(run):
    _refused(CliRunner().invoke(app, ["eval", "--run-dir", str(run)]), run)


@pytest.mark.parametrize("how", ["resume", "resume-existing"])
def test_up_refuses_to_resume_a_run_whose_config_is_empty(run, how, monkeypatch):
    import spotlight.cli.up as up

    def announce(_run):  # what comes after the checks: a start that was not refused stops here
        raise AssertionError(f"up got past its checks on the embedded default: {_run.cfg.model}")

    monkeypatch.setattr(up, "announce", announce)
    args = ["--resume", str(run)] if how == "resume" else ["--resume-existing", "--run-dir", str(run)]
    res = CliRunner().invoke(app, ["up", *args])
    _refused(res, run)
    assert not (run / "checkpoints").exists() and (run / "metrics.jsonl").read_text().count("\n") == 1
