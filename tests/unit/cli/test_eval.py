"""`spotlight eval` refusals before any model is loaded (in-process through ``CliRunner``)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.config import EXAMPLES_DIR


def test_eval_refuses_a_run_without_final(tmp_path):
    (tmp_path / "config.toml").write_text((EXAMPLES_DIR / "default" / "config.toml").read_text())
    res = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "no final/" in res.stderr and not res.stdout


def test_eval_names_a_missing_run_directory_as_missing(tmp_path):
    res = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path / "nosuch")])
    assert res.exit_code == 2 and "nosuch: no such directory" in res.stderr, res.output
    (tmp_path / "f").write_text("")
    res = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path / "f")])
    assert res.exit_code == 2 and "a file, not a run directory" in res.stderr, res.output


def test_an_out_that_is_a_file_is_refused_before_the_run_is_read(tmp_path):
    """Was: the run's config and prompts were read (5 s of loading on a fresh process) before
    `--out afile` was refused; it is the first check now."""
    (tmp_path / "afile").write_text("")
    res = CliRunner().invoke(app, ["eval", "--run-dir", str(tmp_path / "nosuch"), "--out", str(tmp_path / "afile")])
    assert res.exit_code == 2, res.output
    assert f"--out {tmp_path / 'afile'}: " in res.stderr and "nosuch" not in res.stderr, res.stderr


def test_a_prompt_eval_cannot_score_is_named_by_file_and_place(tmp_path):
    """Was: "error: cannot parse 'a photo of a dog' …" without the file or which prompt, where
    `spotlight up` names both."""
    prompts = tmp_path / "bad.txt"
    prompts.write_text("a photo of a circle\na photo of a dog\n")
    res = CliRunner().invoke(app, ["eval", "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert f"{prompts}: prompt 2: cannot parse 'a photo of a dog'" in " ".join(res.stderr.split()), res.stderr


def test_eval_of_another_task_needs_held_out_prompts(tmp_path):
    res = CliRunner().invoke(app, ["eval", "--config", str(EXAMPLES_DIR / "jpeg-toy" / "config.toml")])
    assert res.exit_code == 2, res.output
    assert "--prompts" in res.stderr and not res.stdout


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
    assert list(report)[:2] == ["base", "final"]  # the base model first, though final loads first
    assert report["final"]["eval/score"] == report["base"]["eval/score"]  # the same weights
    assert (out / "eval_base.png").is_file() and (out / "eval_final.png").is_file()


def test_up_suggests_eval_only_for_a_run_eval_accepts(tmp_path):
    """The finished run's ``next:`` line names ``spotlight eval --run-dir`` as is only when eval
    accepts that run (it refused the JPEG toy, which has no held-out prompts, after suggesting it)."""
    from spotlight.cli.up import next_steps
    from spotlight.config import load_config

    for example, accepted in (("default/config.toml", True), ("jpeg-toy/config.toml", False)):
        rd = tmp_path / example.split("/")[0]
        rd.mkdir()
        (rd / "config.toml").write_text((EXAMPLES_DIR / example).read_text())
        (rd / "final").mkdir()
        line = next_steps(rd, load_config(rd / "config.toml"))
        if accepted:
            assert f"spotlight eval --run-dir {rd}[/cyan]" in line
        else:
            assert f"spotlight eval --run-dir {rd}[/cyan]" not in line and "--prompts FILE" in line
            refused = CliRunner().invoke(app, ["eval", "--run-dir", str(rd)])
            assert refused.exit_code == 2 and "--prompts" in refused.stderr
        assert "spotlight status" in line


def test_next_line_says_how_to_get_spotlight_on_the_path_when_it_is_not(tmp_path):
    """`./scripts/run-local` runs the venv's `spotlight` without activating the venv: the `next:`
    line says `source …/bin/activate` first; with the venv's `spotlight` on the PATH it does not."""
    from spotlight.cli.up import activate_hint, next_steps
    from spotlight.config import load_config

    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text("")
    spotlight = venv_bin / "spotlight"
    spotlight.write_text("#!/bin/sh\n")
    spotlight.chmod(0o755)
    python = str(venv_bin / "python")
    assert activate_hint(python, path="/nonexistent") == f"source {venv_bin / 'activate'}"
    assert activate_hint(python, path=str(venv_bin)) is None
    assert activate_hint(str(tmp_path / "bare" / "python"), path="/nonexistent") is None  # not a venv
    line = next_steps(tmp_path, load_config(None), activate_hint(python, path="/nonexistent"))
    assert line.startswith(f"next: [cyan]source {venv_bin / 'activate'}[/cyan], then [cyan]spotlight eval")


