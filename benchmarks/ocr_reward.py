"""Accuracy and speed of the OCR reward (``spotlight/rewards/ocr.py``) on rendered text.

Renders the quoted targets of the first ``--targets`` prompts of Flow-GRPO's OCR test set
(``examples/prompts/ocr/test.txt``) with :func:`~spotlight.rewards.ocr.render_text_image` on a
512² canvas in 3 fonts (DejaVu Sans, DejaVu Serif, DejaVu Sans Mono Bold) at 3 sizes, each
clean, blurred (Gaussian, radius 1.5 px) and noisy (σ = 25 on 0-255), then reports per
condition:

* ``exact``: share of images whose reward on their own prompt is 1 (text read exactly,
  ignoring case and spaces);
* ``reward``: mean reward on their own prompt (Flow-GRPO's 1 - normalised edit distance);
* ``wrong``: mean reward of the same image against another target (how far a wrong text
  is from full marks; lower is better);

and the mean time per image. Text longer than the canvas at a size is shrunk to fit.

Usage: ``.venv/bin/python -m benchmarks.ocr_reward [--targets 16]`` (about 4-8 min on 2
shared CPU cores for the default).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import time

from benchmarks._provenance import provenance_line
from spotlight.rewards.ocr import OcrScorer, ocr_reward, prompt_target, render_text_image

ROOT = pathlib.Path(__file__).resolve().parents[1]
FONTS = {"sans": "DejaVuSans.ttf", "serif": "DejaVuSerif.ttf", "mono-bold": "DejaVuSansMono-Bold.ttf"}
SIZES_PX = (20, 36, 56)
DEGRADE = {"clean": {}, "blur1.5": {"blur_px": 1.5}, "noise25": {"noise_std": 25.0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", type=int, default=16)
    args = ap.parse_args()
    lines = (ROOT / "examples/prompts/ocr/test.txt").read_text(encoding="utf-8").splitlines()
    targets = [prompt_target(p) for p in lines if p.strip()][: args.targets]
    scorer = OcrScorer()
    rows: dict[tuple[str, int, str], list[tuple[float, float, float]]] = collections.defaultdict(list)
    for i, target in enumerate(targets):
        other = targets[(i + 1) % len(targets)]
        for font_name, font in FONTS.items():
            for size in SIZES_PX:
                for deg, kw in DEGRADE.items():
                    im = render_text_image(target, font=font, font_px=size, seed=i, **kw)
                    t0 = time.perf_counter()
                    read = scorer.recognise(im)
                    dt = time.perf_counter() - t0
                    rows[(font_name, size, deg)].append((ocr_reward(read, target), ocr_reward(read, other), dt))
    print(provenance_line())
    print(f"{len(targets)} targets from examples/prompts/ocr/test.txt, 512x512 canvas")
    print(f"{'font':10} {'size':>4} {'degrade':8} {'exact':>6} {'reward':>7} {'wrong':>6} {'s/img':>6}")
    all_r, all_w, all_x, all_t = [], [], [], []
    for (font_name, size, deg), vals in rows.items():
        r = [v[0] for v in vals]
        w = [v[1] for v in vals]
        t = [v[2] for v in vals]
        x = [float(v == 1.0) for v in r]
        all_r += r
        all_w += w
        all_x += x
        all_t += t
        print(
            f"{font_name:10} {size:>4} {deg:8} {statistics.mean(x):6.2f} {statistics.mean(r):7.3f} "
            f"{statistics.mean(w):6.3f} {statistics.mean(t):6.2f}"
        )
    by_size = collections.defaultdict(list)
    by_deg = collections.defaultdict(list)
    for (_f, size, deg), vals in rows.items():
        by_size[size] += [v[0] for v in vals]
        by_deg[deg] += [v[0] for v in vals]
    print("mean reward by size:", {s: round(statistics.mean(v), 3) for s, v in sorted(by_size.items())})
    print("mean reward by degradation:", {d: round(statistics.mean(v), 3) for d, v in by_deg.items()})
    print(
        f"overall: exact {statistics.mean(all_x):.3f}, reward {statistics.mean(all_r):.3f}, "
        f"wrong-text reward {statistics.mean(all_w):.3f}, {statistics.mean(all_t):.2f} s/image"
    )


if __name__ == "__main__":
    main()
