"""Test-set evaluation on the shapes world: the GenEval-style score per task kind.

For each held-out test prompt (``spotlight/tasks/shapes/prompts/test.jsonl``) and each of
``num_seeds`` seeds, one image is sampled with the deterministic flow-matching ODE
(Euler, the run's ``sampler.num_steps`` and ``shift``; Flow-GRPO evaluates with ODE
sampling too) from the initial noise :func:`spotlight.rl.sampler.seeded_noise` gives that
seed, and scored with the *strict* verdict of :mod:`spotlight.tasks.shapes.geneval` (1 only if
every clause holds). The score of a task kind is its mean verdict; ``overall`` is the mean
over the six task kinds (GenEval's overall score).

Seeds start at :data:`EVAL_SEED_BASE`, far from the training seeds, so no evaluated
trajectory started from a seed the run sampled.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Callable

import numpy as np
import torch

from spotlight.config import ModelConfig, SamplerConfig
from spotlight.tasks.shapes import geneval, world

EVAL_SEED_BASE = 1_000_000_000


@dataclasses.dataclass
class EvalResult:
    """Scores of one model: ``per_task`` mean strict verdict by task kind, ``overall`` their
    mean; ``partial`` the mean partial credit; ``images`` ``[N, 3, H, W] uint8`` in
    prompt-major order (``num_seeds`` per prompt) and their ``verdicts``."""

    per_task: dict[str, float]
    overall: float
    per_task_prompts: dict[str, int]
    partial: float
    num_images: int
    images: np.ndarray
    verdicts: list[bool]
    prompts: list[str]

    def to_json(self) -> dict:
        return {
            "overall": self.overall,
            "per_task": self.per_task,
            "per_task_prompts": self.per_task_prompts,
            "partial_credit": self.partial,
            "num_images": self.num_images,
        }


def read_prompts(
    path: str | pathlib.Path = world.TEST_PROMPTS_PATH, *, source: str = "data.prompts_path"
) -> list[world.PromptSpec]:
    """Prompt specs of shapes-world captions from any prompt file ``data.prompts_path`` reads
    (GenEval-metadata JSONL like ``spotlight/tasks/shapes/prompts/test.jsonl``, CSV/TSV with a header,
    plain text; :func:`spotlight.tasks.prompts.load_prompt_set`). ``source`` names where the path
    came from in a missing-file error (``--prompts`` for ``spotlight eval``).

    Raises:
        ValueError: an unreadable or empty file (the message names file and line), or a
            prompt that is not a shapes-world caption (named by file and place, as ``spotlight
            up`` names it).
    """
    from spotlight.tasks.prompts import load_prompt_set

    try:
        prompts = load_prompt_set(path, source=source).prompts
    except Exception as exc:  # ConfigError and friends: one ValueError kind for callers
        raise ValueError(str(exc)) from None
    specs = []
    for i, p in enumerate(prompts):
        try:
            specs.append(geneval.parse_prompt(p))
        except ValueError as exc:
            raise ValueError(f"{path}: prompt {i + 1}: {exc}") from None
    return specs


@torch.no_grad()
def sample_ode(
    transformer,
    model_cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    prompts: list[str],
    seeds: list[int],
    *,
    batch_size: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Deterministic Euler sampling of the tiny family.

    Args:
        transformer: a ``QwenImageTransformer2DModel`` (eval mode).
        prompts, seeds: one image per ``(prompts[i], seeds[i])``.

    Returns:
        ``[N, 3, H, W] uint8`` images.
    """
    from spotlight.models.families import get_family
    from spotlight.rl.sampler import seeded_noise

    family = get_family(model_cfg)
    sigmas = family.sigmas(sampler_cfg.num_steps, sampler_cfg.shift)
    unique = sorted(set(prompts))
    cond_all = family.encode_prompts(unique)
    row = {p: i for i, p in enumerate(unique)}
    out = []
    for start in range(0, len(prompts), batch_size):
        ps, ss = prompts[start : start + batch_size], seeds[start : start + batch_size]
        cond = cond_all.index(torch.tensor([row[p] for p in ps]))
        x = seeded_noise(ss, -1, family.latent_shape)
        for j in range(sampler_cfg.num_steps):
            sig = torch.full((x.shape[0],), float(sigmas[j]))
            v = family.velocity(transformer, x, sig, cond)
            x = x + (float(sigmas[j + 1]) - float(sigmas[j])) * v
        out.append(family.decode(x).numpy())
        if progress is not None:
            progress(min(start + batch_size, len(prompts)), len(prompts))
    return np.concatenate(out)


