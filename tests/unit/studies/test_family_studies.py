"""`spotlight profile` and `spotlight bench stale-ranking` for the real families, from saved tiny
checkpoints of their real classes: the family's own conditioning (negative prompt, pooled
embeddings), its initial version (the LoRA adapter in a LoRA run), First Block Cache where the
family has it (Qwen-Image, FLUX.1; SD3 gets the full-rollout row only)."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from spotlight.config import load_config
from spotlight.studies.profiling import initial_version, run_profile
from spotlight.studies.stale_ranking import run_stale_ranking

PROMPTS = ["a red apple", "two blue cars", "a green bench on grass"]
CASES = [("qwen-image", True), ("flux", False), ("sd3", True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> pathlib.Path:
    import importlib

    root = tmp_path_factory.mktemp("study-ckpts")
    for family, _ in CASES:
        importlib.import_module(f"spotlight.models.families.{family.replace('-', '_')}").make_random_checkpoint(
            root / family, seed=2
        )
    return root


def _cfg(family: str, lora: bool, root: pathlib.Path):
    overrides = {
        "model.family": family,
        "model.pretrained_path": str(root / family),
        "model.image_size": 32,
        "model.max_text_tokens": 8,
        "sampler.num_steps": 4,
        "sampler.sde_window_size": 2,
        "cluster.worker_batch_size": 3,
        "reward.kind": "jpeg_incompressibility",
        "eval.every": 0,
    }
    overrides["train.lora_rank"] = 2 if lora else 0
    return load_config(overrides=overrides)


@pytest.mark.parametrize("family,lora", CASES)
def test_profile_and_stale_ranking_run_for_the_family(checkpoints, tmp_path, family, lora):
    from spotlight.models.families import cached_conditioning, get_family

    cfg = _cfg(family, lora, checkpoints)
    cond = cached_conditioning(get_family(cfg.model), PROMPTS, tmp_path)
    lines: list[str] = []
    prof = run_profile(
        cfg, cond, thresholds=[100.0], num_prompts=2, num_seeds=3, progress=lines.append, prompts=PROMPTS
    )
    rows = {r["cache_threshold"]: r for r in prof["steps"]}
    assert rows[0.0]["effective_steps"] == 4.0 and prof["t_step_s"]["cpu/sp1"] > 0 and prof["family"] == family
    if family == "sd3":  # no First Block Cache: only the full rollout, and said so
        assert set(rows) == {0.0} and any("no First Block Cache" in line for line in lines)
    else:
        assert rows[100.0]["effective_steps"] == 1.0  # every step after the first was cached
    json.dumps(prof, allow_nan=False)

    v0 = initial_version(cfg)
    assert all("lora_" in k for k in v0) == lora and len(v0) > 0
    g = torch.Generator().manual_seed(3)
    v1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in v0.items()}
    res = run_stale_ranking(cfg, cond, [v0, v1], [0, 1], 3, progress=lines.append, versions=[0, 1], prompts=PROMPTS)
    rho = res["pairs"][0]["rho_mean"]
    assert math.isnan(rho) or -1.0 <= rho <= 1.0
    assert sum(map(sum, res["heatmap"])) == 2 * 3
