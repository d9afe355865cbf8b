"""benchmarks/convergence.py without running anything: every mode's benchmark config passes the
config checks with the mode applied, the summary and table of synthetic runs, the profile
rewrite (``--write-profile``) on a copy of the shipped profile, and the figure scripts that read
the summary (fig10_11, fig08) and the runs' held-out curves (``_runs.cost_to_target``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys

import pytest

from spotlight.config import dump_config, load_config
from spotlight.core.modes import mode_overrides
from spotlight.sim.profile import DEFAULT_PROFILE, load_profile
from spotlight.studies.convergence import Curve
from tests.factories import load_benchmark

BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"
MODES = ("rlboost", "verl-omni-spot", "spotlight")


def _load(name: str):
    return load_benchmark(name)


@pytest.fixture(scope="module")
def bench():
    return _load("convergence")


@pytest.mark.parametrize("mode", MODES)
def test_each_modes_benchmark_config_validates_with_the_mode_applied(bench, tmp_path, mode):
    overrides = bench.bench_overrides(mode, 3, iterations=4, eval_every=1, best_of=24)
    cfg = load_config(None, overrides)
    assert cfg.run.mode == mode
    assert (cfg.run.seed, cfg.data.shuffle_seed, cfg.planner.seed) == (3, 3, 3)
    assert cfg.eval.every == 1 and cfg.run.iterations == 4
    for key, value in mode_overrides(mode).items():  # the mode's settings win over the file's
        section, leaf = key.split(".")
        assert getattr(getattr(cfg, section), leaf) == value, key
    if mode == "verl-omni-spot":
        assert cfg.data.num_control_prompts == 0 and cfg.explore.reuse_as_rollout
        assert cfg.explore.num_candidates == 24
    elif mode == "rlboost":
        assert not cfg.explore.active
    else:
        assert cfg.explore.mode == "stale" and cfg.explore.planner == "bandit" and cfg.data.num_control_prompts > 0
    # the file the benchmark writes for `spotlight up --config` loads back to the same config
    dump_config(cfg, tmp_path / "run.toml")
    assert load_config(tmp_path / "run.toml") == cfg


def test_panel_flags_reach_the_eval_section(bench):
    cfg = load_config(None, bench.bench_overrides("spotlight", 0, iterations=2, panel_prompts=46, panel_seeds=3))
    assert (cfg.eval.num_prompts, cfg.eval.num_seeds) == (46, 3)


def _run(first_good: int, iterations: int = 15, critical_s: float = 0.0, final=(0.3, 0.4)) -> dict:
    """A run whose held-out score is 0.2 before iteration ``first_good`` and 0.5 from it on."""
    scores = tuple(0.2 if i < first_good else 0.5 for i in range(1, iterations + 1))
    metrics = [
        {
            "iteration": i,
            "time/iteration_s": 10.0,
            "time/explore_critical_path_s": critical_s,
            "cost/usd": 0.1 * (i + 1),
        }
        for i in range(iterations)
    ]
    return {
        "metrics": metrics,
        "curve": Curve(tuple(range(1, iterations + 1)), scores, 0.2),
        "final": {"base": {"strict": 0.1, "partial": 0.2}, "final": {"strict": final[0], "partial": final[1]}},
    }


@pytest.fixture
def summary(bench):
    runs = {
        "rlboost": {0: _run(9), 1: _run(10), 2: _run(9)},  # target at 11, 12, 11 (3-point window)
        "verl-omni-spot": {0: _run(6, critical_s=3.0), 1: _run(6, critical_s=3.0), 2: _run(7, critical_s=3.0)},
        "spotlight": {0: _run(3, critical_s=0.05), 1: _run(4, critical_s=0.05), 2: _run(3, critical_s=0.05)},
    }
    s = bench.summarize(runs, score="eval/partial", window=3)
    return s | {"iterations": 15, "eval_every": 1, "eval_seeds": 8, "best_of": 24, "agents": 2}


def test_summary_of_synthetic_runs(summary):
    s = summary
    assert s["schema"] == 2 and s["window"] == 3
    assert s["target"] == pytest.approx(0.5)
    assert [r["iterations_to_target"] for r in s["modes"]["rlboost"]["runs"]] == [11, 12, 11]
    assert [r["iterations_to_target"] for r in s["modes"]["spotlight"]["runs"]] == [5, 6, 5]
    assert s["modes"]["spotlight"]["reached"] == 3
    assert s["modes"]["spotlight"]["iterations_to_target"]["mean"] == pytest.approx(16 / 3)
    assert s["modes"]["verl-omni-spot"]["critical_path_share"]["mean"] == pytest.approx(0.3)
    assert s["ratios"]["rlboost/spotlight"]["mean"] == pytest.approx(34 / 16)
    assert s["goal"]["met"] and s["goal"]["separated"]
    json.dumps(s)  # JSON-ready as written


def test_table_has_every_mode_with_intervals_and_the_verdict(bench, summary):
    md = bench.render_md(summary)
    for mode in MODES:
        assert re.search(rf"^\| [*]*{re.escape(mode)}", md, re.M), mode
    assert "| 3/3 | 11.3 [11.0, 12.0] |" in md  # rlboost: reached, mean [low, high]
    assert re.search(r"rlboost/spotlight: \*\*2\.1[23]×\*\* \(95 % interval 1\.\d\d–2\.\d\d\)", md)
    assert "→ **met**" in md
    assert "count as 16 iterations" in md  # the censoring footnote


def test_profile_update_rewrites_only_the_table_and_loads(bench, summary, tmp_path):
    original = DEFAULT_PROFILE.read_text(encoding="utf-8")
    text = bench.profile_update(summary, original, 39, date="2026-01-02")
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    its = load_profile(path).iterations_to_target
    ratio = summary["ratios"]["rlboost/spotlight"]["mean"]
    verl = summary["ratios"]["verl-omni-spot/spotlight"]["mean"]
    assert its["rlboost"] == its["reserved-only"] == round(39 * ratio) == 83
    assert its["verl-omni-spot"] == round(39 * verl)
    assert its["spotlight"] == 39 and its["rlboost+explore"] == 39  # kept
    head = original.index("[iterations_to_target]")
    assert text[:head] == original[:head]  # every other section byte for byte
    assert "2026-01-02" in text and "seeds (0,1,2)" in text and "benchmarks/convergence.py" in text
    assert f"rlboost/spotlight = {ratio:.2f} [" in text
    # the table's own comment lines and the lines it does not set stay
    old_table = original[head:].splitlines()
    assert [x for x in old_table if x.startswith("#")] == [
        x for x in text[head:].splitlines() if x.startswith("#") and "[measured]" not in x
    ]
    assert next(x for x in old_table if x.startswith("spotlight =")) in text

    # rewriting again replaces the measured notes instead of adding a second set
    again = bench.profile_update(summary, text, 39, date="2026-02-03")
    assert again.count("[measured]") == text.count("[measured]") and "2026-01-02" not in again


def test_profile_update_keeps_sections_after_the_table(bench, summary, tmp_path):
    original = DEFAULT_PROFILE.read_text(encoding="utf-8")
    head = original.index("[iterations_to_target]")
    table, rest = original[head:], original[:head]
    prices = rest.index("[prices]")
    moved = rest[:prices] + table + "\n" + rest[prices:]  # the table before [prices]
    text = bench.profile_update(summary, moved, 39, date="2026-01-02")
    assert text[:prices] == moved[:prices]
    assert text.endswith(moved[moved.index("\n[prices]") :])
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    assert load_profile(path).iterations_to_target["rlboost"] == 83


def test_profile_update_refuses_one_run_per_mode(bench):
    """One run per mode gives a ratio without a spread; the simulator must not take it as measured."""
    runs = {"rlboost": {0: _run(9)}, "spotlight": {0: _run(3, critical_s=0.05)}}
    s = bench.summarize(runs, score="eval/partial", window=3) | {"iterations": 15}
    with pytest.raises(ValueError, match="too few runs per mode .*rlboost: 1, spotlight: 1.*--seeds"):
        bench.profile_update(s, DEFAULT_PROFILE.read_text(encoding="utf-8"), 39, date="2026-01-02")


def test_profile_update_refuses_a_ratio_of_censored_runs(bench):
    """A Spotlight run that never reached the target has a lower-bound count, so the ratio is a
    bound: the simulator must not take it as measured (both modes learned here)."""
    runs = {"rlboost": {s: _run(9) for s in range(3)}, "spotlight": {0: _run(3), 1: _run(4), 2: _run(14)}}
    s = bench.summarize(runs, score="eval/partial", window=3) | {"iterations": 15}
    assert bench.compared_learned(s["learning"]) is True
    assert [r["reached"] for r in s["modes"]["spotlight"]["runs"]] == [True, True, False]
    with pytest.raises(ValueError, match="never reached the target .*spotlight: 1"):
        bench.profile_update(s, DEFAULT_PROFILE.read_text(encoding="utf-8"), 39, date="2026-01-02")


def test_profile_update_refuses_a_target_set_above_every_run(bench):
    """--target 0.9 that no run reaches: every count is censored, the ratio 1.00 is no measurement."""
    runs = {"rlboost": {s: _run(9) for s in range(3)}, "spotlight": {s: _run(3) for s in range(3)}}
    s = bench.summarize(runs, score="eval/partial", window=3, target=0.9) | {"iterations": 15}
    assert not s["goal"]["met"]
    with pytest.raises(ValueError, match="never reached the target"):
        bench.profile_update(s, DEFAULT_PROFILE.read_text(encoding="utf-8"), 39, date="2026-01-02")


def test_profile_update_refuses_runs_without_a_base_model_evaluation(bench):
    """Without the base model's score, whether the runs learned cannot be told: refuse, not fail open."""
    runs = {"rlboost": {s: _run(9) for s in range(3)}, "spotlight": {s: _run(3) for s in range(3)}}
    for by_seed in runs.values():
        for r in by_seed.values():
            r["curve"] = dataclasses.replace(r["curve"], base=None)
    s = bench.summarize(runs, score="eval/partial", window=3) | {"iterations": 15}
    assert bench.compared_learned(s["learning"]) is None and not s["goal"]["met"]
    with pytest.raises(ValueError, match="cannot tell whether"):
        bench.profile_update(s, DEFAULT_PROFILE.read_text(encoding="utf-8"), 39, date="2026-01-02")


