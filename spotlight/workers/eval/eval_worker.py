"""The Eval Worker: one weight version on the run's fixed held-out panel (docs/evaluation.md).

Started by the coordinator (``python -m spotlight.workers.eval --run-dir RUN --version N
--iteration I``) every ``eval.every`` iterations, on the reserved side, while the next
iteration trains. It

1. reads the run's ``config.toml`` and builds the panel: ``eval.num_prompts`` prompts evenly spaced through
   ``eval.prompts_path`` × ``eval.num_seeds`` seeds from
   :data:`~spotlight.tasks.shapes.evaluate.EVAL_SEED_BASE` (far from every training seed), the
   same at every evaluation of the run;
2. encodes the panel's prompts with the family's text encoder (cached like the training
   prompts: the encoder loads only on the first evaluation of a panel);
3. builds the family's transformer (LoRA: the frozen base plus the adapter), loads version N
   from the Tensor Store's file (memory-mapped) and samples every panel image with the
   deterministic flow-matching ODE (Euler over the run's sigma schedule, the family's own
   guidance; Flow-GRPO evaluates with ODE sampling too);
4. scores the images with the task's reward (``[reward]``: built-in or the reward server) and,
   for the shapes task, GenEval's strict verdict per task kind;
5. writes ``eval/iter_NNNN.json`` (``eval/*`` scores) and ``eval/iter_NNNN.png`` (the panel:
   one row per prompt, one column per seed, comparable across iterations) atomically, and with
   ``eval.keep_best`` replaces ``best/`` when the score beats ``best/best.json``'s (docs/evaluation.md).

The coordinator reads the JSON when the process has exited; a failed evaluation is a warning,
never a stop of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import time

import numpy as np
import torch

from spotlight.config import SpotlightConfig, load_config, resolve_path
from spotlight.util.atomic_file import replace_dir_atomic, write_text_atomic

log = logging.getLogger("spotlight.eval")


@dataclasses.dataclass(frozen=True)
class Panel:
    """The fixed evaluation panel: one row per ``(prompt, seed)``, prompt-major; ``tags`` the
    shapes task kind of each prompt ("" when the task has none)."""

    prompts: list[str]
    seeds: list[int]
    tags: list[str]
    metadata: list[dict] = dataclasses.field(default_factory=list)
    """Per row, its prompt's record fields from the prompt file (sent to the reward with each image)."""

    @property
    def unique_prompts(self) -> list[str]:
        return list(dict.fromkeys(self.prompts))


