"""Offline profiling for the Planner (paper §4.3.1, §6.8).

``spotlight profile`` measures, for the run's model and sampler:

* ``t_step_s``: seconds per (sequence × denoising step) of one Rollout Worker at the
  worker batch size, per worker kind and SP degree (``"cpu/sp1"``, ``"cuda/sp2"``…);
* for each First-Block-Cache threshold: the mean number of denoising steps whose
  transformer tail actually ran (effective steps s), and the exploration accuracy: the
  Spearman rank correlation, within each prompt group, between rewards of the cached
  exploration and of the full rollout for the same prompts and seeds (averaged over
  prompts).

The table is written as JSON (``spotlight profile --out PATH`` or ``--run-dir DIR``). A run uses
a profile only where it is told to, and says so on its console (:func:`load_profile`): the file
``explore.profile_path`` names, else ``RUN_DIR/profile.json``; with neither it measures t_step
online and explores without a cache. (Earlier versions also read a cache under
``~/.cache/spotlight`` that ``spotlight profile`` wrote by default, so one profiling run changed
the Planner of every later run of that config without a word; such a file is now only pointed
out: :func:`legacy_cache_path`.) The Planner refuses thresholds whose accuracy is below
``planner.min_exploration_accuracy``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import shlex
import time
from typing import Sequence

import msgspec

from spotlight.config import SpotlightConfig, resolve_path
from spotlight.core.planner import StepOption
from spotlight.net.ports import listen_port

PROFILE_VERSION = 1
RUN_DIR_PROFILE = "profile.json"
"""The profile a run directory may hold (used when ``explore.profile_path`` is not set)."""


@dataclasses.dataclass
class Profile:
    """A loaded profile table."""

    t_step_s: float
    """Seconds per sequence-step for the default worker kind (``cpu/sp1`` or ``cuda/sp1``)."""
    t_step_by_kind: dict[str, float]
    steps: list[dict]
    """Rows ``{"cache_threshold", "effective_steps", "accuracy", "num_prompts", "num_seeds"}``."""
    path: str = ""
    source: str = ""
    """Why this file: ``"explore.profile_path"`` or ``"the run directory"``."""
    config_key: str = ""
    """:func:`config_key` of the config it was measured for ("" = not recorded)."""
    created_unix_s: float | None = None

    def describe(self) -> str:
        """One console line: which profile the Planner uses, why, and what it says."""
        when = (
            time.strftime(" %Y-%m-%d %H:%M", time.localtime(self.created_unix_s))
            if self.created_unix_s is not None
            else ""
        )
        kind = next((k for k in ("cpu/sp1", "cuda/sp1") if k in self.t_step_by_kind), "")
        on = f" on {kind}" if kind else ""
        return (
            f"planner profile {self.path} (from {self.source}; measured{when}: t_step "
            f"{self.t_step_s * 1e3:.3g} ms per sequence-step{on}, {len(self.steps)} cache thresholds)"
        )

    def step_options(self) -> list[StepOption]:
        """The Planner's step options. A threshold whose accuracy could not be measured
        (``null``: every prompt's rewards were tied, e.g. a 0/1 reward) gets accuracy −1, so
        the Planner refuses it rather than trusting an unmeasured cache."""
        return [
            StepOption(
                float(r["cache_threshold"]),
                float(r["effective_steps"]),
                _accuracy(r.get("accuracy")),
                float(r["cost_steps"]) if r.get("cost_steps") else None,
            )
            for r in self.steps
        ]


def _accuracy(value) -> float:
    if value is None:
        return -1.0
    v = float(value)
    return v if math.isfinite(v) else -1.0


def config_key(cfg: SpotlightConfig) -> str:
    """Hash of the parts of the config a profile depends on (model, sampler, reward, batch)."""
    parts = {
        "model": msgspec.to_builtins(cfg.model),
        "sampler": msgspec.to_builtins(cfg.sampler),
        "reward": cfg.reward.kind,
        "batch": cfg.cluster.worker_batch_size,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def profile_mismatch(profile: Profile, cfg: SpotlightConfig) -> str | None:
    """Why ``profile`` may not describe a run of ``cfg`` (measured for another model, sampler,
    reward or worker batch size: :func:`config_key`), or None."""
    key = config_key(cfg)
    if not profile.config_key or profile.config_key == key:
        return None
    return (
        f"{profile.path} was measured for another model, sampler, reward or worker batch size "
        f"(config key {profile.config_key}; this run's is {key}): its step times and cache accuracies may not hold"
    )


def legacy_cache_path(cfg: SpotlightConfig) -> pathlib.Path:
    """Where ``spotlight profile`` of earlier versions wrote its profile by default (read by
    every later run of the same config, silently). No run reads it any more."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "spotlight" / f"profile-{config_key(cfg)}.json"


def profile_source(cfg: SpotlightConfig, run_dir: pathlib.Path | None) -> tuple[pathlib.Path, str] | None:
    """``(file, why)`` of the profile a run of ``cfg`` in ``run_dir`` uses: the file
    ``explore.profile_path`` names (``~`` expanded; relative to the working directory, else to
    the repository), else ``run_dir/profile.json`` if it exists, else None (no profile)."""
    if cfg.explore.profile_path:
        return resolve_path(cfg.explore.profile_path), "explore.profile_path"
    if run_dir is not None and (pathlib.Path(run_dir) / RUN_DIR_PROFILE).is_file():
        return pathlib.Path(run_dir) / RUN_DIR_PROFILE, "the run directory"
    return None


def load_profile(cfg: SpotlightConfig, run_dir: pathlib.Path | None = None) -> Profile | None:
    """The profile a run of ``cfg`` in ``run_dir`` uses (:func:`profile_source`), or None when it
    has none (the coordinator then measures t_step online and explores without a cache).

    Raises:
        SpotlightError: ``explore.profile_path`` names a missing file, or the file is not a profile.
    """
    from spotlight.errors import SpotlightError

    found = profile_source(cfg, run_dir)
    if found is None:
        return None
    path, source = found
    if not path.is_file():
        raise SpotlightError(
            f"explore.profile_path: file not found: {path} "
            f"(write it with `spotlight profile --out {shlex.quote(str(path))}`)"
        )
    errors = (ValueError, KeyError, TypeError, AttributeError, StopIteration)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not {"t_step_s", "steps"} <= set(data):
            raise ValueError("expected a JSON object with t_step_s and steps, as `spotlight profile` writes")
        kinds = {str(k): float(v) for k, v in data["t_step_s"].items()}
        steps = list(data["steps"])
        default = kinds.get("cpu/sp1") or kinds.get("cuda/sp1") or next(iter(kinds.values()))
        created = data.get("created_unix_s")
        profile = Profile(
            default,
            kinds,
            steps,
            str(path),
            source=source,
            config_key=str(data.get("config_key") or ""),
            created_unix_s=float(created) if isinstance(created, (int, float)) else None,
        )
    except errors as exc:
        raise SpotlightError(f"{path}: not a Spotlight profile ({exc})") from None
    try:
        options = profile.step_options()  # every row read now: a bad one is refused here, not at run time
    except errors as exc:
        what = f"a row of its steps lacks {exc}" if isinstance(exc, KeyError) else f"a row of its steps: {exc}"
        raise SpotlightError(f"{path}: not a Spotlight profile ({what})") from None
    if not options:
        raise SpotlightError(
            f"{path}: not a Spotlight profile (no steps; `spotlight profile` writes one row a threshold)"
        )
    return profile


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (scipy); nan when either side is constant."""
    from scipy.stats import spearmanr

    if len(set(a)) < 2 or len(set(b)) < 2:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def initial_version(cfg: SpotlightConfig, text_dim: int = 384) -> dict:
    """The weights a run of ``cfg`` starts from (version 0, what its Train Worker publishes
    first): the family's transformer (the checkpoint, or the tiny family's seeded build) in full
    fine-tuning; with LoRA the seeded initial adapter (``lora_B = 0``: the base model's output).

    Raises:
        ModelLoadError: the checkpoint cannot be loaded.
    """
    import torch

    from spotlight.models.families import get_family
    from spotlight.models.lora import add_lora, initial_adapter_state, lora_spec

    family = get_family(cfg.model, text_dim=text_dim)
    model = family.build_transformer(torch.float32)
    spec = lora_spec(cfg.train)
    if not spec:
        return model.state_dict()
    add_lora(model, spec, family.default_lora_targets, seed=cfg.model.init_seed)
    return initial_adapter_state(model, spec, seed=cfg.model.init_seed)


def version_layout(cfg: SpotlightConfig, text_dim: int | None = None):
    """The tensors a weight version of a run of ``cfg`` holds (what its Train Worker publishes and
    its Rollout Workers load, docs/architecture.md §7): every state-dict name and shape of the
    family's transformer (with the LoRA adapter of ``cfg.train`` where it has one), built from
    its config with every parameter on ``meta`` (no weights load, no memory), as an SP group
    checks a version it is handed.

    Args:
        text_dim: width of the tiny family's text embeddings (None: its text encoder's).

    Returns:
        :class:`spotlight.util.weights_file.VersionLayout`.

    Raises:
        ModelLoadError: the checkpoint's transformer config cannot be read.
        SpotlightError: the LoRA target modules match nothing.
    """
    from spotlight.models.families import get_family
    from spotlight.models.lora import add_lora, lora_spec
    from spotlight.util.weights_file import VersionLayout

    family = get_family(cfg.model, text_dim=text_dim)
    model = family.build_empty_transformer()
    spec = lora_spec(cfg.train)
    if spec:
        add_lora(model, spec, family.default_lora_targets, seed=cfg.model.init_seed)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    cls = family.transformer_class
    if spec:
        return VersionLayout(
            shapes=shapes,
            required=frozenset(n for n in shapes if "lora_" in n),
            what=f"LoRA adapter (rank {spec['rank']}) of {cls}",
            hint=f"an adapter of another rank or model? this run has train.lora_rank = {spec['rank']}",
        )
    return VersionLayout(
        shapes=shapes,
        required=frozenset(shapes),
        what=f"{cls} transformer (full fine-tuning)",
        hint="weights of another model size? the run's [model] section sets its shapes",
    )


def check_versions(
    cfg: SpotlightConfig, weights: Sequence[dict], labels: Sequence, text_dim: int | None = None
) -> None:
    """Every one of ``weights`` is a weight version of the run's transformer
    (:func:`version_layout`), checked before any model is built or sampled.

    Raises:
        WeightVersionError: one line naming the version (``labels``) and why it does not fit.
    """
    from spotlight.models.lora import WeightVersionError
    from spotlight.util.weights_file import version_problem

    layout = version_layout(cfg, text_dim)
    for label, sd in zip(labels, weights):
        problem = version_problem({n: tuple(t.shape) for n, t in sd.items()}, layout)
        if problem:
            raise WeightVersionError(f"{label}: {problem}")


def _sp_member(
    rank: int,
    world: int,
    port: int,
    model_cfg: dict,
    sampler_cfg: dict,
    lora: dict,
    state_dict_path: str,
    cond_path: str,
    repeats: int,
    out_q,
) -> None:
    """One rank of an SP profiling group (module-level so ``spawn`` can start it)."""
    import torch

    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from spotlight.config import ModelConfig, SamplerConfig
    from spotlight.rl.sampler import Conditioning, Sampler
    from spotlight.workers.sp import group as G

    mc = msgspec.convert(model_cfg, ModelConfig)
    sc = msgspec.convert(sampler_cfg, SamplerConfig)
    cond = Conditioning.from_tensors(load_file(cond_path))
    member = G.SPGroupMember(mc, f"profile/{rank}", torch.device("cpu"), text_dim=cond.embeds.shape[-1], lora=lora)
    sampler = Sampler(sc, member.family.latent_shape, member.family.sigmas(sc.num_steps, sc.shift))
    sd = load_file(state_dict_path) if rank == 0 else None
    member.form(
        G.GroupSpec(tuple(f"profile/{r}" for r in range(world)), "127.0.0.1", port, 1),
        state_dict=sd,
        version=0 if sd else None,
    )
    batch = len(cond)
    times = []
    for i in range(repeats + 1):  # the first batch warms up
        state = sampler.initial_state(list(range(batch))) if rank == 0 else None
        t0 = time.perf_counter()
        G.run_group_batch(member, sampler, state, cond)
        if i:
            times.append((time.perf_counter() - t0) / (batch * sampler.cfg.num_steps))
    if rank == 0:
        G.release_followers(member)
    else:
        G.serve_until_released(member)
    member.leave()
    if rank == 0:
        out_q.put(sorted(times)[len(times) // 2])


def profile_sp_t_step(cfg: SpotlightConfig, state_dict: dict, degree: int, cond, *, repeats: int = 2) -> float:
    """Seconds per (sequence × step) of an SP group of ``degree`` worker processes (diffusers
    context parallelism over gloo/NCCL) of the run's model family, at the worker batch size,
    on the first rows of ``cond`` (:class:`~spotlight.rl.sampler.Conditioning`, cycled to the batch).

    Raises:
        ValueError: the model cannot be split ``degree`` ways.
    """
    import tempfile

    import torch.multiprocessing as mp
    from safetensors.torch import save_file

    from spotlight.models.lora import lora_spec
    from spotlight.workers.sp.group import check_sp_degree

    check_sp_degree(cfg.model, degree, text_dim=cond.embeds.shape[-1])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = listen_port()
    rows = [i % len(cond) for i in range(cfg.cluster.worker_batch_size)]
    with tempfile.TemporaryDirectory() as d:
        path, cond_path = os.path.join(d, "w.safetensors"), os.path.join(d, "cond.safetensors")
        save_file({k: v.contiguous() for k, v in state_dict.items()}, path)
        save_file({k: v.contiguous() for k, v in cond.index(rows).to_tensors().items()}, cond_path)
        procs = [
            ctx.Process(
                target=_sp_member,
                args=(
                    r,
                    degree,
                    port,
                    msgspec.to_builtins(cfg.model),
                    msgspec.to_builtins(cfg.sampler),
                    lora_spec(cfg.train),
                    path,
                    cond_path,
                    repeats,
                    q,
                ),
            )
            for r in range(degree)
        ]
        for p in procs:
            p.start()
        try:
            result = q.get(timeout=900)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    return float(result)


def profile_device():
    """Where ``spotlight profile`` runs the model: the first CUDA device when there is one, else
    the CPU (the worker kind its t_step is recorded under)."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class _ProfileRunner:
    """One in-process :class:`RolloutExecutor` of the run's model family on the profiled
    weights (LoRA included), and the run's reward.

    Args:
        cfg: run config.
        cond: the prompts' :class:`~spotlight.rl.sampler.Conditioning` (the family's encoding).
        state_dict: the weights (version 0: the transformer, or the adapter with LoRA).
        prompts: prompt text per conditioning row, or None (rewards score empty prompts).
    """

    def __init__(self, cfg: SpotlightConfig, cond, state_dict: dict, prompts: Sequence[str] | None):
        from spotlight.models.lora import lora_spec
        from spotlight.rewards.reward_fn import RewardFn
        from spotlight.workers.rollout.worker import RolloutExecutor

        self.cond = cond
        self.prompts = prompts
        self.device = profile_device()
        self.ex = RolloutExecutor(
            cfg.model, cfg.sampler, text_dim=cond.embeds.shape[-1], lora=lora_spec(cfg.train), device=self.device
        )
        self.ex.add_version(0, state_dict)
        self.reward_fn = RewardFn(cfg.reward)
        self.bs = cfg.cluster.worker_batch_size

    @property
    def num_rows(self) -> int:
        return len(self.cond)

    def run(self, prompt_idx: list[int], seeds: list[int], threshold: float):
        """One batch at ``threshold`` (0: a full rollout): ``(images, computed steps per item, seconds)``."""
        from spotlight import protocol as P
        from spotlight.store.tensor_wire import unpack_tensors

        kind = "explore" if threshold > 0 else "rollout"
        items = [
            P.LeaseItem(
                lease_id=i,
                request_id=f"p{i}",
                kind=kind,
                iteration=0,
                prompt_index=p,
                seed=s,
                weight_version=0,
                params={"cache_threshold": threshold},
            )
            for i, (p, s) in enumerate(zip(prompt_idx, seeds))
        ]
        tensors = self.cond.index(list(prompt_idx)).to_tensors()
        t0 = time.perf_counter()
        out = self.ex.run("profile", P.Leases(worker_id="profile", items=items), tensors)
        dt = time.perf_counter() - t0
        msg, frames = out.result
        got = unpack_tensors(msg.tensors, frames)
        return got["images"].numpy(), [it.computed_steps for it in msg.items], dt

    def rewards_for(self, pairs: list[tuple[int, int]], threshold: float):
        """Rewards of ``(prompt, seed)`` pairs at ``threshold``, in worker batches:
        ``(rewards, mean computed steps, seconds)``."""
        import numpy as np

        bs = self.bs
        all_p = [p for p, _ in pairs]
        all_s = [s for _, s in pairs]
        rewards, steps, secs = [], [], 0.0
        for i in range(0, len(pairs), bs):
            imgs, comp, dt = self.run(all_p[i : i + bs], all_s[i : i + bs], threshold)
            rewards += self.reward_fn(
                imgs, [self.prompts[p] for p in all_p[i : i + bs]] if self.prompts is not None else [""] * len(imgs)
            )
            steps += comp
            secs += dt
        return np.array(rewards), float(np.mean(steps)), secs


