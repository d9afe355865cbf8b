"""Convergence benchmark on the shapes task (paper §6.2–6.3, Fig. 10–11): does Spotlight
reach the target held-out score in fewer iterations than the baselines, and what does its
exploration cost on the critical path? With run seeds enough for confidence intervals.

Runs `spotlight up --local` on the embedded default (the shapes world, GenEval-style reward)
once per mode and run seed, the modes being the product's own (``run.mode``,
``spotlight.core.modes``; each a configuration of the same code):

  rlboost          no exploration: every group uses default seeds; restart reconfiguration
  verl-omni-spot   best-of-N on the current weights before each rollout, on the critical path
                   (N = --best-of candidates per prompt, the selected K are the rollout; no
                   control prompts)
  spotlight        bandit-planned exploration of batch n+1 on the stale weights v_n by the spot
                   workers while training runs

``run.seed``, ``data.shuffle_seed`` and ``planner.seed`` are all set to the run seed, so the
modes of one seed see the same prompts in the same order and start from the same default seeds.

Score per iteration: the run's own held-out evaluation (``[eval]``, docs/evaluation.md), set
to every iteration (``eval.every = --eval-every``): the weights each iteration trained sample a
fixed panel of test prompts × fixed seeds with the ODE, scored into ``eval.jsonl``
(``--score``: ``eval/partial`` by default, the GenEval partial credit, finer-grained than the
strict verdict on a 32-image panel). Every mode has it (``verl-omni-spot`` has no control
prompts, so no ``reward/control_mean``) and seed selection cannot bias it (the panel's seeds
are fixed and never explored). The statistics are in :mod:`spotlight.studies.convergence`:

* target = the lowest saturated score among the modes (the best ``--window``-point moving
  average of each mode's seed-mean curve; paper §6.2), or ``--target``;
* iterations to target of a run = the first iteration whose window (the same ``--window``
  evaluated points for every mode, fewer only when a run has fewer) averages at least the
  target; a run that never gets there is censored at iterations + 1 (and its wall time at the
  whole run's plus one mean iteration) and counted in the "reached" column;
* mean and 95 % percentile-bootstrap interval over runs (10 000 resamples, fixed seed) of
  iterations and wall time to target, critical-path share (summed
  ``time/explore_critical_path_s`` / summed ``time/iteration_s``), mean iteration time, and the
  held-out score of ``final/`` (``spotlight eval``: the 46 test prompts × ``--eval-seeds``,
  strict and partial); the ratio of rlboost's (and verl-omni-spot's) iterations to target over
  Spotlight's, each mode's runs resampled independently, and whether the goal holds
  (Spotlight ≥ 1.5× fewer iterations than rlboost, the two intervals apart, ≤ 2 % of iteration
  time on the critical path).

    python benchmarks/convergence.py                     # 3 modes x 5 seeds x 20 iterations
    python benchmarks/convergence.py --reuse             # re-summarise finished runs (runs the missing ones)
    python benchmarks/convergence.py --summarize-only    # run nothing: summarise what is finished
    python benchmarks/convergence.py --reuse --write-profile spotlight/sim/profiles/qwen-image-h100.toml

Writes ``--out``/convergence.{md,json,png}; ``benchmarks/fig10_11_convergence.py``,
``fig08_cost_to_target.py`` and ``fig09_heldout_score.py`` read them. ``--write-profile``
carries the measured ratios into a simulation profile's ``[iterations_to_target]`` (what
``spotlight simulate`` takes as convergence): rlboost and reserved-only (which converges like
rlboost, paper §6.2) become the profile's Spotlight count times the measured rlboost/Spotlight
ratio, verl-omni-spot its own ratio times it, with comment lines citing this script, the date,
the seeds and the intervals; every other line of the profile stays as it is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _runs import read_metrics  # noqa: E402

from spotlight.config import ConfigError, dump_config, load_config  # noqa: E402
from spotlight.coordinator.evaluation import read_results  # noqa: E402
from spotlight.studies import convergence as cv  # noqa: E402

SCHEMA = 2
"""Version of convergence.json (1: the variants no-exploration / critical-path / spotlight
scored by reward/control_mean, without intervals)."""
MODES = ("rlboost", "verl-omni-spot", "spotlight")
LABELS = {
    "rlboost": "rlboost (no exploration)",
    "verl-omni-spot": "verl-omni-spot (best-of-N on the critical path)",
    "spotlight": "**spotlight** (stale-weight exploration, bandit-planned)",
    "rlboost+explore": "rlboost+explore",
    "reserved-only": "reserved-only",
}
BASELINE, OURS = "rlboost", "spotlight"
PROFILE_MARK = "[measured] "


def run_name(mode: str, seed: int) -> str:
    return f"{mode.replace('+', '-plus-')}-s{seed}"


def bench_overrides(
    mode: str,
    seed: int,
    *,
    iterations: int,
    eval_every: int = 1,
    best_of: int = 24,
    panel_prompts: int | None = None,
    panel_seeds: int | None = None,
) -> dict:
    """The config overrides of one benchmark run (dotted keys, ``load_config(overrides=...)``):
    the mode, the run seed everywhere a seed is drawn, the held-out evaluation every
    ``eval_every`` iterations, best-of-``best_of`` for verl-omni-spot."""
    out = {
        "run.mode": mode,
        "run.iterations": iterations,
        "run.seed": seed,
        "run.sample_grid_every": 5,
        "data.shuffle_seed": seed,
        "planner.seed": seed,
        "eval.every": eval_every,
    }
    if panel_prompts:
        out["eval.num_prompts"] = panel_prompts
    if panel_seeds:
        out["eval.num_seeds"] = panel_seeds
    if mode == "verl-omni-spot":  # the mode fixes everything else of best-of-N but N
        out["explore.num_candidates"] = best_of
    return out


def finished(run_dir: pathlib.Path, iterations: int | None = None) -> bool:
    """A run with all its metrics rows (``iterations`` of them, if given), its evaluations
    during training and the final ``spotlight eval``."""
    metrics = run_dir / "metrics.jsonl"
    if not (metrics.is_file() and (run_dir / "eval.jsonl").is_file() and (run_dir / "eval.json").is_file()):
        return False
    return iterations is None or run_length(run_dir) == iterations


def run_length(run_dir: pathlib.Path) -> int:
    """Iterations a run finished: its ``metrics.jsonl`` rows."""
    return len([x for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()])


def kept_runs_problem(run_dirs: list[pathlib.Path], iterations: int | None, *, reuse: bool) -> str | None:
    """Why the finished runs already in ``--out`` stop this command, or None. Without
    ``--reuse`` a finished run would be deleted and made again: refused, it may be hours of
    work. With ``--reuse`` a finished run of another length than ``iterations`` is refused (it
    would be deleted and made again); with ``--summarize-only`` (``iterations`` None) runs of
    different lengths are: censoring counts a run that never reached the target as its
    iterations + 1, so runs of different lengths are not comparable."""
    done = [rd for rd in run_dirs if finished(rd)]
    if done and not reuse:
        return (
            f"{done[0].parent} already holds {len(done)} finished run(s) (e.g. {done[0].name}); pass --reuse to keep "
            "them, or choose another --out"
        )
    lengths = {rd.name: run_length(rd) for rd in done}
    if iterations is None:
        if len(set(lengths.values())) > 1:
            example = {n: name for name, n in lengths.items()}
            listed = ", ".join(f"{name}: {n}" for n, name in sorted(example.items()))
            return (
                f"the finished runs have different lengths ({listed} iterations): censoring needs one length; "
                "summarise them in separate --out directories"
            )
        return None
    other = {name: n for name, n in lengths.items() if n != iterations}
    if other:
        name, n = next(iter(other.items()))
        return (
            f"{len(other)} finished run(s) have another length than --iterations {iterations} (e.g. {name}: {n} "
            f"iterations); pass --iterations {n}, or choose another --out"
        )
    return None


def _cli(args: list[str], what: str, run_dir: pathlib.Path) -> None:
    cmd = [sys.executable, "-m", "spotlight.cli", *args]
    print("$ spotlight " + " ".join(args), flush=True)
    rc = subprocess.run(cmd, cwd=REPO).returncode
    if rc != 0:
        sys.exit(f"error: {what} failed (exit code {rc}); its logs are in {run_dir / 'logs'}")


def _checked_config(path, overrides: dict):
    """The run's config, or exit with the config error (which names the field)."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        sys.exit(f"error: the config of mode {overrides.get('run.mode')!r}: {exc}")


