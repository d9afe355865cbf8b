"""Reading finished ``spotlight up`` run directories for the figure scripts.

A run directory holds ``metrics.jsonl`` (one JSON object per iteration, written by the
coordinator: ``reward/control_mean``, ``time/*_s``, cumulative ``cost/usd`` …), with
``eval.every`` set ``eval.jsonl`` (the held-out evaluations), ``config.toml`` and
``tensor_store/weights/v<N>.safetensors`` (the published weight versions it keeps). Nothing
here starts a process.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
SCORE = "reward/control_mean"


def read_metrics(run_dir: str | pathlib.Path) -> list[dict]:
    """Rows of ``<run_dir>/metrics.jsonl`` in file order.

    Raises:
        ValueError: no metrics.jsonl, or a line that is not JSON (the message names file and line).
    """
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a run directory?)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
    return rows


CONVERGENCE_SCHEMA = 2
"""``schema`` of the ``convergence.json`` that benchmarks/convergence.py writes now."""


def read_convergence(src: str | pathlib.Path) -> dict:
    """``src/convergence.json`` as benchmarks/convergence.py writes it.

    Raises:
        FileNotFoundError: there is none (the message says what to run).
        ValueError: it is not JSON, was written by the older script, or lacks a field the
            figures read (the message says which and what to run).
    """
    path = pathlib.Path(src) / "convergence.json"
    rerun = f"re-run `python benchmarks/convergence.py --out {src}` (with --reuse --summarize-only to keep its runs)"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `python benchmarks/convergence.py --out {src}`")
    try:
        conv = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); {rerun}") from None
    if not isinstance(conv, dict) or conv.get("schema") != CONVERGENCE_SCHEMA:
        raise ValueError(
            f"{path} was written by an older benchmarks/convergence.py (variants no-exploration / critical-path / "
            f"spotlight scored by reward/control_mean, no intervals); {rerun}"
        )
    missing = [k for k in ("modes", "ratios", "target", "seeds", "score", "window") if k not in conv]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; {rerun}")
    return conv


def learned_modes(conv: dict) -> list[str] | None:
    """The modes of a :func:`read_convergence` summary whose runs learned beyond noise
    (``learning``, :func:`spotlight.studies.convergence.learning_check`); None for a summary
    without that check."""
    modes = (conv.get("learning") or {}).get("modes")
    return None if not modes else [m for m, r in modes.items() if r.get("learned")]


def finite_mean(values) -> float:
    """Mean of the finite numbers among ``values`` (metrics.jsonl writes a missing or NaN value as
    null); NaN when there are none."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)]
    return float(np.mean(xs)) if xs else float("nan")


def cost_to_target(run_dir: str | pathlib.Path, target: float, *, key: str = SCORE, k: int = 3) -> dict:
    """Cost, wall time and iterations of one local run until it reached ``target``, measured as
    benchmarks/convergence.py measures (:func:`spotlight.studies.convergence.run_outcome`: the
    first iteration whose ``k``-point moving average reaches it; a run that never does is
    censored at its iterations + 1, its wall time and cost at the whole run's plus one mean
    iteration's).

    ``key`` is a held-out score of the run's ``eval.jsonl`` (``eval/partial``, ``eval/strict``,
    ``eval/score``: the evaluated iterations) or a metrics.jsonl column
    (``reward/control_mean``: one value per iteration; rows without it are skipped).

    Returns ``{"run", "mode", "iterations", "reached", "cost_usd", "wall_s", "iterations_run"}``
    (censored values for a run that never reached it, with ``reached`` False); ``mode`` is the
    config's ``run.mode`` / ``explore.mode`` as found.

    Raises:
        ValueError: no metrics rows, no eval.jsonl (an ``eval/`` key), or no value of ``key``.
    """
    from spotlight.studies import convergence as cv

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}: metrics.jsonl is empty")
    if key.startswith("eval/"):
        from spotlight.coordinator.evaluation import read_results

        if not (pathlib.Path(run_dir) / "eval.jsonl").is_file():
            raise ValueError(f"{run_dir}: no eval.jsonl (the run had eval.every = 0)")
        curve = cv.heldout_curve(read_results(run_dir), key)
    else:
        have = [(i, r[key]) for i, r in enumerate(rows, 1) if isinstance(r.get(key), (int, float))]
        curve = cv.Curve(tuple(i for i, _ in have), tuple(float(v) for _, v in have), None)
    if not curve.iterations:
        raise ValueError(f"{run_dir}: no value of {key} (a mode without control prompts has no reward/control_mean)")
    o = cv.run_outcome(rows, curve, target, min(k, len(curve.iterations)))
    return {
        "run": str(run_dir),
        "mode": run_mode(run_dir),
        "iterations": o.iterations_censored,
        "reached": o.reached,
        "cost_usd": o.cost_usd_censored if o.cost_usd_censored is not None else float("nan"),
        "wall_s": o.wall_s_censored,
        "iterations_run": o.iterations_run,
    }


def run_mode(run_dir: str | pathlib.Path) -> str:
    """The baseline mode a run directory's config names (``run.mode`` if the config has one,
    else ``explore=<explore.mode>``), or ``"?"`` without a readable config."""
    import tomllib

    path = pathlib.Path(run_dir) / "config.toml"
    try:
        cfg = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return "?"
    mode = cfg.get("run", {}).get("mode")
    return str(mode) if mode else f"explore={cfg.get('explore', {}).get('mode', '?')}"


def spotlight_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m spotlight.cli ARGS`` from the repository root with this interpreter."""
    print("$ spotlight " + " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "spotlight.cli", *args], cwd=REPO, check=check)


BAMBOO = REPO / "examples" / "traces" / "bamboo" / "p3-trace.csv"


def simulate_policies(
    names: list[str],
    *,
    trace: str | pathlib.Path | None = BAMBOO,
    seed: int = 0,
    trace_seed: int = 0,
    iterations: int | None = None,
    profile=None,
) -> tuple[list, str]:
    """What ``spotlight simulate --trace TRACE --policy …`` computes, as :class:`spotlight.sim.simulator.SimResult` s
    (the same placement: the whole trace, played forward and backward, randomly placed on the
    profile's spot nodes), and a one-line description of the setup.

    Raises:
        ValueError: an unknown policy, or a trace with no events.
    """
    from spotlight.sim.profile import load_profile
    from spotlight.sim.simulator import simulate
    from spotlight.traces.actions import trace_actions

    prof = profile or load_profile()
    actions = None
    note = f"static pool of {prof.spot_nodes}x{prof.gpus_per_spot_node} spot GPUs"
    if trace is not None:
        actions = trace_actions(
            trace, spot_nodes=prof.spot_nodes, gpus_per_node=prof.gpus_per_spot_node, seed=trace_seed
        )
        note = (
            f"trace {pathlib.Path(trace).name} on {prof.spot_nodes}x{prof.gpus_per_spot_node} spot GPUs, "
            f"{prof.reserved_gpus} reserved"
        )
    return [simulate(prof, n, actions, iterations=iterations, seed=seed) for n in names], f"{prof.name}; {note}"


def parse_labelled(items: list[str]) -> dict[str, pathlib.Path]:
    """``["LABEL=PATH", "PATH"]`` → ``{label: path}`` (label defaults to the directory name)."""
    out = {}
    for it in items:
        label, sep, path = it.partition("=")
        if not sep:
            label, path = pathlib.Path(it).name, it
        out[label] = pathlib.Path(path)
    return out
