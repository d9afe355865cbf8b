"""GenEval's rules on detections (``spotlight/rewards/geneval.py``), their agreement with the
shapes task's verdict where the rules coincide, and the scorer's plumbing with a tiny random
transformers detector and CLIP on a real reward server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spotlight.rewards.geneval import (
    COUNTING_THRESHOLD,
    THRESHOLD,
    Detection,
    check_record,
    load_metadata,
    verdict,
)


def D(label, box, score=0.95):
    return Detection(label, score, box)


SINGLE = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
COUNT3 = {"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]}
COLOR = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
LEFT = {
    "tag": "position",
    "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}],
}


def test_presence_uses_the_confidence_threshold():
    assert verdict(SINGLE, [D("dog", (0, 0, 10, 10), THRESHOLD + 0.01)]) == (True, 1.0)
    assert verdict(SINGLE, [D("dog", (0, 0, 10, 10), THRESHOLD - 0.01)]) == (False, 0.0)
    assert verdict(SINGLE, [D("cat", (0, 0, 10, 10))]) == (False, 0.0)


def test_counting_is_exact_and_uses_the_counting_threshold():
    boxes = [(i * 10, 0, i * 10 + 8, 8) for i in range(4)]
    assert verdict(COUNT3, [D("cup", b) for b in boxes[:3]])[0]
    assert verdict(COUNT3, [D("cup", b) for b in boxes]) == (False, 0.5)  # four: the exclude fails
    low = [D("cup", b, COUNTING_THRESHOLD - 0.05) for b in boxes[:3]]
    assert not verdict(COUNT3, low)[0]  # confident enough for a single object, not for counting


def test_colour_clause_uses_the_classifier_on_the_matched_objects():
    car = D("car", (0, 0, 10, 10))
    assert verdict(COLOR, [car], lambda d: "red") == (True, 1.0)
    assert verdict(COLOR, [car], lambda d: "blue") == (False, 0.5)
    with pytest.raises(ValueError, match="colour"):
        verdict(COLOR, [car])


@pytest.mark.parametrize(
    "record, fragment",
    [
        ([1], "must be a JSON object"),
        ({"tag": "single_object"}, "no include or exclude"),
        ({"include": {"class": "dog"}}, "'include' must be a list"),
        ({"include": [{"count": 1}]}, "needs a 'class'"),
        ({"include": [{"class": "dog", "count": 0}]}, "'count' must be an integer >= 1"),
        ({"include": [{"class": "dog", "count": 1, "color": 3}]}, "'color' must be a string"),
        ({"include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]}, "earlier include entry"),
        ({"include": [{"class": "dog", "count": 1}], "exclude": [{"class": "dog"}]}, "exclude[0]"),
    ],
)
def test_malformed_records_are_input_errors_naming_the_fault(record, fragment):
    from spotlight.errors import InputError

    with pytest.raises(InputError, match=fragment.replace("[", r"\[")):
        check_record(record)
    with pytest.raises(ValueError):  # an InputError is a ValueError too
        verdict(record, [])


def test_every_shipped_geneval_record_is_well_formed():
    from spotlight.config import EXAMPLES_DIR

    for f in (
        EXAMPLES_DIR / "default/prompts/evaluation_metadata.jsonl",
        EXAMPLES_DIR / "prompts/geneval/train_metadata.jsonl",
    ):
        for line in f.read_text().splitlines():
            check_record(json.loads(line))


def test_position_needs_every_pair_and_a_matched_target():
    cat, dog_left, dog_right = D("cat", (50, 0, 60, 10)), D("dog", (0, 0, 10, 10)), D("dog", (90, 0, 100, 10))
    assert verdict(LEFT, [cat, dog_left]) == (True, 1.0)
    assert verdict(LEFT, [cat, dog_right]) == (False, 2 / 3)
    assert verdict(LEFT, [dog_left]) == (False, 1 / 3)  # no cat: the position cannot hold either


def test_metadata_files_and_bad_records(tmp_path):
    good = tmp_path / "m.jsonl"
    good.write_text(json.dumps(SINGLE | {"prompt": "a photo of a dog"}) + "\n\n")
    assert load_metadata([good])["a photo of a dog"]["tag"] == "single_object"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tag": "x"}\n')
    from spotlight.errors import SpotlightError

    with pytest.raises(SpotlightError, match="bad.jsonl:1"):
        load_metadata([bad])
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "a caf\xe9"}\n')
    with pytest.raises(SpotlightError, match="latin1.jsonl:1: not UTF-8 text"):  # was a UnicodeDecodeError
        load_metadata([latin1])
    from spotlight.config import REPO_ROOT

    published = load_metadata([REPO_ROOT / "examples/default/prompts/evaluation_metadata.jsonl"])
    assert len(published) == 553


def test_agrees_with_the_shapes_verdict_on_rendered_scenes():
    """Where the rules coincide (one object per clause), GenEval's rules on the shapes detector's
    objects give the shapes task's own verdict, strict and partial."""
    from spotlight.tasks.shapes import geneval as shapes
    from spotlight.tasks.shapes import world

    records = [json.loads(line) for line in world.TEST_PROMPTS_PATH.read_text().splitlines()]
    rng = np.random.default_rng(0)
    specs = {s.prompt: s for s in world.all_prompts()}
    checked = 0
    for rec in records:
        spec = specs[rec["prompt"]]
        for _ in range(3):
            image, _placed = world.render(specs[rng.choice(list(specs))] if rng.random() < 0.5 else spec, rng)
            objects = shapes.detect(image)
            dets = [Detection(o.shape, 1.0, tuple(float(v) for v in o.box)) for o in objects]
            colour = {tuple(float(v) for v in o.box): o.color for o in objects}
            got = verdict(rec, dets, lambda d: colour[d.box])
            want = shapes.verdict(spec, objects)
            assert got[0] == want[0], (rec["prompt"], objects)
            checked += 1
    assert checked == 3 * len(records)


