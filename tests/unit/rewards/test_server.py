"""The JSON reward server (spotlight/rewards/server.py) over real HTTP on 127.0.0.1.

Servers bind port 0 and run ``serve_forever`` in a daemon thread; requests are synchronous,
so no sleeps are needed. The CLIP scorer runs a tiny random-weight CLIP built offline
(spotlight/models/tiny_clip.py).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from PIL import Image

from spotlight.config import RewardConfig
from spotlight.rewards.reward_fn import RewardError, RewardFn, jpeg_size_kb
from spotlight.rewards.server import (
    PICKSCORE_SCALE,
    ClipScorer,
    JpegScorer,
    MultiScorer,
    build_multi_scorer,
    make_server,
    parse_scorer_spec,
    parse_scorer_specs,
)

pytestmark = pytest.mark.timeout(120)

MAX_BODY = 256 * 1024


@contextlib.contextmanager
def running(multi: MultiScorer, **limits):
    server = make_server(multi, "127.0.0.1", 0, **limits)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def images_bchw(n: int, seed: int = 0, size: int = 40) -> np.ndarray:
    """Images of different JPEG sizes: smooth gradients plus noise of increasing strength."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, 3, size, size), dtype=np.uint8)
    ramp = np.linspace(0, 255, size)[None, :, None] + np.linspace(0, 64, size)[None, None, :]
    for i in range(n):
        noisy = ramp + rng.normal(0, 10 + 30 * i, size=(3, size, size))
        out[i] = np.clip(noisy, 0, 255).astype(np.uint8)
    return out


