"""`spotlight profile` refuses bad input -- output paths, ``--weights``, the comma-separated lists,
``--num-prompts`` -- with one ``error:`` line naming the option, before anything is measured
(in-process through ``CliRunner``; ``_measure`` is replaced so that no test can measure)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.cli import profile as profile_cli


def _no_measuring(*args, **kwargs):
    raise AssertionError("spotlight profile measured although its input is bad")


@pytest.fixture
def measured(monkeypatch):
    """``_measure`` as a stub: refuses to run (the refusal tests), or with ``fake=True`` records
    its arguments and returns a minimal profile (the acceptance tests)."""
    calls = []

    def setup(fake: bool = False):
        def stub(cfg, prompts, weights, ths, degrees, num_prompts, num_seeds, console):
            calls.append({"weights": weights, "thresholds": ths, "sp_degrees": degrees})
            return {
                "t_step_s": {"cpu/sp1": 0.001},
                "steps": [{"cache_threshold": 0.0, "effective_steps": 4.0, "cost_steps": 4.0, "accuracy": 1.0}],
            }

        monkeypatch.setattr(profile_cli, "_measure", stub if fake else _no_measuring)
        return calls

    return setup


def _refused(args: list[str], *needles: str) -> str:
    """Run ``spotlight profile ARGS``: exit code 2, one ``error:`` line holding every needle."""
    res = CliRunner().invoke(app, ["profile", *args])
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    text = res.output.strip()
    assert text.startswith("error: ") and "\n" not in text, text
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in text, (needle, text)
    return text


# -- output paths --------------------------------------------------------------------------


def test_out_that_is_a_directory_is_refused_before_measuring(tmp_path, measured):
    measured()
    _refused(["--out", str(tmp_path)], "--out", str(tmp_path), "a directory")


def test_out_whose_parent_is_a_file_is_refused(tmp_path, measured):
    measured()
    (tmp_path / "f").write_text("")
    _refused(["--out", str(tmp_path / "f" / "p.json")], "--out", str(tmp_path / "f"), "not a directory")
    _refused(["--out", str(tmp_path / "f" / "sub" / "p.json")], "--out", "cannot be created")


def test_default_out_that_is_a_directory_is_refused(tmp_path, monkeypatch, measured):
    measured()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "profile.json").mkdir()
    _refused([], "profile.json", "--out", "a directory")


def test_run_dir_that_is_a_file_is_refused(tmp_path, measured):
    measured()
    (tmp_path / "f").write_text("")
    _refused(["--run-dir", str(tmp_path / "f")], "--run-dir", str(tmp_path / "f"), "a file, not a directory")
    _refused(["--run-dir", str(tmp_path / "f" / "run")], "--run-dir", "cannot be created")


def test_run_dir_whose_profile_json_is_a_directory_is_refused(tmp_path, measured):
    measured()
    (tmp_path / "profile.json").mkdir()
    _refused(["--run-dir", str(tmp_path)], "--run-dir", str(tmp_path / "profile.json"), "is a directory")


def test_missing_directories_are_created_and_nothing_is_left_by_the_check(tmp_path, measured):
    """A new run directory, or --out under a new directory: created only when the profile is
    written (the up-front check leaves nothing behind)."""
    calls = measured(fake=True)
    out = tmp_path / "new" / "deeper" / "p.json"
    res = CliRunner().invoke(app, ["profile", "--out", str(out), "--thresholds", " 0.5 , 0,1", "--sp-degrees", "1,2"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["steps"][0]["cache_threshold"] == 0.0
    assert calls == [{"weights": None, "thresholds": [0.5, 0.0, 1.0], "sp_degrees": [1, 2]}]
    res = CliRunner().invoke(app, ["profile", "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "run" / "profile.json").is_file()


def test_path_check_leaves_no_directory_behind(tmp_path):
    out = tmp_path / "a" / "b" / "p.json"
    assert profile_cli.profile_path(out, None) == out
    assert not (tmp_path / "a").exists()
    assert profile_cli.profile_path(None, tmp_path / "r" / "s") == tmp_path / "r" / "s" / "profile.json"
    assert not (tmp_path / "r").exists()


# -- --weights -----------------------------------------------------------------------------


def test_missing_weights_are_refused(tmp_path, measured):
    measured()
    _refused(["--weights", str(tmp_path / "nonexistent.safetensors")], "--weights", "nonexistent", "no such file")


def test_weights_that_are_a_directory_are_refused(tmp_path, measured):
    measured()
    _refused(["--weights", str(tmp_path)], "--weights", str(tmp_path), "a directory")


@pytest.mark.parametrize(
    "content, reason",
    [(b"", "header too small"), (b"not a safetensors file at all" * 3, "not a readable safetensors file")],
)
def test_unreadable_weights_are_refused(tmp_path, measured, content, reason):
    measured()
    w = tmp_path / "w.safetensors"
    w.write_bytes(content)
    _refused(["--weights", str(w)], "--weights", str(w), "not a readable safetensors file", reason)


def test_truncated_and_empty_safetensors_are_refused(tmp_path, measured):
    import torch
    from safetensors.torch import save_file

    measured()
    w = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(64)}, str(w))
    w.write_bytes(w.read_bytes()[:-16])
    _refused(["--weights", str(w)], "--weights", "not a readable safetensors file")
    save_file({}, str(w))
    _refused(["--weights", str(w)], "--weights", "without tensors")


def _version(path, cfg) -> None:
    """Write the weight version 0 of a run of ``cfg`` (its transformer, or its LoRA adapter) to ``path``."""
    from safetensors.torch import save_file

    from spotlight.studies.profiling import initial_version

    save_file({k: t.contiguous() for k, t in initial_version(cfg).items()}, str(path))


def _default_cfg(**train):
    import msgspec

    from spotlight.config import load_config

    cfg = load_config(None)  # what `spotlight profile` without --config profiles
    return msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, **train)) if train else cfg


def _foreign(path) -> None:
    """Write a safetensors file whose one tensor name is no transformer's."""
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4)}, str(path))