def eval_prompts(cfg: SpotlightConfig) -> tuple[list[str], list[dict]]:
    """``eval.num_prompts`` prompts evenly spaced through ``eval.prompts_path`` (or the shapes
    test set; all of them when it has fewer), and their records' other fields.

    Raises:
        ConfigError: the file is missing, malformed or empty.
    """
    from spotlight.tasks.prompts import load_prompt_set
    from spotlight.tasks.shapes import world

    path = resolve_path(cfg.eval.prompts_path) if cfg.eval.prompts_path else world.TEST_PROMPTS_PATH
    ps = load_prompt_set(path, source="eval.prompts_path")
    total = len(ps.prompts)
    n = min(cfg.eval.num_prompts, total)
    picks = [i * total // n for i in range(n)]  # evenly spaced through the file: every part of it
    return [ps.prompts[i] for i in picks], [dict(ps.metadata[i]) for i in picks]


def build_panel(cfg: SpotlightConfig) -> Panel:
    """:class:`Panel` of ``cfg`` (see the module docstring)."""
    from spotlight.tasks.shapes.evaluate import EVAL_SEED_BASE

    prompts, meta = eval_prompts(cfg)
    tags = [""] * len(prompts)
    if cfg.reward.kind == "geneval_shapes":
        from spotlight.tasks.shapes import geneval

        tags = [geneval.parse_prompt(p).tag for p in prompts]
    k = cfg.eval.num_seeds
    return Panel(
        prompts=[p for p in prompts for _ in range(k)],
        seeds=[EVAL_SEED_BASE + j for _ in prompts for j in range(k)],
        tags=[t for t in tags for _ in range(k)],
        metadata=[m for m in meta for _ in range(k)],
    )


def eval_device(cfg: SpotlightConfig) -> torch.device:
    if cfg.eval.device != "auto":
        return torch.device(cfg.eval.device)
    if torch.cuda.is_available():
        gpus = cfg.cluster.reserved_rollout_gpus
        return torch.device("cuda", int(gpus[0]) if gpus else 0)
    return torch.device("cpu")


def load_policy(cfg: SpotlightConfig, state_dict: dict[str, torch.Tensor], device: torch.device):
    """``(family, transformer)``: the family's transformer with ``state_dict`` (a published
    version: the whole model, or with LoRA the adapter over the frozen base) on ``device``."""
    from spotlight.models.families import get_family
    from spotlight.models.families.base import torch_dtype
    from spotlight.models.lora import add_lora, load_version, lora_spec

    family = get_family(cfg.model)
    dtype = torch_dtype(cfg.model.dtype, device)
    model = family.build_transformer(dtype)
    spec = lora_spec(cfg.train)
    if spec:
        add_lora(model, spec, family.default_lora_targets, seed=cfg.model.init_seed)
        if dtype != torch.float32:
            model.to(dtype)
    load_version(model, state_dict)
    return family, model.to(device).eval()


@torch.no_grad()
def sample_panel(
    family, transformer, cfg: SpotlightConfig, cond_all, panel: Panel, device: torch.device
) -> tuple[np.ndarray, int]:
    """``([N, 3, H, W] uint8 images, non-finite)``: the panel's rows, Euler steps of the
    flow-matching ODE from :func:`~spotlight.rl.sampler.seeded_noise` of each seed (the family's
    guidance), and how many of them ended with a NaN or inf in their latents (decoded black, so
    scored as failures: :func:`nonfinite_note` says so)."""
    from spotlight.rl.sampler import seeded_noise

    sigmas = family.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
    row = {p: i for i, p in enumerate(panel.unique_prompts)}
    family.load_decoder(device, next(transformer.parameters()).dtype)
    out, nonfinite = [], 0
    bs = cfg.eval.batch_size
    for start in range(0, len(panel.prompts), bs):
        ps, ss = panel.prompts[start : start + bs], panel.seeds[start : start + bs]
        cond = cond_all.index(torch.tensor([row[p] for p in ps])).to(device)
        x = seeded_noise(ss, -1, family.latent_shape).to(device)
        for j in range(cfg.sampler.num_steps):
            sig = torch.full((x.shape[0],), float(sigmas[j]), device=device)
            v = family.velocity(transformer, x, sig, cond)
            x = x + (float(sigmas[j + 1]) - float(sigmas[j])) * v.float()
        nonfinite += int((~torch.isfinite(x.reshape(x.shape[0], -1)).all(dim=1)).sum())
        out.append(family.decode(x).cpu().numpy())
    return np.concatenate(out), nonfinite


def nonfinite_note(nonfinite: int, total: int, what: str = "panel") -> str | None:
    """The warning for ``nonfinite`` of ``total`` samples whose latents hold NaN or inf (None
    when there are none): their images are black and score 0, so the score is not the model's
    drawing but a numerical failure. Pure."""
    if not nonfinite:
        return None
    return (
        f"{nonfinite} of {total} {what} samples are not finite (NaN/inf latents): decoded black and scored 0; "
        "look at model.guidance_scale, sampler.shift and the weights"
    )


def score_panel(cfg: SpotlightConfig, images: np.ndarray, panel: Panel) -> tuple[dict[str, float], list[float]]:
    """``(scores, reward per image)``: ``eval/score`` (mean task reward) and, for the shapes
    task, ``eval/strict`` (GenEval's overall: the mean over task kinds of the strict verdict),
    ``eval/strict/<kind>`` and ``eval/partial``."""
    from spotlight.rewards.reward_fn import RewardFn

    rewards = RewardFn(cfg.reward)(images, panel.prompts, panel.metadata or None)
    out = {"eval/score": float(np.mean(rewards)), "eval/num_images": float(len(panel.prompts))}
    if cfg.reward.kind == "geneval_shapes":
        from spotlight.tasks.shapes import geneval

        both = geneval.verdicts(images, panel.prompts)
        strict = np.array([float(c) for c, _ in both])
        tags = np.array(panel.tags)
        kinds = {t: float(strict[tags == t].mean()) for t in dict.fromkeys(panel.tags)}
        out["eval/strict"] = float(np.mean(list(kinds.values())))
        out["eval/partial"] = float(np.mean([p for _, p in both]))
        out |= {f"eval/strict/{t}": v for t, v in kinds.items()}
    return out, [float(r) for r in rewards]


def write_grid(path: pathlib.Path, images: np.ndarray, panel: Panel, rewards: list[float], title: str) -> None:
    """The panel as a grid: one row per prompt (its text above), one column per seed."""
    from spotlight.util.plots import sample_grid

    slots = [panel.unique_prompts.index(p) for p in panel.prompts]
    labels = dict(enumerate(panel.unique_prompts))
    sample_grid(list(images), slots, rewards, path, title=title, labels=labels)


def _atomic_json(path: pathlib.Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")


def keep_best(run_dir: pathlib.Path, family, transformer, cfg: SpotlightConfig, result: dict, state_dict) -> bool:
    """Replace ``best/`` with this version when its ``eval/score`` beats ``best/best.json``'s (or,
    where a resume removed ``best/``, every other result on disk:
    :func:`~spotlight.coordinator.evaluation.score_to_beat`); written next to it, then swapped in
    (a crash leaves the old ``best/`` or the new one). ``best/`` has ``final/``'s layout: the
    diffusers transformer folder, or with LoRA ``pytorch_lora_weights.safetensors``, and the
    files' ``SHA256SUMS``. Returns True
    when replaced."""
    from spotlight.coordinator.evaluation import score_to_beat

    best = run_dir / "best"
    if not result["eval/score"] > score_to_beat(run_dir, int(result["iteration"])):
        return False
    from spotlight.models.lora import adapter_metadata, lora_spec
    from spotlight.util.weights_file import write_digests

    with replace_dir_atomic(best) as tmp:
        if lora_spec(cfg.train):
            adapter = {k.replace(".default.", "."): v.float() for k, v in state_dict.items()}
            family.save_lora(tmp, adapter, adapter_metadata(transformer))
        else:
            transformer.save_pretrained(str(tmp))
        _atomic_json(tmp / "best.json", result)
        write_digests(tmp)
    return True


def score_version(cfg: SpotlightConfig, state_dict, *, cache_dir: pathlib.Path):
    """``(scores, images, panel, rewards, family, transformer)`` of one published version
    (``state_dict``: :func:`~spotlight.store.tensor_wire.mmap_state_dict` of its file) on
    ``cfg``'s panel: what :func:`evaluate_version` writes, and what a post-hoc evaluation of a
    run's versions (``benchmarks/fig09_heldout_score.py``) computes for any family. Writes nothing."""
    from spotlight.models.families import cached_conditioning

    device = eval_device(cfg)
    panel = build_panel(cfg)
    family, transformer = load_policy(cfg, state_dict, device)
    cond = cached_conditioning(family, panel.unique_prompts, cache_dir)
    images, nonfinite = sample_panel(family, transformer, cfg, cond, panel, device)
    if (note := nonfinite_note(nonfinite, len(panel.prompts))) is not None:
        log.warning("%s", note)
    scores, rewards = score_panel(cfg, images, panel)
    scores["eval/nonfinite_samples"] = float(nonfinite)
    return scores, images, panel, rewards, family, transformer


def evaluate_version(run_dir: pathlib.Path, version: int, iteration: int, *, cache_dir: pathlib.Path) -> dict:
    """Evaluate weight ``version`` of the run in ``run_dir`` (see the module docstring) and
    return the scores written to ``eval/iter_NNNN.json`` (``iteration``: 0-based; the file is
    numbered from 1, like ``samples/``; the base model's evaluation is ``iter_0000``)."""
    from spotlight.store.tensor_wire import mmap_state_dict

    t0 = time.monotonic()
    cfg = load_config(run_dir / "config.toml")
    state_dict = mmap_state_dict(str(run_dir / "tensor_store" / "weights" / f"v{int(version)}.safetensors"))
    scores, images, panel, rewards, family, transformer = score_version(cfg, state_dict, cache_dir=cache_dir)
    result = {"iteration": int(iteration), "version": int(version)} | scores
    out = run_dir / "eval"
    out.mkdir(exist_ok=True)
    name = f"iter_{iteration + 1:04d}" if iteration >= 0 else "iter_0000"
    what = "base model" if iteration < 0 else f"iteration {iteration + 1}"
    write_grid(
        out / f"{name}.png",
        images,
        panel,
        rewards,
        title=f"held-out, {what} (v{version}): {result['eval/score']:.3f}",
    )
    if cfg.eval.keep_best:
        result["eval/is_best"] = float(keep_best(run_dir, family, transformer, cfg, result, state_dict))
    result["eval/elapsed_s"] = round(time.monotonic() - t0, 2)
    _atomic_json(out / f"{name}.json", result)
    return result


def main(argv: list[str] | None = None) -> int:
    from spotlight.util.procs import configure_logging

    ap = argparse.ArgumentParser(description="Spotlight Eval Worker (started by the coordinator)")
    ap.add_argument("--run-dir", required=True, type=pathlib.Path)
    ap.add_argument("--version", required=True, type=int)
    ap.add_argument("--iteration", required=True, type=int, help="0-based; -1 = the base model")
    ap.add_argument("--cache-dir", required=True, type=pathlib.Path, help="prompt-embedding cache")
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args(argv)
    configure_logging("eval", "eval")
    torch.set_num_threads(args.torch_threads)
    r = evaluate_version(args.run_dir, args.version, args.iteration, cache_dir=args.cache_dir)
    log.info("v%d: %s", args.version, {k: round(v, 4) for k, v in r.items() if isinstance(v, float)})
    return 0
