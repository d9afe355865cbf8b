"""Training prompt sets, split from the evaluation sets the field reports on.

Reporting GenEval or OCR accuracy from a model trained on the evaluation prompts reports a
contaminated score. This module generates the *training* side of each split and checks that
it is disjoint from the evaluation side (docs/prompt-sets.md):

* :func:`geneval_train_records`: GenEval-style records (``tag``, ``include``, ``exclude``,
  ``prompt``; the schema of GenEval's ``evaluation_metadata.jsonl``) from GenEval's six
  prompt templates and its 80 COCO classes, with every prompt of the 553 evaluation records
  left out. Single-object prompts use other phrasings ("a picture of a bench"), because the
  evaluation set already holds "a photo of a <class>" for all 80 classes.
* :func:`ocr_train_prompts`: text-rendering prompts (a scene template with one quoted
  target text, the form Flow-GRPO's OCR reward reads) whose target texts and prompts do not
  occur in Flow-GRPO's OCR test prompts.

Both are pure functions of their seed and the evaluation set; ``python -m
spotlight.tasks.prompt_sets`` regenerates the files shipped under ``examples/prompts/``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
from collections.abc import Iterable, Sequence

GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's ten colour names (its colour classifier's classes)."""

GENEVAL_POSITIONS = ("left of", "right of", "above", "below")
NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}
SINGLE_OBJECT_TEMPLATES = ("a picture of {a}", "an image of {a}", "a photograph of {a}")
"""Phrasings for training single-object prompts (the evaluation set uses "a photo of ...")."""

# tag → share of the generated records (GenEval's evaluation set: 80/99/80/94/100/100 of 553)
DEFAULT_TAG_COUNTS = {
    "single_object": 240,
    "two_object": 800,
    "counting": 600,
    "colors": 600,
    "position": 800,
    "color_attr": 800,
}


def article(noun: str) -> str:
    """``"a bench"`` / ``"an apple"`` (GenEval's rule: "an" before a vowel letter)."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def plural(noun: str) -> str:
    """GenEval's plural: ``+es`` after a final ``s`` ("buses", "wine glasses"), else ``+s``
    ("benchs", "knifes", as its evaluation prompts spell them); already-plural class names
    ("skis", "scissors") stay as they are."""
    if noun in ("skis", "scissors"):
        return noun
    return noun + ("es" if noun.endswith("s") else "s")


def load_jsonl(path: str | pathlib.Path) -> list[dict]:
    """Records of a JSONL file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _two_object(rng: random.Random, classes: Sequence[str]) -> dict:
    a, b = rng.sample(list(classes), 2)
    return {
        "tag": "two_object",
        "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
        "prompt": f"a photo of {article(a)} and {article(b)}",
    }


def _counting(rng: random.Random, classes: Sequence[str]) -> dict:
    c = rng.choice(list(classes))
    n = rng.choice((2, 3, 4))
    return {
        "tag": "counting",
        "include": [{"class": c, "count": n}],
        "exclude": [{"class": c, "count": n + 1}],
        "prompt": f"a photo of {NUMBER_WORDS[n]} {plural(c)}",
    }


def _colors(rng: random.Random, classes: Sequence[str]) -> dict:
    c = rng.choice(list(classes))
    col = rng.choice(GENEVAL_COLORS)
    return {
        "tag": "colors",
        "include": [{"class": c, "count": 1, "color": col}],
        "prompt": f"a photo of {article(col + ' ' + c)}",
    }


def _position(rng: random.Random, classes: Sequence[str]) -> dict:
    ref, obj = rng.sample(list(classes), 2)
    pos = rng.choice(GENEVAL_POSITIONS)
    return {
        "tag": "position",
        "include": [{"class": ref, "count": 1}, {"class": obj, "count": 1, "position": [pos, 0]}],
        "prompt": f"a photo of {article(obj)} {pos} {article(ref)}",
    }


