"""The shapes-world GenEval reward (spotlight/tasks/shapes/geneval.py) against the renderer.

Everything is real: images come from ``world.render`` (seeded), the detector and verdict
run unmodified, ``RewardFn`` and the reward server's scorers are the production classes.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw

from spotlight.config import RewardConfig
from spotlight.rewards.reward_fn import RewardError, RewardFn
from spotlight.rewards.server import (
    GenevalShapesScorer,
    MultiScorer,
    ScorerInputError,
    build_multi_scorer,
    parse_scorer_spec,
)
from spotlight.tasks.shapes import geneval, world
from tests.unit.rewards.test_server import running

pytestmark = pytest.mark.timeout(120)

SEEDS = 20
BG = np.array(world.BACKGROUND, dtype=np.uint8)


def _key(objects) -> list[tuple]:
    return sorted((o.shape, o.color, tuple(o.box)) for o in objects)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[tuple[np.ndarray, list[world.PlacedObject]]]]:
    """Every world prompt × SEEDS renders, each with its own ``default_rng(seed)``."""
    return {
        spec.prompt: [world.render(spec, np.random.default_rng(seed)) for seed in range(SEEDS)]
        for spec in world.all_prompts()
    }


def _draw(objects: list[tuple[str, str, int, int, int]], size: int = world.IMAGE_SIZE) -> np.ndarray:
    img = Image.new("RGB", (size, size), world.BACKGROUND)
    draw = ImageDraw.Draw(img)
    for shape, color, x0, y0, s in objects:
        world.draw_object(draw, shape, color, x0, y0, s)
    return np.asarray(img, dtype=np.uint8).copy()


# ------------------------------------------------------------------ (a) renderer <-> reward agreement


def test_detect_finds_exactly_the_rendered_objects_and_the_verdict_is_1(rendered):
    n = exact = correct = 0
    misses = []
    for spec in world.all_prompts():
        renders = rendered[spec.prompt]
        detected = geneval.detect_batch(np.stack([img for img, _ in renders]))
        for seed, ((img, placed), objects) in enumerate(zip(renders, detected)):
            n += 1
            same = _key(objects) == _key(placed)
            ok, partial = geneval.verdict(spec, objects)
            exact += same
            correct += ok
            if (not same or not ok) and len(misses) < 5:
                misses.append((spec.prompt, seed, _key(placed), _key(objects), geneval.clauses(spec, objects)))
    print(f"\nshapes reward on {n} rendered images: detection exact {exact / n:.2%}, strict verdict {correct / n:.2%}")
    assert n == len(world.all_prompts()) * SEEDS == 3540
    assert exact == n, misses
    assert correct / n >= 0.995, misses
    assert correct == n, misses  # measured: 100 %


def test_detected_features_of_rendered_shapes():
    """Every size the renderer draws (7..12 px) at a few offsets: box, area, shape, centroid."""
    for shape in world.SHAPES:
        for size in range(7, 13):
            for x0, y0 in ((0, 0), (3, 5), (32 - size, 32 - size)):
                (obj,) = geneval.detect(_draw([(shape, "green", x0, y0, size)]))
                assert (obj.shape, obj.color, obj.box) == (shape, "green", (x0, y0, x0 + size, y0 + size))
                assert obj.area_px == int(
                    np.sum(_draw([(shape, "green", x0, y0, size)]) != BG, axis=-1).astype(bool).sum()
                )
                if shape == "square":
                    assert obj.fill == 1.0 and obj.taper == pytest.approx(0.0, abs=1e-9)
                    assert obj.centroid == (x0 + size / 2, y0 + size / 2)
                elif shape == "circle":
                    assert 0.74 < obj.fill < 0.82 and obj.taper == pytest.approx(0.0, abs=1e-9)
                else:  # measured on the box trimmed of the one-pixel apex and base corners
                    assert 0.6 < obj.fill < 0.75 and obj.taper > 0.55
                    assert obj.centroid[1] > y0 + size / 2  # bottom-heavy


def test_blobs_that_are_no_world_shape_are_unknown_and_match_no_clause():
    img = Image.new("RGB", (32, 32), world.BACKGROUND)
    draw = ImageDraw.Draw(img)
    draw.rectangle([1, 1, 20, 6], fill=world.COLORS["red"])  # elongated: aspect 20:6
    draw.polygon([(2, 12), (12, 12), (7, 22)], fill=world.COLORS["blue"])  # pointing down
    draw.rectangle([22, 16, 24, 26], fill=world.COLORS["green"])  # a plus: ragged, fill < 0.65
    draw.rectangle([18, 20, 28, 22], fill=world.COLORS["green"])
    objects = geneval.detect(np.asarray(img))
    assert sorted((o.color, o.shape) for o in objects) == [
        ("blue", "unknown"),
        ("green", "unknown"),
        ("red", "unknown"),
    ]
    for prompt in ("a photo of a square", "a photo of a triangle", "a photo of a circle", "a photo of a red square"):
        assert geneval.verdict(geneval.parse_prompt(prompt), objects) == (False, 0.0)


def test_batch_single_and_score_agree(rendered):
    specs = world.all_prompts()
    imgs = np.stack([rendered[s.prompt][3][0] for s in specs])
    batch = geneval.detect_batch(imgs)
    assert batch == [geneval.detect(im) for im in imgs]
    assert batch == geneval.detect_many(list(imgs))
    bchw = np.ascontiguousarray(imgs.transpose(0, 3, 1, 2))
    prompts = [s.prompt for s in specs]
    assert geneval.score(bchw, prompts, partial_credit=False) == [1.0] * len(specs)
    assert geneval.score(bchw, prompts, partial_credit=True) == [1.0] * len(specs)


def test_classify_pixels_matches_the_documented_rule():
    """The lookup table against a direct float64 evaluation of the rule on random colours."""
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.integers(0, 256, (20_000, 3)),
            # blends of each colour with the background and with noise: the boundary region
            *[
                np.clip(
                    np.array(world.BACKGROUND)
                    + rng.uniform(0.3, 1.1, (4000, 1)) * (np.array(c) - world.BACKGROUND)
                    + rng.normal(0, 30, (4000, 3)),
                    0,
                    255,
                ).round()
                for c in world.COLORS.values()
            ],
        ]
    ).astype(np.int64)
    bg = np.array(world.BACKGROUND, dtype=np.float64)
    best = np.full(len(x), np.inf)
    want = np.full(len(x), -1)
    for k, c in enumerate(world.COLORS.values()):
        d = np.array(c, dtype=np.float64) - bg
        share = (x - bg) @ d / (d @ d)
        dist2 = (((x - bg) - np.minimum(share, 1.0)[:, None] * d) ** 2).sum(axis=1)
        dist2[share < geneval.BLEND_THRESHOLD] = np.inf
        closer = dist2 < best
        best[closer], want[closer] = dist2[closer], k
    want[best > geneval.COLOR_DISTANCE_THRESHOLD**2] = -1
    got = geneval.classify_pixels(x.astype(np.uint8)[None])[0]
    assert (got != want).sum() <= 2  # only float rounding exactly on a boundary may differ
    off_palette = np.array(
        [[world.BACKGROUND, (0, 0, 0), (60, 60, 60), (255, 255, 255), (255, 0, 255)]], dtype=np.uint8
    )
    assert geneval.classify_pixels(off_palette).tolist() == [[-1] * 5]
    palette = np.array([list(world.COLORS.values())], dtype=np.uint8)
    assert geneval.classify_pixels(palette).tolist() == [list(range(5))]


# ------------------------------------------------------------------------------------ (b) negatives


def _strict_and_partial(img: np.ndarray, prompt: str) -> tuple[float, float]:
    bchw = img.transpose(2, 0, 1)[None]
    return (
        geneval.score(bchw, [prompt], partial_credit=False)[0],
        geneval.score(bchw, [prompt], partial_credit=True)[0],
    )


def test_incompatible_prompts_score_0(rendered):
    checked = 0
    for spec in world.all_prompts():
        others: list[tuple[str, float]] = []  # (other prompt, its expected partial credit)
        if spec.tag == "counting":
            c = spec.include[0]
            for n in world.NUMBERS:
                if n != c.count:
                    others.append((world.make_prompt("counting", (world.ObjectClause(c.shape, count=n),)).prompt, 0.0))
        elif spec.tag == "color_attr":
            a, b = spec.include
            swapped = (world.ObjectClause(a.shape, color=b.color), world.ObjectClause(b.shape, color=a.color))
            others.append((world.make_prompt("color_attr", swapped).prompt, 0.5))  # shapes present, colours wrong
        elif spec.tag == "position":
            rel = spec.include[1].position[0]
            opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}[rel]
            clauses = (spec.include[0], world.ObjectClause(spec.include[1].shape, position=(opposite, 0)))
            others.append((world.make_prompt("position", clauses).prompt, 2 / 3))  # both present, relation wrong
        elif spec.tag == "colors":
            c = spec.include[0]
            for color in world.COLORS:
                if color != c.color:
                    others.append((f"a photo of {'an' if c.shape[0] in 'aeiou' else 'a'} {color} {c.shape}", 0.5))
        elif spec.tag == "single_object":
            for shape in world.SHAPES:
                if shape != spec.include[0].shape:
                    others.append((f"a photo of a {shape}", 0.0))
        for img, _ in rendered[spec.prompt][:5]:
            for other, partial in others:
                assert _strict_and_partial(img, other) == (0.0, pytest.approx(partial)), (spec.prompt, other)
                checked += 1
    assert checked > 1000


def test_relations_are_checked_between_different_objects():
    img = _draw([("circle", "red", 2, 10, 9), ("square", "blue", 20, 10, 9)])
    assert _strict_and_partial(img, "a photo of a square right of a circle") == (1.0, 1.0)
    assert _strict_and_partial(img, "a photo of a circle left of a square") == (1.0, 1.0)
    assert _strict_and_partial(img, "a photo of a square above a circle") == (0.0, pytest.approx(2 / 3))
    assert _strict_and_partial(img, "a photo of a triangle left of a square") == (0.0, pytest.approx(1 / 3))
    # Two circles, one left of the other: a relation between two objects of one shape holds.
    two = _draw([("circle", "red", 2, 10, 9), ("circle", "blue", 20, 10, 9)])
    assert _strict_and_partial(two, "a photo of a circle right of a circle") == (1.0, 1.0)
    assert _strict_and_partial(_draw([("circle", "red", 2, 10, 9)]), "a photo of a circle right of a circle") == (
        0.0,
        pytest.approx(2 / 3),
    )


# ------------------------------------------------------------------------------------ (c) parsing


def test_parse_prompt_round_trips_every_prompt_and_the_prompt_files():
    for spec in world.all_prompts():
        assert geneval.parse_prompt(spec.prompt) == spec
    import json

    for path in (world.TRAIN_PROMPTS_PATH, world.TEST_PROMPTS_PATH):
        for line in path.read_text().splitlines():
            meta = json.loads(line)
            assert geneval.parse_prompt(meta["prompt"]).to_json() == meta


def test_parse_prompt_forgives_case_spacing_articles_and_a_full_stop():
    want = world.make_prompt(
        "color_attr", (world.ObjectClause("circle", color="red"), world.ObjectClause("triangle", color="blue"))
    )
    assert geneval.parse_prompt("  A photo of an red  circle and a BLUE triangle. ") == want
    assert geneval.parse_prompt("a photo of a red circle and a blue triangle").prompt == want.prompt


@pytest.mark.parametrize(
    "junk, why",
    [
        ("", "no template matches"),
        ("a photo of a dog", "no template matches"),
        ("a photo of five circles", "no template matches"),
        ("a photo of one circle", "no template matches"),
        ("a photo of a pink square", "no template matches"),
        ("a photo of a square below", "no template matches"),
        ("a photo of a red circle and a square", "both objects take a colour or neither"),
        ("a photo of a red circle left of a square", "position captions take no colours"),
        ("a photo of a circle and a circle", "two different shapes"),
    ],
)
def test_parse_prompt_rejects_junk_with_a_clear_message(junk, why):
    with pytest.raises(ValueError) as info:
        geneval.parse_prompt(junk)
    message = str(info.value)
    assert repr(junk) in message and why in message
    assert "a photo of a {shape} {left of|right of|above|below} a {shape}" in message  # lists the templates


def test_parse_prompt_rejects_a_non_string():
    with pytest.raises(ValueError, match="must be a string"):
        geneval.parse_prompt(3)


# ------------------------------------------------------------------------------ (d) RewardFn end to end


def test_reward_fn_geneval_shapes_partial_vs_strict():
    img = _draw([("circle", "red", 2, 3, 10), ("square", "blue", 18, 3, 10), ("triangle", "yellow", 10, 19, 10)])
    prompts = [
        "a photo of a red circle and a blue square",  # all 4 clauses hold
        "a photo of a red circle and a green square",  # 3 of 4 (the square is blue)
        "a photo of a triangle below a square",  # 3 of 3
        "a photo of a triangle above a circle",  # 2 of 3
        "a photo of two circles",  # 0 of 1
        "a photo of a purple triangle",  # 1 of 2
        "a photo of a circle and a triangle",  # 2 of 2
    ]
    images = np.stack([img.transpose(2, 0, 1)] * len(prompts))
    assert RewardConfig(kind="geneval_shapes").partial_credit is True
    partial = RewardFn(RewardConfig(kind="geneval_shapes"))(images, prompts)
    strict = RewardFn(RewardConfig(kind="geneval_shapes", partial_credit=False))(images, prompts)
    assert partial == pytest.approx([1.0, 0.75, 1.0, 2 / 3, 0.0, 0.5, 1.0])
    assert strict == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert all(isinstance(r, float) for r in partial + strict)


@pytest.mark.parametrize("kind", ["geneval_shapes", "ocr"])
def test_a_long_prompt_the_reward_cannot_score_is_named_short(kind):
    """Was: the refusal quoted the whole prompt, a 10.6 KB error line for a 10 000-character one;
    it now names the prompt's place and its first 80 characters."""
    long = "a photo of a red circle and a blue square" + " and a blue square" * 550
    fn = RewardFn(RewardConfig(kind=kind))
    good = "a photo of a circle" if kind == "geneval_shapes" else 'a sign that says "open"'
    with pytest.raises(RewardError) as exc:
        fn.check_prompts([good, long])
    line = str(exc.value)
    assert line.startswith("prompt 2: ") and f"… ({len(long)} characters)" in line, line[:300]
    assert len(line) < 1000 and "\n" not in line


