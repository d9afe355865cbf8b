"""Reward scoring: built-in rewards (DDPO JPEG, shapes-world GenEval, OCR) and a client for an
HTTP reward service.

Built-ins (Black et al. 2023, DDPO; Flow-GRPO ``rewards.py``):
    * ``jpeg_compressibility``   = −(JPEG size at quality 95 in kB)
    * ``jpeg_incompressibility`` = +(JPEG size in kB)
    * ``geneval_shapes``         = GenEval verdict of the image for its prompt, computed by
      the rule-based detector of :mod:`spotlight.tasks.shapes.geneval` (shapes-world captions
      only): with ``partial_credit`` (the default, for training) the fraction of the
      prompt's clauses that hold, in [0, 1]; without it the strict 0/1 verdict. Never NaN.
    * ``ocr``                    = Flow-GRPO's OCR reward, 1 − normalised edit distance between
      the prompt's quoted text and the text RapidOCR reads (:mod:`spotlight.rewards.ocr`).

HTTP reward service protocol (JSON only — never pickle; Flow-GRPO's reward server uses
pickle, which is remote code execution for whoever can reach it)::

    POST <url>            Content-Type: application/json
    {"version": 2, "images": ["<base64 PNG>", ...], "prompts": ["...", ...],
     "metadata": [{...}, ...]}
    200 → {"rewards": [float, ...]}     (same length and order)

``metadata`` is one JSON object per image: its prompt's record fields as the prompt file has
them (GenEval's ``tag`` / ``include`` / ``exclude``, an ``ocr_target``, a CSV/TSV row's other
columns; ``{}`` for a plain-text prompt). ``version`` is :data:`REWARD_PROTOCOL_VERSION`;
version 1 had no ``version`` key and no ``metadata``.

Each reward is a JSON number (``NaN``/``Infinity`` are accepted: the coordinator's
``trainable_samples`` drops samples with a non-finite reward and counts them); a string, a
bool, ``null``, a list or a wrong count is a malformed answer.  Redirects are not followed:
a 3xx is an error.  Each attempt must deliver its whole answer within ``reward.timeout_s``
seconds overall (a service that trickles bytes is cut off) and in at most
:func:`max_response_bytes` bytes.

Non-2xx, a timeout, or a connection failure is retried up to ``max_retries`` attempts, then
raises :class:`RewardError`; a 3xx or a malformed body raises at once.  The caller keeps the
samples and retries later.
"""

from __future__ import annotations

import base64
import io
import json
import math

import numpy as np
from PIL import Image

from spotlight.config import RewardConfig
from spotlight.errors import SpotlightError

REWARD_PROTOCOL_VERSION = 2
"""Version of the reward service's JSON request (2: per-image ``metadata``; 1: none, no ``version`` key)."""


class RewardError(SpotlightError):
    """Scoring failed (service unreachable, bad response)."""


def jpeg_size_kb(image_hwc: np.ndarray, quality: int = 95) -> float:
    """Encoded JPEG size of one ``[H, W, 3] uint8`` image, in kB (1000 bytes)."""
    buf = io.BytesIO()
    Image.fromarray(image_hwc).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


def _to_hwc(images_bchw: np.ndarray) -> list[np.ndarray]:
    if images_bchw.ndim != 4 or images_bchw.shape[1] != 3 or images_bchw.dtype != np.uint8:
        raise RewardError(f"expected [B, 3, H, W] uint8 images, got {images_bchw.shape} {images_bchw.dtype}")
    return [np.ascontiguousarray(img.transpose(1, 2, 0)) for img in images_bchw]


