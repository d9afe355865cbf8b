"""Does a shapes model bind colours to the right shape, and place the right shape on the
prompt's side, more often than chance? (``spotlight.tasks.shapes.evaluate.binding_counts`` and
``likelihood_margins``)

    python benchmarks/shapes_binding.py                                  # the shipped base model
    python benchmarks/shapes_binding.py --weights runs/<run>/final --weights runs/<other>/final
    python benchmarks/shapes_binding.py --probe likelihood --weights runs/pretrain-shapes/step_00400

Two probes of the held-out colour-attribution and position prompts (``--prompts``: another file):

* ``sample``: ODE samples (the config's steps and guidance, ``--seeds`` per prompt, the seeds
  ``spotlight eval`` uses), objects detected with the reward's detector; among the images that
  show both prompted shapes once, how often the colours (or the places) are the right way round
  rather than swapped. A model that only draws the right parts scores 1/2; the 95 % interval is
  the Wilson score interval (``evaluate.wilson_interval``).
* ``likelihood``: ``--pairs`` rendered scenes per prompt and their twins with the colours (or the
  shapes' places) swapped; at each noise level σ, the rectified-flow loss of both under the
  prompt, with one shared noise. The margin (swapped minus right, in % of the loss) and the
  share of pairs the model prefers the right way round (chance 0.50). The colours prompts' row
  (the object recoloured) is the scale: an attribute the model learned. About a minute per model.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rows(name: str, counts: dict[str, dict[str, int]]) -> list[str]:
    from spotlight.tasks.shapes.evaluate import BINDING_SHARES, binding_shares

    shares = binding_shares(counts)
    out = []
    for kind, of, right in BINDING_SHARES:
        c = counts[kind]
        share, lo, hi = shares[kind]
        out.append(
            f"| {name} | {kind} | {c['images']} | {c['both_shapes_once'] / max(c['images'], 1):.2f} | "
            f"{c[of]} | {c[right]} | {share:.2f} [{lo:.2f}, {hi:.2f}] |"
        )
    return out


def likelihood_table(rows_by_model: list[tuple[str, list[dict]]]) -> list[str]:
    """Markdown rows of :func:`spotlight.tasks.shapes.evaluate.likelihood_margins` per model:
    one row per kind, one column per σ, "margin in % of the loss (share of pairs right)"."""
    sigmas = sorted({r["sigma"] for _, rows in rows_by_model for r in rows})
    lines = [
        "| model | kind | pairs | "
        + " | ".join(f"σ {s:.1f}" for s in sigmas)
        + " |  (loss margin swapped − right, % of the loss (share of pairs right; chance 0.50))",
        "|---|---|---|" + "---|" * len(sigmas),
    ]
    for name, rows in rows_by_model:
        for kind in dict.fromkeys(r["kind"] for r in rows):
            cells = {r["sigma"]: r for r in rows if r["kind"] == kind}
            pairs = next(iter(cells.values()))["pairs"]
            text = [
                f"{100 * c['margin'] / c['loss']:+.0f} % ({c['accuracy']:.2f})" if (c := cells.get(s)) else "—"
                for s in sigmas
            ]
            lines.append(f"| {name} | {kind} | {pairs} | " + " | ".join(text) + " |")
    return lines


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main() -> int:
    import msgspec
    import torch

    from spotlight.config import load_config
    from spotlight.errors import SpotlightError
    from spotlight.models.families.tiny import read_text_conditioning
    from spotlight.tasks.shapes import evaluate as ev

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="config whose model and sampler to use (default: the embedded one)")
    ap.add_argument(
        "--weights",
        action="append",
        default=[],
        help="a run's final/ folder (repeat); sampled with its run's config.toml when the run has one",
    )
    ap.add_argument(
        "--prompts",
        default=None,
        help="prompt file to sample (default: the held-out test prompts; the train split, "
        "spotlight/tasks/shapes/prompts/train.jsonl, tells memorised binding from learned binding)",
    )
    ap.add_argument(
        "--probe",
        choices=("both", "sample", "likelihood"),
        default="both",
        help="sample and detect, compare losses of rendered pairs, or both (default: %(default)s)",
    )
    ap.add_argument("--seeds", type=int, default=16, help="samples per prompt (the sample probe)")
    ap.add_argument("--pairs", type=int, default=16, help="rendered pairs per prompt (the likelihood probe)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.seeds < 1:
        return fail(f"--seeds {args.seeds}: needs an integer >= 1")
    if args.pairs < 1:
        return fail(f"--pairs {args.pairs}: needs an integer >= 1")
    if args.threads < 1:
        return fail(f"--threads {args.threads}: needs an integer >= 1")
    torch.set_num_threads(args.threads)
    # every config and model is loaded before any sampling, so a bad argument fails at once
    runs = []
    try:
        all_specs = ev.read_prompts(args.prompts, source="--prompts") if args.prompts else ev.read_prompts()
        for weights in [None, *args.weights]:
            run_config = pathlib.Path(weights).parent / "config.toml" if weights else None
            config = run_config if run_config is not None and run_config.is_file() else args.config
            cfg = load_config(config)
            if weights and (pathlib.Path(weights) / "config.json").is_file() and not run_config.is_file():
                # a pretraining checkpoint: probe it with the prompt embeddings it was trained on
                trained_on = read_text_conditioning(weights)
                cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, text_encoder=trained_on))
            if cfg.reward.kind != "geneval_shapes" or cfg.model.family != "tiny":
                return fail(
                    f"{config or 'the embedded config'}: not a shapes-task config (reward.kind = "
                    f"{cfg.reward.kind!r}, model.family = {cfg.model.family!r})"
                )
            runs.append((weights or "base", cfg, ev.load_transformer(cfg.model, weights)))
    except (SpotlightError, OSError, ValueError) as exc:
        return fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    specs = [s for s in all_specs if ev.binds_two_parts(s)]
    if not specs:
        return fail(
            f"{args.prompts}: no colour-attribution or position prompts with two different shapes (and colours) "
            "to measure binding on"
        )
    if args.probe in ("both", "likelihood"):
        probed = [
            (name, ev.likelihood_margins(model, cfg.model, all_specs, images_per_prompt=args.pairs))
            for name, cfg, model in runs
        ]
        print("\n".join(likelihood_table(probed)), flush=True)
        if args.probe == "likelihood":
            return 0
        print()
    lines = [
        "| model | kind | images | both shapes once | of those, right parts (colours; position: on the axis) "
        "| the right way round | share [95 % CI] (chance 0.50) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, cfg, model in runs:
        res = ev.evaluate(model, cfg.model, cfg.sampler, specs, num_seeds=args.seeds)
        lines += rows(name, ev.binding_counts_of(res))
        print(lines[-2], lines[-1], sep="\n", flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
