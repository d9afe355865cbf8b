"""A procedural shapes world with GenEval-style prompts (the embedded task).

Images are ``IMAGE_SIZE × IMAGE_SIZE`` RGB: one to four solid shapes (circle, square,
triangle) in five clearly separable colours on a light background, drawn by Pillow
without anti-aliasing so every pixel is exactly a palette colour. Captions follow
GenEval's six task kinds and templates (Ghosh et al. 2023, ``prompts/create_prompts.py``
and ``evaluation_metadata.jsonl``):

================  ==================================================  ===================
tag               template                                            clauses checked
================  ==================================================  ===================
single_object     ``a photo of a {shape}``                            shape present
two_object        ``a photo of a {A} and a {B}``                      both present
counting          ``a photo of {three} {shape}s``                     exactly N
colors            ``a photo of a {colour} {shape}``                   present, colour
position          ``a photo of a {B} {left of|right of|above|below}   both present, B's
                  a {A}``                                             relation to A
color_attr        ``a photo of a {c1} {A} and a {c2} {B}``            each shape+colour
================  ==================================================  ===================

Everything is deterministic from a seed: :func:`render` takes a ``numpy.random.Generator``.
:func:`prompt_split` is the fixed train/test split (about a quarter of each task kind
is held out; test prompts are never trained on, neither by ``spotlight/tasks/shapes/pretrain.py``
nor by the default RL run).

Relations use GenEval's rule (``evaluation/evaluate_images.py``: ``relative_position``
with ``POSITION_THRESHOLD = 0.1``): the centre offset, shrunk by 0.1 × the summed box
sizes, normalised; "left of" when its x component is below −0.5, and so on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 32
"""Pixels per side of a rendered image."""
SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (150, 60, 190),
}
"""Palette (RGB uint8). Pairwise distances are ≥ 120, far from the background's."""
BACKGROUND = (245, 245, 245)
NUMBERS = {2: "two", 3: "three", 4: "four"}
RELATIONS = ("left of", "right of", "above", "below")
OPPOSITE_RELATION = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
"""Each relation of :data:`RELATIONS` with the two shapes' places exchanged."""
TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
POSITION_THRESHOLD = 0.1
"""GenEval's margin: offsets smaller than 0.1 × (size A + size B) count as no offset."""
TEST_FRACTION = 0.25
SPLIT_SEED = 0

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
PROMPTS_DIR = PACKAGE_DIR / "prompts"
TRAIN_PROMPTS_PATH = PROMPTS_DIR / "train.jsonl"
TRAIN_BALANCED_PROMPTS_PATH = PROMPTS_DIR / "train_balanced.jsonl"
"""The train prompts, each repeated so every task kind has about the same number of lines
(the split has 90 colour-attribution prompts but 2 single-object ones); the default RL run
samples from it, so every task kind is trained on about equally often."""
TEST_PROMPTS_PATH = PROMPTS_DIR / "test.jsonl"