def b64(image_hwc: np.ndarray, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.fromarray(image_hwc).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def hwc(images: np.ndarray) -> list[np.ndarray]:
    return [np.ascontiguousarray(im.transpose(1, 2, 0)) for im in images]


def v2(payload: dict) -> dict:
    """``payload`` as a version-2 request: ``version`` and one ``{}`` of metadata per image added."""
    out = {"version": 2, **payload}
    if isinstance(payload.get("images"), list):
        out.setdefault("metadata", [{} for _ in payload["images"]])
    return out


def good_payload(n: int = 2) -> dict:
    return v2({"images": [b64(im) for im in hwc(images_bchw(n))], "prompts": [f"prompt {i}" for i in range(n)]})


@pytest.fixture(scope="module")
def jpeg_server():
    multi = MultiScorer(
        {"jpeg_compressibility": (JpegScorer(-1.0), 1.0), "jpeg_incompressibility": (JpegScorer(+1.0), 0.25)}
    )
    with running(multi, max_body_bytes=MAX_BODY, max_batch=8) as server:
        yield server


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from spotlight.models.tiny_clip import make_random_clip

    return make_random_clip(tmp_path_factory.mktemp("tiny-clip"), seed=0)


@pytest.fixture(scope="module")
def clip_scorer(clip_dir):
    return ClipScorer(clip_dir, device="cpu")


# --------------------------------------------------------------------------------- JPEG + client


def test_existing_client_gets_jpeg_rewards_over_http():
    multi = MultiScorer({"jpeg_compressibility": (JpegScorer(-1.0), 1.0)})
    images = images_bchw(3)
    with running(multi) as server:
        rewards = RewardFn(RewardConfig(kind="http", url=server.url, max_retries=1))(images, ["a", "b", "c"])
    expected = [-jpeg_size_kb(im) for im in hwc(images)]
    assert rewards == expected
    assert len(set(expected)) == 3  # the images really differ, so order is checked too


def test_weighted_sum_equals_weighted_per_scorer_values(jpeg_server):
    payload = good_payload(3)
    resp = requests.post(jpeg_server.url, json=payload, timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    sizes = [jpeg_size_kb(im) for im in hwc(images_bchw(3))]
    assert body["scores"]["jpeg_compressibility"] == [-s for s in sizes]
    assert body["scores"]["jpeg_incompressibility"] == sizes
    assert body["rewards"] == pytest.approx([-s + 0.25 * s for s in sizes], rel=1e-12)
    # /score is the same endpoint
    again = requests.post(jpeg_server.url + "score", json=payload, timeout=30).json()
    assert again == body


def test_jpeg_and_data_url_images_are_accepted(jpeg_server):
    im = hwc(images_bchw(1))[0]
    payload = v2({"images": [b64(im, "JPEG"), "data:image/png;base64," + b64(im)], "prompts": ["x", "y"]})
    resp = requests.post(jpeg_server.url, json=payload, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["scores"]["jpeg_incompressibility"][1] == jpeg_size_kb(im)


def test_health_lists_scorers_and_weights(jpeg_server):
    resp = requests.get(jpeg_server.url + "health", timeout=10)
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "scorers": {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.25}}


# ------------------------------------------------------------------------------------ bad inputs


def _gif_b64() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, format="GIF")
    return base64.b64encode(buf.getvalue()).decode()


BAD_REQUESTS = {
    "malformed_json": (dict(data=b'{"images": [', headers={"Content-Type": "application/json"}), 400, "malformed JSON"),
    "not_an_object": (dict(json=[1, 2]), 400, "JSON object"),
    "missing_prompts": (dict(json={"images": []}), 400, "'prompts'"),
    "wrong_lengths": (
        dict(json={"images": [b64(np.zeros((8, 8, 3), np.uint8))], "prompts": ["a", "b"]}),
        400,
        "len(images) = 1 != len(prompts) = 2",
    ),
    "not_base64": (dict(json={"images": ["@@not base64@@"], "prompts": ["a"]}), 400, "not valid base64"),
    "base64_not_image": (
        dict(json={"images": [base64.b64encode(b"hello world").decode()], "prompts": ["a"]}),
        400,
        "not a decodable PNG/JPEG",
    ),
    "gif_image": (dict(json={"images": [_gif_b64()], "prompts": ["a"]}), 400, "GIF"),
    "prompt_not_string": (
        dict(json={"images": [b64(np.zeros((8, 8, 3), np.uint8))], "prompts": [3]}),
        400,
        "prompts[0]",
    ),
    "batch_over_limit": (dict(json={"images": ["x"] * 9, "prompts": ["a"] * 9}), 400, "over the limit 8"),
    "wrong_content_type": (
        dict(data=json.dumps({"images": [], "prompts": []}), headers={"Content-Type": "text/plain"}),
        415,
        "application/json",
    ),
    "version_1": (
        dict(json={"images": [b64(np.zeros((8, 8, 3), np.uint8))], "prompts": ["a"]}, raw=True),
        400,
        "reward protocol version 1 (no 'version' key: version 1, without per-image metadata) is not served",
    ),
    "version_3": (dict(json={"version": 3, "images": [], "prompts": [], "metadata": []}, raw=True), 400, "version 3"),
    "metadata_not_object": (
        dict(json={"images": [b64(np.zeros((8, 8, 3), np.uint8))], "prompts": ["a"], "metadata": ["tag"]}),
        400,
        "metadata[0] is a str",
    ),
    "wrong_metadata_length": (
        dict(json={"images": [b64(np.zeros((8, 8, 3), np.uint8))], "prompts": ["a"], "metadata": []}),
        400,
        "len(images) = 1 != len(metadata) = 0",
    ),
    "oversize_body": (
        dict(data=b"x" * (2 * MAX_BODY), headers={"Content-Type": "application/json"}),
        413,
        "over the limit",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_json_error_and_server_keeps_serving(jpeg_server, case):
    kwargs, status, fragment = BAD_REQUESTS[case]
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("json"), dict) and not kwargs.pop("raw", False):
        kwargs["json"] = v2(kwargs["json"])
    kwargs.pop("raw", None)
    with requests.Session() as session:
        resp = session.post(jpeg_server.url, timeout=30, **kwargs)
        assert resp.status_code == status, resp.text
        assert resp.headers["Content-Type"] == "application/json"
        assert fragment in resp.json()["error"]
        ok = session.post(jpeg_server.url, json=good_payload(1), timeout=30)  # same session, maybe same connection
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["rewards"]) == 1


def test_oversize_content_length_is_refused_without_reading_the_body(jpeg_server):
    conn = http.client.HTTPConnection("127.0.0.1", jpeg_server.server_address[1], timeout=30)
    try:
        conn.putrequest("POST", "/")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(10**12))  # a terabyte that is never sent
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413
        assert "over the limit" in json.loads(resp.read())["error"]
    finally:
        conn.close()
    assert requests.post(jpeg_server.url, json=good_payload(1), timeout=30).status_code == 200


def test_unknown_path_is_404_json(jpeg_server):
    resp = requests.get(jpeg_server.url + "nope", timeout=10)
    assert resp.status_code == 404 and "no such path" in resp.json()["error"]
    resp = requests.post(jpeg_server.url + "nope", json=good_payload(1), timeout=10)
    assert resp.status_code == 404 and "no such path" in resp.json()["error"]


class _NanScorer:
    thread_safe = True

    def __call__(self, images, prompts):
        return [float("nan")] * len(images)


class _BrokenScorer:
    thread_safe = False

    def __call__(self, images, prompts):
        raise RuntimeError("model fell over")