def _color_attr(rng: random.Random, classes: Sequence[str]) -> dict:
    a, b = rng.sample(list(classes), 2)
    ca, cb = rng.sample(GENEVAL_COLORS, 2)
    return {
        "tag": "color_attr",
        "include": [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
        "prompt": f"a photo of {article(ca + ' ' + a)} and {article(cb + ' ' + b)}",
    }


_MAKERS = {
    "two_object": _two_object,
    "counting": _counting,
    "colors": _colors,
    "position": _position,
    "color_attr": _color_attr,
}


def geneval_train_records(
    classes: Sequence[str],
    eval_prompts: Iterable[str],
    *,
    seed: int = 0,
    tag_counts: dict[str, int] | None = None,
) -> list[dict]:
    """GenEval-style training records, none of whose prompts is an evaluation prompt.

    Args:
        classes: the 80 COCO class names (GenEval's ``object_names.txt``).
        eval_prompts: the evaluation prompts to keep out (GenEval's 553).
        seed: the generator's seed; the same seed gives the same records.
        tag_counts: records per tag (default :data:`DEFAULT_TAG_COUNTS`); a tag whose
            distinct prompts run out yields fewer.

    Returns:
        Records in a shuffled order, each prompt once.
    """
    counts = dict(DEFAULT_TAG_COUNTS if tag_counts is None else tag_counts)
    unknown = set(counts) - set(DEFAULT_TAG_COUNTS)
    if unknown:
        raise ValueError(f"unknown GenEval tags {sorted(unknown)}; known: {sorted(DEFAULT_TAG_COUNTS)}")
    rng = random.Random(seed)
    taken = {p.strip().lower() for p in eval_prompts}
    out: list[dict] = []
    for tag, n in counts.items():
        if tag == "single_object":
            pool = [
                {"tag": tag, "include": [{"class": c, "count": 1}], "prompt": t.format(a=article(c))}
                for t in SINGLE_OBJECT_TEMPLATES
                for c in classes
            ]
            rng.shuffle(pool)
            got = [r for r in pool if r["prompt"].lower() not in taken][:n]
            taken.update(r["prompt"].lower() for r in got)
            out.extend(got)
            continue
        made, tries = 0, 0
        while made < n and tries < 50 * n:
            tries += 1
            rec = _MAKERS[tag](rng, classes)
            key = rec["prompt"].lower()
            if key in taken:
                continue
            taken.add(key)
            out.append(rec)
            made += 1
    rng.shuffle(out)
    return out


# ------------------------------------------------------------------------------------------ OCR

OCR_SCENES = (
    'A storefront sign above a small bakery that reads "{text}", morning light on the brick wall.',
    'A hand-painted wooden signboard at a farmers market with the words "{text}".',
    'A neon sign glowing in a rainy city alley at night, spelling "{text}".',
    'A chalkboard menu outside a cafe with "{text}" written in white chalk.',
    'A vintage poster on a concrete wall with the headline "{text}" in bold letters.',
    'A book cover on a wooden table, its title "{text}" printed in large serif type.',
    'A coffee mug on a desk printed with the phrase "{text}".',
    'A highway billboard at sunset advertising "{text}" in huge letters.',
    'A birthday cake with "{text}" piped in blue icing on the top.',
    'A T-shirt on a hanger with "{text}" printed across the chest.',
    'A road sign beside a mountain road that says "{text}".',
    'A greeting card lying on a bed of flowers with "{text}" in elegant script.',
    'A computer screen in a dark office showing the message "{text}".',
    'A protest banner held up by a crowd, reading "{text}".',
    'A shop window with a sticker that says "{text}".',
    'A classroom whiteboard with "{text}" written in red marker.',
    'A delivery truck with "{text}" painted on its side.',
    'A movie theatre marquee lit up with the words "{text}".',
    'A handwritten note pinned to a corkboard that reads "{text}".',
    'A sandwich board on a sidewalk announcing "{text}".',
)
"""Scene templates of the generated OCR training prompts; ``{text}`` is the quoted target."""

_OCR_FIRST = (
    "Fresh", "Grand", "Happy", "Open", "Welcome", "Summer", "Winter", "Autumn", "Midnight", "Golden",
    "Silent", "Urban", "Wild", "Blue", "Lucky", "Sunny", "Daily", "Little", "Royal", "Green",
    "Modern", "Classic", "Secret", "Cozy", "Bright",
)  # fmt: skip
_OCR_SECOND = (
    "Bakery", "Market", "Garden", "Coffee", "Books", "Sale", "Festival", "Diner", "Studio", "Harbor",
    "Library", "Cinema", "Records", "Kitchen", "Workshop", "Gallery", "Station", "Tavern", "Bazaar", "Arcade",
    "Pharmacy", "Florist", "Bistro", "Garage", "Boutique",
)  # fmt: skip
_OCR_PHRASES = (
    "Back In Five Minutes", "No Parking Today", "Think Outside The Box", "Best Tacos In Town",
    "Keep Calm And Carry On", "Free Wifi Inside", "Closed For Renovation", "Mind The Gap",
    "Dream Big Work Hard", "Hot Soup Served Here", "Live Music Tonight", "Handmade With Love",
    "Beware Of The Cat", "Please Ring The Bell", "Exit Only", "Fresh Bread Daily",
    "Stay Curious", "Now Hiring", "Save The Bees", "Gone Fishing",
)  # fmt: skip


def ocr_target(prompt: str) -> str | None:
    """The OCR target of a text-rendering prompt: its first double-quoted span (Flow-GRPO's
    OCR reward reads ``prompt.split('"')[1]``); ``None`` if it has none."""
    m = re.search(r'"([^"]+)"', prompt)
    return m.group(1) if m else None


def ocr_train_prompts(test_prompts: Iterable[str], *, n: int = 4000, seed: int = 0) -> list[str]:
    """Text-rendering training prompts whose targets (compared without case and spaces) and
    prompts do not occur in ``test_prompts``.

    Targets are "<word> <word>" names, "<name> <year>" and fixed phrases; each prompt is one
    of :data:`OCR_SCENES` with one target. Distinct prompts, at most ``n``.
    """
    test = list(test_prompts)
    banned = {_norm(t) for t in (ocr_target(p) for p in test) if t}
    test_set = {p.strip() for p in test}
    rng = random.Random(seed)
    texts = [f"{a} {b}" for a in _OCR_FIRST for b in _OCR_SECOND]
    texts += [f"{a} {b} {y}" for a in _OCR_FIRST[:10] for b in _OCR_SECOND[:10] for y in (2026, 2027, 2031)]
    texts += list(_OCR_PHRASES)
    texts = [t for t in texts if _norm(t) not in banned]
    pairs = [(s, t) for s in OCR_SCENES for t in texts]
    rng.shuffle(pairs)
    out, seen = [], set()
    for scene, text in pairs:
        p = scene.format(text=text)
        if p in test_set or p in seen:
            continue
        seen.add(p)
        out.append(p)
        if len(out) >= n:
            break
    return out


def _norm(text: str) -> str:
    return "".join(text.split()).lower()


def main(argv: list[str] | None = None) -> None:
    """Regenerate the shipped training sets (``--out examples/prompts``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from spotlight.util.cli_paths import nonempty_path_arg

    ap.add_argument(
        "--out", default="examples/prompts", type=nonempty_path_arg, help="folder holding geneval/ and ocr/"
    )
    ap.add_argument(
        "--geneval-eval",
        default="examples/default/prompts/evaluation_metadata.jsonl",
        type=nonempty_path_arg,
        help="GenEval's 553 evaluation records (kept out of the training set)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    gdir, odir = out / "geneval", out / "ocr"
    classes = [c.strip() for c in (gdir / "object_names.txt").read_text().splitlines() if c.strip()]
    eval_prompts = [r["prompt"] for r in load_jsonl(args.geneval_eval)]
    records = geneval_train_records(classes, eval_prompts, seed=args.seed)
    with open(gdir / "train_metadata.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    test = [p for p in (odir / "test.txt").read_text(encoding="utf-8").splitlines() if p.strip()]
    prompts = ocr_train_prompts(test, seed=args.seed)
    (odir / "train.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    print(f"{len(records)} GenEval training records → {gdir / 'train_metadata.jsonl'}")
    print(f"{len(prompts)} OCR training prompts → {odir / 'train.txt'}")


if __name__ == "__main__":
    main()
