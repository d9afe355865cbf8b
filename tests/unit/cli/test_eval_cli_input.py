"""``spotlight eval`` refuses bad input with one ``error:`` line and exit 2, before any sampling:
an unreachable reward service, a reward that cannot score the held-out prompts, and
``--run-dir`` given with ``--config``."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from spotlight.cli import app

runner = CliRunner()


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_dir(tmp_path, reward: str, prompts: str = "a photo of a cat\na photo of a dog\n"):
    """A finished run (config.toml and final/) whose held-out prompts are ``prompts`` and whose
    ``[reward]`` section is ``reward``."""
    (tmp_path / "prompts.txt").write_text(prompts)
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.toml").write_text(
        f'[reward]\n{reward}\n\n[eval]\nprompts_path = "{tmp_path / "prompts.txt"}"\nnum_prompts = 2\n'
    )
    return run


def _no_sampling(monkeypatch, why: str) -> None:
    """Any model load or sampling fails the test: the refusal must come first."""
    from spotlight.cli import eval as eval_cli
    from spotlight.tasks.shapes import evaluate as ev
    from spotlight.workers.eval import eval_worker as ew

    fail = lambda *a, **k: pytest.fail(why)  # noqa: E731
    monkeypatch.setattr(ev, "evaluate", fail)
    monkeypatch.setattr(ew, "sample_panel", fail)
    monkeypatch.setattr(eval_cli, "load_weights", fail)


def _one_line(res) -> str:
    return " ".join(res.output.split())


def test_eval_with_an_unreachable_reward_service_is_one_line_before_any_sampling(tmp_path, monkeypatch):
    """Was: a Rich traceback ending in `RewardError: … Connection refused`, exit 1."""
    _no_sampling(monkeypatch, "sampled before the reward service was checked")
    url = f"http://127.0.0.1:{_closed_port()}/score"
    run = _run_dir(tmp_path, f'kind = "http"\nurl = "{url}"\nmax_retries = 1\ntimeout_s = 5.0')
    res = runner.invoke(app, ["eval", "--run-dir", str(run), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    out = _one_line(res)
    assert out.startswith(f"error: reward service check failed: reward service {url} failed"), res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) <= 3, res.output
    assert not (tmp_path / "out").exists()


def test_eval_with_prompts_the_reward_cannot_score_is_one_line_before_any_sampling(tmp_path, monkeypatch):
    """The same kind of fault: a RewardError from the reward's setup (here `ocr` on prompts without
    a quoted target) was a traceback after the base model had sampled the whole panel."""
    pytest.importorskip("rapidocr_onnxruntime")  # reward.kind = 'ocr' needs it to load the config
    _no_sampling(monkeypatch, "sampled before the reward was checked against the prompts")
    run = _run_dir(tmp_path, 'kind = "ocr"')
    res = runner.invoke(app, ["eval", "--run-dir", str(run), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert _one_line(res).startswith("error: reward.kind = 'ocr' cannot score the held-out prompts:"), res.output
    assert "Traceback" not in res.output


def test_eval_refuses_run_dir_with_config_naming_both(tmp_path, monkeypatch):
    """Was: --config silently ignored, the run's own config evaluated."""
    _no_sampling(monkeypatch, "sampled although --config was ignored")
    run = _run_dir(tmp_path, 'kind = "jpeg_compressibility"')
    other = tmp_path / "other.toml"
    other.write_text('[reward]\nkind = "jpeg_incompressibility"\n')
    res = runner.invoke(
        app,
        ["eval", "--run-dir", str(run), "--config", str(other), "--num-seeds", "1", "--out", str(tmp_path / "out")],
    )
    assert res.exit_code == 2, res.output
    out = _one_line(res)
    assert out.startswith("error: --run-dir and --config cannot be used together"), res.output
    assert str(other) in out and "Traceback" not in res.output
    assert not (tmp_path / "out").exists()


def test_a_reward_service_that_answers_passes_the_check(tmp_path):
    """The probe refuses only a service that fails: one that answers lets the evaluation go on."""
    from spotlight.cli.eval import reward_refusal
    from spotlight.config import load_config
    from spotlight.workers.eval import eval_worker as ew
    from tests import fakes

    with fakes.reward_service() as (url, _):
        run = _run_dir(tmp_path, f'kind = "http"\nurl = "{url}"\nmax_retries = 1\ntimeout_s = 5.0')
        cfg = load_config(run / "config.toml")
        assert reward_refusal(cfg, ew.build_panel(cfg)) is None