@pytest.mark.parametrize("bad, fragment", [(_NanScorer(), "non-finite"), (_BrokenScorer(), "model fell over")])
def test_scorer_failure_is_500_naming_the_scorer(bad, fragment):
    multi = MultiScorer({"jpeg_compressibility": (JpegScorer(-1.0), 1.0), "flaky": (bad, 1.0)})
    with running(multi) as server:
        resp = requests.post(server.url, json=good_payload(2), timeout=30)
        assert resp.status_code == 500
        assert "'flaky'" in resp.json()["error"] and fragment in resp.json()["error"]
        assert requests.get(server.url + "health", timeout=10).status_code == 200


def test_a_prompt_a_scorer_refuses_is_400_naming_scorer_and_prompt():
    """A caption the shapes scorer cannot parse is the client's error (400, one line), not a
    server failure; the server keeps serving."""
    multi = build_multi_scorer(parse_scorer_specs(["geneval_shapes"]))
    with running(multi) as server:
        payload = good_payload(1) | {"prompts": ["a photo of a dragon"]}
        resp = requests.post(server.url, json=payload, timeout=30)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert "'geneval_shapes'" in error and "a photo of a dragon" in error and "\n" not in error
        ok = good_payload(1) | {"prompts": ["a photo of a red circle"]}
        assert requests.post(server.url, json=ok, timeout=30).status_code == 200


# ------------------------------------------------------------------------------------------ CLIP


def test_clip_scores_are_finite_deterministic_and_input_dependent(clip_scorer):
    ims = [Image.fromarray(im) for im in hwc(images_bchw(2, seed=1))]
    first = clip_scorer([ims[0], ims[0], ims[1]], ["a photo of a cat", "a photo of a red dog", "a photo of a cat"])
    second = clip_scorer([ims[0], ims[0], ims[1]], ["a photo of a cat", "a photo of a red dog", "a photo of a cat"])
    assert all(math.isfinite(s) for s in first)
    assert first == second
    assert first[0] != first[1]  # different prompt, same image
    assert first[0] != first[2]  # different image, same prompt
    assert abs(first[0]) <= clip_scorer.model.logit_scale.exp().item() / PICKSCORE_SCALE + 1e-6


def test_clip_score_matches_clip_forward_logits(clip_scorer, clip_dir):
    """Cross-check against CLIPModel.forward: logits_per_image diagonal / 26."""
    import torch
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(str(clip_dir), local_files_only=True).float().eval()
    proc = CLIPProcessor.from_pretrained(str(clip_dir), local_files_only=True)
    ims = [Image.fromarray(im) for im in hwc(images_bchw(3, seed=2, size=48))]
    prompts = ["the cat", "a blue photo of a dog", "of"]
    with torch.no_grad():
        out = model(**proc(text=prompts, images=ims, return_tensors="pt", padding=True))
    expected = (out.logits_per_image.diagonal() / PICKSCORE_SCALE).tolist()
    assert clip_scorer(ims, prompts) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_clip_and_pickscore_over_http_with_weights(clip_dir, clip_scorer):
    multi = build_multi_scorer({"pickscore": 2.0, "jpeg_incompressibility": 0.1}, clip_path=clip_dir, device="cpu")
    payload = good_payload(3)
    payload["prompts"] = ["a cat", "a dog", "the red photo"]
    with running(multi) as server:
        with ThreadPoolExecutor(4) as pool:  # concurrent requests: the CLIP scorer is behind a lock
            bodies = list(pool.map(lambda _: requests.post(server.url, json=payload, timeout=60).json(), range(4)))
        health = requests.get(server.url + "health", timeout=10).json()
    assert all(b == bodies[0] for b in bodies)
    body = bodies[0]
    ims = [Image.fromarray(im) for im in hwc(images_bchw(3))]
    assert body["scores"]["pickscore"] == pytest.approx(clip_scorer(ims, payload["prompts"]), rel=1e-6)
    expected = [
        2.0 * c + 0.1 * j for c, j in zip(body["scores"]["pickscore"], body["scores"]["jpeg_incompressibility"])
    ]
    assert body["rewards"] == pytest.approx(expected, rel=1e-12)
    assert health["scorers"] == {"pickscore": 2.0, "jpeg_incompressibility": 0.1}