def run_one(mode: str, seed: int, args, out_dir: pathlib.Path) -> None:
    """Run ``spotlight up --local`` and ``spotlight eval`` for one mode and seed (skipped with
    ``--reuse`` when the run is finished)."""
    run_dir = out_dir / run_name(mode, seed)
    if args.reuse and finished(run_dir, args.iterations):
        return
    overrides = bench_overrides(
        mode,
        seed,
        iterations=args.iterations,
        eval_every=args.eval_every,
        best_of=args.best_of,
        panel_prompts=args.panel_prompts,
        panel_seeds=args.panel_seeds,
    )
    cfg = _checked_config(args.config, overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    conf = out_dir / f"{run_name(mode, seed)}.toml"
    dump_config(cfg, conf)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.monotonic()
    _cli(
        ["up", "--local", "--agents", str(args.agents), "--config", str(conf), "--run-dir", str(run_dir)],
        f"spotlight up ({mode}, seed {seed})",
        run_dir,
    )
    _cli(
        ["eval", "--run-dir", str(run_dir), "--num-seeds", str(args.eval_seeds)],
        f"spotlight eval ({mode}, seed {seed})",
        run_dir,
    )
    print(f"== {mode} seed {seed}: {time.monotonic() - t0:.0f} s", flush=True)


def load_run(run_dir: pathlib.Path, score: str) -> dict:
    """A finished run's metrics rows, held-out curve, final ``spotlight eval`` scores and the
    settings it ran with (:func:`run_settings`)."""
    try:
        final = json.loads((run_dir / "eval.json").read_text())
    except ValueError as exc:
        sys.exit(f"error: {run_dir / 'eval.json'}: not JSON ({exc})")
    if not isinstance(final, dict) or any(not isinstance(final.get(n, {}), dict) for n in ("base", "final")):
        sys.exit(
            f"error: {run_dir / 'eval.json'}: not what `spotlight eval` writes (an object with base and final scores)"
        )
    try:
        curve = cv.heldout_curve(read_results(run_dir), score)  # a torn line is skipped, as the coordinator does
    except ValueError as exc:
        sys.exit(f"error: {run_dir / 'eval.jsonl'}: {exc}")
    if not curve.iterations:
        sys.exit(f"error: {run_dir / 'eval.jsonl'}: no evaluated iteration (eval.every = 0, or its evaluations failed)")
    try:
        metrics = read_metrics(run_dir)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if not metrics:
        sys.exit(f"error: {run_dir / 'metrics.jsonl'}: no metrics rows")
    return {
        "metrics": metrics,
        "curve": curve,
        "final": {
            name: {"strict": final[name].get("overall"), "partial": final[name].get("partial_credit")}
            for name in ("base", "final")
            if name in final
        },
        "settings": run_settings(run_dir, final),
    }


def run_settings(run_dir: pathlib.Path, final: dict) -> dict:
    """What a finished run was made with, read from the run (not from this command line, which
    with ``--summarize-only`` or ``--reuse`` need not match it): ``eval_every`` and ``best_of``
    (``explore.num_candidates``) of its ``config.toml``, ``eval_seeds`` of its ``eval.json``,
    ``agents`` (spot agents) of ``local_agents.json``; None for what the run does not record."""
    import tomllib

    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, ValueError):
        cfg = {}
    try:
        agents = json.loads((run_dir / "local_agents.json").read_text()).get("agents", {})
        n_agents = sum(1 for a in agents.values() if a.get("spot"))
    except (OSError, ValueError, AttributeError):
        n_agents = None
    return {
        "eval_every": cfg.get("eval", {}).get("every"),
        "best_of": cfg.get("explore", {}).get("num_candidates"),
        "eval_seeds": final.get("num_seeds"),
        "agents": n_agents,
    }


