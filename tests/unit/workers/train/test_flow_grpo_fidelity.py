"""Flow-GRPO fidelity of the update (measured against yifan123/flow_grpo ``train_sd3.py``):
both KL forms against their formulas, several optimizer steps per iteration (ratio exactly 1
on the first minibatch only), non-finite samples and steps never reaching the weights,
Flow-GRPO's zero-std group filter, and the random SDE window (Flow-GRPO-Fast)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spotlight.config import SamplerConfig, SpotlightConfig, TrainConfig
from spotlight.rl.grpo import kl_to_reference
from spotlight.rl.sampler import Sampler, make_sigmas, sde_step
from spotlight.workers.train.train_worker import FlowGRPOTrainer, _minibatches
from tests.unit.workers.train.test_train_worker import ROLLOUT_MBS, TEXT_DIM, _states_differ, make_rollout

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")


def _trainer(**train) -> FlowGRPOTrainer:
    cfg = SpotlightConfig(train=TrainConfig(**train), sampler=SamplerConfig(sde_window_size=1))
    return FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)


# ------------------------------------------------------------------ KL forms


def _step_pair():
    sigmas = make_sigmas(10, 3.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=g)
    v, v_ref = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    sig, nxt = float(sigmas[2]), float(sigmas[3])
    noise = torch.randn(3, 4, 5, generator=g)
    res = sde_step(v, x, sig, nxt, float(sigmas[1]), 0.7, noise=noise)
    ref = sde_step(v_ref, x, sig, nxt, float(sigmas[1]), 0.7, noise=noise)
    return res, ref, sig, nxt


def test_flow_grpo_kl_divides_by_std_dev_t_squared():
    res, ref, sig, nxt = _step_pair()
    std_dev_t = 0.7 * math.sqrt(sig / (1 - sig))
    assert res.std_dev_t == pytest.approx(std_dev_t)
    expected = sum(((res.mean[b] - ref.mean[b]) ** 2).mean().item() / (2 * std_dev_t**2) for b in range(3))
    assert kl_to_reference(res.mean, ref.mean, res.std_dev_t).item() == pytest.approx(expected, rel=1e-6)


def test_exact_kl_divides_by_the_step_variance():
    res, ref, sig, nxt = _step_pair()
    step_std = 0.7 * math.sqrt(sig / (1 - sig)) * math.sqrt(sig - nxt)
    assert res.std == pytest.approx(step_std)
    expected = sum(((res.mean[b] - ref.mean[b]) ** 2).mean().item() / (2 * step_std**2) for b in range(3))
    exact = kl_to_reference(res.mean, ref.mean, res.std).item()
    assert exact == pytest.approx(expected, rel=1e-6)
    # the exact form is larger by 1/|dt| (why Flow-GRPO's published β values are weaker than they look)
    assert exact / kl_to_reference(res.mean, ref.mean, res.std_dev_t).item() == pytest.approx(
        1.0 / (sig - nxt), rel=1e-5
    )


@pytest.mark.procs
def test_trainer_uses_the_configured_kl_form(pg):
    """Two optimizer steps (KL = 0 on the first: μ = μ_ref, and its gradient is 0, so both
    trainers hold identical weights for the second): the KL of the second differs by 1/|dt|."""
    batch = make_rollout(SpotlightConfig(sampler=SamplerConfig(sde_window_size=1)))
    kls = {}
    for form in ("flow_grpo", "exact"):
        tr = _trainer(kl_beta=0.1, kl_form=form, steps_per_iteration=2)
        m = tr.train_step(batch, ROLLOUT_MBS, iteration=0)
        assert m["train/optimizer_steps"] == 2
        kls[form] = m["train/kl"]
    assert kls["flow_grpo"] > 0
    sigmas = make_sigmas(10, 1.0)
    dt = float(sigmas[0] - sigmas[1])
    assert kls["exact"] / kls["flow_grpo"] == pytest.approx(1.0 / dt, rel=1e-4)


# ------------------------------------------------------------------ minibatches


def test_minibatch_split_is_consecutive_and_complete():
    mbs = [[0], [1], [2], [3, 4, 5]]
    assert _minibatches(mbs, 1) == [mbs]
    assert _minibatches(mbs, 2) == [[[0], [1]], [[2], [3, 4, 5]]]
    parts = _minibatches(mbs, 3)
    assert [r for p in parts for mb in p for r in mb] == list(range(6))
    assert _minibatches([[0]], 2) == [[], [[0]]]


@pytest.mark.procs
def test_first_minibatch_is_on_policy_later_ones_are_not(pg):
    batch = make_rollout(SpotlightConfig(sampler=SamplerConfig(sde_window_size=1)))
    tr = _trainer(steps_per_iteration=2, clip_range=1e-6)
    m = tr.train_step(batch, ROLLOUT_MBS, iteration=0)
    assert m["train/optimizer_steps"] == 2
    assert m["train/ratio_max_dev"] == 0.0  # exactly: recomputed with the rollout weights
    assert m["train/offpolicy_ratio_max_dev"] > 0.0  # not forced to 1 after the first step
    assert m["train/clipfrac"] > 0.0  # so the clip acts


# ------------------------------------------------------------------ non-finite


def test_non_finite_sample_is_dropped_and_counted():
    from spotlight.core.request_scheduler import RequestKind
    from spotlight.rl.batch import Sample, trainable_samples

    def sample(i, reward=1.0, bad=False):
        wl = torch.zeros(3, 4, 2)
        if bad:
            wl[1, 2, 0] = float("inf")
        return Sample(
            f"r{i}",
            RequestKind.ROLLOUT,
            0,
            0,
            0,
            i,
            "b",
            torch.zeros(3, 2, 2, dtype=torch.uint8),
            window_latents=wl,
            log_probs=torch.zeros(2),
            reward=reward,
        )

    kept, counts = trainable_samples([sample(0), sample(1, bad=True), sample(2, reward=float("nan")), sample(3)])
    assert [s.request_id for s in kept] == ["r0", "r3"]
    assert counts == {"nonfinite_reward": 1, "nonfinite_latents": 1}


@pytest.mark.procs
def test_non_finite_step_never_reaches_the_weights(pg):
    """One overflowed latent in the batch: the gradient norm is not finite, so the optimizer
    step is skipped (weights and optimizer state untouched) and counted."""
    batch = make_rollout(SpotlightConfig(sampler=SamplerConfig(sde_window_size=1)))
    batch["window_latents"][1, 0, 3, 0] = float("inf")
    tr = _trainer()
    before = tr.full_state_dict()
    m = tr.train_step(batch, ROLLOUT_MBS, iteration=0)
    assert m["train/skipped_steps"] == 1 and m["train/optimizer_steps"] == 0
    after = tr.full_state_dict()
    assert not _states_differ(before, after)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not tr.optimizer.state  # AdamW moments never saw the non-finite gradient
    # the next, clean batch trains normally
    clean = make_rollout(SpotlightConfig(sampler=SamplerConfig(sde_window_size=1)))
    m2 = tr.train_step(clean, ROLLOUT_MBS, iteration=1)
    assert m2["train/optimizer_steps"] == 1 and m2["train/skipped_steps"] == 0
    assert _states_differ(before, tr.full_state_dict())


# ------------------------------------------------------------------ zero-std filter, SDE window


def test_zero_std_filter_drops_constant_groups():
    from spotlight.rl.batch import zero_std_filter

    adv = np.array([0.0, 0.0, 1.0, -1.0, 0.0, 0.0])
    keep = zero_std_filter(adv, [0, 0, 1, 1, 2, 2])
    assert keep.tolist() == [False, False, True, True, False, False]
    # all constant: one group is kept so the update is not empty (its advantages are 0)
    assert zero_std_filter(np.zeros(4), [0, 0, 1, 1]).tolist() == [True, True, False, False]


def test_random_sde_window_is_deterministic_and_in_range():
    cfg = SamplerConfig(num_steps=10, sde_window_size=2, sde_window_range=(0, 5))
    starts = [cfg.window_start_for(0, n) for n in range(40)]
    assert starts == [cfg.window_start_for(0, n) for n in range(40)]
    assert set(starts) <= {0, 1, 2, 3} and len(set(starts)) > 1
    assert SamplerConfig(sde_window_start=2, sde_window_size=2).window_start_for(0, 7) == 2
    s = Sampler(cfg, (4, 3)).with_window(3)
    assert s.window_start == 3 and s.eta(3) > 0 and s.eta(5) == 0
    with pytest.raises(ValueError):
        Sampler(cfg, (4, 3)).with_window(8)
