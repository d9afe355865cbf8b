"""Stale-weight ranking study (paper §3.2.1, Insight 1, Fig. 5).

Spotlight explores seeds with the stale weights v_n while training produces v_{n+1},
then rolls the selected seeds out under v_{n+1}. That only pays off if the within-group
reward ranking of seeds survives the weight update. This module measures it: for each
pair of checkpoints (v_n, v_{n+1}) it generates the same prompts × seeds under both
(rollout kind, full fidelity), ranks the seeds of each prompt group by reward under
each version, and reports

* the within-group Spearman ρ between the two reward vectors, averaged over prompts
  (and its std over prompts);
* the rank-vs-rank heat map: ``counts[i, j]`` = how many seeds ranked ``i`` under v_n
  (exploration rank) are ranked ``j`` under v_{n+1} (generation rank); 0 = best;
* the fraction of seeds that the seed bank's top-k / bottom-k selection picks under
  v_n that it would also pick under v_{n+1} (when ``num_seeds`` exceeds the group size).

``spotlight bench stale-ranking`` drives it on a finished run directory.
"""

from __future__ import annotations

import math
import pathlib
import time
from typing import Callable, Sequence

import numpy as np

from spotlight.config import SpotlightConfig
from spotlight.core.seed_bank import derive_seed, select_top_bottom
from spotlight.studies.profiling import spearman


