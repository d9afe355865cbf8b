"""Which Planner profile a run uses is explicit: the file ``explore.profile_path`` names, else the
run directory's ``profile.json``, else none. A profile ``spotlight profile`` wrote under the home
directory no longer changes later runs of that config without a word (it did: it was read by
every run of the same model config)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.config import load_config
from spotlight.studies.profiling import config_key, legacy_cache_path, load_profile, profile_mismatch


def _profile(cfg, t_step_s: float = 0.004, **extra) -> dict:
    return {
        "version": 1,
        "config_key": config_key(cfg),
        "created_unix_s": 1.0e9,
        "t_step_s": {"cpu/sp1": t_step_s},
        "steps": [
            {"cache_threshold": 0.0, "effective_steps": 10.0, "cost_steps": 10.0, "accuracy": 1.0},
            {"cache_threshold": 0.7, "effective_steps": 4.0, "cost_steps": 4.5, "accuracy": 0.9},
        ],
        **extra,
    }


@pytest.fixture
def home_cache(tmp_path, monkeypatch):
    """A profile cached where `spotlight profile` used to write it by default."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = load_config()
    path = legacy_cache_path(cfg)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_profile(cfg, t_step_s=9.0)))
    return path


def test_a_profile_cached_under_home_is_not_read(tmp_path, home_cache):
    assert load_profile(load_config(), tmp_path / "run") is None


def test_the_run_directorys_profile_is_used_and_says_so(tmp_path, home_cache):
    cfg = load_config()
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "profile.json").write_text(json.dumps(_profile(cfg)))
    prof = load_profile(cfg, rd)
    assert prof.path == str(rd / "profile.json") and prof.t_step_s == 0.004 and prof.source == "the run directory"
    line = prof.describe()
    assert line.startswith(f"planner profile {rd / 'profile.json'} (from the run directory; measured ")
    assert line.endswith(": t_step 4 ms per sequence-step on cpu/sp1, 2 cache thresholds)"), line
    assert profile_mismatch(prof, cfg) is None


def test_the_configs_profile_comes_before_the_run_directorys(tmp_path):
    cfg0 = load_config()
    named = tmp_path / "named.json"
    named.write_text(json.dumps(_profile(cfg0, t_step_s=0.002)))
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "profile.json").write_text(json.dumps(_profile(cfg0)))
    cfg = load_config(overrides={"explore.profile_path": str(named)})
    prof = load_profile(cfg, rd)
    assert prof.path == str(named) and prof.source == "explore.profile_path" and prof.t_step_s == 0.002


def test_a_profile_of_another_config_is_pointed_out(tmp_path):
    cfg = load_config()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile(cfg, config_key="0123456789ab")))
    prof = load_profile(load_config(overrides={"explore.profile_path": str(path)}))
    why = profile_mismatch(prof, cfg)
    assert why.startswith(f"{path} was measured for another model, sampler, reward or worker batch size"), why


def test_profile_writes_where_it_is_told_and_says_which_runs_use_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    res = CliRunner().invoke(app, ["profile", "--out", "a.json", "--run-dir", "run"])
    assert res.exit_code == 2 and res.output.strip() == "error: give --out or --run-dir, not both", res.output
    args = ["--num-prompts", "2", "--num-seeds", "3", "--thresholds", "100", "--sp-degrees", "1"]
    res = CliRunner().invoke(app, ["profile", "--run-dir", "run", *args], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1] == (
        "wrote run/profile.json: the run in run uses it (`spotlight up --run-dir run` or --resume), "
        "unless its config sets explore.profile_path"
    )
    assert load_profile(load_config(), tmp_path / "run").source == "the run directory"
    assert not list(tmp_path.rglob("profile-*.json"))  # nothing cached for every later run
