"""The lab's gradient-agreement statistics on synthetic draws with a known signal (pure
functions: no process group, so they run in the fast lane)."""

from __future__ import annotations

import math

import pytest
import torch

from spotlight.studies.lab import gradient_agreement, gradient_agreement_by_part, gradient_part


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
