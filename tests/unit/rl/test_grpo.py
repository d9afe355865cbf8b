"""Flow-GRPO objective: group advantages, clipped policy loss, KL surrogate (hand numbers).

Reference: docs/flow-grpo.md §1.4–§1.5 (Flow-GRPO stat_tracking / train_sd3).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spotlight.rl.grpo import ADV_EPS, clipped_policy_loss, group_advantages, kl_to_reference

# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("std", ["batch", "group"])
def test_constant_groups_get_exactly_zero(std):
    # one constant group next to a varying one
    adv = group_advantages([0.3, 0.3, 0.3, 1.0, 2.0, 4.0], [0, 0, 0, 1, 1, 1], std=std)
    assert adv.dtype == np.float64
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert np.all(adv[3:] != 0.0)
    # the whole batch constant (batch std 0): zeros, not NaN / 0/eps blow-ups
    adv = group_advantages([-1.7] * 6, [0, 0, 0, 1, 1, 1], std=std)
    assert adv.tolist() == [0.0] * 6
    # many groups of a value that is not exact in binary floating point
    adv = group_advantages([0.1] * 8 * 4, [g for g in range(4) for _ in range(8)], std=std)
    assert adv.tolist() == [0.0] * 32
    # values whose float mean is not exactly the value (0.1 * 3, 0.7 * 6, 0.1 * 24): the
    # residual (x - mean(x)) would be ~1e-17, not 0, without an explicit all-equal rule
    assert np.full(3, 0.1).mean() != 0.1 and np.full(6, 0.7).mean() != 0.7
    adv = group_advantages([0.1] * 3 + [0.7] * 6 + [0.0, 1.0], [0] * 3 + [1] * 6 + [2, 2], std=std)
    assert adv[:9].tolist() == [0.0] * 9 and adv[9] < 0 < adv[10]
    adv = group_advantages([0.1] * 24, [0] * 24, std=std)
    assert adv.tolist() == [0.0] * 24
    adv = group_advantages([0.7] * 18, [g for g in range(3) for _ in range(6)], std=std)
    assert adv.tolist() == [0.0] * 18
    # groups given out of order and interleaved
    adv = group_advantages([0.1, 5.0, 0.1, 7.0], [2, 9, 2, 9], std=std)
    assert adv[0] == 0.0 and adv[2] == 0.0 and adv[1] < 0 < adv[3]


def test_batch_std_hand_numbers():
    rewards = [1.0, 2.0, 3.0, 4.0]
    adv = group_advantages(rewards, [0, 0, 1, 1], std="batch")
    batch_std = math.sqrt(1.25)  # population std of 1, 2, 3, 4 (numpy ddof=0, as Flow-GRPO)
    expected = np.array([-0.5, 0.5, -0.5, 0.5]) / (batch_std + 1e-4)
    np.testing.assert_allclose(adv, expected, rtol=1e-12)
    assert ADV_EPS == 1e-4


def test_batch_std_includes_constant_groups():
    # the constant group contributes to the batch std even though its advantages are 0
    rewards = [0.0, 2.0, 5.0, 5.0]
    adv = group_advantages(rewards, [0, 0, 1, 1], std="batch")
    batch_std = float(np.std(rewards))  # mean 3, deviations -3, -1, 2, 2 -> var 18/4
    assert batch_std == pytest.approx(math.sqrt(4.5))
    np.testing.assert_allclose(
        adv, [-1.0 / (math.sqrt(4.5) + 1e-4), 1.0 / (math.sqrt(4.5) + 1e-4), 0.0, 0.0], rtol=1e-12
    )


def test_group_std_hand_numbers():
    rewards = [1.0, 3.0, 10.0, 20.0, 30.0]
    adv = group_advantages(rewards, [0, 0, 1, 1, 1], std="group")
    g1_std = math.sqrt(200.0 / 3.0)  # 10, 20, 30 about 20: (100 + 0 + 100) / 3
    expected = [-1.0 / (1.0 + 1e-4), 1.0 / (1.0 + 1e-4), -10.0 / (g1_std + 1e-4), 0.0, 10.0 / (g1_std + 1e-4)]
    np.testing.assert_allclose(adv, expected, rtol=1e-12)
    # each group is normalised on its own, so scaling one group does not affect the other
    adv2 = group_advantages([1.0, 3.0, 100.0, 200.0, 300.0], [0, 0, 1, 1, 1], std="group")
    np.testing.assert_allclose(adv2[:2], adv[:2], rtol=1e-12)


def test_single_member_group_is_zero():
    adv = group_advantages([4.0, 1.0, 2.0], [0, 1, 1])
    assert adv[0] == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_raises(bad):
    with pytest.raises(ValueError):
        group_advantages([1.0, bad, 0.0, 2.0], [0, 0, 1, 1])


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        group_advantages([1.0, 2.0], [0])


# ---------------------------------------------------------------- clipped loss


def test_ratio_one_loss_is_minus_sum_of_advantages():
    old = torch.tensor([[-1.3, 0.2, 0.7], [2.0, -0.5, 0.1]])
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    loss, stats = clipped_policy_loss(logp, old, adv, clip_range=1e-4, adv_clip_max=5.0)
    # ratio == 1 exactly -> every element contributes -A: -(1*3) - (-2*3) = 3
    assert loss.item() == 3.0
    assert stats["ratio_sum"].item() == 6.0
    assert stats["ratio_max_dev"].item() == 0.0
    assert stats["clipped"].item() == 0.0
    assert stats["approx_kl"].item() == 0.0
    assert stats["count"].item() == 6.0
    loss.backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A
    assert torch.equal(logp.grad, torch.tensor([[-1.0, -1.0, -1.0], [2.0, 2.0, 2.0]]))


def test_clipping_on_hand_made_ratios():
    eps = 0.2
    ratios = torch.tensor([[1.5, 0.5], [1.5, 0.5]], dtype=torch.float64)
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = ratios.log().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = clipped_policy_loss(logp, old, adv, clip_range=eps, adv_clip_max=5.0)
    # A=+1: ratio 1.5 -> max(-1.5, -1.2) = -1.2 (clipped); ratio 0.5 -> max(-0.5, -0.8) = -0.5
    # A=-1: ratio 1.5 -> max(1.5, 1.2) = 1.5;              ratio 0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx(-1.2 - 0.5 + 1.5 + 0.8, abs=1e-6)
    assert stats["clipped"].item() == 4.0  # |ratio - 1| = 0.5 > eps everywhere
    assert stats["ratio_max_dev"].item() == pytest.approx(0.5, abs=1e-6)
    loss.backward()
    # gradient flows only through unclipped terms: d(-A r)/dlogp = -A r
    expected = torch.tensor([[0.0, -0.5], [1.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-6, atol=1e-6)


def test_small_ratio_deviation_within_clip_range_is_not_clipped():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.00005), math.log(0.99995)]])
    loss, stats = clipped_policy_loss(logp, old, torch.tensor([2.0]), clip_range=1e-4, adv_clip_max=5.0)
    assert stats["clipped"].item() == 0.0
    assert loss.item() == pytest.approx(-2.0 * (1.00005 + 0.99995), rel=1e-6)


def test_advantages_are_clamped():
    old = torch.zeros(3, 2)
    adv = torch.tensor([10.0, -7.0, 0.5])
    loss, _ = clipped_policy_loss(old.clone(), old, adv, clip_range=0.1, adv_clip_max=5.0)
    # clamp to [-5, 5]: -(5*2) - (-5*2) - (0.5*2) = -1
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)


def test_approx_kl_stat():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.1, -0.3]])
    _, stats = clipped_policy_loss(logp, old, torch.tensor([1.0]), clip_range=1.0, adv_clip_max=5.0)
    assert stats["approx_kl"].item() == pytest.approx(0.5 * (0.01 + 0.09), rel=1e-6)
    assert not stats["approx_kl"].requires_grad


# ---------------------------------------------------------------- KL to reference


def test_kl_to_reference_hand_numbers():
    mean = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]]])
    ref = torch.tensor([[[0.0, 2.0], [3.0, 2.0]], [[1.0, 1.0], [1.0, 1.0]]])
    std = 0.5
    # sample 0: sq diffs 1, 0, 0, 4 -> mean 1.25; sample 1: mean 1.0; each / (2 * 0.25) = / 0.5
    kl = kl_to_reference(mean, ref, std)
    assert kl.item() == pytest.approx((1.25 + 1.0) / 0.5, rel=1e-6)
    assert kl_to_reference(mean, mean.clone(), std).item() == 0.0


@pytest.mark.parametrize("std", [0.0, -1.0, float("inf"), float("nan")])
def test_kl_needs_positive_std(std):
    x = torch.zeros(1, 2, 2)
    with pytest.raises(ValueError):
        kl_to_reference(x, x, std)
