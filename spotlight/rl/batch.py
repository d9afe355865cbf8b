"""RL batch assembly: from an iteration's scored rollout samples to one update per Train Worker.

Pure functions over tensors (no sockets, files or clocks), called by the coordinator between
ROLLOUT and TRAIN (docs/architecture.md §3)::

    samples (DONE, scored)  ──▶ trainable_samples     non-finite rewards / latents / log-probs out
                            ──▶ group_advantages      (r - mean_group) / std  (spotlight.rl.grpo)
                            ──▶ zero_std_filter       groups whose advantages are all 0 out (optional)
                            ──▶ rank_batches          micro-batches = rollout batches, dealt to ranks

Micro-batches keep the composition the samples had at rollout (one per rollout batch), so the
trainer's first recompute of the log-probs is bit-identical to the rollout's and its first
policy ratio is exactly 1 (docs/flow-grpo.md §1.5).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np
import torch

from spotlight.core.request_scheduler import RequestKind
from spotlight.rl.grpo import group_advantages
from spotlight.rl.sampler import Conditioning

__all__ = ["RankBatch", "Sample", "TrainingBatches", "build_training_batches", "trainable_samples", "zero_std_filter"]


@dataclasses.dataclass
class Sample:
    """One finished request's outputs, kept until the iteration is trained on.

    ``image``: ``[3, S, S] uint8``; ``window_latents``: ``[W + 1, C, H, W'] float32`` and
    ``log_probs``: ``[W] float32`` (the SDE window's latents and per-step log-probs), kept only
    for requests the update may use (:func:`keeps_window`); the others, exploration candidates,
    keep no image either once it is handed to the reward (``image`` None: at real sizes the
    candidates of an iteration would hold tens of GiB of images on the coordinator only to be
    ranked by reward; docs/planning.md)."""

    request_id: str
    kind: RequestKind
    iteration: int
    slot: int
    prompt_index: int
    seed: int
    batch_id: str
    image: torch.Tensor | None
    window_latents: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    computed_steps: int = 0
    reward: float | None = None
    window_start: int = 0
    reused_as_rollout: bool = False
    """An exploration candidate selected as part of its iteration's rollout (the
    verl-omni-spot baseline, params ``as_rollout``): trained on, shown in the sample grid."""

    @property
    def in_rollout(self) -> bool:
        """Part of the rollout of its iteration: a rollout request, or a candidate reused as one."""
        return self.kind == RequestKind.ROLLOUT or self.reused_as_rollout


def result_sample(req, slot: int, prompt_index: int, batch_id: str, tensors: dict, i: int, window_start: int):
    """``(sample, image)`` of row ``i`` of a RESULT's ``tensors`` for request ``req``: the
    :class:`Sample` the coordinator keeps and the ``uint8`` image to score. A request the update
    may use (:func:`keeps_window`) keeps its image, window latents and log-probs; an exploration
    candidate keeps neither (its ``image`` is None: only its reward ranks it). ``window_start``:
    ``sampler.sde_window_start``, unless the request's params name another."""
    image = tensors["images"][i]
    s = Sample(req.request_id, req.kind, req.iteration, slot, prompt_index, req.seed, batch_id, image)
    s.window_start = int(req.params.get("sde_window_start", window_start))
    if keeps_window(req):  # a rollout, or a candidate that may become the rollout (verl-omni-spot)
        s.window_latents, s.log_probs = tensors["window_latents"][i], tensors["log_probs"][i]
    else:
        s.image = None
    return s, image.numpy()


def keeps_window(req) -> bool:
    """A request whose window latents and log-probs are kept for training: a rollout, or an
    exploration candidate of the verl-omni-spot baseline (params ``as_rollout``), whose
    selected candidates are the rollout."""
    return req.kind == RequestKind.ROLLOUT or bool(req.params.get("as_rollout"))


def trainable_samples(samples: list[Sample]) -> tuple[list[Sample], dict[str, int]]:
    """Samples the update may use: a finite reward AND finite window latents and log-probs.

    A non-finite latent or log-prob (an overflowed rollout) would make the loss, then every
    weight, non-finite after one step; such samples are dropped here, next to the reward filter.

    Returns:
        ``(kept samples, {"nonfinite_reward": n, "nonfinite_latents": m})``.
    """
    kept, counts = [], {"nonfinite_reward": 0, "nonfinite_latents": 0}
    for s in samples:
        if s.reward is None or not math.isfinite(s.reward):
            counts["nonfinite_reward"] += 1
        elif (s.window_latents is not None and not bool(torch.isfinite(s.window_latents).all())) or (
            s.log_probs is not None and not bool(torch.isfinite(s.log_probs).all())
        ):
            counts["nonfinite_latents"] += 1
        else:
            kept.append(s)
    return kept, counts


def zero_std_filter(advantages: np.ndarray, groups: list[int]) -> np.ndarray:
    """Flow-GRPO's filter (``train_sd3.py``): keep-mask ``[N] bool`` that drops every group whose
    advantages are all exactly 0 (all rewards equal), keeping at least one group if all are."""
    adv = np.asarray(advantages)
    g = np.asarray(groups)
    keep = np.ones(len(adv), dtype=bool)
    for gid in np.unique(g):
        idx = g == gid
        if np.all(adv[idx] == 0.0):
            keep[idx] = False
    if not keep.any() and len(adv):
        keep[g == g[0]] = True  # an empty update would stall; the zero advantages add no gradient
    return keep


@dataclasses.dataclass
class RankBatch:
    """One Train Worker's share: ``micro_batches`` index rows of ``tensors`` (window latents,
    log-probs, advantages, window starts, conditioning, and one ``pad.cond.*`` row for a rank
    without samples: its padding passes need shapes)."""

    micro_batches: list[list[int]]
    tensors: dict[str, torch.Tensor]


@dataclasses.dataclass
class TrainingBatches:
    """The update of one iteration: a :class:`RankBatch` per rank and what was left out."""

    ranks: list[RankBatch]
    num_samples: int
    num_micro_batches: int
    dropped: dict[str, int]
    """``nonfinite_reward``, ``nonfinite_latents``, ``zero_std`` (samples left out)."""

    def metrics(self) -> dict[str, float]:
        """The ``train/*`` counts of the metrics row."""
        return {
            "train/nonfinite_samples": float(self.dropped["nonfinite_latents"]),
            "train/nonfinite_rewards": float(self.dropped["nonfinite_reward"]),
            "train/zero_std_filtered": float(self.dropped["zero_std"]),
        }


def build_training_batches(
    samples: list[Sample],
    cond: Conditioning,
    *,
    world_size: int,
    advantage_std: str,
    filter_zero_std_groups: bool,
) -> TrainingBatches:
    """Filter, compute group advantages, and deal the rollout batches to ``world_size`` ranks
    (rank r gets batches r, r + world, ...). ``advantage_std``: ``train.advantage_std``."""
    finite, dropped = trainable_samples(samples)
    slots = [s.slot for s in finite]
    adv = group_advantages([s.reward for s in finite], slots, std=advantage_std) if finite else np.zeros(0)
    dropped["zero_std"] = 0
    if filter_zero_std_groups and finite:
        keep = zero_std_filter(adv, slots)
        dropped["zero_std"] = len(finite) - int(keep.sum())
        finite = [s for s, k in zip(finite, keep) if k]
        adv = adv[keep]
    by_batch: dict[str, list[int]] = collections.defaultdict(list)
    for i, s in enumerate(finite):
        by_batch[s.batch_id].append(i)
    batches = list(by_batch.values())
    ranks = [_rank_batch(finite, adv, batches[rank::world_size], cond) for rank in range(world_size)]
    return TrainingBatches(ranks, len(finite), len(batches), dropped)


def _rank_batch(finite: list[Sample], adv: np.ndarray, mine: list[list[int]], cond: Conditioning) -> RankBatch:
    rows = [i for b in mine for i in b]
    local, pos = [], 0
    for b in mine:
        local.append(list(range(pos, pos + len(b))))
        pos += len(b)
    tensors = cond.index([0]).to_tensors(prefix="pad.cond.")
    if rows:
        tensors.update(
            {
                "window_latents": torch.stack([finite[i].window_latents for i in rows]),
                "log_probs": torch.stack([finite[i].log_probs for i in rows]),
                "advantages": torch.tensor([adv[i] for i in rows], dtype=torch.float32),
                "window_start": torch.tensor([finite[i].window_start for i in rows], dtype=torch.int64),
            }
        )
        tensors.update(cond.index([finite[i].prompt_index for i in rows]).to_tensors())
    return RankBatch(local, tensors)