@pytest.fixture(scope="module")
def tiny_detector(tmp_path_factory):
    import torch
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    try:
        from transformers import DetrImageProcessorPil as Processor
    except ImportError:  # transformers 4.x
        from transformers import DetrImageProcessor as Processor

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("detr")
    labels = {0: "dog", 1: "cat", 2: "car"}
    backbone = ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 16], depths=[1, 1, 1, 1], out_features=["stage4"])
    cfg = DetrConfig(
        use_timm_backbone=False,
        backbone_config=backbone,
        use_pretrained_backbone=False,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        num_queries=8,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    DetrForObjectDetection(cfg).save_pretrained(path)
    Processor(size={"shortest_edge": 64, "longest_edge": 64}).save_pretrained(path)
    return path


def test_scorer_on_a_real_server_with_a_tiny_detector_and_clip(tiny_detector, tmp_path):
    import requests

    from spotlight.models.tiny_clip import make_random_clip
    from spotlight.rewards.server import build_multi_scorer
    from tests.unit.rewards.test_server import b64, running

    clip = make_random_clip(tmp_path / "clip")
    meta = tmp_path / "meta.jsonl"
    meta.write_text("".join(json.dumps(r | {"prompt": p}) + "\n" for r, p in ((SINGLE, "a dog"), (COLOR, "a red car"))))
    multi = build_multi_scorer(
        {"geneval_partial": 1.0}, detector_path=tiny_detector, clip_path=clip, geneval_metadata=[meta], device="cpu"
    )
    rng = np.random.default_rng(0)
    images = [b64(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)) for _ in range(2)]
    with running(multi) as server:
        r = requests.post(
            server.url,
            json={"version": 2, "images": images, "prompts": ["a dog", "a red car"], "metadata": [{}, {}]},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        rewards = r.json()["rewards"]
        assert len(rewards) == 2 and all(0.0 <= v <= 1.0 for v in rewards)
        r = requests.post(
            server.url,
            json={"version": 2, "images": images[:1], "prompts": ["nobody described this"], "metadata": [{}]},
            timeout=60,
        )
        assert r.status_code == 400 and "no GenEval metadata" in r.json()["error"]  # the request's fault
        bad = {"tag": "counting", "include": [{"class": "cup", "count": "three"}]}
        r = requests.post(
            server.url,
            json={"version": 2, "images": images[:1], "prompts": ["three cups"], "metadata": [bad]},
            timeout=60,
        )
        assert r.status_code == 400 and "'count' must be an integer" in r.json()["error"]
        meta = SINGLE | {"prompt": "nobody described this"}  # the record on the wire is used first
        r = requests.post(
            server.url,
            json={"version": 2, "images": images[:1], "prompts": ["nobody described this"], "metadata": [meta]},
            timeout=60,
        )
        assert r.status_code == 200, r.text


def test_missing_detector_is_one_clear_error(tmp_path):
    from spotlight.errors import SpotlightError
    from spotlight.rewards.server import build_scorer

    with pytest.raises(SpotlightError, match="--detector-path"):
        build_scorer("geneval")
    with pytest.raises(SpotlightError, match="no config.json"):
        build_scorer("geneval", detector_path=tmp_path)
