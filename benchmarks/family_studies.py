"""`spotlight profile` and `spotlight bench stale-ranking` (paper Insight 1) for every model family,
on saved tiny random-weight checkpoints of the families' real classes (docs/architecture.md §7).

Per family: a checkpoint (``make_random_checkpoint``), a config (32² images, 10 steps, the JPEG
reward, LoRA r 4 for Qwen-Image and SD3.5, full fine-tuning for FLUX.1), then

    spotlight profile --config C --out OUT/<family>-profile.json --sp-degrees 1,2 ...
    spotlight up --local --agents 0 --iterations 3 --config C --run-dir OUT/<family>-run
    spotlight bench stale-ranking --run-dir OUT/<family>-run ...

and one table of what they measured. Random weights make the numbers a check of the plumbing
and of the cache's effect on a real architecture, not of a trained model's behaviour.

    python benchmarks/family_studies.py        # ~10 min on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAMILIES = {"qwen-image": "lora", "flux": "full", "sd3": "lora"}


def _config(family: str, mode: str, ckpt: pathlib.Path) -> dict:
    from spotlight.config import SpotlightConfig, config_to_dict

    full = config_to_dict(SpotlightConfig())
    full["model"].update(family=family, pretrained_path=str(ckpt), image_size=32, max_text_tokens=16)
    full["sampler"].update(num_steps=10, sde_window_size=2, sde_window_range=[0, 8], noise_level=1.0)
    full["data"].update(prompts_per_iteration=3, group_size=4, num_control_prompts=1)
    full["explore"].update(planner="fixed", num_candidates=8)
    full["train"].update(steps_per_iteration=2, learning_rate=1e-3)
    if mode == "lora":
        full["train"].update(lora_rank=4)
    full["reward"]["kind"] = "jpeg_incompressibility"
    full["cluster"]["worker_batch_size"] = 4
    full["eval"]["every"] = 0
    full["run"]["sample_grid_every"] = 0
    return full


def _run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "spotlight.cli", *args], cwd=REPO, check=True)


def main() -> None:
    import tomli_w

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--num-seeds", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "family_studies"))
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="spotlight-family-studies-"))
    summary = {}
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        mode = FAMILIES[family]
        mod = importlib.import_module(f"spotlight.models.families.{family.replace('-', '_')}")
        ckpt = mod.make_random_checkpoint(work / f"ckpt-{family}", seed=1)
        conf = work / f"{family}.toml"
        conf.write_text(tomli_w.dumps(_config(family, mode, ckpt)))
        prof = out / f"{family}-profile.json"
        sizes = ["--num-prompts", str(args.num_prompts), "--num-seeds", str(args.num_seeds)]
        _run("profile", "--config", str(conf), "--out", str(prof), "--thresholds", "0.05,0.2,1.0", *sizes)
        rd = work / f"{family}-run"
        _run("up", "--local", "--agents", "0", "--iterations", "3", "--config", str(conf), "--run-dir", str(rd))
        bench = out / f"{family}-stale"
        _run("bench", "stale-ranking", "--run-dir", str(rd), "--out", str(bench), *sizes)
        p = json.loads(prof.read_text())
        s = json.loads((bench / "stale_ranking.json").read_text())
        summary[family] = {
            "mode": mode,
            "t_step_s": p["t_step_s"],
            "steps": [(r["cache_threshold"], r["effective_steps"], r["cost_steps"], r["accuracy"]) for r in p["steps"]],
            "stale_rho": [(r["stale_version"], r["updated_version"], r["rho_mean"]) for r in s["pairs"]],
            "stale_rho_overall": s["overall"]["rho_mean"],
        }
        print(json.dumps({family: summary[family]}, indent=1), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
