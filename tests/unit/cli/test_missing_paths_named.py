"""A path that does not exist is said to not exist, in one line, not described as the wrong
kind of folder (`--resume`, `eval --weights`, a config's checkpoint folder), and a simulation
profile saved with a byte-order mark reads as configs do."""

from __future__ import annotations

import tomli_w
from typer.testing import CliRunner

from spotlight.cli import app

runner = CliRunner()


def _line(res) -> str:
    return " ".join(res.output.split())


def test_resume_of_a_missing_directory_says_so(tmp_path):
    """Was: `--resume …: no config.toml there; not a Spotlight run directory`."""
    res = runner.invoke(app, ["up", "--local", "--resume", str(tmp_path / "nope")])
    assert res.exit_code == 2 and _line(res) == f"error: --resume {tmp_path / 'nope'}: no such directory", res.output
    res = runner.invoke(app, ["up", "--local", "--resume", str(tmp_path)])
    assert res.exit_code == 2 and "no config.toml there" in _line(res), res.output


def test_eval_weights_that_do_not_exist_say_so(tmp_path, monkeypatch):
    """Was: `/nope: neither a transformer folder (config.json) nor LoRA weights`."""
    import pytest

    from spotlight.tasks.shapes import evaluate as ev

    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: pytest.fail("sampled before the weights were checked"))
    res = runner.invoke(app, ["eval", "--weights", str(tmp_path / "nope"), "--num-seeds", "1"])
    assert res.exit_code == 2, res.output
    assert _line(res) == f"error: cannot load final weights: {tmp_path / 'nope'}: no such file or directory"


def test_a_missing_checkpoint_folder_is_named_as_missing_not_as_lacking_a_subfolder(tmp_path):
    """Was (`spotlight plan`): `…: no 'transformer/' folder; a sd3 checkpoint in diffusers layout…`."""
    from spotlight.config import ConfigError, load_config
    from spotlight.models.families import get_family
    from spotlight.models.families.base import ModelLoadError

    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(tomli_w.dumps({"model": {"family": "sd3", "pretrained_path": str(tmp_path / "nope")}}))
    try:
        cfg = load_config(cfg_path)
    except ConfigError as exc:  # the config itself may refuse it first: then that is the one line
        assert "nope" in str(exc)
        return
    family = get_family(cfg.model)
    try:
        family.component_dir("transformer")
    except ModelLoadError as exc:
        assert str(exc) == f"checkpoint directory not found: {tmp_path / 'nope'} (model.pretrained_path)"
    else:
        raise AssertionError("a missing checkpoint folder was accepted")


def test_a_simulation_profile_with_a_byte_order_mark_loads(tmp_path):
    """Was: `not valid TOML: Invalid statement (at line 1, column 1)`."""
    from spotlight.sim.profile import DEFAULT_PROFILE, ProfileError, load_profile

    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + DEFAULT_PROFILE.read_bytes())
    assert load_profile(bom).num_steps == load_profile(DEFAULT_PROFILE).num_steps
    latin = tmp_path / "latin.toml"
    latin.write_bytes(DEFAULT_PROFILE.read_bytes().replace(b"name = ", b"# caf\xe9\nname = ", 1))
    try:
        load_profile(latin)
    except ProfileError as exc:
        assert "not UTF-8 text" in str(exc) and "TOML files are UTF-8" in str(exc)
    else:
        raise AssertionError("a file that is not UTF-8 was accepted")