@pytest.mark.procs
def test_run_local_asks_for_the_venv_the_callers_shell_lacks(tmp_path, monkeypatch):
    """`scripts/_venv.sh` puts the venv first on PATH for `spotlight up`, so the hint looked at
    that PATH and never fired: a new user's next `spotlight eval` was "command not found". The
    script keeps the caller's PATH, and the hint reads it."""
    import subprocess

    from spotlight.cli.up import activate_hint

    root = pathlib.Path(__file__).resolve().parents[3]
    probe = f'source "{root}/scripts/_venv.sh" >/dev/null; echo "$SPOTLIGHT_CALLER_PATH"'
    env = {k: v for k, v in os.environ.items() if k != "SPOTLIGHT_CALLER_PATH"} | {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "/usr/bin:/bin", out.stderr[-2000:]
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text("")
    (venv_bin / "spotlight").write_text("#!/bin/sh\n")
    (venv_bin / "spotlight").chmod(0o755)
    monkeypatch.setenv("PATH", f"{venv_bin}:/usr/bin:/bin")  # as run-local runs `spotlight up`
    monkeypatch.setenv("SPOTLIGHT_CALLER_PATH", "/usr/bin:/bin")
    assert activate_hint(str(venv_bin / "python")) == f"source {venv_bin / 'activate'}"
    monkeypatch.delenv("SPOTLIGHT_CALLER_PATH")
    assert activate_hint(str(venv_bin / "python")) is None  # `spotlight up` from an activated shell


def test_overall_standard_error_is_that_of_a_mean_over_task_kinds():
    """One kind with a single prompt: the bound is sqrt(Σ 1/(4 n_k s)) / K, not 0.5/sqrt(N) of one
    mean over every image (which printed ±0.026 for 46 prompts × 8 seeds)."""
    from spotlight.cli.eval import overall_standard_error

    kinds, seeds = {"counting": 1, "colors": 45}, 8
    se = overall_standard_error(kinds, seeds)
    assert se == pytest.approx((0.25 / 8 + 0.25 / 360) ** 0.5 / 2)
    assert se > 3 * 0.5 / (46 * seeds) ** 0.5  # the old formula's ±0.026 understated it
    even = overall_standard_error({"a": 23, "b": 23}, seeds)  # equal kinds: both formulas agree
    assert even == pytest.approx(0.5 / (46 * seeds) ** 0.5)
    assert overall_standard_error({}, seeds) == 0.0


def test_eval_prints_the_bound_of_its_task_kinds(tmp_path, monkeypatch):
    """`spotlight eval` on two task kinds of one and three prompts prints the kinds' bound."""
    import re

    from spotlight.cli.eval import overall_standard_error
    from spotlight.tasks.shapes import world

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _show_loading_bars(monkeypatch)  # as in a fresh process: an earlier test may have hidden them
    specs = world.all_prompts()
    counting = [s.prompt for s in specs if s.tag == "counting"][:1]
    colors = [s.prompt for s in specs if s.tag == "colors"][:3]
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(counting + colors) + "\n")
    res = CliRunner().invoke(app, ["eval", "--prompts", str(prompts), "--num-seeds", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    shown = float(re.search(r"up to ±([0-9.]+)", res.stdout)[1])
    assert shown == pytest.approx(overall_standard_error({"counting": 1, "colors": 3}, 1), abs=1e-3)
    assert "Loading weights" not in res.output  # the libraries' loading bars stay off the console
    # off a terminal (a log file, CI) the spinner's text is a line: minutes of silence otherwise
    assert "sampling 4 test prompts × 1 seed with the base model…" in res.output, res.output
    # eval.json names its prompt file; a second evaluation into the same folder says what it
    # replaces before it samples (was: replaced silently, a 5-prompt score over the test set's)
    assert json.loads((tmp_path / "eval.json").read_text())["prompts"] == str(prompts)
    again = CliRunner().invoke(app, ["eval", "--prompts", str(prompts), "--num-seeds", "1", "--out", str(tmp_path)])
    assert again.exit_code == 0, again.output
    note = " ".join(again.stderr.split())
    assert f"note: replacing the evaluation in {tmp_path / 'eval.json'} (4 prompts × 1 seed of {prompts}, " in note


def _show_loading_bars(monkeypatch) -> None:
    import diffusers
    import transformers

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    transformers.utils.logging.enable_progress_bar()
    diffusers.utils.logging.enable_progress_bar()


def test_hide_loading_bars_turns_off_every_library_s_bars(monkeypatch):
    import os

    import diffusers
    import transformers

    from spotlight.util.quiet import hide_loading_bars

    _show_loading_bars(monkeypatch)
    hide_loading_bars()
    assert not transformers.utils.logging.is_progress_bar_enabled()
    assert not diffusers.utils.logging.is_progress_bar_enabled()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_eval_without_a_run_or_out_writes_a_new_directory_each_time(tmp_path):
    """An evaluation of a config (no --run-dir, no --out) never overwrites an earlier one."""
    from spotlight.cli.eval import new_eval_dir

    first = new_eval_dir(tmp_path)
    assert first.parent == tmp_path and not first.exists()
    first.mkdir()
    second = new_eval_dir(tmp_path)
    assert second != first and not second.exists()
    second.mkdir()
    assert new_eval_dir(tmp_path) not in (first, second)
