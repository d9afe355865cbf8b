"""Paper Fig. 9: score on held-out prompts vs training iteration.

Evaluates the weight versions a run published (``<run>/tensor_store/weights/v<N>.safetensors``;
version N = the weights after N training iterations) on the shapes task's 46 held-out test
prompts with ``spotlight eval``'s code (``spotlight.tasks.shapes.evaluate``: ODE sampling, strict
GenEval-style verdict, mean over the six task kinds; partial credit too).

Toy scale on CPU (default): the seed-0 runs of the three variants of
``benchmarks/convergence.py`` (no exploration / best-of-N on the critical path / Spotlight,
found under ``--convergence-dir``), every 3rd version, 2 samples per prompt; ~6 min on 2 CPU
cores. Without those runs it first makes one short local run
(``spotlight up --local --iterations 4 --agents 2``, ~3 min)::

    python benchmarks/fig09_heldout_score.py
    python benchmarks/fig09_heldout_score.py --run-dir runs/A --run-dir runs/B --every 1 --eval-seeds 8

Real scale on a GPU cluster: run the job with ``spotlight up`` (a paper config such as
``examples/paper/*.toml``), then point ``--run-dir`` at its run directory; the evaluator here is
the shapes task's, so for another reward use that task's own test-set evaluator on the same
``tensor_store/weights`` versions.

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

VARIANTS = ("no-exploration", "critical-path", "spotlight")


def versions(run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
    """``{version: path}`` of the weight versions a run published."""
    out = {}
    for p in (run_dir / "tensor_store" / "weights").glob("v*.safetensors"):
        m = re.fullmatch(r"v(\d+)\.safetensors", p.name)
        if m:
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--run-dir",
        action="append",
        default=[],
        help="a run directory to evaluate (repeatable); default: the convergence runs",
    )
    ap.add_argument("--convergence-dir", default=str(REPO / "benchmarks" / "out" / "convergence"))
    ap.add_argument("--seed", type=int, default=0, help="which run seed of the convergence runs")
    ap.add_argument("--every", type=int, default=3, help="evaluate every k-th version (and the last)")
    ap.add_argument("--eval-seeds", type=int, default=2, help="samples per test prompt")
    ap.add_argument(
        "--cache",
        default=str(REPO / "benchmarks" / "out" / "fig09" / "cache.json"),
        help="scores already computed (per weight file and seeds) are read from and written to here",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fig09_heldout_score.png"))
    args = ap.parse_args()

    import torch

    from spotlight.config import load_config
    from spotlight.store.tensor_wire import mmap_state_dict
    from spotlight.tasks.shapes import evaluate as ev

    runs = {pathlib.Path(d).name: pathlib.Path(d) for d in args.run_dir}
    if not runs:
        conv = pathlib.Path(args.convergence_dir)
        runs = {
            v: conv / f"{v}-s{args.seed}" for v in VARIANTS if (conv / f"{v}-s{args.seed}" / "tensor_store").is_dir()
        }
    if not runs:
        rd = REPO / "benchmarks" / "out" / "fig09" / "local-run"
        if not versions(rd):
            conf = rd.parent / "keep-every-version.toml"  # every version is scored: none pruned
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text("[run]\nkeep_weight_versions = 0\n")
            spotlight_cli(
                "up", "--local", "--iterations", "4", "--agents", "2", "--config", str(conf), "--run-dir", str(rd)
            )
        runs = {"spotlight (4-iteration local run)": rd}
    torch.set_num_threads(max(1, torch.get_num_threads()))
    specs = ev.read_prompts()
    results: dict[str, list[dict]] = {}
    cache_path = pathlib.Path(args.cache)
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    for label, rd in runs.items():
        vs = versions(rd)
        if not vs:
            sys.exit(f"error: {rd}: no published weight versions under tensor_store/weights/")
        cfg = load_config(rd / "config.toml")
        last = max(vs)
        chosen = [v for v in vs if v % args.every == 0 or v == last]
        model = ev.load_transformer(cfg.model, None)
        results[label] = []
        for v in chosen:
            t0 = time.monotonic()
            st = vs[v].stat()
            key = f"{vs[v].resolve()}|{st.st_size}|{st.st_mtime_ns}|{args.eval_seeds}"
            if key not in cache:
                model.load_state_dict(mmap_state_dict(vs[v]))
                r = ev.evaluate(model.eval(), cfg.model, cfg.sampler, specs, num_seeds=args.eval_seeds)
                cache[key] = {
                    "score": r.overall,
                    "partial_credit": r.partial,
                    "per_task": r.per_task,
                    "num_images": r.num_images,
                }
                cache_path.parent.mkdir(parents=True, exist_ok=True)
                cache_path.write_text(json.dumps(cache, indent=1))
            row = {"version": v, **cache[key]}
            results[label].append(row)
            print(
                f"{label:>16} v{v:<3} score {row['score']:.3f}  partial {row['partial_credit']:.3f}  "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )

    print(
        f"\nFig. 9: held-out score ({len(specs)} test prompts x {args.eval_seeds} seeds, strict verdict) vs iteration"
    )
    print(f"{'run':>16} " + " ".join(f"{'v' + str(r['version']):>6}" for r in next(iter(results.values()))))
    for label, rows in results.items():
        print(f"{label:>16} " + " ".join(f"{r['score']:6.3f}" for r in rows))
    # binomial standard error of one score (mean over 6 kinds of strict verdicts)
    n = len(specs) * args.eval_seeds
    print(f"standard error of one score ~ +-{(0.25 / n) ** 0.5:.3f} (at p = 0.5, {n} images)")
    prov = provenance()
    print(provenance_line())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, rows in results.items():
        x = [r["version"] for r in rows]
        axes[0].plot(x, [r["score"] for r in rows], marker="o", label=label)
        axes[1].plot(x, [r["partial_credit"] for r in rows], marker="o", label=label)
    axes[0].set_ylabel("held-out score (strict, GenEval-style)")
    axes[1].set_ylabel("held-out partial credit")
    for ax in axes:
        ax.set_xlabel("iteration (weight version)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Fig. 9 (toy): {len(specs)} test prompts x {args.eval_seeds} seeds", fontsize=9)
    out = save_result(
        fig,
        args.out,
        {
            "provenance": prov,
            "eval_seeds": args.eval_seeds,
            "num_prompts": len(specs),
            "runs": {k: str(v) for k, v in runs.items()},
            "results": results,
        },
        indent=2,
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