def rank_within_groups(rewards) -> np.ndarray:
    """Rank of each seed within its prompt group, 0 = highest reward.

    Args:
        rewards: ``[P, S]`` rewards (one row per prompt group).

    Returns:
        ``[P, S]`` int64 ranks; ties are broken by seed index (earlier = better), NaN
        rewards rank last.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"expected [P, S] rewards, got shape {r.shape}")
    key = np.where(np.isnan(r), np.inf, -r)
    order = np.argsort(key, axis=1, kind="stable")
    ranks = np.empty(r.shape, dtype=np.int64)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(r.shape[1]), r.shape).copy(), axis=1)
    return ranks


def rank_heatmap(ranks_a, ranks_b, num_seeds: int) -> np.ndarray:
    """``[S, S]`` counts: ``counts[i, j]`` = seeds ranked ``i`` under a and ``j`` under b."""
    a = np.asarray(ranks_a, dtype=np.int64).ravel()
    b = np.asarray(ranks_b, dtype=np.int64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"rank arrays differ in size: {a.size} vs {b.size}")
    if a.size and (min(a.min(), b.min()) < 0 or max(a.max(), b.max()) >= num_seeds):
        raise ValueError(f"ranks must lie in [0, {num_seeds})")
    counts = np.zeros((num_seeds, num_seeds), dtype=np.int64)
    np.add.at(counts, (a, b), 1)
    return counts


def group_spearman(rewards_a, rewards_b) -> np.ndarray:
    """Per-prompt Spearman ρ between two ``[P, S]`` reward arrays (NaN for a constant group)."""
    a = np.asarray(rewards_a, dtype=np.float64)
    b = np.asarray(rewards_b, dtype=np.float64)
    return np.array([spearman(list(a[p]), list(b[p])) for p in range(a.shape[0])])


def selection_overlap(rewards_a, rewards_b, seeds, group_size: int) -> float:
    """Mean fraction of the top-k/bottom-k seeds picked under a that are also picked under b.

    NaN when there are no more seeds per group than ``group_size`` (then every seed is
    picked either way) or the group size is odd.
    """
    a = np.asarray(rewards_a, dtype=np.float64)
    b = np.asarray(rewards_b, dtype=np.float64)
    if a.shape[1] <= group_size or group_size % 2 or group_size < 2:
        return float("nan")
    fracs = []
    for p in range(a.shape[0]):
        sa = set(select_top_bottom(seeds[p], list(a[p]), group_size))
        sb = set(select_top_bottom(seeds[p], list(b[p]), group_size))
        if sa:
            fracs.append(len(sa & sb) / len(sa))
    return float(np.mean(fracs)) if fracs else float("nan")


def rho_text(mean: float, std: float, num_valid: int, num_groups: int) -> str:
    """A Spearman ρ as the output says it: ``mean ± std``, or why there is none (every prompt
    group's rewards tied under a version, so no rank correlation exists), with the groups left
    out for tied rewards. Pure; never ``nan``."""
    if num_valid == 0:
        return f"undefined: the rewards tied within each of the {num_groups} prompt groups under a version"
    left = num_groups - num_valid
    note = f", {left} left out: rewards tied" if left else ""
    return f"{mean:.3f} ± {std:.3f} ({num_valid} of {num_groups} prompt groups{note})"


def _finite_stats(values) -> tuple[float, float, int]:
    v = np.asarray([x for x in np.asarray(values, dtype=np.float64).ravel() if math.isfinite(x)])
    if v.size == 0:
        return float("nan"), float("nan"), 0
    return float(v.mean()), float(v.std()), int(v.size)


def generate_rewards(
    cfg: SpotlightConfig,
    executor,
    version: int,
    cond,
    prompt_indices: Sequence[int],
    seeds: Sequence[Sequence[int]],
    reward_fn,
    prompts: Sequence[str] | None = None,
) -> np.ndarray:
    """``[P, S]`` rewards of ``prompt_indices`` × ``seeds[p]`` rolled out under ``version``.

    Full-fidelity rollout requests, batched at ``cfg.cluster.worker_batch_size``, the way
    :func:`spotlight.studies.profiling.run_profile` drives :class:`RolloutExecutor`; ``cond`` is the
    prompts' :class:`~spotlight.rl.sampler.Conditioning` as the run's family encodes them (every
    tensor: negative prompt, pooled embeddings).
    """
    from spotlight import protocol as P
    from spotlight.store.tensor_wire import unpack_tensors

    flat = [(p, s) for p, row in zip(prompt_indices, seeds) for s in row]
    bs = max(1, cfg.cluster.worker_batch_size)
    rewards: list[float] = []
    for start in range(0, len(flat), bs):
        chunk = flat[start : start + bs]
        idx = [p for p, _ in chunk]
        items = [
            P.LeaseItem(
                lease_id=i,
                request_id=f"v{version}-{start + i}",
                kind="rollout",
                iteration=version,
                prompt_index=p,
                seed=s,
                weight_version=version,
                params={},
            )
            for i, (p, s) in enumerate(chunk)
        ]
        tensors = cond.index(idx).to_tensors()
        out = executor.run("stale-ranking", P.Leases(worker_id="stale-ranking", items=items), tensors)
        msg, frames = out.result
        imgs = unpack_tensors(msg.tensors, frames)["images"].numpy()
        rewards += reward_fn(imgs, [prompts[p] for p in idx] if prompts is not None else [""] * len(imgs))
    return np.asarray(rewards, dtype=np.float64).reshape(len(prompt_indices), -1)


def run_stale_ranking(
    cfg: SpotlightConfig,
    cond,
    weights: list[dict],
    prompt_indices: Sequence[int],
    num_seeds: int,
    progress: Callable[[str], object] = print,
    *,
    versions: Sequence[int] | None = None,
    pairs: Sequence[tuple[int, int]] | None = None,
    seed_tag: str = "stale-ranking",
    prompts: Sequence[str] | None = None,
) -> dict:
    """Rank agreement between consecutive weight versions on the same prompts and seeds.

    Args:
        prompts: prompt text of each conditioning row, for rewards that read it (None = empty).
        cfg: run config (model, sampler, reward, worker batch size, group size, LoRA settings).
        cond: the prompts' :class:`~spotlight.rl.sampler.Conditioning` (the family's encoding).
        weights: versions of consecutive iterations (oldest first): whole transformers, or
            adapters in a LoRA run (over the checkpoint's frozen base).
        prompt_indices: rows of ``embeds`` to use (P prompt groups).
        num_seeds: seeds per prompt group (S); the same seeds for every version.
        progress: called with one line per generated version and one per pair (its ρ in words
            where every group's rewards tied: :func:`rho_text`).
        versions: labels of ``weights`` (default ``0, 1, …``), reported in the result.
        pairs: ``(stale, updated)`` indices into ``weights`` (default: each adjacent pair).
            Each version is generated once and reused by every pair it belongs to.

    Returns:
        JSON-able dict: ``pairs`` (per pair: versions, ``rho_mean``, ``rho_std``,
        ``rho_per_prompt``, ``near_diagonal_frac``, ``selection_overlap``, ``heatmap``),
        ``overall`` (ρ mean/std over every prompt of every pair) and the pooled
        ``heatmap``.

    Raises:
        WeightVersionError: one of ``weights`` is no weight version of the run's transformer
            (another model size, LoRA rank, or no name of it), before anything is sampled.
    """
    from spotlight.models.lora import lora_spec
    from spotlight.rewards.reward_fn import RewardFn
    from spotlight.studies.profiling import check_versions, profile_device
    from spotlight.workers.rollout.worker import RolloutExecutor

    if len(weights) < 2:
        raise ValueError("need at least two weight versions")
    if num_seeds < 2:
        raise ValueError("need at least two seeds per prompt")
    labels = list(versions) if versions is not None else list(range(len(weights)))
    if len(labels) != len(weights):
        raise ValueError(f"{len(labels)} version labels for {len(weights)} weight sets")
    pair_idx = list(pairs) if pairs is not None else [(i, i + 1) for i in range(len(weights) - 1)]
    prompt_indices = [int(p) for p in prompt_indices]
    seeds = [[derive_seed(seed_tag, p, k) for k in range(num_seeds)] for p in prompt_indices]
    # weights of another model size or LoRA rank: one line before any sampling, not torch's traceback
    check_versions(cfg, weights, [f"weight version v{v}" for v in labels], cond.embeds.shape[-1])

    ex = RolloutExecutor(
        cfg.model, cfg.sampler, text_dim=cond.embeds.shape[-1], lora=lora_spec(cfg.train), device=profile_device()
    )
    reward_fn = RewardFn(cfg.reward)
    cache: dict[int, np.ndarray] = {}

    def rewards_of(i: int) -> np.ndarray:
        if i not in cache:
            t0 = time.perf_counter()
            ex.add_version(labels[i], weights[i])
            cache[i] = generate_rewards(cfg, ex, labels[i], cond, prompt_indices, seeds, reward_fn, prompts)
            progress(
                f"v{labels[i]}: {cache[i].size} samples in {time.perf_counter() - t0:.1f}s, "
                f"reward mean {np.nanmean(cache[i]):.4f} "
                f"(within-group std {np.nanmean(np.nanstd(cache[i], axis=1)):.4f})"
            )
        return cache[i]

    group_size = cfg.data.group_size
    pooled = np.zeros((num_seeds, num_seeds), dtype=np.int64)
    all_rhos: list[float] = []
    rows = []
    for a, b in pair_idx:
        ra, rb = rewards_of(a), rewards_of(b)
        row, rhos, heat = _compare_pair(ra, rb, seeds, group_size, num_seeds)
        pooled += heat
        all_rhos += list(rhos)
        rows.append({"stale_version": labels[a], "updated_version": labels[b], **row})
        rho = rho_text(row["rho_mean"], row["rho_std"], row["num_valid_prompts"], len(prompt_indices))
        progress(f"v{labels[a]} -> v{labels[b]}: Spearman ρ {rho}")
    mean, std, n = _finite_stats(all_rhos)
    return {
        "num_prompts": len(prompt_indices),
        "num_seeds": num_seeds,
        "prompt_indices": prompt_indices,
        "group_size": group_size,
        "pairs": rows,
        "overall": {
            "rho_mean": mean,
            "rho_std": std,
            "num_valid": n,
            "near_diagonal_frac": _near_diagonal_frac(pooled),
            "selection_overlap": _finite_stats([r["selection_overlap"] for r in rows])[0],
        },
        "heatmap": pooled.tolist(),
    }


def _near_diagonal_frac(counts: np.ndarray) -> float:
    """Fraction of a rank heat map's seeds whose rank moved by at most one place."""
    i, j = np.indices(counts.shape)
    return float(counts[np.abs(i - j) <= 1].sum() / max(1, counts.sum()))


def _compare_pair(ra: np.ndarray, rb: np.ndarray, seeds, group_size: int, num_seeds: int):
    """One (stale, updated) pair of ``[P, S]`` rewards: ``(row, per-prompt rho, heat map)``;
    ``row`` is the pair's result entry without its version labels."""
    rhos = group_spearman(ra, rb)
    heat = rank_heatmap(rank_within_groups(ra), rank_within_groups(rb), num_seeds)
    mean, std, n = _finite_stats(rhos)
    row = {
        "rho_mean": mean,
        "rho_std": std,
        "num_valid_prompts": n,
        "rho_per_prompt": [float(x) for x in rhos],
        "near_diagonal_frac": _near_diagonal_frac(heat),
        "selection_overlap": selection_overlap(ra, rb, seeds, group_size),
        "reward_mean_stale": float(np.nanmean(ra)),
        "reward_mean_updated": float(np.nanmean(rb)),
        "heatmap": heat.tolist(),
    }
    return row, rhos, heat


def plot_heatmap(counts, path: str | pathlib.Path, title: str = "") -> None:
    """Paper Fig. 5 style heat map.

    x = exploration rank under the stale weights v_n, y = generation rank under the
    updated weights v_{n+1}; darker = more seeds. ``counts[i, j]`` is indexed
    (exploration rank, generation rank) as returned by :func:`rank_heatmap`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = np.asarray(counts, dtype=np.float64)
    s = c.shape[0]
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    im = ax.imshow(c.T, origin="lower", cmap="Blues", interpolation="nearest", extent=(0.5, s + 0.5, 0.5, s + 0.5))
    ax.set_xlabel("Exploration rank under stale $v_n$ (1 = best)")
    ax.set_ylabel("Generation rank under updated $v_{n+1}$ (1 = best)")
    ticks = sorted(set([1] + list(range(0, s + 1, max(1, s // 8)))[1:] + [s]))
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    if title:
        ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="count")
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
