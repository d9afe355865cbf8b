"""The RL lab (spotlight/studies/lab.py): Spotlight's iteration in one process."""

from __future__ import annotations

import json
import math

import pytest
import torch

from spotlight.config import load_config
from spotlight.studies.lab import (
    LabSettings,
    gradient_agreement,
    gradient_agreement_by_part,
    gradient_part,
    run_lab,
)
from tests.factories import LAB_SMALL

pytestmark = pytest.mark.procs  # a one-rank gloo process group in the test process


def _cfg(**extra):
    return load_config(overrides={"run.iterations": 2, **LAB_SMALL, **extra})


def test_lab_iterations_explore_the_next_batch_train_on_policy_and_evaluate(tmp_path):
    test_prompts = tmp_path / "test.jsonl"
    test_prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ("a photo of a red circle", "a photo of two squares"))
    )
    settings = LabSettings(explore_candidates=6, eval_every=2, eval_seeds=1, eval_prompts_path=str(test_prompts))
    res = run_lab(_cfg(), settings)
    assert [r["iteration"] for r in res.rows] == [0, 1]
    first, second = res.rows
    # iteration 1's batch was explored on v_0 (2 explored slots x 6 candidates); batch 0 never is
    assert math.isnan(first["reward/population_mean"]) and not math.isnan(second["reward/population_mean"])
    # fresh samples: the first minibatch's policy ratio is exactly 1 (docs/flow-grpo.md §1.5)
    assert first["train/ratio_max_dev"] == 0.0 and second["train/ratio_max_dev"] == 0.0
    assert first["train/num_samples"] == 12 and first["update/rel_change"] > 0
    assert [e["iteration"] for e in res.evals] == [0, 2]
    assert all(0.0 <= e["strict"] <= e["partial"] <= 1.0 for e in res.evals)


def test_lab_rollouts_follow_the_coordinator_s_prompt_order_and_seeds():
    from spotlight.coordinator.coordinator import build_core
    from spotlight.core.request_scheduler import RequestScheduler
    from spotlight.core.seed_bank import SeedBank, default_seeds
    from spotlight.studies import lab

    cfg = _cfg(**{"run.iterations": 1})
    seen = []
    real_run = lab._Rollouts.run

    def spy(self, prompt_index, seeds, window_start=None):
        seen.append((prompt_index, list(seeds)))
        return real_run(self, prompt_index, seeds, window_start)

    lab._Rollouts.run = spy
    try:
        run_lab(cfg, LabSettings(eval_every=0))
    finally:
        lab._Rollouts.run = real_run
    from spotlight.tasks.prompts import load_prompt_set

    n = len(load_prompt_set(cfg.data.prompts_path).prompts)
    core = build_core(cfg, RequestScheduler(), SeedBank(cfg.run.seed, 4), None, num_prompts=n)
    assert [p for p, _ in seen] == core.batch_prompts(0)
    assert [s for _, s in seen] == [default_seeds(cfg.run.seed, 0, slot, 4) for slot in range(3)]


def test_the_default_recipe_keeps_the_background_clean():
    """The embedded default's trained samples keep the base model's clean background: the share
    of near-white pixels with visible colour (chroma > 15, ``image/speckle``) on the held-out
    panel stays within :data:`SPECKLE_BOUND` of the base model's after 6 iterations of the
    default recipe. (The full fine-tune at lr 1e-4 with an 8-step SDE window that preceded it
    went from 0.011 to 0.38 by iteration 6: patch-grid noise the rule-based reward does not see;
    docs/flow-grpo.md §3.)"""
    cfg = load_config(overrides={"run.iterations": 6})
    res = run_lab(cfg, LabSettings(eval_every=6, eval_seeds=2))
    base, trained = res.evals[0]["image/speckle"], res.evals[-1]["image/speckle"]
    assert trained <= base + SPECKLE_BOUND, (base, trained)


SPECKLE_BOUND = 0.03
"""Background speckle the default recipe may add over the base model (share of near-white pixels)."""


def test_gradients_only_draws_every_batch_at_the_initial_weights():
    """``gradients_only`` keeps one gradient per optimizer step and takes none of the steps."""
    res = run_lab(_cfg(**{"run.iterations": 3}), LabSettings(eval_every=0, gradients_only=True))
    assert len(res.gradients) == 3
    assert all(r["update/rel_change"] == 0.0 and r["train/ratio_max_dev"] == 0.0 for r in res.rows)
    norms = [float(g.norm()) for g in res.gradients]
    assert all(math.isfinite(n) and n > 0 for n in norms)
    assert len({g.numel() for g in res.gradients}) == 1
    agreement = gradient_agreement(res.gradients)
    assert -1.0 <= agreement["pairwise_cos_mean"] <= 1.0
    # the layout names every slice of the vector: the LoRA parameters of each block
    assert sum(n for _, n in res.gradient_layout) == res.gradients[0].numel()
    assert all("lora_" in name for name, _ in res.gradient_layout)
    parts = gradient_agreement_by_part(res.gradients, res.gradient_layout)
    blocks = {k for k in parts if k.startswith("block ")}
    assert blocks == {f"block {i}" for i in range(_cfg().model.num_layers)}
    assert "module attn.to_q" in parts and "module img_mlp.net.2" in parts
    for prefix in ("block ", "module "):
        assert sum(a["norm_share"] for k, a in parts.items() if k.startswith(prefix)) == pytest.approx(1.0)
    # one gradient per whole batch: several optimizer steps per iteration would give minibatches
    with pytest.raises(ValueError, match="steps_per_iteration = 1"):
        run_lab(_cfg(**{"train.steps_per_iteration": 2}), LabSettings(eval_every=0, gradients_only=True))