def _one_or_all(values, fallback):
    """The value every run shares, the sorted distinct values when they differ, ``fallback``
    when no run recorded it."""
    distinct = sorted({v for v in values if v is not None})
    return fallback if not distinct else distinct[0] if len(distinct) == 1 else distinct


def summarize(
    runs: dict[str, dict[int, dict]],
    *,
    score: str,
    window: int,
    target: float | None = None,
    resamples: int = cv.RESAMPLES,
    bootstrap_seed: int = cv.BOOTSTRAP_SEED,
) -> dict:
    """The benchmark's numbers (JSON-ready) from ``{mode: {seed: load_run(...)}}``."""
    curves = {m: [r["curve"] for r in by_seed.values()] for m, by_seed in runs.items()}
    k = cv.common_window([c for cs in curves.values() for c in cs], window)
    sat = {m: cv.saturated_score(cs, k) for m, cs in curves.items()}
    tgt = min(sat.values()) if target is None else float(target)
    kw = {"resamples": resamples, "seed": bootstrap_seed}
    modes, outcomes = {}, {}
    for m, by_seed in runs.items():
        per_run, outs = [], []
        for seed, r in by_seed.items():
            o = cv.run_outcome(r["metrics"], r["curve"], tgt, k)
            outs.append(o)
            fin, base = r["final"].get("final", {}), r["final"].get("base", {})
            per_run.append(
                {
                    "seed": seed,
                    "run_dir": run_name(m, seed),
                    **{f: getattr(o, f) for f in o.__dataclass_fields__},
                    "heldout_strict": fin.get("strict"),
                    "heldout_partial": fin.get("partial"),
                    "base_strict": base.get("strict"),
                    "base_partial": base.get("partial"),
                    "curve": {
                        "iterations": list(r["curve"].iterations),
                        "scores": list(r["curve"].scores),
                        "base": r["curve"].base,
                    },
                }
            )
        outcomes[m] = outs
        heldout = {
            "heldout_strict": [p["heldout_strict"] for p in per_run],
            "heldout_partial": [p["heldout_partial"] for p in per_run],
            "base_strict": [p["base_strict"] for p in per_run],
            "base_partial": [p["base_partial"] for p in per_run],
        }
        row = cv.mode_summary(outs, heldout, **kw)
        modes[m] = {
            "label": LABELS.get(m, m),
            "runs": per_run,
            "reached": row.pop("reached"),
            "n": row.pop("runs"),
            **{name: ci.to_json() for name, ci in row.items()},
        }
    ratios, goal = {}, None
    if OURS in outcomes:
        den = [o.iterations_censored for o in outcomes[OURS]]
        for m in outcomes:
            if m != OURS:
                num = [o.iterations_censored for o in outcomes[m]]
                ratios[f"{m}/{OURS}"] = cv.bootstrap_ratio_ci(num, den, **kw).to_json()
        if BASELINE in outcomes:
            g = cv.goal_check(outcomes[BASELINE], outcomes[OURS], **kw)
            goal = {key: (v.to_json() if isinstance(v, cv.CI) else v) for key, v in g.items()}
    learning = cv.learning_check(curves, tgt, k)
    if goal is not None:  # iterations to a target reached by noise say nothing about convergence
        goal["learned"] = compared_learned(learning)
        goal["met"] = bool(goal["met"] and goal["learned"])
    seeds = sorted({s for by_seed in runs.values() for s in by_seed})
    return {
        "schema": SCHEMA,
        "score": score,
        "window": k,
        "window_asked": window,
        "target": tgt,
        "target_source": "--target" if target is not None else "lowest saturated score among the modes",
        "saturated": sat,
        "learning": learning,
        "seeds": seeds,
        "bootstrap": {"resamples": resamples, "seed": bootstrap_seed, "level": cv.LEVEL},
        "modes": modes,
        "ratios": ratios,
        "goal": goal,
    }