def test_one_mode_learning_is_not_reported_as_no_mode(bench):
    """rlboost climbs far above the base model while Spotlight stays flat: the table names who learned."""
    runs = {
        "rlboost": {s: _run(3 + s) for s in range(3)},
        "spotlight": {s: _run(99) for s in range(3)},
    }
    for s_, r in runs["spotlight"].items():
        r["curve"] = Curve(r["curve"].iterations, tuple(0.2 + 0.01 * ((i * (s_ + 1)) % 3 - 1) for i in range(15)), 0.2)
    s = bench.summarize(runs, score="eval/partial", window=3) | {"iterations": 15}
    assert s["learning"]["modes"]["rlboost"]["learned"] and not s["learning"]["modes"]["spotlight"]["learned"]
    md = bench.render_md(s)
    assert "Learned beyond noise: rlboost; not: spotlight" in md and "No mode raised" not in md


def test_runs_that_never_rise_above_the_base_model_meet_no_goal_and_feed_no_profile(bench):
    """Two modes whose panel score stays at the base model's: whatever their iteration counts,
    the verdict is "not met", the table says nothing was learned, and the profile is refused."""

    def flat(wobble: tuple[float, ...]) -> dict:
        run = _run(99, iterations=len(wobble))
        run["curve"] = Curve(tuple(range(1, len(wobble) + 1)), tuple(0.2 + w for w in wobble), 0.2)
        return run

    wobbles = [
        (0.0, -0.02, 0.01, 0.0, -0.01, 0.02, -0.02, 0.0),
        (0.01, 0.02, 0.0, -0.01, 0.0, -0.02, 0.01, -0.01),
        (-0.01, 0.0, 0.02, -0.02, 0.01, 0.0, -0.01, 0.02),
    ]
    runs = {
        "rlboost": {s: flat(wobbles[s]) for s in range(3)},
        "spotlight": {s: flat(wobbles[(s + 1) % 3][::-1]) for s in range(3)},
    }
    s = bench.summarize(runs, score="eval/partial", window=3) | {"iterations": 8}
    assert not any(r["learned"] for r in s["learning"]["modes"].values()) and not s["goal"]["met"]
    assert "No mode raised the held-out score beyond noise" in bench.render_md(s)
    with pytest.raises(ValueError, match="did not both learn beyond noise"):
        bench.profile_update(s, DEFAULT_PROFILE.read_text(encoding="utf-8"), 39, date="2026-01-02")


