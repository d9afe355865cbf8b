"""The reward HTTP client (spotlight/rewards/reward_fn.py) against real local HTTP servers that misbehave:
trickled answers, redirects, non-numeric rewards."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from spotlight.config import RewardConfig
from spotlight.rewards.reward_fn import RewardError, RewardFn, parse_rewards


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


class Service:
    """A loopback HTTP server whose POST answer is ``self.answer(handler)``."""

    def __init__(self, answer):
        self.answer = answer
        self.posts = 0
        self.stop = threading.Event()
        svc = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                svc.posts += 1
                svc.answer(self)

        self.httpd = _Server(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def send(h, code, body: bytes, headers=()):
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body)))
    for k, v in headers:
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


IMAGES = np.zeros((2, 3, 8, 8), dtype=np.uint8)


def score(url, **cfg):
    return RewardFn(RewardConfig(kind="http", url=url, **{"max_retries": 1, "timeout_s": 5.0, **cfg}))(
        IMAGES, ["a", "b"]
    )


def test_trickling_service_is_cut_off_by_the_overall_deadline():
    def trickle(h):  # valid headers, then a byte every 0.3 s, forever (until the test ends)
        h.close_connection = True
        h.send_response(200)
        h.send_header("Content-Length", "1000000")
        h.end_headers()
        h.wfile.flush()
        try:
            while not svc.stop.wait(0.3):
                h.wfile.write(b" ")
                h.wfile.flush()
        except OSError:
            pass

    svc = Service(trickle)
    try:
        with pytest.raises(
            RewardError, match=r"failed after 2 attempts: DeadlineExceeded: .*not complete within 1\.5s"
        ):
            score(svc.url, timeout_s=1.5, max_retries=2)
        assert svc.posts == 2
    finally:
        svc.close()


def test_oversized_answer_is_refused():
    svc = Service(lambda h: send(h, 200, b"[" + b" " * (2 << 20) + b"]"))
    try:
        with pytest.raises(RewardError, match="ResponseTooLarge: .*exceeds"):
            score(svc.url)
    finally:
        svc.close()


def test_redirect_is_an_error_and_not_followed():
    target = Service(lambda h: send(h, 200, b'{"rewards": [1, 2]}'))
    svc = Service(lambda h: send(h, 307, b"", [("Location", target.url)]))
    try:
        with pytest.raises(
            RewardError, match=r"answered HTTP 307 \(redirect to '.*/score'\); redirects are not followed"
        ):
            score(svc.url, max_retries=3)
        assert (svc.posts, target.posts) == (1, 0)  # no retry, no follow
        assert score(target.url) == [1.0, 2.0]
    finally:
        svc.close()
        target.close()


@pytest.mark.parametrize(
    "rewards,fragment",
    [
        (["1.0", 2], "reward 0 is str"),
        ([True, 0.5], "reward 0 is bool"),
        ([0.5, None], "reward 1 is NoneType null"),
        ([[0.5], 1], "reward 0 is list"),
        ([{"r": 1}, 1], "reward 0 is dict"),
        ([0.5], "returned 1 rewards for 2 images"),
        ([0.5, 1, 2], "returned 3 rewards for 2 images"),
    ],
)
def test_non_numeric_or_miscounted_rewards_are_refused(rewards, fragment):
    svc = Service(lambda h: send(h, 200, json.dumps({"rewards": rewards}).encode()))
    try:
        with pytest.raises(RewardError, match=fragment.replace("(", r"\(")):
            score(svc.url, max_retries=3)
        assert svc.posts == 1  # a malformed answer is not retried
    finally:
        svc.close()


@pytest.mark.parametrize(
    "body,fragment",
    [
        (b"not json", "not JSON"),
        (b'{"r": []}', "expected"),
        (b"[1, 2]", "expected"),
        (b'{"rewards": [1e999, 1]}', None),
    ],
)
def test_malformed_bodies(body, fragment):
    if fragment is None:  # 1e999 parses to inf: a number, kept (trainable_samples drops it)
        assert parse_rewards(body, 2) == [math.inf, 1.0]
        return
    with pytest.raises(RewardError, match=fragment):
        parse_rewards(body, 2)


def test_nan_and_ints_are_numbers_and_nan_is_dropped_downstream():
    svc = Service(lambda h: send(h, 200, b'{"rewards": [NaN, 3]}'))
    try:
        r = score(svc.url)
    finally:
        svc.close()
    assert math.isnan(r[0]) and r[1] == 3.0 and type(r[1]) is float
    import torch

    from spotlight.core.request_scheduler import RequestKind
    from spotlight.rewards.reward_fn import finite_rewards
    from spotlight.rl.batch import Sample, trainable_samples  # the coordinator's filter

    assert finite_rewards(r) == [False, True]
    samples = [
        Sample(
            request_id=f"r{i}",
            kind=list(RequestKind)[0],
            iteration=0,
            slot=i,
            prompt_index=0,
            seed=i,
            batch_id="b",
            image=torch.zeros(3, 2, 2),
        )
        for i in range(2)
    ]
    for s, v in zip(samples, r):
        s.reward = v
    kept, counts = trainable_samples(samples)
    assert [s.request_id for s in kept] == ["r1"] and counts["nonfinite_reward"] == 1
