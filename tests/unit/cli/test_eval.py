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


def test_eval_of_another_task_needs_held_out_prompts(tmp_path):
    res = CliRunner().invoke(app, ["eval", "--config", str(EXAMPLES_DIR / "jpeg-toy" / "config.toml")])
    assert res.exit_code == 2, res.output
    assert "--prompts" in res.stdout


def test_eval_scores_any_family_on_its_panel(tmp_path, monkeypatch):
    """A Qwen-Image checkpoint (tiny, random) with the JPEG reward: base and saved weights on the
    held-out panel, one grid each."""
    import json

    import tomli_w

    from spotlight.models.families.qwen_image import make_random_checkpoint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = make_random_checkpoint(tmp_path / "ckpt", seed=2)
    conf = tmp_path / "c.toml"
    conf.write_text(
        tomli_w.dumps(
            {
                "model": {
                    "family": "qwen-image",
                    "pretrained_path": str(ckpt),
                    "image_size": 32,
                    "max_text_tokens": 24,
                },
                "sampler": {"num_steps": 4, "sde_window_size": 2},
                "reward": {"kind": "jpeg_compressibility"},
                "eval": {
                    "num_prompts": 2,
                    "prompts_path": str(EXAMPLES_DIR / "default/prompts/evaluation_metadata.jsonl"),
                },
            }
        )
    )
    out = tmp_path / "out"
    args = ["eval", "--config", str(conf), "--num-seeds", "1", "--out", str(out)]
    res = CliRunner().invoke(app, [*args, "--weights", str(ckpt / "transformer")])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "eval.json").read_text())
    assert report["num_prompts"] == 2 and report["base"]["eval/score"] < 0  # -kB
    assert report["final"]["eval/score"] == report["base"]["eval/score"]  # the same weights
    assert (out / "eval_base.png").is_file() and (out / "eval_final.png").is_file()