def test_write_profile_replaces_the_file_after_checking_it(bench, summary, tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(DEFAULT_PROFILE.read_text(encoding="utf-8"), encoding="utf-8")
    bench.write_profile(summary, path)
    assert load_profile(path).iterations_to_target["rlboost"] == 83
    assert not list(tmp_path.glob("*.tmp"))
    no_spotlight = tmp_path / "q.toml"
    no_spotlight.write_text(re.sub(r"(?m)^spotlight = .*$", "", DEFAULT_PROFILE.read_text()), encoding="utf-8")
    with pytest.raises(SystemExit, match="no \\[iterations_to_target\\] spotlight count"):
        bench.write_profile(summary, no_spotlight)


def test_fig10_11_reads_the_summary_and_refuses_the_old_one(summary, tmp_path):
    fig = _load("fig10_11_convergence")
    (tmp_path / "convergence.json").write_text(json.dumps(summary))
    rows = fig.rows_from_summary(fig.read_summary(tmp_path))
    assert rows["rlboost"]["iterations_per_run"] == [11, 12, 11]
    assert rows["spotlight"]["iterations_vs_spotlight"]["mean"] == 1.0
    assert rows["rlboost"]["iterations_vs_spotlight"]["mean"] == pytest.approx(34 / 16)
    (tmp_path / "convergence.json").write_text(json.dumps({"target": 0.46, "table": {}, "seeds": [0]}))
    with pytest.raises(SystemExit, match="older benchmarks/convergence.py"):
        fig.read_summary(tmp_path)


def test_fig08_takes_the_local_costs_from_the_summary(summary, tmp_path):
    fig = _load("fig08_cost_to_target")
    (tmp_path / "convergence.json").write_text(json.dumps(summary))
    args = argparse.Namespace(run_dir=[], target=None, convergence_dir=str(tmp_path), score="eval/partial", window=3)
    local, target = fig.local_runs(args)
    assert target == pytest.approx(0.5)
    assert [r["cost_usd"] for r in local["spotlight"]] == pytest.approx([0.5, 0.6, 0.5])
    assert all(r["reached"] for rs in local.values() for r in rs)


def test_cost_to_target_reads_the_held_out_curve(tmp_path):
    runs = _load("_runs")
    run = _run(4, iterations=8)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["metrics"]))
    evals = [{"iteration": -1, "version": 0, "eval/partial": 0.2}] + [
        {"iteration": i - 1, "version": i, "eval/partial": s}
        for i, s in zip(run["curve"].iterations, run["curve"].scores)
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    c = runs.cost_to_target(tmp_path, 0.5, key="eval/partial", k=3)
    assert c["reached"] and c["iterations"] == 6 and c["cost_usd"] == pytest.approx(0.6)
    assert not runs.cost_to_target(tmp_path, 0.6, key="eval/partial", k=3)["reached"]


def _write_run(run_dir: pathlib.Path, run: dict, *, eval_seeds: int, num_candidates: int, spot_agents: int) -> None:
    """A finished run directory as `spotlight up` and `spotlight eval` leave it (the files the
    benchmark reads)."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["metrics"]))
    evals = [
        {"iteration": i - 1, "version": i, "eval/partial": s} for i, s in zip(*dataclasses.astuple(run["curve"])[:2])
    ]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    scores = {"overall": 0.3, "partial_credit": 0.4}
    (run_dir / "eval.json").write_text(json.dumps({"base": scores, "final": scores, "num_seeds": eval_seeds}))
    (run_dir / "config.toml").write_text(f"[eval]\nevery = 1\n\n[explore]\nnum_candidates = {num_candidates}\n")
    agents = {"reserved-0": {"spot": False}} | {f"spot-{i}": {"spot": True} for i in range(spot_agents)}
    (run_dir / "local_agents.json").write_text(json.dumps({"agents": agents}))


def test_summarize_only_reports_the_settings_the_runs_were_made_with(bench, tmp_path, monkeypatch):
    # runs made with 1 eval seed, best-of-6 and 3 agents; the command line's defaults are 8, 24, 2
    for mode, first_good in (("rlboost", 6), ("verl-omni-spot", 5), ("spotlight", 3)):
        for seed in (0, 1):
            run = _run(first_good, iterations=8)
            _write_run(tmp_path / f"{mode}-s{seed}", run, eval_seeds=1, num_candidates=6, spot_agents=3)
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--out", str(tmp_path), "--summarize-only", "--seeds", "0,1"])
    import _provenance  # on the path the benchmark put it on; no git or uname processes in a unit test

    monkeypatch.setattr(_provenance, "provenance", lambda: {"commit": "test"})
    bench.main()
    s = json.loads((tmp_path / "convergence.json").read_text())
    assert (s["eval_seeds"], s["best_of"], s["agents"], s["eval_every"]) == (1, 6, 3, 1)
    md = (tmp_path / "convergence.md").read_text()
    assert "× 1 seed." in md and "3 local spot agents, verl-omni-spot with N = 6" in md


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", ""], "--seeds: expected distinct"),
        (["--seeds", "0,0"], "--seeds: expected distinct"),
        (["--window", "0"], "--window must be >= 1, got 0"),
        (["--iterations", "-1"], "--iterations must be >= 1"),
        (["--target", "nan"], "--target must be a finite score, got nan"),
    ],
)
def test_bad_arguments_stop_before_any_run(bench, tmp_path, monkeypatch, argv, message):
    # --summarize-only: whatever happens, this test starts no run
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--out", str(tmp_path / "out"), "--summarize-only", *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        bench.main()
    assert not (tmp_path / "out").exists()


def test_finite_mean_skips_the_nulls_metrics_jsonl_writes():
    """The last metrics row of a run has ``spot/busy_fraction`` null; fig14 averaged it and failed."""
    runs = _load("_runs")
    assert runs.finite_mean([0.99, None, 0.97, float("nan")]) == pytest.approx(0.98)
    assert runs.finite_mean([None, None]) != runs.finite_mean([None, None])  # NaN: nothing to average


def test_finished_runs_are_neither_deleted_nor_mixed_with_runs_of_another_length(bench, tmp_path):
    """A plain re-run would delete finished runs, ``--reuse`` with another --iterations would too,
    and a truncated run summarised beside full ones is censored at the wrong count."""
    for mode in ("rlboost", "spotlight"):
        _write_run(tmp_path / f"{mode}-s0", _run(3, iterations=8), eval_seeds=1, num_candidates=6, spot_agents=2)
    dirs = [tmp_path / "rlboost-s0", tmp_path / "spotlight-s0"]
    assert "pass --reuse to keep" in bench.kept_runs_problem(dirs, 8, reuse=False)
    assert "pass --iterations 8" in bench.kept_runs_problem(dirs, 20, reuse=True)
    assert bench.kept_runs_problem(dirs, 8, reuse=True) is None
    assert bench.kept_runs_problem(dirs, None, reuse=True) is None
    metrics = tmp_path / "spotlight-s0" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:5]))
    assert "different lengths (spotlight-s0: 5, rlboost-s0: 8" in bench.kept_runs_problem(dirs, None, reuse=True)


@pytest.mark.parametrize(
    "eval_json, metrics, message",
    [
        ("[]", None, "not what `spotlight eval` writes"),
        ('{"final": 3}', None, "not what `spotlight eval` writes"),
        (None, "", "metrics.jsonl: no metrics rows"),
    ],
)
def test_a_broken_run_file_stops_with_its_path(bench, tmp_path, eval_json, metrics, message):
    run_dir = tmp_path / "rlboost-s0"
    _write_run(run_dir, _run(3, iterations=8), eval_seeds=1, num_candidates=6, spot_agents=2)
    if eval_json is not None:
        (run_dir / "eval.json").write_text(eval_json)
    if metrics is not None:
        (run_dir / "metrics.jsonl").write_text(metrics)
    with pytest.raises(SystemExit, match=re.escape(message)):
        bench.load_run(run_dir, "eval/partial")


def test_figures_stop_with_one_line_on_a_broken_summary(tmp_path):
    fig = _load("fig10_11_convergence")
    (tmp_path / "convergence.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not JSON"):
        fig.read_summary(tmp_path)
    (tmp_path / "convergence.json").write_text('{"schema": 2}')
    with pytest.raises(SystemExit, match="lacks modes, ratios, target"):
        fig.read_summary(tmp_path)


def test_cost_to_target_names_a_score_the_run_never_logged(tmp_path):
    """verl-omni-spot has no control prompts: its reward/control_mean is null in every row."""
    runs = _load("_runs")
    rows = [
        {"iteration": i, "time/iteration_s": 1.0, "cost/usd": 0.1 * i, "reward/control_mean": None} for i in range(4)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="no value of reward/control_mean"):
        runs.cost_to_target(tmp_path, 0.5, key="reward/control_mean")
