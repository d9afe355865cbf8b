"""CLI error messages name where the bad value came from (a flag, not a config key)."""

from __future__ import annotations

from typer.testing import CliRunner

from spotlight.cli import app

runner = CliRunner()


def test_eval_prompts_missing_file_names_the_flag(tmp_path):
    res = runner.invoke(app, ["eval", "--prompts", str(tmp_path / "nope.jsonl")])
    assert res.exit_code != 0
    out = " ".join(res.output.split())
    assert "--prompts: file not found" in out, res.output
    assert "data.prompts_path" not in out