def test_reward_fn_geneval_shapes_errors():
    fn = RewardFn(RewardConfig(kind="geneval_shapes"))
    images = np.full((2, 3, 32, 32), 245, dtype=np.uint8)
    with pytest.raises(RewardError, match=r"cannot parse 'a photo of a cat'.*accepted templates"):
        fn(images, ["a photo of a circle", "a photo of a cat"])
    with pytest.raises(RewardError, match="2 images but 1 prompts"):
        fn(images, ["a photo of a circle"])
    with pytest.raises(RewardError, match="uint8"):
        fn(images.astype(np.float32), ["a photo of a circle"] * 2)
    fn.check_prompts([s.prompt for s in world.all_prompts()])
    with pytest.raises(RewardError, match="a photo of a cat"):
        fn.check_prompts(["a photo of a circle", "a photo of a cat"])
    RewardFn(RewardConfig(kind="jpeg_compressibility")).check_prompts(["a photo of a cat"])  # any prompt


def test_reward_server_geneval_scorers_match_the_built_in_reward(rendered):
    assert parse_scorer_spec("geneval_shapes_partial:0.5") == ("geneval_shapes_partial", 0.5)
    specs = world.all_prompts()[::7]
    # Every other image scored against the next image's prompt: a mix of 0, partial and 1.
    images = np.stack([rendered[s.prompt][0][0].transpose(2, 0, 1) for s in specs])
    prompts = [s.prompt if i % 2 == 0 else specs[(i + 1) % len(specs)].prompt for i, s in enumerate(specs)]
    strict = RewardFn(RewardConfig(kind="geneval_shapes", partial_credit=False))(images, prompts)
    partial = RewardFn(RewardConfig(kind="geneval_shapes"))(images, prompts)
    assert 0 < sum(strict) < len(strict) and any(0 < p < 1 for p in partial)
    multi = build_multi_scorer({"geneval_shapes": 1.0, "geneval_shapes_partial": 2.0})
    with running(multi) as server:
        total = RewardFn(RewardConfig(kind="http", url=server.url, max_retries=1))(images, prompts)
    assert total == pytest.approx([s + 2 * p for s, p in zip(strict, partial)])
    # In process, with PIL images of two sizes (the 64×64 one is the 32×32 one upscaled).
    scorer = GenevalShapesScorer(partial_credit=True)
    pil = [
        Image.fromarray(images[0].transpose(1, 2, 0)),
        Image.fromarray(images[0].transpose(1, 2, 0)).resize((64, 64), Image.NEAREST),
    ]
    assert scorer(pil, [specs[0].prompt] * 2) == [1.0, 1.0]
    with pytest.raises(  # the request's fault: the server answers it 400 (ScorerInputError)
        ScorerInputError, match=r"scorer 'geneval_shapes_partial' refused the request: cannot parse 'a photo of a cat'"
    ):
        MultiScorer({"geneval_shapes_partial": (scorer, 1.0)}).score(pil[:1], ["a photo of a cat"])