class RewardFn:
    """Scores a batch of images (``cfg.kind``: a built-in reward of the module docstring, or
    ``"http"``: the JSON reward service at ``cfg.url``).

    Args:
        cfg: the ``[reward]`` config section.
        session: optional ``requests.Session`` (tests inject one).
    """

    def __init__(self, cfg: RewardConfig, session=None):
        self.cfg = cfg
        self._session = session
        self._ocr = None  # the OCR engine, built on first use (kind = "ocr")

    def __call__(self, images_bchw: np.ndarray, prompts: list[str], metadata: list[dict] | None = None) -> list[float]:
        """Rewards for ``[B, 3, H, W] uint8`` images, in input order. ``metadata``: one dict per
        image, its prompt's record fields (``ocr`` reads ``ocr_target``; the HTTP service gets
        them all); None = ``{}`` each.

        Raises:
            RewardError: bad input (``geneval_shapes``: also a prompt that is no shapes-world
                caption, with the parser's message), or the HTTP service failed
                ``max_retries`` times.
        """
        hwc = _to_hwc(images_bchw)
        metadata = [{} for _ in hwc] if metadata is None else list(metadata)
        if len(metadata) != len(hwc):
            raise RewardError(f"{len(hwc)} images but {len(metadata)} metadata records")
        if self.cfg.kind == "geneval_shapes":
            from spotlight.tasks.shapes import geneval

            if len(prompts) != len(hwc):
                raise RewardError(f"{len(hwc)} images but {len(prompts)} prompts")
            try:
                return geneval.score(images_bchw, prompts, partial_credit=self.cfg.partial_credit, metadata=metadata)
            except ValueError as exc:
                raise RewardError(str(exc)) from None
        if self.cfg.kind == "ocr":
            from PIL import Image

            if len(prompts) != len(hwc):
                raise RewardError(f"{len(hwc)} images but {len(prompts)} prompts")
            if self._ocr is None:
                from spotlight.rewards.ocr import OcrScorer

                self._ocr = OcrScorer()
            try:
                return self._ocr([Image.fromarray(im) for im in hwc], prompts, metadata)
            except ValueError as exc:
                raise RewardError(str(exc)) from None
        if self.cfg.kind == "jpeg_compressibility":
            return [-jpeg_size_kb(im, self.cfg.jpeg_quality) for im in hwc]
        if self.cfg.kind == "jpeg_incompressibility":
            return [jpeg_size_kb(im, self.cfg.jpeg_quality) for im in hwc]
        return self._http(hwc, prompts, metadata)

    def check_service(self, image_size: int, prompt: str, metadata: dict | None = None) -> None:
        """Fail fast on a reward service that does not answer (``kind = "http"``: one black
        ``image_size`` probe image for ``prompt``); other kinds have no service to check.

        Raises:
            RewardError: ``reward service check failed: …`` with the client's reason.
        """
        if self.cfg.kind != "http":
            return
        try:
            self(np.zeros((1, 3, image_size, image_size), dtype=np.uint8), [prompt], [metadata or {}])
        except RewardError as exc:
            raise RewardError(f"reward service check failed: {exc}") from None

    def check_prompts(self, prompts: list[str], metadata: list[dict] | None = None) -> None:
        """Fail fast on prompts this reward cannot score (``geneval_shapes``: prompts that are
        no shapes-world caption; ``ocr``: prompts without a quoted target, unless their
        ``metadata`` has an ``ocr_target``); other kinds accept any prompt.

        Raises:
            RewardError: the first bad prompt, with the parser's message.
        """
        if self.cfg.kind == "ocr":
            from spotlight.rewards.ocr import prompt_target

            for i, p in enumerate(prompts):
                if metadata is not None and i < len(metadata) and metadata[i].get("ocr_target"):
                    continue
                try:
                    prompt_target(p)
                except ValueError as exc:
                    raise RewardError(f"prompt {i + 1}: {exc}") from None
        if self.cfg.kind == "geneval_shapes":
            from spotlight.tasks.shapes import geneval

            for i, p in enumerate(prompts):
                try:
                    geneval.parse_prompt(p)
                except ValueError as exc:
                    raise RewardError(f"prompt {i + 1}: {exc}") from None

    def _http(self, hwc: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> list[float]:
        import requests

        session = self._session or requests.Session()
        payload = {
            "version": REWARD_PROTOCOL_VERSION,
            "images": [_png_b64(im) for im in hwc],
            "prompts": list(prompts),
            "metadata": metadata,
        }
        from spotlight.net.http_limits import bounded_request

        last = "no attempt"
        for attempt in range(max(1, self.cfg.max_retries)):
            try:  # overall deadline per attempt, no redirects, bounded size (module docstring)
                resp = bounded_request(
                    session,
                    "POST",
                    self.cfg.url,
                    json=payload,
                    deadline_s=self.cfg.timeout_s,
                    max_bytes=max_response_bytes(len(hwc)),
                )
            except requests.RequestException as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code // 100 == 3:
                raise RewardError(
                    f"reward service {self.cfg.url} answered HTTP {resp.status_code} (redirect to "
                    f"{resp.headers.get('Location')!r}); "
                    "redirects are not followed: set reward.url to the service's own address"
                )
            if resp.status_code // 100 != 2:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            return parse_rewards(resp.content, len(hwc), self.cfg.url)
        raise RewardError(f"reward service {self.cfg.url} failed after {self.cfg.max_retries} attempts: {last}")


def max_response_bytes(n_images: int) -> int:
    """Largest reward-service answer read, in bytes: 1 MiB + 64 bytes per image."""
    return (1 << 20) + 64 * n_images


def parse_rewards(body: bytes, n_images: int, url: str = "the reward service") -> list[float]:
    """The ``rewards`` list of a service answer, as floats (NaN and ±inf kept).

    Raises:
        RewardError: not a JSON object with a ``rewards`` list of ``n_images`` numbers
            (a string, bool, null or nested list is refused).
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RewardError(f"reward service {url} sent a malformed body: not JSON ({exc})") from None
    rewards = doc.get("rewards") if isinstance(doc, dict) else None
    if not isinstance(rewards, list):
        raise RewardError(f'reward service {url} sent a malformed body: expected {{"rewards": [number, ...]}}')
    if len(rewards) != n_images:
        raise RewardError(f"reward service returned {len(rewards)} rewards for {n_images} images")
    out = []
    for i, r in enumerate(rewards):
        if type(r) not in (int, float):  # bool is an int subclass: refused too
            raise RewardError(
                f"reward service {url} sent a malformed body: reward {i} is {type(r).__name__} {json.dumps(r)[:40]}, "
                "not a number"
            )
        try:
            out.append(float(r))
        except OverflowError:
            raise RewardError(f"reward service {url} sent a malformed body: reward {i} is out of float range") from None
    return out


def _png_b64(image_hwc: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(image_hwc).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def finite_rewards(rewards: list[float]) -> list[bool]:
    """Mask of rewards that can be trained on (NaN/inf samples are excluded and logged)."""
    return [math.isfinite(r) for r in rewards]
