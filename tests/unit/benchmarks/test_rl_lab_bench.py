"""benchmarks/rl_lab.py: bad arguments stop with one line before anything runs, and
--gradient-agreement with exploration compares the explored batches (batch 0 never is)."""

from __future__ import annotations

import math
import sys

import pytest

from tests.factories import LAB_SMALL as SMALL
from tests.factories import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("rl_lab")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--set", "garbage"], "--set garbage: expected KEY=VALUE"),
        (["--set", "run.iterations.x=1"], "override run.iterations.x: run.iterations is a value, not a table"),
        (["--set", "nosuch.key=1"], "override nosuch.key: [nosuch]: unknown section"),
        (["--gradient-agreement", "2"], "at least 4 batches"),
        (
            ["--gradient-agreement", "4", "--set", "train.steps_per_iteration=2"],
            "error: --gradient-agreement keeps one gradient per whole batch",
        ),
    ],
)
def test_bad_arguments_stop_with_one_line(bench, monkeypatch, capsys, argv, says):
    _refused_before_running(bench, monkeypatch, capsys, argv, says)


def _refused_before_running(bench, monkeypatch, capsys, argv, says):
    monkeypatch.setattr(sys, "argv", ["rl_lab.py", *argv])
    monkeypatch.setattr(bench, "run_one", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr(bench, "run_gradients", lambda *a, **k: pytest.fail("ran"))
    try:
        code = bench.main()
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "setting 'run'" not in err[-1]


SWEEPS = {
    "unclosed.toml": ("[setting.a\n", "not valid TOML"),
    "none.toml": ("[other]\nx = 1\n", "no settings; expected [setting.NAME] tables"),
    "empty.toml": ("[setting]\n", "no settings"),
    "value.toml": ("[setting]\na = 1\n", "setting.a must be a table"),
    "explore.toml": ('[setting.a]\nexplore = "many"\n', "setting.a.explore must be a whole number >= 0"),
    "seeds.toml": ("[setting.a]\neval_seeds = 0\n", "setting.a.eval_seeds must be a whole number >= 1"),
}


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_bad_sweep_files_stop_with_one_line(bench, monkeypatch, capsys, tmp_path, name):
    """Were tracebacks: FileNotFoundError, TOMLDecodeError, KeyError, TypeError, ValueError, or
    (an empty [setting]) nothing run and then a FileNotFoundError."""
    text, says = SWEEPS[name]
    (tmp_path / name).write_text(text)
    _refused_before_running(bench, monkeypatch, capsys, ["--sweep", str(tmp_path / name)], says)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--seeds", "a"], "--seeds a: expected run seeds >= 0"),
        (["--seeds", "0,,1"], "--seeds 0,,1: expected"),
        (["--seeds", "-1"], "--seeds -1: expected"),
        (["--threads", "-1"], "argument --threads: must be >= 1, got -1"),
        (["--eval-seeds", "0"], "argument --eval-seeds: must be >= 1, got 0"),
        (["--explore", "-3"], "argument --explore: must be >= 0, got -3"),
        (["--eval-every", "-1"], "argument --eval-every: must be >= 0"),
        (["--iterations", "x"], "argument --iterations: expected a whole number, got 'x'"),
    ],
)
def test_bad_numbers_stop_with_one_line(bench, monkeypatch, capsys, argv, says):
    """Were a traceback (--seeds), an error after the model had loaded (--threads, --eval-seeds),
    or a full run started anyway (--explore -3, --eval-every -1, --seeds -1)."""
    _refused_before_running(bench, monkeypatch, capsys, argv, says)


def test_an_out_that_is_a_file_is_refused_before_running(bench, monkeypatch, capsys, tmp_path):
    """Was: every batch run, then FileExistsError and the results lost."""
    (tmp_path / "afile").write_text("")
    _refused_before_running(bench, monkeypatch, capsys, ["--out", str(tmp_path / "afile")], "not a writable directory")
    _refused_before_running(
        bench, monkeypatch, capsys, ["--sweep", str(tmp_path / "nosuch.toml")], "nosuch.toml: No such file"
    )


@pytest.mark.procs  # the lab's one-rank gloo process group, in the test process
def test_gradient_agreement_with_exploration_compares_explored_batches(bench, tmp_path):
    doc = bench.run_gradients("ex", dict(SMALL), {"explore": 6}, 0, tmp_path, 3)
    # 4 batches ran (the first is never explored) and the first one's gradient is left out
    assert doc["overrides"]["run.iterations"] == 4
    assert doc["explore_candidates"] == 6
    assert doc["agreement"]["num_gradients"] == 3 and len(doc["rewards"]) == 3
    assert len(doc["cosines"]) == 3
    assert (tmp_path / "ex-grad-s0.json").is_file()
    assert "(explored, d = 6)" in bench.summarise_gradients([doc])
    # the lab takes down the process group it made (a later module's own group must come up)
    import torch.distributed as dist

    assert not dist.is_initialized()
    plain = bench.run_gradients("plain", dict(SMALL), {}, 0, tmp_path, 3)
    assert plain["overrides"]["run.iterations"] == 3 and plain["agreement"]["num_gradients"] == 3
    assert "explored" not in bench.summarise_gradients([plain])
    assert plain["by_part"] and "by block and by module" in bench.summarise_gradients([plain])
    assert all(math.isfinite(x) for row in plain["cosines"] for x in row)