def evaluate(
    transformer,
    model_cfg: ModelConfig,
    sampler_cfg: SamplerConfig,
    specs: list[world.PromptSpec],
    *,
    num_seeds: int = 8,
    progress=None,
) -> EvalResult:
    """Sample ``num_seeds`` images per spec and score them (see the module docstring)."""
    prompts = [s.prompt for s in specs for _ in range(num_seeds)]
    seeds = [EVAL_SEED_BASE + k for _ in specs for k in range(num_seeds)]
    images = sample_ode(transformer, model_cfg, sampler_cfg, prompts, seeds, progress=progress)
    both = geneval.verdicts(images, prompts)
    strict = [float(c) for c, _ in both]
    partial = [p for _, p in both]
    tags = [s.tag for s in specs for _ in range(num_seeds)]
    per_task = {t: float(np.mean([v for v, tt in zip(strict, tags) if tt == t])) for t in world.TASKS if t in tags}
    return EvalResult(
        per_task=per_task,
        per_task_prompts={t: sum(1 for s in specs if s.tag == t) for t in per_task},
        overall=float(np.mean(list(per_task.values()))),
        partial=float(np.mean(partial)),
        num_images=len(prompts),
        images=images,
        verdicts=[v >= 1.0 for v in strict],
        prompts=prompts,
    )


def load_transformer(model_cfg: ModelConfig, weights_dir: str | pathlib.Path | None = None):
    """The run's transformer: the base model of ``model_cfg``, or a saved ``final/`` folder
    (``save_pretrained`` of a full fine-tune, or ``pytorch_lora_weights.safetensors`` of a
    LoRA run, applied to the base model).

    Raises:
        FileNotFoundError: ``weights_dir`` holds neither.
        ModelLoadError: the base checkpoint or a transformer folder was trained on other prompt
            embeddings than ``model_cfg.text_encoder`` (or another architecture).
    """
    from spotlight.models.families import get_family
    from spotlight.models.families.base import ModelLoadError
    from spotlight.models.families.tiny import TEXT_CONDITIONING_FILE, read_text_conditioning

    d = pathlib.Path(weights_dir) if weights_dir is not None else None
    if d is not None and not (d / "pytorch_lora_weights.safetensors").is_file() and (d / "config.json").is_file():
        from diffusers import QwenImageTransformer2DModel

        # a folder that names its prompt embeddings must be sampled with them (a run's full
        # fine-tune names none: it is the run's config's)
        trained_on = read_text_conditioning(d) if (d / TEXT_CONDITIONING_FILE).is_file() else model_cfg.text_encoder
        if trained_on != model_cfg.text_encoder:
            raise ModelLoadError(
                f"{d}: trained on {trained_on!r} prompt embeddings but model.text_encoder = "
                f"{model_cfg.text_encoder!r}; its scores would be wrong"
            )
        return QwenImageTransformer2DModel.from_pretrained(d, torch_dtype=torch.float32).eval()
    family = get_family(model_cfg)
    family.check()  # a pretrained base must be the model section's (architecture, text encoder)
    model = family.build_transformer()
    if d is None:
        return model.eval()
    if (d / "pytorch_lora_weights.safetensors").is_file():
        family.load_lora(model, d)  # one line for a file of another shape, or one that matches nothing
        return model.eval()
    if not d.exists():
        raise FileNotFoundError(f"{d}: no such file or directory")
    raise FileNotFoundError(
        f"{d}: neither a transformer folder (config.json) nor LoRA weights (pytorch_lora_weights.safetensors)"
    )


def comparison_grid(
    results: dict[str, EvalResult], path: pathlib.Path, *, num_prompts: int = 12, num_seeds: int = 4
) -> None:
    """One row per (test prompt, model): ``num_seeds`` samples with pass/fail under each."""
    from spotlight.util.plots import labelled_grid

    first = next(iter(results.values()))
    per_prompt = first.num_images // len(set(first.prompts))
    prompts = list(dict.fromkeys(first.prompts))
    # spread the rows over the task kinds
    by_tag: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_tag.setdefault(geneval.parse_prompt(p).tag, []).append(i)
    chosen: list[int] = []
    while len(chosen) < min(num_prompts, len(prompts)):
        for tag in world.TASKS:
            rest = [i for i in by_tag.get(tag, []) if i not in chosen]
            if rest and len(chosen) < num_prompts:
                chosen.append(rest[0])
    rows, colors = [], []
    for i in chosen:
        for name, res in results.items():
            idx = range(i * per_prompt, i * per_prompt + min(num_seeds, per_prompt))
            rows.append(
                (
                    f"{name}: {prompts[i]}",
                    [res.images[k] for k in idx],
                    ["pass" if res.verdicts[k] else "fail" for k in idx],
                )
            )
            colors.append([(0, 140, 0) if res.verdicts[k] else (200, 0, 0) for k in idx])
    title = "test prompts (never trained on), ODE samples: " + ", ".join(
        f"{n} {r.overall:.3f}" for n, r in results.items()
    )
    labelled_grid(rows, path, title=title, colors=colors)


