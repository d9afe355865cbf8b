"""Accuracy and speed of the shapes-world GenEval reward (``spotlight/tasks/shapes/geneval.py``).

Renders ``--per-prompt`` images (default 50) of every prompt of ``world.all_prompts()``
(177 prompts) with ``world.render`` and ``np.random.default_rng(seed)``, then reports per
task kind:

* ``detect exact``: share of images where :func:`geneval.detect` finds exactly the placed
  objects (same multiset of shape, colour, box);
* ``strict``: share of images whose strict GenEval verdict on their own prompt is 1;
* ``partial``: mean partial credit on their own prompt;

and the time per image of ``detect`` (one image per call), ``detect_batch`` (all images of
a prompt per call) and ``score`` (batched, with parsing and verdicts), plus the one-off
colour-table build.

``--degrade`` also scores degraded copies (Gaussian blur, per-channel Gaussian noise, JPEG,
a global colour cast, darkened objects) with the strict verdict — a stand-in for what a
small diffusion model produces, not a measurement on generated images.

Usage: ``.venv/bin/python benchmarks/shapes_reward_accuracy.py [--per-prompt 50] [--degrade]``
(about 10-20 s for the default on 2 shared CPU cores).
"""

from __future__ import annotations

import argparse
import collections
import io
import time

import numpy as np
from PIL import Image, ImageFilter

from spotlight.tasks.shapes import geneval, world


def _blur(img: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    return np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(sigma)))


def _noise(img: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    return np.clip(img + rng.normal(0.0, sigma, img.shape), 0, 255).astype(np.uint8)


def _jpeg(img: np.ndarray, quality: int, rng: np.random.Generator) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=quality)
    return np.asarray(Image.open(buf).convert("RGB"))


def _cast(img: np.ndarray, amount: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(img.astype(np.int32) + rng.integers(-amount, amount + 1, 3), 0, 255).astype(np.uint8)


def _darken(img: np.ndarray, factor: float, rng: np.random.Generator) -> np.ndarray:
    out = img.astype(np.float32)
    objects = (img != np.array(world.BACKGROUND, dtype=np.uint8)).any(axis=-1)
    out[objects] *= factor
    return out.astype(np.uint8)


DEGRADATIONS = {
    "blur σ=0.5": lambda im, r: _blur(im, 0.5, r),
    "blur σ=1.0": lambda im, r: _blur(im, 1.0, r),
    "blur σ=1.3": lambda im, r: _blur(im, 1.3, r),
    "noise σ=10": lambda im, r: _noise(im, 10, r),
    "noise σ=25": lambda im, r: _noise(im, 25, r),
    "noise σ=40": lambda im, r: _noise(im, 40, r),
    "blur 0.8 + noise 10": lambda im, r: _noise(_blur(im, 0.8, r), 10, r),
    "JPEG q=75": lambda im, r: _jpeg(im, 75, r),
    "JPEG q=50": lambda im, r: _jpeg(im, 50, r),
    "colour cast ±30": lambda im, r: _cast(im, 30, r),
    "objects × 0.75": lambda im, r: _darken(im, 0.75, r),
}


def _key(objs) -> list[tuple]:
    return sorted((o.shape, o.color, tuple(o.box)) for o in objs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-prompt", type=int, default=50, help="renders per prompt (seeds 0..N-1)")
    ap.add_argument("--degrade", action="store_true", help="also score degraded copies (strict verdict)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    geneval.classify_pixels(np.zeros((1, 1, 3), dtype=np.uint8))
    lut_s = time.perf_counter() - t0

    prompts = world.all_prompts()
    rendered: dict[str, list[tuple[np.ndarray, list]]] = {}
    for spec in prompts:
        rendered[spec.prompt] = [world.render(spec, np.random.default_rng(seed)) for seed in range(args.per_prompt)]

    n = collections.Counter()
    exact = collections.Counter()
    strict = collections.Counter()
    partial = collections.Counter()
    t_detect = 0.0
    failures = []
    for spec in prompts:
        for seed, (img, placed) in enumerate(rendered[spec.prompt]):
            t = time.perf_counter()
            objs = geneval.detect(img)
            t_detect += time.perf_counter() - t
            ok, part = geneval.verdict(spec, objs)
            n[spec.tag] += 1
            exact[spec.tag] += _key(objs) == _key(placed)
            strict[spec.tag] += ok
            partial[spec.tag] += part
            if not ok and len(failures) < 5:
                failures.append((spec.prompt, seed, geneval.clauses(spec, objs)))
    total = sum(n.values())

    t = time.perf_counter()
    for spec in prompts:
        geneval.detect_batch(np.stack([img for img, _ in rendered[spec.prompt]]))
    t_batch = time.perf_counter() - t
    images = np.stack([img.transpose(2, 0, 1) for spec in prompts for img, _ in rendered[spec.prompt]])
    captions = [spec.prompt for spec in prompts for _ in rendered[spec.prompt]]
    t = time.perf_counter()
    scores = geneval.score(images, captions, partial_credit=False)
    t_score = time.perf_counter() - t
    assert sum(scores) == sum(strict.values())

    print(f"{total} images ({len(prompts)} prompts × {args.per_prompt} seeds), {images.shape[2]}×{images.shape[3]}\n")
    print("| task kind | images | detect exact | strict verdict | mean partial |")
    print("|---|---:|---:|---:|---:|")
    for tag in world.TASKS:
        print(
            f"| {tag} | {n[tag]} | {exact[tag] / n[tag]:.2%} | {strict[tag] / n[tag]:.2%} | "
            f"{partial[tag] / n[tag]:.4f} |"
        )
    print(
        f"| **all** | {total} | {sum(exact.values()) / total:.2%} | {sum(strict.values()) / total:.2%} | "
        f"{sum(partial.values()) / total:.4f} |"
    )
    print(f"\ncolour table build (once per process): {lut_s:.2f} s")
    print(f"detect (one image per call):      {t_detect / total * 1e3:.3f} ms/image")
    print(f"detect_batch ({args.per_prompt} images per call): {t_batch / total * 1e3:.3f} ms/image")
    print(f"score (all {total} images, strict): {t_score / total * 1e3:.3f} ms/image")
    for prompt, seed, checked in failures:
        print(f"FAIL {prompt!r} seed {seed}: {checked}")

    if args.degrade:
        print("\nStrict verdict on degraded copies (same renders; degradation seeded by the render seed):\n")
        print("| degradation | " + " | ".join(world.TASKS) + " | all |")
        print("|---|" + "---:|" * (len(world.TASKS) + 1))
        for name, fn in DEGRADATIONS.items():
            ok = collections.Counter()
            for spec in prompts:
                imgs = [
                    fn(img, np.random.default_rng(10_000 + seed)) for seed, (img, _) in enumerate(rendered[spec.prompt])
                ]
                for objs in geneval.detect_batch(np.stack(imgs)):
                    ok[spec.tag] += geneval.verdict(spec, objs)[0]
            print(
                f"| {name} | "
                + " | ".join(f"{ok[t] / n[t]:.1%}" for t in world.TASKS)
                + f" | {sum(ok.values()) / total:.1%} |"
            )


if __name__ == "__main__":
    main()
