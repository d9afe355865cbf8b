"""benchmarks/run-all's budget selection (benchmarks/run_all.py ``select``, a pure function)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.factories import load_benchmark

BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def run_all():
    return load_benchmark("run_all")


def figs(run_all, *spec):
    return [run_all.Figure(name, f"{name}.py", est) for name, est in spec]


def test_cheapest_first_within_budget_then_paper_order(run_all):
    f = figs(run_all, ("a", 5.0), ("b", 1.0), ("c", 3.0), ("d", 2.0))
    run, skipped = run_all.select(f, 6.0)
    # cheapest first: b (1) + d (2) + c (3) = 6 fit; a (5) does not; run in the given order
    assert [x.name for x in run] == ["b", "c", "d"]
    assert [(x.name, why) for x, why in skipped] == [("a", "needs ~5 min, 0.0 min of the 6-min budget left")]


def test_budget_is_never_exceeded_and_everything_is_accounted_for(run_all):
    f = figs(run_all, ("a", 2.5), ("b", 2.5), ("c", 2.5), ("d", 0.1))
    for budget in (0.0, 0.1, 2.5, 2.6, 5.0, 7.6, 100.0):
        run, skipped = run_all.select(f, budget)
        assert sum(x.est_min for x in run) <= budget + 1e-9
        assert sorted([x.name for x in run] + [x.name for x, _ in skipped]) == ["a", "b", "c", "d"]
    # d (0.1) is taken first, so two 2.5-min figures no longer fit in 5.0
    assert [x.name for x in run_all.select(f, 5.0)[0]] == ["a", "d"]
    assert [x.name for x in run_all.select(f, 5.1)[0]] == ["a", "b", "d"]


def test_missing_input_is_skipped_with_its_reason_and_frees_its_budget(run_all):
    f = figs(run_all, ("a", 1.0), ("b", 1.0))
    run, skipped = run_all.select(f, 1.0, {"a": "out/x.json"})
    assert [x.name for x in run] == ["b"]
    assert [(x.name, why) for x, why in skipped] == [("a", "input missing: out/x.json")]


def test_negative_budget_is_refused(run_all):
    with pytest.raises(ValueError, match="budget-min"):
        run_all.select(figs(run_all, ("a", 1.0)), -1.0)


def test_every_figure_script_exists_and_names_are_unique(run_all):
    names = [f.name for f in run_all.FIGURES]
    assert len(names) == len(set(names))
    for f in run_all.FIGURES:
        assert (BENCH / f.script).is_file(), f.script


@pytest.mark.procs
def test_run_all_dry_run_reports_skips(tmp_path):
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(
        ["bash", str(BENCH / "run-all"), "--budget-min", "0", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "running 0 of" in out.stdout
    assert "skipped fig03" in out.stdout and "needs ~" in out.stdout