def _measure_t_steps(
    runner: _ProfileRunner, cfg: SpotlightConfig, state_dict: dict, sp_degrees: Sequence[int], progress
) -> dict[str, float]:
    """``t_step_s`` per worker kind: the median of 3 full-fidelity worker batches (after one
    warm-up) for SP 1, then a real SP group per degree > 1."""
    import numpy as np

    from spotlight.core.seed_bank import derive_seed
    from spotlight.workers.sp.degrees import degree_problem, sp_shape

    bs = runner.bs
    T = cfg.sampler.num_steps
    prompt_idx = [i % runner.num_rows for i in range(bs)]
    seeds = [derive_seed("profile-tstep", i) for i in range(bs)]
    runner.run(prompt_idx, seeds, 0.0)
    times = []
    for _ in range(3):
        _, _, dt = runner.run(prompt_idx, seeds, 0.0)
        times.append(dt / (bs * T))
    t_step = float(np.median(times))
    device = runner.device.type
    progress(f"t_step = {t_step * 1e3:.2f} ms per sequence-step ({device}, SP 1, batch {bs})")
    t_steps = {f"{device}/sp1": t_step}
    shape = None
    for k in sorted(set(int(d) for d in sp_degrees if int(d) > 1)):
        shape = shape or sp_shape(runner.ex.family)
        problem = degree_problem(shape, k)
        if problem:
            progress(f"SP {k}: not measured ({problem})")
            continue
        t_steps[f"{device}/sp{k}"] = profile_sp_t_step(cfg, state_dict, k, runner.cond)
        progress(
            f"t_step = {t_steps[f'{device}/sp{k}'] * 1e3:.2f} ms per sequence-step "
            f"({device}, SP {k} group of {k} processes, batch {bs})"
        )
    return t_steps


