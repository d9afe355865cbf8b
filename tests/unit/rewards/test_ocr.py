"""The OCR reward (spotlight/rewards/ocr.py): Flow-GRPO's edit-distance formula, and RapidOCR
(models inside its wheel, no network) reading rendered text, built in and over HTTP."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import requests

from spotlight.config import ConfigError, RewardConfig, config_from_dict
from spotlight.rewards.ocr import OcrScorer, levenshtein, ocr_reward, prompt_target, render_text_image
from spotlight.rewards.reward_fn import RewardError, RewardFn
from spotlight.rewards.server import build_multi_scorer, parse_scorer_specs
from tests.unit.rewards.test_server import running

pytestmark = pytest.mark.timeout(300)

SIGN = 'A high-fashion runway with a sleek backdrop displaying "Spring Collection 2024".'


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0


@pytest.mark.parametrize(
    ("recognised", "target", "expected"),
    [
        ("Spring Collection 2024", "Spring Collection 2024", 1.0),
        ("SPRINGCOLLECTION 2024", "Spring Collection 2024", 1.0),  # spaces and case do not count
        ("New: Spring Collection 2024!", "Spring Collection 2024", 1.0),  # the target occurs in it
        ("", "Spring", 0.0),
        ("Sprinq", "Spring", 1 - 1 / 6),
        ("completely different words here", "ab", 0.0),  # the distance is capped at |t|
    ],
)
def test_reward_formula(recognised, target, expected):
    assert ocr_reward(recognised, target) == pytest.approx(expected)


def test_prompt_target_is_the_first_quoted_span():
    assert prompt_target(SIGN) == "Spring Collection 2024"
    with pytest.raises(ValueError, match="quoted"):
        prompt_target("a sign with no quotes")


@pytest.fixture(scope="module")
def scorer():
    return OcrScorer()


def test_rendered_sign_scores_near_one_and_wrong_text_near_zero(scorer):
    right = render_text_image("Spring Collection 2024")
    wrong = render_text_image("Ocean Breeze Hotel")
    blank = render_text_image("")
    scores = scorer([right, wrong, blank], [SIGN] * 3)
    assert scores[0] >= 0.95
    assert scores[1] <= 0.35
    assert scores[2] == 0.0


def test_metadata_target_wins_over_the_prompt(scorer):
    im = render_text_image("Gone Fishing")
    assert scorer([im], ["no quotes here"], [{"ocr_target": "Gone Fishing"}]) == [pytest.approx(1.0)]


def test_built_in_reward_kind_ocr():
    im = np.asarray(render_text_image("Spring Collection 2024", size_px=256, font_px=24))
    fn = RewardFn(RewardConfig(kind="ocr"))
    (r,) = fn(im.transpose(2, 0, 1)[None].copy(), [SIGN])
    assert r >= 0.95
    with pytest.raises(RewardError, match="quoted"):
        fn.check_prompts(["no target"])


def test_config_accepts_kind_ocr():
    cfg = config_from_dict({"reward": {"kind": "ocr"}})
    assert cfg.reward.kind == "ocr"


def test_config_refuses_ocr_without_rapidocr(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "rapidocr_onnxruntime" else real(n, *a))
    with pytest.raises(ConfigError, match="spotlight-rl\\[ocr\\]"):
        RewardConfig(kind="ocr")


def test_reward_server_scorer_ocr_over_http():
    multi = build_multi_scorer(parse_scorer_specs(["ocr"]))

    def png(im) -> str:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    images = [render_text_image("Spring Collection 2024"), render_text_image("Winter Clearance")]
    with running(multi) as server:
        both = {"version": 2, "images": [png(i) for i in images], "prompts": [SIGN, SIGN], "metadata": [{}, {}]}
        body = requests.post(server.url, json=both).json()
        one = {"version": 2, "images": [png(images[0])], "prompts": ["no quotes"], "metadata": [{}]}
        bad = requests.post(server.url, json=one)
    assert body["rewards"][0] >= 0.95
    assert body["rewards"][1] <= 0.5
    assert bad.status_code == 400 and "ocr" in bad.json()["error"] and "no quotes" in bad.json()["error"]