# -------------------------------------------------------------------------------- (e) noise robustness


def test_blank_background_scores_0_with_no_detections():
    blank = np.broadcast_to(BG, (32, 32, 3)).copy()
    assert geneval.detect(blank) == []
    prompts = [s.prompt for s in world.all_prompts()]
    images = np.broadcast_to(blank.transpose(2, 0, 1), (len(prompts), 3, 32, 32)).copy()
    assert geneval.score(images, prompts, partial_credit=True) == [0.0] * len(prompts)
    # Tiny specks of palette colour are noise, not objects.
    specks = blank.copy()
    specks[4:8, 4:8] = world.COLORS["red"]  # a 4×4 patch: 16 px < MIN_AREA_PX
    specks[20, 3] = world.COLORS["blue"]
    assert geneval.detect(specks) == []


def test_salt_noise_keeps_the_verdict(rendered):
    """A few random pixels: 8 of random RGB anywhere, 6 of random palette colours on the
    background away from the objects (a palette-coloured pixel touching an object of its
    colour is part of it by definition)."""
    rng = np.random.default_rng(1)
    palette = np.array(list(world.COLORS.values()), dtype=np.uint8)
    n = 0
    for spec in world.all_prompts():
        for img, placed in rendered[spec.prompt][:4]:
            noisy = img.copy()
            ys, xs = rng.integers(0, 32, 8), rng.integers(0, 32, 8)
            noisy[ys, xs] = rng.integers(0, 256, (8, 3))
            is_bg = (img == BG).all(axis=-1)
            padded = np.pad(is_bg, 1, constant_values=True)
            free = np.argwhere(
                np.all([padded[1 + dy : 33 + dy, 1 + dx : 33 + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)], axis=0)
            )
            for y, x in free[rng.choice(len(free), 6, replace=False)]:
                noisy[y, x] = palette[rng.integers(0, 5)]
            objects = geneval.detect(noisy)
            assert geneval.verdict(spec, objects) == (True, 1.0), (spec.prompt, _key(placed), _key(objects))
            n += 1
    assert n == 4 * len(world.all_prompts())


