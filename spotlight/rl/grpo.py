"""Flow-GRPO objective: group advantages and the clipped policy-ratio loss.

Follows Flow-GRPO (Liu et al. 2025; ``flow_grpo/stat_tracking.py`` and
``scripts/train_sd3.py``; docs/flow-grpo.md §1.4–§1.5):

* advantage ``A_i = (r_i − mean_g) / (σ + 1e-4)`` with the group mean of the sample's
  prompt group g and σ either the batch std (Flow-GRPO ``global_std``) or the group's
  std; computed in float64; a group whose rewards are all equal gets exactly 0;
* ``ratio = exp(logp_new − logp_old)``;
  ``L = mean(max(−A·ratio, −A·clip(ratio, 1−ε, 1+ε)))`` over samples × window steps;
* optional KL to a reference policy, per step, in one of two forms (``train.kl_form``):
  Flow-GRPO's ``mean((μ_θ − μ_ref)²) / (2·std_dev_t²)`` (``train_sd3.py``; ``std_dev_t`` without
  the ``sqrt(−dt)`` factor, so its published β values apply), or the exact per-element Gaussian
  KL ``mean((μ_θ − μ_ref)²) / (2·(std_dev_t·sqrt(−dt))²)`` — larger by ``1/|dt|`` (4–25× at 10 steps).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import numpy as np
import torch

ADV_EPS = 1e-4


def group_advantages(
    rewards: Sequence[float],
    groups: Sequence[int],
    *,
    std: Literal["batch", "group"] = "batch",
) -> np.ndarray:
    """Per-prompt-group advantages.

    Args:
        rewards: N finite rewards.
        groups: N group ids (same id = same prompt in this batch).
        std: normaliser: ``"batch"`` (std of all N rewards) or ``"group"``.

    Returns:
        ``[N] float64`` advantages; exactly 0.0 for every member of a group whose
        rewards are all equal (also when the whole batch is constant).

    Raises:
        ValueError: length mismatch or a non-finite reward.
    """
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(groups)
    if r.shape != g.shape:
        raise ValueError(f"rewards {r.shape} and groups {g.shape} differ in length")
    if not np.all(np.isfinite(r)):
        raise ValueError("non-finite reward: filter NaN/inf samples before computing advantages")
    adv = np.zeros_like(r)
    batch_std = float(r.std()) if r.size else 0.0
    for gid in np.unique(g):
        idx = np.nonzero(g == gid)[0]
        vals = r[idx]
        if vals.max() == vals.min():
            continue  # all equal: exactly zero advantage
        denom = (float(vals.std()) if std == "group" else batch_std) + ADV_EPS
        adv[idx] = (vals - vals.mean()) / denom
    return adv


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped surrogate of Flow-GRPO.

    Args:
        log_probs: ``[B, S]`` float32 log-probs under the current weights (with grad).
        old_log_probs: ``[B, S]`` log-probs stored at rollout.
        advantages: ``[B]`` advantages (broadcast over the S window steps).
        clip_range: ε.
        adv_clip_max: advantages are clamped to ``[−adv_clip_max, adv_clip_max]``.

    Returns:
        ``(loss summed over B×S elements, stats)``; callers divide by the element count
        of the whole update (gradient accumulation). Stats are detached sums so callers can
        reduce across micro-batches and ranks: ``ratio_sum``, ``ratio_max_dev`` (max
        |ratio − 1|), ``clipped`` (elements outside the clip range), ``approx_kl``, ``count``.
    """
    adv = advantages.float().clamp(-adv_clip_max, adv_clip_max).unsqueeze(1).expand_as(log_probs)
    ratio = torch.exp(log_probs - old_log_probs.float())
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).sum()
    with torch.no_grad():
        stats = {
            "ratio_sum": ratio.sum(),
            "ratio_max_dev": (ratio - 1.0).abs().max(),
            "clipped": ((ratio - 1.0).abs() > clip_range).float().sum(),
            "approx_kl": 0.5 * ((log_probs - old_log_probs) ** 2).sum(),
            "count": torch.tensor(float(ratio.numel())),
        }
    return loss, stats


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: float) -> torch.Tensor:
    """Per-step KL surrogate summed over the batch: ``Σ_b mean((μ−μ_ref)²) / (2·std²)``.

    Args:
        mean, ref_mean: ``[B, *latent_shape]`` step means under the policy and the reference.
        std: the divisor: ``StepResult.std_dev_t`` for Flow-GRPO's form (``kl_form =
            "flow_grpo"``), ``StepResult.std`` (= ``std_dev_t·sqrt(−dt)``, the step's noise std)
            for the exact Gaussian KL (``"exact"``).

    Returns:
        Scalar float32 (callers divide by the update's element count).

    Raises:
        ValueError: ``std`` is not a positive finite number (KL exists only on SDE steps).
    """
    if std <= 0 or not math.isfinite(std):
        raise ValueError("KL is only defined on SDE steps (std > 0)")
    per = ((mean.float() - ref_mean.float()) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2.0 * std**2)
    return per.sum()
