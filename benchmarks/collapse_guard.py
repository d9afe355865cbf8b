"""The collapse guard on our own collapse: the default recipe against lr 3e-4 without KL.

Runs ``spotlight up --local`` twice on the embedded shapes default, side by side on the same
machine (both see the same load): the default settings (lr 1e-4, KL β 0.04) and the pilot
settings that degrade the images (lr 3e-4, KL β 0), each with held-out evaluation every
``--eval-every`` iterations (docs/evaluation.md) and the collapse guard on (docs/collapse-guard.md,
``action = "warn"``). Prints per variant: the iteration at which each guard alert fired, the
held-out score at the base model, its best and its last, and the rollout images' speckle by
iteration (share of near-white pixels with chroma > 15).

What the guard must do: fire on the collapsing settings before their held-out score has fallen
by half, and stay quiet on the default.

Usage (about 2 × 10-15 min on 2 cores)::

    python benchmarks/collapse_guard.py --iterations 20 --out /tmp/guard
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance_line  # noqa: E402

VARIANTS = {
    "default (lr 1e-4, KL 0.04)": {},
    "collapsing (lr 3e-4, no KL)": {"train": {"learning_rate": 3e-4, "kl_beta": 0.0}},
}


def _config(base: dict, eval_every: int, path: pathlib.Path) -> pathlib.Path:
    import tomli_w

    cfg = {"eval": {"every": eval_every, "num_prompts": 16, "num_seeds": 2}, "guard": {"action": "warn"}}
    for section, values in base.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(tomli_w.dumps(cfg))
    return path


def _summary(rd: pathlib.Path) -> dict:
    status = json.loads((rd / "status.json").read_text())
    evals = (
        [json.loads(line) for line in (rd / "eval.jsonl").read_text().splitlines()]
        if (rd / "eval.jsonl").is_file()
        else []
    )
    evals.sort(key=lambda e: e["iteration"])
    rows = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    return {
        "alerts": [(a["iteration"], a["kind"], a["metric"]) for a in status.get("guard_alerts", [])],
        "eval": [
            (e["iteration"] + 1, round(e["eval/score"], 3), round(e.get("eval/strict", float("nan")), 3)) for e in evals
        ],
        "speckle": [round(r.get("image/speckle", float("nan")), 3) for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/collapse_guard"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(provenance_line())
    procs = {}
    for i, (name, base) in enumerate(VARIANTS.items()):
        rd = args.out / f"run{i}"
        conf = _config(base, args.eval_every, args.out / f"config{i}.toml")
        cmd = [sys.executable, "-m", "spotlight.cli", "up", "--local", "--iterations", str(args.iterations)]
        cmd += ["--config", str(conf), "--run-dir", str(rd)]
        log = open(args.out / f"run{i}.console.txt", "w")
        procs[name] = (rd, subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    for name, (rd, p) in procs.items():
        rc = p.wait()
        s = _summary(rd)
        print(f"\n== {name}: exit {rc}, run dir {rd}")
        print("guard alerts (iteration, kind, metric):", s["alerts"] or "none")
        print("held-out (iteration, score, strict):", s["eval"])
        print("rollout speckle by iteration:", s["speckle"])
        if s["eval"]:
            base, best = s["eval"][0][1], max(e[1] for e in s["eval"])
            print(f"held-out score: base {base:.3f}, best {best:.3f}, last {s['eval'][-1][1]:.3f}")


if __name__ == "__main__":
    main()