def test_soft_edges_keep_the_verdict(rendered):
    """A Gaussian blur of σ = 0.8 px (soft edges, off-palette blends): the verdict holds on
    every image (the benchmark script measures heavier blur and noise)."""
    from PIL import ImageFilter

    for spec in world.all_prompts():
        imgs = [
            np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(0.8)))
            for img, _ in rendered[spec.prompt][:3]
        ]
        for objects in geneval.detect_batch(np.stack(imgs)):
            assert geneval.verdict(spec, objects)[0], (spec.prompt, _key(objects))


def test_detect_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[H, W, 3\] uint8"):
        geneval.detect(np.zeros((32, 32, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"\[H, W, 3\] uint8"):
        geneval.detect(np.zeros((32, 32), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\] uint8"):
        geneval.score(np.zeros((1, 32, 32, 3), dtype=np.uint8), ["a photo of a circle"], partial_credit=True)


def test_a_prompt_s_geneval_record_states_the_same_spec_its_caption_does():
    """The scorers judge by a prompt's metadata (its GenEval record) when present: for every
    caption of the world the record gives the parsed spec; something else falls back to parsing."""
    from spotlight.tasks.shapes.geneval import spec_from_metadata

    for spec in world.all_prompts():
        meta = {k: v for k, v in spec.to_json().items() if k != "prompt"}
        assert spec_from_metadata(spec.prompt, meta) == geneval.parse_prompt(spec.prompt)
    assert spec_from_metadata("a photo of a bench", {"tag": "single_object", "include": [{"class": "bench"}]}) is None
    assert spec_from_metadata("x", {}) is None and spec_from_metadata("x", None) is None


def test_metadata_decides_over_an_unparseable_caption(rendered):
    spec = world.all_prompts()[0]
    image = rendered[spec.prompt][0][0].transpose(2, 0, 1)[None]
    meta = {k: v for k, v in spec.to_json().items() if k != "prompt"}
    fn = RewardFn(RewardConfig(kind="geneval_shapes", partial_credit=False))
    with pytest.raises(RewardError):
        fn(image, ["a caption the parser does not know"])
    assert fn(image, ["a caption the parser does not know"], [meta]) == fn(image, [spec.prompt])
