"""``spotlight profile`` checks the run's reward before it encodes or measures anything, as
``spotlight eval`` and ``up`` do: a reward service that does not answer, and prompts the reward
cannot score, are one ``error:`` line (exit 2); a service that stops answering while the profile
samples is one line too (exit 1), not a ``RewardError`` traceback."""

from __future__ import annotations

import pathlib
import socket

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.cli import profile as profile_cli
from tests import fakes

runner = CliRunner()


@pytest.fixture
def no_measuring(monkeypatch):
    def fail(*args, **kwargs):
        pytest.fail("spotlight profile measured before it checked the reward")

    monkeypatch.setattr(profile_cli, "_measure", fail)


def _config(tmp_path: pathlib.Path, reward: str, prompts: str = "a red cube\na photo of a cat\ntwo blue balls\n"):
    """A tiny-family config (8x8, 3 steps) with ``reward`` as its ``[reward]`` section."""
    (tmp_path / "prompts.txt").write_text(prompts)
    conf = tmp_path / "config.toml"
    conf.write_text(
        "[model]\nimage_size = 8\nmax_text_tokens = 8\n\n[sampler]\nnum_steps = 3\nsde_window_size = 1\n\n"
        f'[data]\nprompts_path = "{tmp_path / "prompts.txt"}"\n\n[cluster]\nworker_batch_size = 4\n\n'
        f"[eval]\nevery = 0\n\n[reward]\n{reward}\n"
    )
    return conf


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _profile(conf: pathlib.Path, tmp_path: pathlib.Path, *args: str):
    return runner.invoke(
        app,
        ["profile", "--config", str(conf), "--out", str(tmp_path / "p.json"), "--num-prompts", "2",
         "--num-seeds", "3", "--thresholds", "0", "--sp-degrees", "1", *args],
        env={"COLUMNS": "300"},
    )  # fmt: skip


def test_an_unreachable_reward_service_is_one_line_before_measuring(tmp_path, no_measuring):
    """Was: the prompts encoded and sampled, then `RewardError: reward service … failed after 3
    attempts` as a Rich traceback."""
    url = f"http://127.0.0.1:{_closed_port()}/score"
    conf = _config(tmp_path, f'kind = "http"\nurl = "{url}"\nmax_retries = 1\ntimeout_s = 5.0')
    res = _profile(conf, tmp_path)
    assert res.exit_code == 2, (res.output, res.exception)
    text = res.stderr.strip()
    assert text.startswith(f"error: reward service check failed: reward service {url} failed"), text
    assert "\n" not in text and res.stdout == "" and "Traceback" not in res.output
    assert not (tmp_path / "p.json").exists()


def test_prompts_the_reward_cannot_score_are_one_line_before_measuring(tmp_path, no_measuring):
    """The same kind: the shapes task's reward on prompts that are no shapes-world caption failed
    only when the first samples were scored."""
    conf = _config(tmp_path, 'kind = "geneval_shapes"', prompts="a photo of a cat\na bowl of soup\n")
    res = _profile(conf, tmp_path)
    assert res.exit_code == 2, (res.output, res.exception)
    text = res.stderr.strip()
    assert text.startswith("error: reward.kind = 'geneval_shapes' cannot score the profile's prompts:"), text
    assert "\n" not in text and "Traceback" not in res.output


def test_a_reward_service_that_fails_while_measuring_is_one_line(tmp_path, monkeypatch):
    """It answers the check, then HTTP 500 once the profile scores its samples: one line, exit 1,
    no profile written."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with fakes.reward_service(answers=1) as (url, count):  # the check's probe image is the one answer
        conf = _config(tmp_path, f'kind = "http"\nurl = "{url}"\nmax_retries = 1\ntimeout_s = 5.0')
        res = _profile(conf, tmp_path)
    assert res.exit_code == 1, (res.output, res.exception)
    text = res.stderr.strip()
    assert text.startswith("error: scoring the samples failed: reward service") and "\n" not in text, text
    assert "HTTP 500" in text and "Traceback" not in res.output
    assert count["n"] >= 2 and not (tmp_path / "p.json").exists()