def test_clip_scorer_rejects_bad_paths(tmp_path):
    from spotlight.errors import SpotlightError

    with pytest.raises(SpotlightError, match="not a directory"):
        ClipScorer(tmp_path / "missing")
    with pytest.raises(SpotlightError, match="config.json"):
        ClipScorer(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(SpotlightError, match="expected 'clip'"):
        ClipScorer(tmp_path)


# ------------------------------------------------------------------------------------- specs + CLI


def test_parse_scorer_spec():
    assert parse_scorer_spec("clip:1.5") == ("clip", 1.5)
    assert parse_scorer_spec("jpeg_compressibility") == ("jpeg_compressibility", 1.0)
    assert parse_scorer_spec("pickscore:-0.5") == ("pickscore", -0.5)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--scorer", "imagereward"], "scorer 'imagereward' is not built in: its package (image-reward 1.5) pins"),
        (["--scorer", "hpsv2:0.5"], "scorer 'hpsv2' is not built in"),
        (["--scorer", "dreamsim"], "unknown scorer 'dreamsim'"),
        (["--scorer", "aesthetic"], "needs --aesthetic-head"),
        (["--scorer", "clip:heavy"], "bad weight 'heavy'"),
        (["--scorer", "jpeg_compressibility:nan"], "must be finite"),
        (["--scorer", "clip"], "needs --clip-path"),
        (["--scorer", "clip", "--clip-path", "/nonexistent/clip"], "not a directory"),
        ([], "at least one --scorer"),
    ],
)
def test_cli_rejects_bad_arguments(args, fragment):
    from typer.testing import CliRunner

    from spotlight.cli import app

    result = CliRunner().invoke(app, ["reward-server", *args])
    assert result.exit_code == 2, result.output
    assert fragment in result.output
    assert "Traceback" not in result.output


class _MetadataRecorder:
    """A custom scorer that takes ``metadata``: it records what it is given and scores each
    image by its prompt's ``count`` field."""

    thread_safe = False

    def __init__(self):
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, images, prompts, metadata):
        self.seen += list(zip(prompts, metadata))
        return [float(m.get("count", 0)) for m in metadata]


class _PromptsOnly:
    thread_safe = True

    def __call__(self, images, prompts):
        return [1.0] * len(images)


def test_custom_scorer_sees_each_prompt_s_metadata_from_the_prompt_file(tmp_path):
    """Prompt file → prompt set → the coordinator's reward scorer → RewardFn (HTTP, protocol
    version 2) → a real reward server → a custom scorer: each image arrives with its prompt's
    record fields; a scorer without a ``metadata`` parameter is called as before."""
    import time

    from spotlight.coordinator.reward_scorer import RewardScorer
    from spotlight.tasks.prompts import load_prompt_set

    rows = [
        {"tag": "counting", "include": [{"class": "cow", "count": 2}], "count": 2, "prompt": "two cows"},
        {"tag": "ocr", "ocr_target": "OPEN", "count": 0, "prompt": 'a sign that reads "OPEN"'},
        {"tag": "counting", "count": 3, "prompt": "three cats"},
    ]
    f = tmp_path / "meta.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_prompt_set(f)
    recorder = _MetadataRecorder()
    multi = MultiScorer({"meta": (recorder, 1.0), "plain": (_PromptsOnly(), 0.5)})
    with running(multi) as server:
        cfg = RewardConfig(kind="http", url=server.url, max_retries=1)
        scorer = RewardScorer(RewardFn(cfg), cfg)
        order = [2, 0, 1, 0]  # prompt indices of the four samples
        scorer.submit(
            [f"r{i}" for i in range(4)],
            images_bchw(4, size=16),
            [ps.prompts[i] for i in order],
            [ps.metadata[i] for i in order],
        )
        got: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while len(got) < 4 and time.monotonic() < deadline and scorer.error is None:
            got.update(scorer.poll(time.monotonic()))
            time.sleep(0.01)
        scorer.close()
    assert scorer.error is None and got == {"r0": 3.5, "r1": 2.5, "r2": 0.5, "r3": 2.5}
    expected = [(rows[i]["prompt"], {k: v for k, v in rows[i].items() if k != "prompt"}) for i in order]
    assert recorder.seen == expected
    assert recorder.seen[2][1]["ocr_target"] == "OPEN" and recorder.seen[1][1]["include"][0]["class"] == "cow"


def test_builtin_reward_passes_metadata_to_the_ocr_scorer():
    from spotlight.rewards.ocr import render_text_image

    img = np.asarray(render_text_image("OPEN").convert("RGB")).transpose(2, 0, 1)[None]
    fn = RewardFn(RewardConfig(kind="ocr"))
    # the prompt has no quoted target: metadata's ocr_target is what it is scored against
    (r,) = fn(img, ["a shop sign"], [{"ocr_target": "OPEN"}])
    assert r > 0.5
    with pytest.raises(RewardError, match="1 images but 2 metadata records"):
        fn(img, ["a shop sign"], [{}, {}])