def test_readable_weights_are_accepted(tmp_path, measured):
    calls = measured(fake=True)
    w = tmp_path / "w.safetensors"
    _version(w, _default_cfg())
    res = CliRunner().invoke(app, ["profile", "--weights", str(w), "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert calls[0]["weights"] == w


@pytest.mark.parametrize(
    "write, says",
    [
        (lambda w: _version(w, _default_cfg(lora_rank=8)), "tensors of another shape"),
        (lambda w: _version(w, _default_cfg(lora_rank=0)), "holds no weights of this run's LoRA adapter"),
        (_foreign, "holds no weights"),
    ],
    ids=["another-lora-rank", "full-weights-for-a-lora-config", "no-name-matches"],
)
def test_weights_of_another_model_are_refused_before_measuring(tmp_path, measured, write, says):
    """Was: accepted, then the prompts encoded and torch's `size mismatch for …lora_A.default.weight`
    (or `WeightVersionError: weight version has 1 unknown keys`) as a traceback."""
    measured()
    w = tmp_path / "w.safetensors"
    write(w)
    _refused(["--weights", str(w), "--out", str(tmp_path / "p.json")], f"--weights {w}", says,
             "LoRA adapter (rank 32)")  # fmt: skip


def test_weights_that_changed_before_their_load_give_one_line(tmp_path, capsys):
    """Checked fine, then replaced by weights of another rank before the load: one line, exit 2."""
    w = tmp_path / "w.safetensors"
    _version(w, _default_cfg(lora_rank=8))
    with pytest.raises(typer.Exit) as info:
        profile_cli.load_weights(w, _default_cfg())
    assert info.value.exit_code == 2
    out, err = capsys.readouterr()
    text = err.strip()
    assert not out and len(text.splitlines()) == 1, (out, err)
    assert text.startswith(f"error: --weights {w}: not a weight version") and "another shape" in text, text


def test_run_profile_refuses_weights_of_another_model():
    """The study itself: one WeightVersionError before any model is built."""
    import torch

    from spotlight.models.lora import WeightVersionError
    from spotlight.rl.sampler import Conditioning
    from spotlight.studies.profiling import run_profile

    cond = Conditioning(torch.zeros(2, 4, 384), torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(WeightVersionError, match="the profiled weights: holds no weights"):
        run_profile(
            _default_cfg(), cond, thresholds=[0.5], num_prompts=2, num_seeds=3, state_dict={"a": torch.zeros(1)}
        )


def test_weights_unreadable_when_loaded_give_one_line(tmp_path, capsys):
    """Where the file is opened for the tensors (it may change after the check): the library's
    error as one line on stderr, exit 2."""
    w = tmp_path / "w.safetensors"
    w.write_bytes(b"")
    with pytest.raises(typer.Exit) as info:
        profile_cli.load_weights(w)
    assert info.value.exit_code == 2
    out, err = capsys.readouterr()
    text = err.strip()
    assert not out and len(text.splitlines()) == 1, (out, err)
    assert text.startswith("error: --weights") and str(w) in text and "header too small" in text, text


# -- the lists -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, bad, why",
    [
        ("abc", "'abc'", "not a number"),
        ("0.5,abc", "'abc'", "not a number"),
        ("-1", "'-1'", "negative"),
        ("0.3,-0.1", "'-0.1'", "negative"),
        ("nan", "'nan'", "not a finite number"),
        ("inf", "'inf'", "not a finite number"),
        (",", "','", "an empty element"),
        ("", "''", "an empty element"),
        ("0.5,,1", "'0.5,,1'", "an empty element"),
        ("0.5,", "'0.5,'", "an empty element"),
    ],
)
def test_bad_thresholds_are_refused(measured, value, bad, why):
    measured()
    _refused(["--thresholds", value], "--thresholds", bad, why, "finite numbers >= 0")


@pytest.mark.parametrize(
    "value, bad, why",
    [
        ("x", "'x'", "not an integer"),
        ("1,x", "'x'", "not an integer"),
        ("1.5", "'1.5'", "not an integer"),
        ("0", "'0'", "less than 1"),
        ("1,-2", "'-2'", "less than 1"),
        (",", "','", "an empty element"),
        ("", "''", "an empty element"),
        ("1,,2", "'1,,2'", "an empty element"),
    ],
)
def test_bad_sp_degrees_are_refused(measured, value, bad, why):
    measured()
    _refused(["--sp-degrees", value], "--sp-degrees", bad, why, "integers >= 1")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--sp-degrees", "1,1"], "--sp-degrees '1,1': '1' is listed twice"),
        (["--sp-degrees", "1, 2,2"], "--sp-degrees '1, 2,2': '2' is listed twice"),
        (["--thresholds", "0.1,0.10"], "--thresholds '0.1,0.10': '0.10' is listed twice"),
    ],
)
def test_a_repeated_element_is_refused(measured, args, needle):
    """Was: `--sp-degrees 1,1` was accepted and SP 1 measured twice."""
    measured()
    _refused(args, needle)


def test_an_sp_degree_that_cannot_split_the_model_is_refused_before_measuring(measured):
    """Was: `--sp-degrees 3` measured SP 1 and the cache thresholds first (minutes on a real
    model) and only then said "SP 3: not measured (… does not divide … 4 attention heads …)"."""
    measured()  # measuring would fail the test
    _refused(["--sp-degrees", "1,3"], "--sp-degrees 3: SP degree 3 does not divide the transformer's 4 attention heads")


def test_threshold_zero_alone_is_accepted(tmp_path, measured):
    """0 is a threshold the code treats as valid: the full rollout every profile holds."""
    calls = measured(fake=True)
    res = CliRunner().invoke(app, ["profile", "--thresholds", "0", "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert calls[0]["thresholds"] == [0.0]


# -- numbers -------------------------------------------------------------------------------


def test_more_prompts_than_the_prompt_file_has_are_refused(measured):
    measured()
    _refused(["--num-prompts", "1000000"], "--num-prompts 1000000", "has only")