def binds_two_parts(spec: world.PromptSpec) -> bool:
    """Whether ``spec`` is a colour-attribution or position prompt whose two shapes (and, for
    colour attribution, two colours) differ: only then does swapping its binding give a scene
    the prompt rules out (the world never writes the others; ``geneval.parse_prompt`` accepts
    them)."""
    if spec.tag not in ("color_attr", "position") or len(spec.include) != 2:
        return False
    first, second = spec.include
    return first.shape != second.shape and (spec.tag != "color_attr" or first.color != second.color)


def binding_counts(
    specs: list[world.PromptSpec], objects: list[list[geneval.DetectedObject]]
) -> dict[str, dict[str, int]]:
    """Whether a model binds attributes to the right object beyond chance, from detections.

    For each colour-attribution and position prompt and the objects detected in one of its
    images (``objects[i]`` belongs to ``specs[i]``), counted among the images that show each of
    the prompt's two shapes exactly once:

    * ``color_attr``: ``both_colors`` -- the two shapes carry the prompt's two colours (in either
      order); ``bound_right`` -- each carries its own. Swapped colours pass the same detector,
      so with no binding ``bound_right / both_colors`` is 1/2.
    * ``position``: ``on_axis`` -- the second shape is on the prompt's side of the first or on the
      opposite side; ``relation_right`` -- on the prompt's side. Chance is 1/2 again.

    Other task kinds are skipped, and so are prompts whose two shapes (or, for colour
    attribution, two colours) are the same: swapping them changes nothing, so chance would
    not be 1/2 (the world never writes such prompts; ``geneval.parse_prompt`` accepts them).
    Returns ``{kind: {"images", "both_shapes_once", …}}``.
    """
    out = {
        "color_attr": dict.fromkeys(("images", "both_shapes_once", "both_colors", "bound_right"), 0),
        "position": dict.fromkeys(("images", "both_shapes_once", "on_axis", "relation_right"), 0),
    }
    for spec, found in zip(specs, objects, strict=True):
        if not binds_two_parts(spec):
            continue
        first, second = spec.include
        row = out[spec.tag]
        row["images"] += 1
        a = [o for o in found if o.shape == first.shape]
        b = [o for o in found if o.shape == second.shape]
        if len(a) != 1 or len(b) != 1:
            continue
        row["both_shapes_once"] += 1
        a, b = a[0], b[0]
        if spec.tag == "color_attr":
            if {a.color, b.color} == {first.color, second.color}:
                row["both_colors"] += 1
                row["bound_right"] += a.color == first.color
        else:
            relation = second.position[0]
            holds = world.relations_between(b.box, a.box)
            if relation in holds or world.OPPOSITE_RELATION[relation] in holds:
                row["on_axis"] += 1
                row["relation_right"] += relation in holds
    return out


def binding_counts_of(res: EvalResult) -> dict[str, dict[str, int]]:
    """:func:`binding_counts` of an :func:`evaluate` result's images (its prompts parsed again)."""
    specs = [geneval.parse_prompt(p) for p in res.prompts]
    return binding_counts(specs, geneval.detect_many(list(res.images.transpose(0, 2, 3, 1))))


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``k / n`` (95 % for the default ``z``);
    ``(nan, nan)`` for ``n = 0``."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


BINDING_SHARES = (("color_attr", "both_colors", "bound_right"), ("position", "on_axis", "relation_right"))
"""Per kind of :func:`binding_counts`: the images with the right parts, and of those, the ones the
right way round."""


def binding_shares(counts: dict[str, dict[str, int]]) -> dict[str, tuple[float, float, float]]:
    """``{kind: (share the right way round, 95 % low, high)}`` of :func:`binding_counts`; chance is 1/2."""
    out = {}
    for kind, of, right in BINDING_SHARES:
        k, n = counts[kind][right], counts[kind][of]
        out[kind] = (k / n if n else math.nan, *wilson_interval(k, n))
    return out


LIKELIHOOD_KINDS = ("colors", "color_attr", "position")
"""What :func:`likelihood_margins` probes: binding (colour attribution, position) next to a single
attribute a model learns early (colours), the scale to read binding's margins against."""
LIKELIHOOD_SIGMAS = (0.3, 0.5, 0.7, 0.8, 0.9)