def _accuracy_rows(
    runner: _ProfileRunner, T: int, thresholds: Sequence[float], num_prompts: int, num_seeds: int, progress
) -> list[dict]:
    """The threshold table: the full rollout (threshold 0), then per threshold its effective
    steps, measured cost and mean per-prompt Spearman accuracy against the full rollout."""
    import numpy as np

    from spotlight.core.seed_bank import derive_seed

    pairs = [(p, derive_seed("profile", p, k)) for p in range(num_prompts) for k in range(num_seeds)]
    full, _, full_s = runner.rewards_for(pairs, 0.0)
    rows = [
        {
            "cache_threshold": 0.0,
            "effective_steps": float(T),
            "cost_steps": float(T),
            "accuracy": 1.0,
            "num_prompts": num_prompts,
            "num_seeds": num_seeds,
        }
    ]
    for thr in sorted(set(float(t) for t in thresholds if t > 0)):
        cached, eff, secs = runner.rewards_for(pairs, thr)
        rhos = [
            spearman(cached[p * num_seeds : (p + 1) * num_seeds], full[p * num_seeds : (p + 1) * num_seeds])
            for p in range(num_prompts)
        ]
        rhos = [r for r in rhos if r == r]
        # no prompt with untied rewards: the ranking accuracy is unknown (JSON null, refused)
        acc = float(np.mean(rhos)) if rhos else None
        # a cached step still runs the head block + embeddings: measure its real cost
        cost = float(T) * secs / full_s
        rows.append(
            {
                "cache_threshold": thr,
                "effective_steps": eff,
                "cost_steps": max(cost, eff),
                "accuracy": acc,
                "num_prompts": num_prompts,
                "num_seeds": num_seeds,
            }
        )
        acc_txt = f"{acc:.3f}" if acc is not None else "unknown (every prompt's rewards tied; refused)"
        progress(
            f"threshold {thr:.3f}: {eff:.2f} effective steps of {T} "
            f"(cost {cost:.2f} full-step equivalents), accuracy (Spearman) {acc_txt}"
        )
    return rows