def _n(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _yes(b: bool) -> str:
    return "yes" if b else "**no**"


def compared_learned(lr: dict) -> bool | None:
    """Did rlboost and Spotlight (the goal's two modes) both learn beyond noise, with the target
    beyond noise above the base score? None when that cannot be told (one run per mode, no
    base-model evaluation)."""
    flags = [lr["modes"][m]["learned"] for m in (BASELINE, OURS) if m in lr["modes"]] + [lr["target_ok"]]
    return None if any(f is None for f in flags) else all(flags)


def _learning_lines(lr: dict | None, score: str) -> list[str]:
    """What :func:`spotlight.studies.convergence.learning_check` found, as a paragraph and a
    blank line; nothing for a summary without it."""
    if not lr or lr.get("base") is None:
        return []
    per_mode = "; ".join(
        f"{m} {r['gain']:+.4f} ± {r['se']:.4f}" if r["gain"] is not None else f"{m} unknown"
        for m, r in lr["modes"].items()
    )
    head = (
        f"Learning (`{score}` of the best window minus the base model's {lr['base']:.4f}, mean ± standard error over "
        f"runs; learned at ≥ {lr['z']:g} standard errors): {per_mode}"
        + (f"; target {lr['target_gain']:+.4f}" if lr["target_gain"] is not None else "")
        + "."
    )
    learned = [m for m, r in lr["modes"].items() if r["learned"]]
    unknown = [m for m, r in lr["modes"].items() if r["learned"] is None]
    if unknown:
        verdict = f"Whether {', '.join(unknown)} learned cannot be told (one run, or no base-model evaluation)."
    elif not learned:
        verdict = (
            "**No mode raised the held-out score beyond noise**, so iterations to target say how soon a run's noise "
            "touched the target, not how fast it converged: the ratios below are not a convergence measurement, "
            "and `--write-profile` refuses them."
        )
    elif len(learned) < len(lr["modes"]):
        rest = [m for m in lr["modes"] if m not in learned]
        verdict = (
            f"**Learned beyond noise: {', '.join(learned)}; not: {', '.join(rest)}** — iterations to target of a mode "
            "that did not learn are noise."
        )
    else:
        verdict = "Every mode learned beyond noise."
    if lr["target_ok"] is False:
        verdict += " The target is within noise of the base model's score: reaching it shows nothing."
    return [f"{head} {verdict}", ""]


def render_md(s: dict) -> str:
    """The benchmark's table and verdict (Markdown)."""
    iters = s.get("iterations")
    bs = s["bootstrap"]
    base_strict = [r["base_strict"] for m in s["modes"].values() for r in m["runs"] if r["base_strict"] is not None]
    base_partial = [r["base_partial"] for m in s["modes"].values() for r in m["runs"] if r["base_partial"] is not None]
    bstr = f"{np.mean(base_strict):.3f}" if base_strict else "—"
    bpar = f"{np.mean(base_partial):.3f}" if base_partial else "—"
    sat = ", ".join(f"{m} {v:.4f}" for m, v in s["saturated"].items())
    window = f"{s['window']}-point" + (
        f" (fewer than the {s['window_asked']} asked: a run evaluated only {s['window']} iterations)"
        if s["window"] < s["window_asked"]
        else ""
    )
    lines = [
        f"Score per evaluated iteration: `{s['score']}` of the run's held-out panel (`eval.jsonl`, evaluated every "
        f"{s.get('eval_every', '?')} iteration(s)), {window} moving average. Target {s['target']:.4f} = "
        + (
            f"the lowest saturated score (best moving average of the seed-mean curve) among the modes ({sat})"
            if s["target_source"] != "--target"
            else "set with --target"
        )
        + f". {_n(len(s['seeds']), 'run seed')} per mode ({', '.join(map(str, s['seeds']))}), {iters} iterations, "
        f"{s.get('agents', '?')} local spot agents, verl-omni-spot with N = {s.get('best_of', '?')}. "
        f"Mean [95 % percentile-bootstrap interval] over runs ({bs['resamples']} resamples, seed {bs['seed']}); "
        f"held-out score of final/ by `spotlight eval` on the 46 test prompts × {_n(s.get('eval_seeds', 0), 'seed')}.",
        "",
        *_learning_lines(s.get("learning"), s["score"]),
        "| mode | reached target | iterations to target¹ | wall time to target (s)¹ | mean iteration (s) "
        f"| exploration on the critical path (share of iteration time) | held-out strict of final/ (base {bstr}) "
        f"| held-out partial of final/ (base {bpar}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, row in s["modes"].items():
        lines.append(
            f"| {row['label']} | {row['reached']}/{row['n']} | {cv.format_ci(row['iterations_to_target'], '%.1f')} "
            f"| {cv.format_ci(row['wall_s_to_target'], '%.0f')} | {cv.format_ci(row['mean_iteration_s'], '%.1f')} "
            f"| {cv.format_ci(row['critical_path_share'], '%.1f', 100)} % "
            f"| {cv.format_ci(row['heldout_strict'], '%.3f')} | {cv.format_ci(row['heldout_partial'], '%.3f')} |"
        )
    censor = f"{iters + 1}" if isinstance(iters, int) else "iterations + 1"
    lines += [
        "",
        f'¹ Runs that never reached the target (see "reached") count as {censor} iterations and their whole wall '
        "time plus one mean iteration: censored, so those means are lower bounds.",
        "",
    ]
    for name, r in s["ratios"].items():
        lines.append(
            f"- iterations to target, {name}: **{r['mean']:.2f}×** (95 % interval {r['low']:.2f}–{r['high']:.2f})"
        )
    g = s.get("goal")
    if g:
        share = g["critical_path_share"]
        lines += [
            "",
            f"Goal (Spotlight reaches the target in ≥ {g['min_ratio']}× fewer iterations than rlboost, the two "
            f"intervals apart, ≤ {100 * g['max_critical_share']:.0f} % of iteration time on the critical path): "
            f"ratio ≥ {g['min_ratio']}: {_yes(g['ratio_ok'])} (its interval's low end too: {_yes(g['ratio_low_ok'])}); "
            f"intervals apart: {_yes(g['separated'])}"
            + (" (too few runs per mode for an interval)" if g.get("too_few_runs") else "")
            + f"; critical path {cv.format_ci(share, '%.1f', 100)} % ≤ "
            f"{100 * g['max_critical_share']:.0f} %: {_yes(g['critical_path_ok'])}"
            + (
                f"; every Spotlight run reached the target: **no** ({g['ours_censored']} did not)"
                if g.get("ours_censored")
                else ""
            )
            + (
                "; rlboost and Spotlight learned beyond noise: "
                + {True: "yes", False: "**no**", None: "**cannot tell**"}[g["learned"]]
                if "learned" in g
                else ""
            )
            + " → "
            + ("**met**" if g["met"] else "**not met**")
            + (
                f". {g['censored_runs']} of these runs never reached the target (censored), so the ratio is "
                "uncertain beyond its interval."
                if g["censored_runs"]
                else "."
            ),
        ]
    return "\n".join(lines)


def plot(s: dict, path: pathlib.Path) -> None:
    """Seed-mean held-out curves (moving average) with their run-to-run spread, and the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = s["window"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for m, row in s["modes"].items():
        curves = [cv.Curve(tuple(r["curve"]["iterations"]), tuple(r["curve"]["scores"])) for r in row["runs"]]
        common = cv.mean_curve(curves).iterations
        mas = np.array([cv.moving_average([c.scores[c.iterations.index(i)] for i in common], k) for c in curves])
        x = np.array(common[k - 1 :])
        mean, sd = mas.mean(0), mas.std(0)
        ax.plot(x, mean, linewidth=2, label=f"{m} (mean of {len(curves)} runs, {k}-point average)")
        ax.fill_between(x, mean - sd, mean + sd, alpha=0.15)
    ax.axhline(s["target"], color="gray", linestyle="--", label=f"target {s['target']:.3f}")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"held-out {s['score']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile_update(s: dict, profile_text: str, spotlight_iterations: int, *, date: str) -> str:
    """``profile_text`` with its ``[iterations_to_target]`` scaled by the measured ratios
    (:func:`spotlight.sim.profile.set_iterations_to_target`): rlboost and reserved-only =
    ``spotlight_iterations`` × rlboost/spotlight, verl-omni-spot × its own ratio; Spotlight's
    and rlboost+explore's counts stay.

    Raises:
        ValueError: the summary has no rlboost/spotlight ratio; a mode has fewer runs than the
            goal check needs for an interval (one run's ratio says nothing about its spread, and
            the simulator would take it as measured); rlboost or spotlight did not learn beyond
            noise, or the target is within noise of the base score, or that cannot be told
            (:func:`compared_learned`); or a run of either never reached the target (its count,
            and so the ratio, is a bound).
    """
    from spotlight.sim.profile import set_iterations_to_target

    key = f"{BASELINE}/{OURS}"
    if key not in s["ratios"]:
        raise ValueError(f"the benchmark has no {key} ratio (run both modes)")
    if s["goal"].get("too_few_runs"):
        runs = {m: len(s["modes"][m]["runs"]) for m in (BASELINE, OURS)}
        raise ValueError(
            f"too few runs per mode for an interval ({', '.join(f'{m}: {n}' for m, n in runs.items())}); "
            "measure at least 2 run seeds per mode (--seeds) before the simulator takes the ratio"
        )
    learned = compared_learned(s.get("learning") or {"modes": {}, "target_ok": None})
    if learned is not True:
        raise ValueError(
            "cannot tell whether rlboost and spotlight learned (no base-model evaluation)"
            if learned is None
            else "rlboost and spotlight did not both learn beyond noise, or the target is within noise of the base "
            "model's score: the ratio is not a convergence measurement (run more iterations)"
        )
    censored = {m: sum(not r["reached"] for r in s["modes"][m]["runs"]) for m in (BASELINE, OURS)}
    if any(censored.values()):
        raise ValueError(
            f"runs that never reached the target ({', '.join(f'{m}: {n}' for m, n in censored.items())}): their "
            "counts are bounds, so the ratio is a bound, not a measurement"
        )

    def scaled(ratio: dict) -> int:
        return max(1, round(spotlight_iterations * ratio["mean"]))

    def note(name: str, ratio: dict) -> str:
        return f"benchmarks/convergence.py: spotlight's {spotlight_iterations} x {ratio['mean']:.2f} (measured {name})"

    r = s["ratios"][key]
    values = {
        "rlboost": (scaled(r), note(key, r)),
        "reserved-only": (scaled(r), note(key, r) + "; converges like rlboost, paper §6.2"),
    }
    comments = [
        f"benchmarks/convergence.py, {date}: iterations to target measured on the shapes task (CPU, toy scale),",
        f"{_n(len(s['seeds']), 'run seed')} ({','.join(map(str, s['seeds']))}) x {s.get('iterations', '?')} "
        "iterations, "
        f"score {s['score']} ({s['window']}-point moving average), target {s['target']:.4f}.",
        "Ratio of iterations to target over spotlight's, mean [95 % bootstrap interval]:",
        f"{key} = {r['mean']:.2f} [{r['low']:.2f}, {r['high']:.2f}]",
    ]
    vkey = f"verl-omni-spot/{OURS}"
    if vkey in s["ratios"]:
        v = s["ratios"][vkey]
        comments.append(f"{vkey} = {v['mean']:.2f} [{v['low']:.2f}, {v['high']:.2f}]")
        verl_learned = s["learning"]["modes"].get("verl-omni-spot", {}).get("learned")
        if verl_learned and all(r["reached"] for r in s["modes"]["verl-omni-spot"]["runs"]):
            values["verl-omni-spot"] = (scaled(v), note(vkey, v))
        else:
            comments.append("verl-omni-spot keeps its count: its runs did not all learn and reach the target.")
    comments.append(
        "Every rlboost and spotlight run reached the target. spotlight and rlboost+explore keep their counts."
    )
    return set_iterations_to_target(profile_text, values, comments, PROFILE_MARK)


def write_profile(s: dict, path: pathlib.Path) -> None:
    """Rewrite the profile at ``path`` (checked with the simulator's loader before it replaces the file)."""
    from spotlight.sim.profile import ProfileError, load_profile

    try:
        prof = load_profile(path)
    except ProfileError as exc:
        sys.exit(f"error: --write-profile: {exc}")
    spot = prof.iterations_to_target.get(OURS)
    if spot is None:
        sys.exit(f"error: --write-profile: {path} has no [iterations_to_target] spotlight count to scale")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    try:
        text = profile_update(s, path.read_text(encoding="utf-8"), spot, date=date)
    except ValueError as exc:
        sys.exit(f"error: --write-profile: {exc}")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        new = load_profile(tmp)
    except ProfileError as exc:
        tmp.unlink()
        sys.exit(f"error: --write-profile: the rewritten profile does not load ({exc}); {path} left as it was")
    os.replace(tmp, path)
    print(f"wrote {path}: [iterations_to_target] {new.iterations_to_target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--modes", default=",".join(MODES), help="run modes (run.mode), comma-separated")
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--best-of", type=int, default=24, help="N of verl-omni-spot's best-of-N")
    ap.add_argument("--eval-every", type=int, default=1, help="eval.every: held-out panel after every N iterations")
    ap.add_argument("--panel-prompts", type=int, default=None, help="eval.num_prompts (default: the config's)")
    ap.add_argument("--panel-seeds", type=int, default=None, help="eval.num_seeds (default: the config's)")
    ap.add_argument("--score", default="eval/partial", choices=cv.SCORE_KEYS, help="held-out score per iteration")
    ap.add_argument("--window", type=int, default=3, help="moving-average window (evaluated iterations)")
    ap.add_argument("--target", type=float, default=None, help="fixed target (default: lowest saturated score)")
    ap.add_argument("--eval-seeds", type=int, default=8, help="spotlight eval of final/: samples per test prompt")
    ap.add_argument("--resamples", type=int, default=cv.RESAMPLES, help="bootstrap resamples")
    ap.add_argument("--config", default=None)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "convergence"))
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs found in --out")
    ap.add_argument(
        "--summarize-only",
        action="store_true",
        help="run nothing: summarise the finished runs found in --out (a partial benchmark)",
    )
    ap.add_argument(
        "--write-profile",
        type=pathlib.Path,
        default=None,
        help="rewrite this simulation profile's [iterations_to_target] with the measured ratios",
    )
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    if args.target is not None and not math.isfinite(args.target):
        sys.exit(f"error: --target must be a finite score, got {args.target}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"error: --seeds: expected comma-separated integers, got {args.seeds!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        sys.exit(f"error: --seeds: expected distinct comma-separated integers, got {args.seeds!r}")
    for flag in ("iterations", "window", "agents", "best_of", "eval_seeds", "resamples"):
        if getattr(args, flag) < 1:
            sys.exit(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    modes = [m for m in args.modes.split(",") if m.strip()]
    from spotlight.core.modes import MODE_NAMES

    bad = [m for m in modes if m not in MODE_NAMES]
    if bad or not modes:
        sys.exit(f"error: --modes: unknown mode(s) {bad}; choose from {', '.join(MODE_NAMES)}")
    if args.eval_every < 1:
        sys.exit("error: --eval-every must be >= 1 (the score per iteration is the held-out evaluation)")
    if not args.summarize_only:  # a config every run accepts, before hours of runs
        for m in modes:
            _checked_config(
                args.config,
                bench_overrides(
                    m,
                    seeds[0],
                    iterations=args.iterations,
                    eval_every=args.eval_every,
                    best_of=args.best_of,
                    panel_prompts=args.panel_prompts,
                    panel_seeds=args.panel_seeds,
                ),
            )

    todo = [(s, m) for s in seeds for m in modes]  # seed-major: a partial benchmark still compares the modes
    problem = kept_runs_problem(
        [out / run_name(m, s) for s, m in todo],
        None if args.summarize_only else args.iterations,
        reuse=args.reuse or args.summarize_only,
    )
    if problem:
        sys.exit(f"error: {problem}")
    t_start, done = time.monotonic(), 0
    runs: dict[str, dict[int, dict]] = {m: {} for m in modes}
    for i, (seed, m) in enumerate(todo, 1):
        rd = out / run_name(m, seed)
        if args.summarize_only:
            if not finished(rd):
                print(f"== {m} seed {seed}: not finished, left out")
                continue
        else:
            fresh = not (args.reuse and finished(rd, args.iterations))
            if fresh:
                eta = ""
                if done:
                    per = (time.monotonic() - t_start) / done
                    eta = f", ~{per * (len(todo) - i + 1) / 60:.0f} min left"
                print(f"== run {i}/{len(todo)}: {m} seed {seed}{eta}", flush=True)
            run_one(m, seed, args, out)
            done += fresh
        runs[m][seed] = load_run(rd, args.score)
    have = [set(by_seed) for by_seed in runs.values()]
    common = sorted(set.intersection(*have)) if have else []
    if not common:
        sys.exit(f"error: no run seed finished in every mode under {out}")
    if any(h != set(common) for h in have):
        print(f"== summarising the seeds every mode finished: {common}")
        runs = {m: {s: by_seed[s] for s in common} for m, by_seed in runs.items()}
    try:
        s = summarize(runs, score=args.score, window=args.window, target=args.target, resamples=args.resamples)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    iters = {len(r["metrics"]) for by_seed in runs.values() for r in by_seed.values()}
    every_run = [r["settings"] for by_seed in runs.values() for r in by_seed.values()]
    best_of_runs = [r["settings"] for r in runs.get("verl-omni-spot", {}).values()]
    s |= {  # as the runs were made (a --summarize-only or --reuse command line need not say)
        "iterations": iters.pop() if len(iters) == 1 else sorted(iters),
        "eval_every": _one_or_all((x["eval_every"] for x in every_run), args.eval_every),
        "eval_seeds": _one_or_all((x["eval_seeds"] for x in every_run), args.eval_seeds),
        "best_of": _one_or_all((x["best_of"] for x in best_of_runs), args.best_of),
        "agents": _one_or_all((x["agents"] for x in every_run), args.agents),
    }
    from _provenance import provenance

    s["provenance"] = provenance()
    out.mkdir(parents=True, exist_ok=True)
    plot(s, out / "convergence.png")
    text = render_md(s)
    (out / "convergence.md").write_text(text + "\n")
    (out / "convergence.json").write_text(json.dumps(s, indent=2))
    print(text)
    print(f"wrote {out / 'convergence.md'}, convergence.json and convergence.png")
    if args.write_profile is not None:
        write_profile(s, args.write_profile)


if __name__ == "__main__":
    main()