def swapped_scene(spec: world.PromptSpec, objects: list[world.PlacedObject]) -> list[world.PlacedObject] | None:
    """The scene that differs from ``objects`` (a render of ``spec``) only in what the prompt binds,
    or None for the other kinds:

    * ``color_attr``: the two objects' colours exchanged (what :func:`binding_counts` counts as
      bound wrong);
    * ``position``: the two objects' shapes exchanged, boxes kept (the named shape on the other
      side);
    * ``colors``: the object in the next colour of the palette (a wrong attribute, no binding).

    Prompts whose two shapes (or colours) are equal give None (:func:`binds_two_parts`): the
    swapped scene would fit the prompt as well."""
    if spec.tag == "colors" and len(objects) == 1:
        names = list(world.COLORS)
        return [dataclasses.replace(objects[0], color=names[(names.index(objects[0].color) + 1) % len(names)])]
    if not binds_two_parts(spec) or len(objects) != 2:
        return None
    a, b = objects
    if spec.tag == "color_attr":
        swapped = [dataclasses.replace(a, color=b.color), dataclasses.replace(b, color=a.color)]
    else:
        swapped = [dataclasses.replace(a, shape=b.shape), dataclasses.replace(b, shape=a.shape)]
    return None if swapped == list(objects) else swapped


def likelihood_margins(
    transformer,
    model_cfg: ModelConfig,
    specs: list[world.PromptSpec],
    *,
    sigmas: tuple[float, ...] = LIKELIHOOD_SIGMAS,
    images_per_prompt: int = 4,
    seed: int = 0,
    batch_size: int = 64,
) -> list[dict]:
    """Does the denoiser prefer the scene the prompt describes over :func:`swapped_scene`?

    For each prompt of :data:`LIKELIHOOD_KINDS` in ``specs``, ``images_per_prompt`` rendered scenes
    ``x`` and their swapped twins ``x'`` (same boxes); at each ``σ``, with one noise ``ε`` shared
    by the pair, the rectified-flow loss ``‖v(x_σ, σ, prompt) − (ε − x)‖²`` of both
    (``x_σ = (1 − σ)·x + σ·ε``; conditional velocity, no guidance). A model that ties the
    prompt's attributes to the right objects has the lower loss on ``x``; one that does not
    cannot tell the pair apart: margin 0, accuracy 1/2. Unlike sampling and detecting
    (:func:`binding_counts`), every pair counts and the noise is shared, so a checkpoint is
    probed in about a minute on a CPU.

    Returns one row per kind and ``σ``: ``{"kind", "sigma", "pairs", "loss"`` (mean on ``x``),
    ``"margin"`` (mean loss on ``x'`` minus on ``x``), ``"stderr"`` (its standard error),
    ``"accuracy"`` (share of pairs with the lower loss on ``x``)``}``.
    """
    import msgspec

    from spotlight.models.families import get_family
    from spotlight.tasks.shapes.pretrain import pack

    family = get_family(msgspec.structs.replace(model_cfg, guidance_scale=1.0))
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    pairs: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for spec in specs:
        if spec.tag not in LIKELIHOOD_KINDS:
            continue
        for _ in range(images_per_prompt):
            image, objects = world.render(spec, rng)
            if (other := swapped_scene(spec, objects)) is not None:
                pairs.setdefault(spec.tag, []).append((spec.prompt, image, world.draw_scene(other)))

    def latents(images: list[np.ndarray]) -> torch.Tensor:
        return pack(np.stack(images).transpose(0, 3, 1, 2).copy(), model_cfg.patch_size)

    rows = []
    for kind in LIKELIHOOD_KINDS:
        if kind not in pairs:
            continue
        prompts = [p for p, _, _ in pairs[kind]]
        unique = sorted(set(prompts))
        cond = family.encode_prompts(unique).index(torch.tensor([unique.index(p) for p in prompts]))
        right, wrong = latents([r for _, r, _ in pairs[kind]]), latents([w for _, _, w in pairs[kind]])
        n = right.shape[0]
        for sigma in sigmas:
            noise = torch.randn(right.shape, generator=gen)
            losses = []
            with torch.no_grad():
                for x0 in (right, wrong):
                    per_image = []
                    for i in range(0, n, batch_size):
                        xs, eps = x0[i : i + batch_size], noise[i : i + batch_size]
                        t = torch.full((xs.shape[0],), float(sigma))
                        v = family.velocity(
                            transformer, (1.0 - sigma) * xs + sigma * eps, t, cond.index(slice(i, i + batch_size))
                        )
                        per_image.append(((v - (eps - xs)) ** 2).mean(dim=(1, 2)))
                    losses.append(torch.cat(per_image))
            d = losses[1] - losses[0]
            rows.append(
                {
                    "kind": kind,
                    "sigma": float(sigma),
                    "pairs": n,
                    "loss": float(losses[0].mean()),
                    "margin": float(d.mean()),
                    "stderr": float(d.std() / math.sqrt(n)) if n > 1 else math.nan,
                    "accuracy": float((d > 0).float().mean()),
                }
            )
    return rows
