"""`spotlight eval` refusals before any model is loaded (in-process through ``CliRunner``)."""

from __future__ import annotations

from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.config import EXAMPLES_DIR


def test_eval_refuses_a_run_without_final(tmp_path):
    (tmp_path / "config.toml").write_text((EXAMPLES_DIR / "default" / "config.toml").read_text())
    res = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "no final/" in res.stdout
