"""Paper Fig. 9: score on held-out prompts vs training iteration, for any model family and task.

Each run's held-out scores come from the run's own held-out evaluation (docs/evaluation.md):

* ``eval.jsonl``, written during training when the run had ``eval.every = N`` (the base model and
  every N-th version on the run's fixed panel: ``eval.prompts_path`` × ``eval.num_seeds`` seeds, ODE
  sampling, scored by the run's reward; for the shapes task also GenEval's strict verdict); or,
  for a run without it (or with ``--source versions``),
* the run's published weight versions (``tensor_store/weights/v<N>.safetensors``; version N = the
  weights after N iterations), each scored post hoc by the Eval Worker's own code
  (:func:`spotlight.workers.eval.eval_worker.score_version`: the run's panel, here with
  ``--eval-prompts`` prompts × ``--eval-seeds`` seeds), which is also what ``spotlight eval
  --run-dir`` runs for any family.

Toy scale on CPU (default): the seed-0 runs of the three run modes of
``benchmarks/convergence.py`` (rlboost / verl-omni-spot / Spotlight, found under
``--convergence-dir``; the benchmark evaluates the held-out panel after every iteration).
Without those runs it first makes one short local run with an evaluation after every iteration
(``spotlight up --local --iterations 4 --agents 2`` with ``eval.every = 1``, ~4 min)::

    python benchmarks/fig09_heldout_score.py
    python benchmarks/fig09_heldout_score.py --run-dir runs/A --run-dir runs/B
    python benchmarks/fig09_heldout_score.py --run-dir runs/A --source versions --every 3 \
        --eval-prompts 46 --eval-seeds 2

Real scale on a GPU cluster: run the job with ``spotlight up`` and ``eval.every`` set (every
``examples/families`` and ``examples/paper`` config sets it, with its held-out test set), then point
``--run-dir`` at its run directory: nothing is recomputed. Post hoc (``--source versions``) the
versions are sampled on ``eval.device`` (the first CUDA GPU when there is one).

Paper: Fig. 9 shows the test score rising with iterations, Spotlight above the baselines at
every iteration count.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance, provenance_line, save_result  # noqa: E402
from _runs import spotlight_cli  # noqa: E402

MODES = ("rlboost", "verl-omni-spot", "spotlight")
"""The run modes of benchmarks/convergence.py; its run directories are ``<mode>-s<seed>``."""


def versions(run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
    """``{version: path}`` of the weight versions a run published."""
    out = {}
    for p in (run_dir / "tensor_store" / "weights").glob("v*.safetensors"):
        m = re.fullmatch(r"v(\d+)\.safetensors", p.name)
        if m:
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def from_eval_jsonl(run_dir: pathlib.Path) -> list[dict]:
    """The run's evaluations during training (``eval.jsonl``) as rows ``{"version", "score",
    "strict"?}`` by version (a version evaluated twice, e.g. by a resumed run: its last line)."""
    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return []
    rows = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"error: {path}:{n}: not JSON ({exc.msg})") from None
        row = {"version": int(e["version"]), "score": float(e["eval/score"])}
        if "eval/strict" in e:
            row["strict"] = float(e["eval/strict"])
        if "eval/partial" in e:
            row["partial"] = float(e["eval/partial"])
        rows[row["version"]] = row
    return [rows[v] for v in sorted(rows)]


def from_versions(run_dir: pathlib.Path, args, cache: dict) -> list[dict]:
    """Score every ``--every``-th published version (and the last) with the Eval Worker's code."""
    import msgspec

    from spotlight.config import load_config
    from spotlight.coordinator.evaluation import cache_dir
    from spotlight.store.tensor_wire import mmap_state_dict
    from spotlight.workers.eval.eval_worker import score_version

    vs = versions(run_dir)
    if not vs:
        raise SystemExit(
            f"error: {run_dir}: no published weight versions under tensor_store/weights/ and no eval.jsonl"
        )
    cfg = load_config(run_dir / "config.toml")
    panel = msgspec.structs.replace(cfg.eval, num_prompts=args.eval_prompts, num_seeds=args.eval_seeds)
    cfg = msgspec.structs.replace(cfg, eval=panel)
    last = max(vs)
    rows = []
    for v in (v for v in vs if v % args.every == 0 or v == last):
        t0 = time.monotonic()
        st = vs[v].stat()
        key = f"{vs[v].resolve()}|{st.st_size}|{st.st_mtime_ns}|{args.eval_prompts}|{args.eval_seeds}"
        if key not in cache:
            scores, *_ = score_version(cfg, mmap_state_dict(str(vs[v])), cache_dir=cache_dir())
            cache[key] = {"score": scores["eval/score"]} | {
                name: scores[f"eval/{name}"] for name in ("strict", "partial") if f"eval/{name}" in scores
            }
        rows.append({"version": v, **cache[key]})
        print(f"{run_dir.name:>20} v{v:<3} score {rows[-1]['score']:.3f}  ({time.monotonic() - t0:.0f} s)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--run-dir",
        action="append",
        default=[],
        help="a run directory (repeatable); default: the convergence runs",
    )
    ap.add_argument("--convergence-dir", default=str(REPO / "benchmarks" / "out" / "convergence"))
    ap.add_argument("--seed", type=int, default=0, help="which run seed of the convergence runs")
    ap.add_argument(
        "--source",
        choices=("auto", "eval-jsonl", "versions"),
        default="auto",
        help="auto: the run's eval.jsonl when it has one, else its published versions scored post hoc",
    )
    ap.add_argument("--every", type=int, default=3, help="post hoc: score every k-th version (and the last)")
    ap.add_argument("--eval-prompts", type=int, default=10**6, help="post hoc: panel prompts (default: all)")
    ap.add_argument("--eval-seeds", type=int, default=2, help="post hoc: samples per panel prompt")
    ap.add_argument(
        "--cache",
        default=str(REPO / "benchmarks" / "out" / "fig09" / "cache.json"),
        help="post-hoc scores already computed (per weight file and panel) are read from and written to here",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig09_heldout_score.png"))
    args = ap.parse_args()

    runs = {pathlib.Path(d).name: pathlib.Path(d) for d in args.run_dir}
    if not runs:
        conv = pathlib.Path(args.convergence_dir)
        runs = {m: conv / f"{m}-s{args.seed}" for m in MODES if (conv / f"{m}-s{args.seed}" / "config.toml").is_file()}
    if not runs:
        rd = REPO / "benchmarks" / "out" / "fig09" / "local-run"
        if not (rd / "eval.jsonl").is_file():
            conf = rd.parent / "eval-every-iteration.toml"  # the held-out panel after every iteration
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text("[eval]\nevery = 1\n")
            spotlight_cli(
                "up", "--local", "--iterations", "4", "--agents", "2", "--config", str(conf), "--run-dir", str(rd)
            )
        runs = {"spotlight (4-iteration local run)": rd}

    cache_path = pathlib.Path(args.cache)
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    results: dict[str, list[dict]] = {}
    sources: dict[str, str] = {}
    for label, rd in runs.items():
        rows = from_eval_jsonl(rd) if args.source != "versions" else []
        sources[label] = "eval.jsonl (during training)"
        if not rows:
            if args.source == "eval-jsonl":
                raise SystemExit(f"error: {rd}: no eval.jsonl (the run had eval.every = 0); use --source versions")
            import torch

            torch.set_num_threads(max(1, torch.get_num_threads()))
            rows = from_versions(rd, args, cache)
            sources[label] = f"published versions, post hoc ({args.eval_seeds} seeds per prompt)"
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            cache_path.write_text(json.dumps(cache, indent=1))
        results[label] = rows

    print("\nFig. 9: held-out score (the run's reward on its panel; strict GenEval verdict where the task has one)")
    for label, rows in results.items():
        print(f"{label} [{sources[label]}]")
        print("  version " + " ".join(f"{'v' + str(r['version']):>7}" for r in rows))
        print("  score   " + " ".join(f"{r['score']:7.3f}" for r in rows))
        if all("strict" in r for r in rows):
            print("  strict  " + " ".join(f"{r['strict']:7.3f}" for r in rows))
    prov = provenance()
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strict = any("strict" in r for rows in results.values() for r in rows)
    fig, axes = plt.subplots(1, 2 if strict else 1, figsize=(9 if strict else 5, 3.6), squeeze=False)
    for label, rows in results.items():
        x = [r["version"] for r in rows]
        axes[0][0].plot(x, [r["score"] for r in rows], marker="o", label=label)
        if strict:
            axes[0][1].plot(x, [r.get("strict", float("nan")) for r in rows], marker="o", label=label)
    axes[0][0].set_ylabel("held-out score (the run's reward)")
    if strict:
        axes[0][1].set_ylabel("held-out strict verdict (GenEval-style)")
    for ax in axes[0]:
        ax.set_xlabel("iteration (weight version)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Fig. 9 (toy): held-out score vs iteration", fontsize=9)
    out = save_result(
        fig,
        args.out,
        {
            "provenance": prov,
            "runs": {k: str(v) for k, v in runs.items()},
            "sources": sources,
            "results": results,
        },
        indent=2,
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
