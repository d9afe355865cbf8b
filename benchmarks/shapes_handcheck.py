"""A sheet for hand-checking the shapes reward on generated images: every held-out test prompt,
sampled by a model (ODE, the default config's steps and guidance), upscaled, with the reward's
verdict, what it detected (colour + shape of each object) and the prompt under each tile.

    python benchmarks/shapes_handcheck.py --out benchmarks/results/shapes_handcheck.png
    python benchmarks/shapes_handcheck.py --weights runs/<run>/final --out /tmp/final_check.png

Writes the PNG and ``<out>.json`` (per tile: prompt, verdict, detected objects with area in
pixels, fill ratio and taper). Look at each tile and note where the verdict is wrong.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    import torch
    from PIL import Image, ImageDraw

    from spotlight.config import load_config
    from spotlight.tasks.shapes import evaluate as ev
    from spotlight.tasks.shapes import geneval

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="config whose model and sampler to use (default: the embedded one)")
    ap.add_argument("--weights", default=None, help="a run's final/ folder (default: the base model)")
    ap.add_argument("--seeds", type=int, default=1, help="samples per test prompt")
    ap.add_argument("--out", default="runs/shapes_handcheck.png")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    model = ev.load_transformer(cfg.model, args.weights)
    res = ev.evaluate(model, cfg.model, cfg.sampler, ev.read_prompts(), num_seeds=args.seeds)
    images = res.images.transpose(0, 2, 3, 1)
    found = geneval.detect_many(list(images))
    side, cols = 128, 8
    rows = (len(images) + cols - 1) // cols
    sheet = Image.new("RGB", (cols * (side + 8), rows * (side + 44)), "white")
    draw = ImageDraw.Draw(sheet)
    records = []
    for i, (image, prompt, verdict, objects) in enumerate(zip(images, res.prompts, res.verdicts, found)):
        x, y = (i % cols) * (side + 8), (i // cols) * (side + 44)
        sheet.paste(Image.fromarray(image).resize((side, side), Image.NEAREST), (x, y))
        draw.text(
            (x, y + side + 1), f"{i} {'PASS' if verdict else 'fail'}", fill=(0, 120, 0) if verdict else (200, 0, 0)
        )
        draw.text((x, y + side + 12), " ".join(f"{o.color[:3]}{o.shape[:3]}" for o in objects)[:26], fill=(0, 0, 0))
        draw.text((x, y + side + 23), prompt.replace("a photo of ", "")[:26], fill=(60, 60, 160))
        records.append(
            {
                "tile": i,
                "prompt": prompt,
                "pass": bool(verdict),
                "objects": [(o.shape, o.color, o.area_px, round(o.fill, 2), round(o.taper, 2)) for o in objects],
            }
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    out.with_suffix(out.suffix + ".json").write_text(json.dumps(records, indent=1))
    print(f"strict {res.overall:.3f}; wrote {out} and {out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
