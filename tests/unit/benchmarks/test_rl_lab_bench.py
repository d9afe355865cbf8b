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
