"""The RL lab: Spotlight's Flow-GRPO iteration in one process, for tuning a recipe in minutes.

``spotlight up --local`` runs an iteration across a coordinator, agents, Rollout Workers and
Train Workers that talk over ZeroMQ; that is what a deployment needs and what a recipe sweep
does not. The lab runs the same pieces in one process, one after another:

1. **Rollout** of batch ``n`` on weights ``v_n``: the batch's prompts (the coordinator's seeded
   epoch order, ``data.shuffle_seed``), the seed bank's seeds for each prompt group (selected
   ones where batch ``n`` was explored, default seeds otherwise), the project's
   :class:`~spotlight.rl.sampler.Sampler` (SDE window, per-step log-probs) with the family's
   velocity, one micro-batch per prompt group, then the run's reward
   (:class:`~spotlight.rewards.reward_fn.RewardFn`).
2. **Stale exploration** of batch ``n + 1`` on ``v_n`` (Spotlight, paper §4.2): ``d`` candidate
   seeds per explored prompt (every slot but the ``data.num_control_prompts`` control slots),
   scored, and the seed bank's top-k / bottom-k selection
   (:meth:`~spotlight.core.seed_bank.SeedBank.record_exploration`). In a real run this
   overlaps training on the spot GPUs; here it runs before the update, on the same weights.
3. **Update** ``v_n → v_{n+1}``: :func:`~spotlight.rl.batch.build_training_batches` (group
   advantages, filters) and :meth:`FlowGRPOTrainer.train_step
   <spotlight.workers.train.train_worker.FlowGRPOTrainer.train_step>` on a one-rank process
   group (gloo, in this process).
4. **Held-out evaluation** every ``eval_every`` iterations: ODE samples of the shapes task's
   test prompts with fixed seeds, strict and partial GenEval-style scores
   (:mod:`spotlight.tasks.shapes.evaluate`).

Beside the run's own metrics it logs what a recipe search needs: the reward of every scored
candidate (the population) next to the selected groups' reward, the update's size (relative
parameter change, approximate KL, clip fraction, gradient norm) and the images' statistics
(:func:`~spotlight.core.collapse_guard.image_stats`).

Not modelled: the Planner (the lab explores a fixed ``d``, or none), streamed extra
candidates, timing, preemption. With exploration off, its rollouts are those of
``spotlight up --local`` on the same config (same prompts, seeds and weights), which
``benchmarks/rl_lab.py --check-against-up`` verifies.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Callable

import numpy as np
import torch

from spotlight.config import SpotlightConfig


@dataclasses.dataclass
class LabSettings:
    """What the lab adds to a run config.

    Attributes:
        explore_candidates: ``d`` candidate seeds per explored prompt (0: no exploration).
        eval_every: held-out evaluation after every N iterations (and of the base model); 0 = none.
        eval_seeds: seeds per test prompt.
        eval_prompts_path: the held-out prompts (default: the shapes task's test set).
        threads: torch intra-op threads.
        gradients_only: measure, do not learn: each iteration's gradient (the trained
            parameters, flattened, after clipping) is kept in :attr:`LabResult.gradients` and
            the step is not taken, so every iteration's batch is drawn and scored at the
            initial weights: independent draws of the update direction, for
            :func:`gradient_agreement`. Needs ``train.steps_per_iteration = 1`` (one gradient
            per whole batch); an iteration whose gradient norm is not finite keeps none (the
            trainer skips that step), so fewer gradients than iterations can come back.
    """

    explore_candidates: int = 0
    eval_every: int = 5
    eval_seeds: int = 16
    eval_prompts_path: str = ""
    threads: int = 1
    gradients_only: bool = False


@dataclasses.dataclass
class LabResult:
    """One lab run: a metrics row per iteration and the held-out evaluations."""

    rows: list[dict]
    evals: list[dict]
    seconds: float
    gradients: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """With :attr:`LabSettings.gradients_only`: one float64 vector per iteration (its whole batch)."""
    gradient_layout: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    """With :attr:`LabSettings.gradients_only`: ``(parameter name, numel)`` of each slice of a
    gradient vector, in order (for :func:`gradient_agreement_by_part`)."""


def _stacked(gradients: list[torch.Tensor]) -> torch.Tensor:
    """``[B, D]`` float64 rows of the gradients, checked."""
    if len(gradients) < 2:
        raise ValueError(f"gradient_agreement needs at least 2 gradients, got {len(gradients)}")
    if len({t.numel() for t in gradients}) != 1:
        raise ValueError("gradient_agreement: the gradients have different lengths")
    return torch.stack([t.double().reshape(-1) for t in gradients])


def _cosines(g: torch.Tensor) -> torch.Tensor:
    unit = g / g.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return unit @ unit.T


def cosine_matrix(gradients: list[torch.Tensor]) -> torch.Tensor:
    """``[B, B]`` float64 cosines between the gradient vectors.

    Raises:
        ValueError: fewer than two vectors, or vectors of different lengths.
    """
    return _cosines(_stacked(gradients))


def gradient_agreement(gradients: list[torch.Tensor]) -> dict[str, float]:
    """How much of a batch's policy gradient is signal: cosines between independent draws.

    Let ``g`` be the expected gradient of the loss the trainer minimises (Flow-GRPO's clipped
    surrogate with group-centred advantages, not the gradient of the expected reward itself),
    ``n`` the samples per batch and ``Σ`` one sample's gradient covariance. For
    independent batch estimates ``ĝ_i = g + noise_i``, ``E[ĝ_i·ĝ_j] = |g|²`` (``i ≠ j``) and
    ``E|ĝ_i|² = |g|² + tr Σ / n``. In high dimension the norms concentrate, so the mean
    pairwise cosine ``c`` estimates ``|g|² / (|g|² + tr Σ / n)``: the signal's share of one
    batch gradient's squared norm. Averaging ``T`` such gradients gives a signal-to-noise
    ratio (of squared norms) of ``T·c / (1 − c)``, so ``(1 − c) / c`` plain-SGD steps before an
    update's direction is as much signal as noise. Adam rescales each coordinate and its
    momentum averages about ten steps, so for the trainer this count is a guide to the order
    of magnitude, not a bound.

    Args:
        gradients: ``B ≥ 2`` gradient vectors of equal length, drawn independently at the
            same weights (:attr:`LabSettings.gradients_only`).

    Returns:
        ``pairwise_cos_mean`` (``c``) and ``pairwise_cos_se``, its jackknife standard error
        over the ``B`` draws (pairs that share a draw are correlated, so an error over the
        pairs would be too small; NaN for ``B < 3``); ``halves_cos``, the cosine between the
        mean of the first ``h1 = B // 2`` draws and the mean of the other ``h2``, and
        ``halves_cos_expected = c·√(h1·h2) / √((1 + (h1 − 1)c)(1 + (h2 − 1)c))``, what it
        should be if ``c`` is real; ``signal_share_upper`` (``max(c + 2·se, 0)``) and
        ``steps_for_snr1_lower`` (``(1 − c_hi) / c_hi`` with that bound: the fewest steps the
        measurement allows at about 2 standard errors; inf when the bound is 0; both NaN
        for ``B < 3``).

    Raises:
        ValueError: fewer than two vectors, or vectors of different lengths.
    """
    g = _stacked(gradients)
    cos = _cosines(g)
    b = len(cos)
    iu = torch.triu_indices(b, b, offset=1)
    pairs = float(cos[iu[0], iu[1]].sum())
    n_pairs = b * (b - 1) / 2
    c = pairs / n_pairs
    se = math.nan
    if b >= 3:
        off_diag_rows = cos.sum(dim=1) - cos.diagonal()  # each draw's pairs
        leave_one_out = (pairs - off_diag_rows) / (n_pairs - (b - 1))
        se = float(math.sqrt((b - 1) / b * float(((leave_one_out - leave_one_out.mean()) ** 2).sum())))
    h1 = b // 2
    h2 = b - h1
    first, rest = g[:h1].mean(0), g[h1:].mean(0)
    halves = float(first @ rest / (first.norm() * rest.norm()).clamp_min(1e-300))
    denominator = (1.0 + (h1 - 1) * c) * (1.0 + (h2 - 1) * c)
    expected = c * math.sqrt(h1 * h2) / math.sqrt(denominator) if denominator > 0 else math.nan
    c_hi = max(c + 2.0 * se, 0.0) if math.isfinite(se) else math.nan
    if math.isnan(c_hi):
        steps = math.nan
    else:
        steps = (1.0 - c_hi) / c_hi if c_hi > 0 else math.inf
    return {
        "num_gradients": float(b),
        "pairwise_cos_mean": c,
        "pairwise_cos_se": se,
        "halves_cos": halves,
        "halves_cos_expected": expected,
        "signal_share_upper": c_hi,
        "steps_for_snr1_lower": steps,
        "grad_norm_mean": float(g.norm(dim=1).mean()),
    }


def gradient_part(name: str) -> tuple[str, str]:
    """The two parts a trained parameter belongs to: its block (``"block 3"``, or ``"other"``
    outside the transformer blocks) and its module within a block, LoRA's and peft's wrapping
    left out (``"attn.to_v"``, ``"img_mlp.net.2"``)."""
    n = re.sub(r"\.(lora_[AB]|lora_embedding_[AB])(\.[A-Za-z0-9_]+)?\.weight$", "", name)
    n = re.sub(r"\.base_layer", "", n).removeprefix("base_model.model.")
    m = re.search(r"transformer_blocks\.(\d+)\.(.+)$", n)
    if m is None:
        return "other", re.sub(r"\.(weight|bias)$", "", n)
    return f"block {m.group(1)}", re.sub(r"\.(weight|bias)$", "", m.group(2))


def gradient_agreement_by_part(
    gradients: list[torch.Tensor], layout: list[tuple[str, int]]
) -> dict[str, dict[str, float]]:
    """:func:`gradient_agreement` of each block's and each module's slice of the gradients: where
    a batch gradient's signal is, if anywhere (a part whose slices agree when the whole does not
    is where LoRA would learn fastest: ``train.lora_target_modules``).

    Args:
        gradients: as for :func:`gradient_agreement`.
        layout: ``(parameter name, numel)`` per slice, in the vectors' order
            (:attr:`LabResult.gradient_layout`); names are grouped by :func:`gradient_part`.

    Returns:
        ``{"block 0": {...}, ..., "module attn.to_v": {...}, ...}``: each part's agreement
        dict plus ``numel`` and ``norm_share`` (its share of the gradients' summed squared
        norm; the shares of the blocks, and of the modules, each sum to 1). Parameters whose
        gradient is zero in every draw (LoRA's A matrices while B is zero) are left out.

    Raises:
        ValueError: as :func:`gradient_agreement`, or a layout whose sizes do not add up to
            the vectors' length.
    """
    g = _stacked(gradients)
    if sum(n for _, n in layout) != g.shape[1]:
        raise ValueError(
            f"gradient_agreement_by_part: the layout covers {sum(n for _, n in layout)} values, "
            f"the gradients have {g.shape[1]}"
        )
    total = float((g**2).sum())
    slices: dict[str, list[tuple[int, int]]] = {}
    offset = 0
    for name, n in layout:
        span = (offset, offset + n)
        offset += n
        if not bool(g[:, span[0] : span[1]].any()):
            continue
        block, module = gradient_part(name)
        slices.setdefault(block, []).append(span)
        slices.setdefault(f"module {module}", []).append(span)
    out = {}
    for part in sorted(slices, key=lambda k: (k.startswith("module"), _natural(k))):
        sub = torch.cat([g[:, a:b] for a, b in slices[part]], dim=1)
        out[part] = {
            **gradient_agreement(list(sub)),
            "numel": float(sub.shape[1]),
            "norm_share": float((sub**2).sum()) / total if total > 0 else math.nan,
        }
    return out


def _natural(key: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _init_single_process_group() -> bool:
    """A world-size-1 gloo process group for the trainer's collectives, unless one is up; True
    when this call made it (the caller then takes it down)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


class _Rollouts:
    """Sampling and scoring of prompt groups with the current weights."""

    def __init__(self, cfg: SpotlightConfig, family, model, cond_all, prompts, metadata):
        from spotlight.rewards.reward_fn import RewardFn
        from spotlight.rl.sampler import Sampler

        self.cfg = cfg
        self.family = family
        self.model = model
        self.cond_all = cond_all
        self.prompts = prompts
        self.metadata = metadata
        self.sampler = Sampler(
            cfg.sampler, family.latent_shape, family.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
        )
        self.velocity_fn = family.make_velocity_fn(model)
        self.reward = RewardFn(cfg.reward)

    @torch.no_grad()
    def run(self, prompt_index: int, seeds: list[int], window_start: int | None = None) -> dict:
        """Denoise ``seeds`` for one prompt in batches of ``cluster.worker_batch_size`` rows."""
        sampler = self.sampler.with_window(window_start)
        size = self.cfg.cluster.worker_batch_size
        images, windows, log_probs = [], [], []
        for start in range(0, len(seeds), size):
            part = seeds[start : start + size]
            cond = self.cond_all.index([prompt_index] * len(part))
            state = sampler.run(sampler.initial_state(part), self.velocity_fn, cond)
            images.append(self.family.decode(state.latents))
            windows.append(torch.stack(state.window_latents, dim=1))
            log_probs.append(torch.stack(state.log_probs, dim=1))
        img = torch.cat(images).numpy()
        n = len(seeds)
        rewards = self.reward(img, [self.prompts[prompt_index]] * n, [self.metadata[prompt_index]] * n)
        return {
            "images": img,
            "window_latents": torch.cat(windows),
            "log_probs": torch.cat(log_probs),
            "rewards": [float(r) for r in rewards],
            "batches": [list(range(s, min(s + size, len(seeds)))) for s in range(0, len(seeds), size)],
        }


def _param_vector(model) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            parts.append(t.detach().float().reshape(-1).cpu())
    return torch.cat(parts) if parts else torch.zeros(0)


@torch.no_grad()
def _policy_shift(trainer, rb, max_micro_batches: int = 2) -> dict[str, float]:
    """How far one update moved the policy on its own samples: the window log-probs of the first
    ``max_micro_batches`` rollout batches recomputed with the new weights against those stored at
    rollout (``update/kl`` = 0.5·mean Δlogp², ``update/ratio_spread`` = std of the ratio, in
    element-mean log-prob units as the loss uses them). The first minibatch's ratio before the
    step is exactly 1 (``train/ratio_max_dev``); this is the ratio the *next* step would see."""
    from spotlight.rl.sampler import Conditioning

    deltas = []
    for mb in rb.micro_batches[:max_micro_batches]:
        idx = torch.as_tensor(mb)
        t = {key: v[idx] for key, v in rb.tensors.items() if not key.startswith("pad.")}
        cond = Conditioning.from_tensors(t)
        sampler = trainer.sampler.with_window(int(t["window_start"][0]) if "window_start" in t else None)
        new, _ = sampler.window_log_probs(trainer.velocity_fn, t["window_latents"].float(), cond)
        deltas.append((new - t["log_probs"].float()).reshape(-1))
    if not deltas:
        return {}
    dl = torch.cat(deltas).double()
    return {
        "update/kl": float(0.5 * (dl**2).mean()),
        "update/ratio_spread": float(torch.exp(dl).std()),
        "update/max_ratio_dev": float((torch.exp(dl) - 1).abs().max()),
    }


def run_lab(
    cfg: SpotlightConfig,
    settings: LabSettings,
    *,
    progress: Callable[[str], None] | None = None,
) -> LabResult:
    """Run ``cfg.run.iterations`` lab iterations (see the module docstring).

    Returns:
        Per-iteration rows (``iteration`` 0-based, ``reward/mean`` of the trained rollout,
        ``reward/population_mean`` over every candidate scored for the batch, ``train/*``,
        ``update/rel_change``, ``image/*``, ``time/*``) and evaluations (``iteration`` = the
        number of updates before it, ``strict``, ``partial``, ``per_task``).

    The process group it needs is taken down at the end when it made it, so a lab run leaves
    the process as it found it.
    """
    import torch.distributed as dist

    made_group = _init_single_process_group()
    try:
        return _run_lab(cfg, settings, progress=progress)
    finally:
        if made_group:
            dist.destroy_process_group()


def _run_lab(cfg: SpotlightConfig, settings: LabSettings, *, progress: Callable[[str], None] | None) -> LabResult:
    from spotlight.coordinator.coordinator import build_core
    from spotlight.core.collapse_guard import image_stats
    from spotlight.core.request_scheduler import RequestKind, RequestScheduler
    from spotlight.core.seed_bank import SeedBank, candidate_seeds
    from spotlight.models.families import get_family
    from spotlight.rl.batch import Sample, build_training_batches
    from spotlight.tasks.prompts import load_prompt_set
    from spotlight.workers.train.train_worker import FlowGRPOTrainer

    say = progress or (lambda s: None)
    torch.set_num_threads(settings.threads)
    t_start = time.monotonic()
    family = get_family(cfg.model)
    pset = load_prompt_set(cfg.data.prompts_path)
    prompts = list(pset.prompts)
    metadata = list(pset.metadata) if getattr(pset, "metadata", None) else [{} for _ in prompts]
    unique = sorted(set(prompts))
    row_of = {p: i for i, p in enumerate(unique)}
    cond_unique = family.encode_prompts(unique)
    cond_all = cond_unique.index([row_of[p] for p in prompts])
    if settings.gradients_only and cfg.train.steps_per_iteration != 1:
        raise ValueError(
            "the lab's gradients_only keeps one gradient per whole batch: it needs train.steps_per_iteration = 1, "
            f"not {cfg.train.steps_per_iteration}"
        )
    trainer = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"))
    gradients: list[torch.Tensor] = []
    layout: list[tuple[str, int]] = []
    if settings.gradients_only:

        def keep_and_drop(optimizer, args, kwargs) -> None:
            # keep this step's gradient, then clear it so that the optimizer skips every
            # parameter: the weights (and the optimizer state) stay as they are
            params = [p for group in optimizer.param_groups for p in group["params"]]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            grads = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in grads]  # FSDP2's DTensors
            gradients.append(torch.cat([t.detach().double().reshape(-1) for t in grads]))
            if not layout:
                name_of = {id(p): n for n, p in trainer.model.named_parameters()}
                layout.extend(
                    (name_of.get(id(p), f"param{i}"), t.numel()) for i, (p, t) in enumerate(zip(params, grads))
                )
            for p in params:
                p.grad = None

        trainer.optimizer.register_step_pre_hook(keep_and_drop)
    rollouts = _Rollouts(cfg, family, trainer.model, cond_all, prompts, metadata)
    k = cfg.data.group_size
    bank = SeedBank(cfg.run.seed, k)
    # the coordinator's own iteration core: its prompt order, control slots and SDE windows
    core = build_core(cfg, RequestScheduler(), bank, None, num_prompts=len(prompts))
    batch_prompts, is_control = core.batch_prompts, core.settings.is_control
    n_control = cfg.data.num_control_prompts
    d = settings.explore_candidates
    population: dict[int, list[float]] = {}
    explore_groups: dict[int, list[tuple[float, float]]] = {}  # batch -> (candidates' std, selected std)

    def explore(n_next: int) -> None:
        if d <= 0:
            return
        for slot, pidx in enumerate(batch_prompts(n_next)):
            if is_control(slot):
                continue
            seeds = candidate_seeds(cfg.run.seed, n_next, slot, d)
            res = rollouts.run(pidx, seeds)
            population.setdefault(n_next, []).extend(res["rewards"])
            picked = set(bank.record_exploration(n_next, slot, seeds, res["rewards"], required=d))
            chosen = [r for s_, r in zip(seeds, res["rewards"]) if s_ in picked]
            explore_groups.setdefault(n_next, []).append((float(np.std(res["rewards"])), float(np.std(chosen))))

    evals: list[dict] = []
    specs = None
    if settings.eval_every > 0:
        from spotlight.tasks.shapes import evaluate as ev

        specs = ev.read_prompts(settings.eval_prompts_path) if settings.eval_prompts_path else ev.read_prompts()

    def evaluate(after: int) -> None:
        from spotlight.tasks.shapes import evaluate as ev

        t0 = time.monotonic()
        res = ev.evaluate(trainer.model, cfg.model, cfg.sampler, specs, num_seeds=settings.eval_seeds)
        evals.append(
            {
                "iteration": after,
                "strict": res.overall,
                "partial": res.partial,
                "per_task": res.per_task,
                **{k2: v for k2, v in image_stats(list(res.images)).items()},
                "time_s": round(time.monotonic() - t0, 2),
            }
        )
        say(f"eval after {after} iterations: strict {res.overall:.3f} partial {res.partial:.3f}")

    if specs is not None:
        evaluate(0)
    rows = []  # batch 0 is never explored (there is no v_{-1} training window to hide it in)
    for n in range(cfg.run.iterations):
        t0 = time.monotonic()
        samples: list[Sample] = []
        images, rewards, group_stds = [], [], []
        win_start = core.sampler_params(n).get("sde_window_start")
        for slot, pidx in enumerate(batch_prompts(n)):
            seeds, _ = bank.seeds_for(n, slot)
            res = rollouts.run(pidx, seeds, win_start)
            images.extend(res["images"])
            rewards.extend(res["rewards"])
            group_stds.append(float(np.std(res["rewards"])))
            for b, rows_b in enumerate(res["batches"]):
                for i in rows_b:
                    samples.append(
                        Sample(
                            request_id=f"{n}-{slot}-{i}",
                            kind=RequestKind.ROLLOUT,
                            iteration=n,
                            slot=slot,
                            prompt_index=pidx,
                            seed=seeds[i],
                            batch_id=f"{slot}-{b}",
                            image=torch.from_numpy(res["images"][i]),
                            window_latents=res["window_latents"][i],
                            log_probs=res["log_probs"][i],
                            reward=res["rewards"][i],
                            window_start=win_start if win_start is not None else cfg.sampler.sde_window_start,
                        )
                    )
        t_roll = time.monotonic() - t0
        t1 = time.monotonic()
        if n + 1 < cfg.run.iterations:
            explore(n + 1)
        t_explore = time.monotonic() - t1
        before = _param_vector(trainer.model)
        t2 = time.monotonic()
        batches = build_training_batches(
            samples,
            cond_all,
            world_size=1,
            advantage_std=cfg.train.advantage_std,
            filter_zero_std_groups=cfg.train.filter_zero_std_groups,
        )
        rb = batches.ranks[0]
        metrics = trainer.train_step(rb.tensors, rb.micro_batches, iteration=n)
        t_train = time.monotonic() - t2
        moved = _policy_shift(trainer, rb)
        after = _param_vector(trainer.model)
        rel = float((after - before).norm() / max(float(before.norm()), 1e-12)) if before.numel() else 0.0
        pop, ex = population.get(n, []), explore_groups.get(n, [])
        row = {
            "iteration": n,
            "reward/mean": float(np.mean(rewards)),
            "reward/std": float(np.std(rewards)),
            "reward/control_mean": float(np.mean(rewards[-n_control * k :])) if n_control else math.nan,
            "reward/population_mean": float(np.mean(pop)) if pop else math.nan,
            "update/rel_change": rel,
            **moved,
            "groups/rollout_std": float(np.mean(group_stds)),
            "groups/rollout_zero_std": float(np.mean([g == 0.0 for g in group_stds])),
            "groups/candidates_std": float(np.mean([a for a, _ in ex])) if ex else math.nan,
            "groups/selected_std": float(np.mean([b for _, b in ex])) if ex else math.nan,
            **{key: float(v) for key, v in metrics.items()},
            **batches.metrics(),
            **image_stats(images),
            "time/rollout_s": round(t_roll, 2),
            "time/explore_s": round(t_explore, 2),
            "time/train_s": round(t_train, 2),
        }
        rows.append(row)
        explored = f"(population {row['reward/population_mean']:+.3f}) " if pop else ""
        say(
            f"iter {n + 1}/{cfg.run.iterations} reward {row['reward/mean']:+.3f} "
            f"{explored}grad {row.get('train/grad_norm', math.nan):.3g} "
            f"Δθ {rel:.2e} speckle {row['image/speckle']:.3f}  "
            f"rollout {t_roll:.0f}s explore {t_explore:.0f}s train {t_train:.0f}s"
        )
        if specs is not None and ((n + 1) % settings.eval_every == 0 or n + 1 == cfg.run.iterations):
            evaluate(n + 1)
    return LabResult(
        rows=rows, evals=evals, seconds=time.monotonic() - t_start, gradients=gradients, gradient_layout=layout
    )