def test_gradient_agreement_recovers_the_signal_share():
    """Draws ``g + noise`` with ``|g|² = 1`` and noise ``tr Σ = 9``: the signal's share of a
    draw's squared norm is 0.1, and the mean of half of 40 draws agrees with the other half's
    far more (20·0.1 / (1 + 19·0.1) ≈ 0.69)."""
    gen = torch.Generator().manual_seed(0)
    dim = 20_000
    g = torch.zeros(dim, dtype=torch.float64)
    g[0] = 1.0
    draws = [g + 3.0 * torch.randn(dim, generator=gen, dtype=torch.float64) / math.sqrt(dim) for _ in range(40)]
    a = gradient_agreement(draws)
    assert a["pairwise_cos_mean"] == pytest.approx(0.1, abs=0.02)
    assert a["halves_cos"] == pytest.approx(a["halves_cos_expected"], abs=0.1)
    assert 4 < a["steps_for_snr1_lower"] < 15  # (1 - 0.1) / 0.1 = 9, from an upper bound on c
    pure_noise = [torch.randn(dim, generator=gen, dtype=torch.float64) for _ in range(10)]
    n = gradient_agreement(pure_noise)
    assert abs(n["pairwise_cos_mean"]) < 0.01
    assert n["steps_for_snr1_lower"] > 20
    # odd B: halves of 20 and 21 draws, and the expectation for unequal halves
    odd = gradient_agreement(draws + [g + 3.0 * torch.randn(dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)])
    c = odd["pairwise_cos_mean"]
    assert odd["halves_cos_expected"] == pytest.approx(
        c * math.sqrt(20 * 21) / math.sqrt((1 + 19 * c) * (1 + 20 * c)), rel=1e-9
    )
    assert odd["halves_cos"] == pytest.approx(odd["halves_cos_expected"], abs=0.1)
    # two draws: one pair, no error to bound it with
    two = gradient_agreement(draws[:2])
    assert math.isnan(two["pairwise_cos_se"]) and math.isnan(two["steps_for_snr1_lower"])
    with pytest.raises(ValueError, match="at least 2"):
        gradient_agreement(draws[:1])
    with pytest.raises(ValueError, match="different lengths"):
        gradient_agreement([draws[0], draws[1][:10]])


def test_gradient_agreement_by_part_finds_where_the_signal_is():
    """Signal in one module of one block, noise everywhere: that block's and that module's slices
    agree (their own signal share, |g|² / (|g|² + noise) = 0.5), the other parts do not; the
    LoRA A matrices' all-zero slices are left out."""
    gen = torch.Generator().manual_seed(1)
    names = [
        f"base_model.model.transformer_blocks.{b}.{m}.lora_{ab}.default.weight"
        for b in range(2)
        for m in ("attn.to_q", "img_mlp.net.2")
        for ab in "AB"
    ]
    size = 2_000
    layout = [(n, size) for n in names]
    signal = torch.zeros(len(names) * size, dtype=torch.float64)
    i = names.index("base_model.model.transformer_blocks.1.attn.to_q.lora_B.default.weight")
    signal[i * size] = 1.0
    draws = []
    for _ in range(30):
        noise = torch.randn(len(names) * size, generator=gen, dtype=torch.float64) / math.sqrt(size)
        d = signal + noise
        for j, n in enumerate(names):
            if ".lora_A." in n:
                d[j * size : (j + 1) * size] = 0.0
        draws.append(d)
    parts = gradient_agreement_by_part(draws, layout)
    assert list(parts) == ["block 0", "block 1", "module attn.to_q", "module img_mlp.net.2"]
    assert all(a["numel"] == 2 * size for a in parts.values())  # the two B matrices of each part
    assert parts["block 1"]["pairwise_cos_mean"] == pytest.approx(1 / 3, abs=0.07)  # |g|² / (|g|² + 2)
    assert parts["module attn.to_q"]["pairwise_cos_mean"] == pytest.approx(1 / 3, abs=0.07)
    for quiet in ("block 0", "module img_mlp.net.2"):
        assert abs(parts[quiet]["pairwise_cos_mean"]) < 0.02
    assert gradient_part("transformer_blocks.3.attn.to_out.0.lora_B.default.weight") == ("block 3", "attn.to_out.0")
    assert gradient_part("proj_out.weight") == ("other", "proj_out")
    with pytest.raises(ValueError, match="layout covers"):
        gradient_agreement_by_part(draws, layout[:-1])
