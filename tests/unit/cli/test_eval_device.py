"""An ``eval.device`` this host lacks (``cuda`` on a CPU-only host) is refused in one line by
``spotlight up`` before the run starts and by ``spotlight eval`` before it loads a model (was:
accepted, then every evaluation of the run failed in the eval worker's traceback, and the run
ended with no held-out score)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from spotlight.cli import app

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")


@pytest.fixture
def config(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text('[eval]\nevery = 1\ndevice = "cuda"\n')
    return conf


def _refused(res):
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert 'eval.device = "cuda": this host has no CUDA device' in res.stderr, res.output
    assert "Traceback" not in res.output


def test_up_refuses_before_the_run_starts(tmp_path, config, monkeypatch):
    import spotlight.cli.up as up

    def announce(_run):
        raise AssertionError("up got past its checks")

    monkeypatch.setattr(up, "announce", announce)
    _refused(CliRunner().invoke(app, ["up", "--local", "--config", str(config), "--run-dir", str(tmp_path / "r")]))
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_eval_refuses_before_it_loads_a_model(config, tmp_path):
    _refused(CliRunner().invoke(app, ["eval", "--config", str(config), "--out", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists()