@dataclasses.dataclass(frozen=True)
class ObjectClause:
    """One ``include`` entry of GenEval metadata: ``count`` objects of ``shape`` (at least,
    or exactly for counting prompts), optionally of ``color``, optionally placed
    ``position = (relation, index)`` relative to the ``index``-th clause."""

    shape: str
    count: int = 1
    color: str | None = None
    position: tuple[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """A caption and what it asks for (GenEval ``evaluation_metadata.jsonl`` schema)."""

    tag: str
    include: tuple[ObjectClause, ...]
    prompt: str

    @property
    def exact_count(self) -> bool:
        """Counting prompts ask for exactly N (GenEval adds an ``exclude`` of N + 1)."""
        return self.tag == "counting"

    def to_json(self) -> dict:
        inc = []
        for c in self.include:
            d: dict = {"class": c.shape, "count": c.count}
            if c.color is not None:
                d["color"] = c.color
            if c.position is not None:
                d["position"] = [c.position[0], c.position[1]]
            inc.append(d)
        out = {"tag": self.tag, "include": inc, "prompt": self.prompt}
        if self.exact_count:
            out["exclude"] = [{"class": self.include[0].shape, "count": self.include[0].count + 1}]
        return out


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _obj(shape: str, color: str | None = None) -> str:
    words = f"{color} {shape}" if color else shape
    return f"{_article(words)} {words}"


def make_prompt(tag: str, include: tuple[ObjectClause, ...]) -> PromptSpec:
    """The caption of a GenEval-style request (the templates in the module docstring)."""
    if tag in ("single_object", "colors"):
        text = f"a photo of {_obj(include[0].shape, include[0].color)}"
    elif tag == "two_object":
        text = f"a photo of {_obj(include[0].shape)} and {_obj(include[1].shape)}"
    elif tag == "counting":
        c = include[0]
        text = f"a photo of {NUMBERS[c.count]} {c.shape}s"
    elif tag == "position":
        rel = include[1].position[0]
        text = f"a photo of {_obj(include[1].shape)} {rel} {_obj(include[0].shape)}"
    elif tag == "color_attr":
        a, b = include
        text = f"a photo of {_obj(a.shape, a.color)} and {_obj(b.shape, b.color)}"
    else:
        raise ValueError(f"unknown task kind {tag!r}; expected one of {TASKS}")
    return PromptSpec(tag, tuple(include), text)


def all_prompts() -> list[PromptSpec]:
    """Every prompt of the world, in a fixed order (177 prompts)."""
    out: list[PromptSpec] = []
    for s in SHAPES:
        out.append(make_prompt("single_object", (ObjectClause(s),)))
    for a in SHAPES:
        for b in SHAPES:
            if a != b:
                out.append(make_prompt("two_object", (ObjectClause(a), ObjectClause(b))))
    for s in SHAPES:
        for n in NUMBERS:
            out.append(make_prompt("counting", (ObjectClause(s, count=n),)))
    for s in SHAPES:
        for c in COLORS:
            out.append(make_prompt("colors", (ObjectClause(s, color=c),)))
    for a in SHAPES:
        for b in SHAPES:
            if a != b:
                for rel in RELATIONS:
                    out.append(make_prompt("position", (ObjectClause(a), ObjectClause(b, position=(rel, 0)))))
    for a in SHAPES:
        for b in SHAPES:
            if a == b:
                continue
            for ca in COLORS:
                for cb in COLORS:
                    if ca != cb:
                        out.append(make_prompt("color_attr", (ObjectClause(a, color=ca), ObjectClause(b, color=cb))))
    return out


def prompt_split() -> tuple[list[PromptSpec], list[PromptSpec]]:
    """The fixed ``(train, test)`` split: per task kind, ``ceil(TEST_FRACTION · n)`` prompts
    drawn with ``random.Random(SPLIT_SEED)`` are held out for testing."""
    train: list[PromptSpec] = []
    test: list[PromptSpec] = []
    rng = random.Random(SPLIT_SEED)
    prompts = all_prompts()
    for tag in TASKS:
        group = [p for p in prompts if p.tag == tag]
        held = set(rng.sample(range(len(group)), math.ceil(TEST_FRACTION * len(group))))
        for i, p in enumerate(group):
            (test if i in held else train).append(p)
    return train, test


def balanced(specs: list[PromptSpec]) -> list[PromptSpec]:
    """Each spec repeated ``round(n_max / n_kind)`` times (task-kind balance), in order."""
    counts = {t: sum(1 for s in specs if s.tag == t) for t in TASKS}
    most = max(counts.values())
    return [s for s in specs for _ in range(max(1, round(most / counts[s.tag])))]


def write_prompt_files(directory: pathlib.Path = PROMPTS_DIR) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``train.jsonl``, ``train_balanced.jsonl`` and ``test.jsonl`` (GenEval metadata
    format) to ``directory``; returns the train and test paths."""
    directory.mkdir(parents=True, exist_ok=True)
    train, test = prompt_split()
    for name, specs in (("train", train), ("test", test), ("train_balanced", balanced(train))):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(s.to_json()) + "\n" for s in specs))
    return directory / "train.jsonl", directory / "test.jsonl"


# --------------------------------------------------------------------------- geometry


def relations_between(box_b: tuple[float, float, float, float], box_a: tuple[float, float, float, float]) -> set[str]:
    """GenEval's relative position of box B to box A (boxes ``(x0, y0, x1, y1)``, y down).

    Returns the subset of :data:`RELATIONS` that hold ("B is left of A", …).
    """
    ca = np.array([(box_a[0] + box_a[2]) / 2, (box_a[1] + box_a[3]) / 2])
    cb = np.array([(box_b[0] + box_b[2]) / 2, (box_b[1] + box_b[3]) / 2])
    dim_a = np.array([box_a[2] - box_a[0], box_a[3] - box_a[1]])
    dim_b = np.array([box_b[2] - box_b[0], box_b[3] - box_b[1]])
    offset = cb - ca
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    rel = set()
    if dx < -0.5:
        rel.add("left of")
    if dx > 0.5:
        rel.add("right of")
    if dy < -0.5:
        rel.add("above")
    if dy > 0.5:
        rel.add("below")
    return rel


@dataclasses.dataclass(frozen=True)
class PlacedObject:
    """A drawn object: its box ``(x0, y0, x1, y1)`` in pixels, end-exclusive."""

    shape: str
    color: str
    box: tuple[int, int, int, int]


def draw_object(draw: ImageDraw.ImageDraw, shape: str, color: str, x0: int, y0: int, size: int) -> None:
    """Draw one shape filling the ``size × size`` box at ``(x0, y0)`` (no anti-aliasing)."""
    rgb = COLORS[color]
    x1, y1 = x0 + size - 1, y0 + size - 1
    if shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=rgb)
    elif shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=rgb)
    elif shape == "triangle":
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=rgb)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


class SceneError(RuntimeError):
    """No placement satisfying the prompt was found (should not happen for world prompts)."""


def _size_range(num_objects: int) -> tuple[int, int]:
    return (8, 12) if num_objects <= 2 else (7, 10)


def _place(rng: np.random.Generator, sizes: list[int], boxes: list[tuple[int, int, int, int]], gap: int = 2):
    """Rejection-sample a box of each size not within ``gap`` pixels of the others."""
    out = []
    for s in sizes:
        for _ in range(200):
            x0 = int(rng.integers(1, IMAGE_SIZE - s))
            y0 = int(rng.integers(1, IMAGE_SIZE - s))
            box = (x0, y0, x0 + s, y0 + s)
            if all(
                box[0] >= b[2] + gap or b[0] >= box[2] + gap or box[1] >= b[3] + gap or b[1] >= box[3] + gap
                for b in boxes + out
            ):
                out.append(box)
                break
        else:
            return None
    return out


def render(spec: PromptSpec, rng: np.random.Generator) -> tuple[np.ndarray, list[PlacedObject]]:
    """Draw an image that satisfies ``spec``.

    Unspecified colours are drawn uniformly from the palette. Objects never touch (2 px
    apart), so each is one connected component of its colour.

    Returns:
        ``(image [IMAGE_SIZE, IMAGE_SIZE, 3] uint8, objects)``.

    Raises:
        SceneError: no valid placement after 100 attempts.
    """
    shapes: list[tuple[str, str]] = []
    for clause in spec.include:
        for _ in range(clause.count):
            color = clause.color or str(rng.choice(list(COLORS)))
            shapes.append((clause.shape, color))
    lo, hi = _size_range(len(shapes))
    for _ in range(100):
        sizes = [int(rng.integers(lo, hi + 1)) for _ in shapes]
        boxes = _place(rng, sizes, [])
        if boxes is None:
            continue
        if spec.tag == "position":
            rel = spec.include[1].position[0]
            if rel not in relations_between(boxes[1], boxes[0]):
                continue
        break
    else:
        raise SceneError(f"could not place {spec.prompt!r}")
    placed = [PlacedObject(shape, color, box) for (shape, color), box in zip(shapes, boxes)]
    return draw_scene(placed), placed


def draw_scene(objects: list[PlacedObject]) -> np.ndarray:
    """``objects`` on the background, in order: ``[IMAGE_SIZE, IMAGE_SIZE, 3] uint8``."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for o in objects:
        draw_object(draw, o.shape, o.color, o.box[0], o.box[1], o.box[2] - o.box[0])
    return np.asarray(img, dtype=np.uint8).copy()