def run_profile(
    cfg: SpotlightConfig,
    cond,
    *,
    thresholds: Sequence[float],
    num_prompts: int,
    num_seeds: int,
    state_dict: dict | None = None,
    sp_degrees: Sequence[int] = (1,),
    progress=print,
    prompts: Sequence[str] | None = None,
) -> dict:
    """Measure t_step and the threshold → (effective steps, accuracy) table for the run's model
    family (its transformer, its conditioning, LoRA or full weights).

    Args:
        cfg: run config (model, sampler, reward, worker batch size, LoRA settings).
        cond: the prompts' :class:`~spotlight.rl.sampler.Conditioning`, as the family encodes
            them (:func:`spotlight.models.families.cached_conditioning`; the first
            ``num_prompts`` rows are used).
        prompts: the prompt text of each conditioning row, for rewards that read it (the shapes
            task's GenEval verdict); None scores with empty prompts (JPEG rewards).
        thresholds: First-Block-Cache thresholds to try (0 is always included: it is the
            full rollout the others are compared with). A family without First Block Cache
            (SD3) gets the full-rollout row only.
        num_prompts, num_seeds: prompts and seeds per prompt for the accuracy estimate.
        state_dict: weights to profile (default: the run's version 0, :func:`initial_version`).
        sp_degrees: SP degrees whose t_step is measured (> 1 spawns a real group; a degree the
            model cannot be split by is skipped with a note).

    Returns:
        The JSON-able profile dict.

    Raises:
        WeightVersionError: ``state_dict`` is no weight version of the run's transformer
            (:func:`check_versions`).
    """
    from spotlight.config import STEP_CACHE_FAMILIES

    if state_dict is None:
        state_dict = initial_version(cfg, cond.embeds.shape[-1])
    else:  # weights of another model size or LoRA rank: one line, not torch's size-mismatch traceback
        check_versions(cfg, [state_dict], ["the profiled weights"], cond.embeds.shape[-1])
    if cfg.model.family not in STEP_CACHE_FAMILIES and any(t > 0 for t in thresholds):
        progress(f"{cfg.model.family}: no First Block Cache, so only the full rollout is profiled")
        thresholds = []
    runner = _ProfileRunner(cfg, cond, state_dict, prompts)
    t_steps = _measure_t_steps(runner, cfg, state_dict, sp_degrees, progress)
    rows = _accuracy_rows(runner, cfg.sampler.num_steps, thresholds, num_prompts, num_seeds, progress)
    return {
        "version": PROFILE_VERSION,
        "config_key": config_key(cfg),
        "created_unix_s": time.time(),
        "family": cfg.model.family,
        "t_step_s": t_steps,
        "steps": rows,
    }
