"""A JSON reward service: built-in JPEG and shapes-world GenEval scorers and a CLIP/PickScore
preference scorer.

This is the server side of the HTTP protocol that :class:`spotlight.rewards.reward_fn.RewardFn`
(``[reward] kind = "http"``) speaks. It replaces Flow-GRPO's pickle-over-HTTP reward servers
(``yifan123/reward-server``) with JSON + base64 images, so nothing received is ever unpickled.

Protocol::

    POST /   or   POST /score          Content-Type: application/json
    {"version": 2, "images": ["<base64 PNG or JPEG>", ...], "prompts": ["...", ...],
     "metadata": [{...}, ...]}                            # one JSON object per image
    200 → {"rewards": [float, ...],                    # Σ_k w_k · score_k, input order
           "scores": {"<scorer>": [float, ...], ...}}   # each scorer's unweighted scores

    GET /health
    200 → {"status": "ok", "scorers": {"<scorer>": weight, ...}}

    Errors → {"error": "<message>"} with
      400  a request of another protocol version (version 1 had no "version" key and no
           "metadata"; the message says so), malformed JSON / fields, len(images) !=
           len(prompts) or len(metadata), a metadata item that is no object, batch over the limit,
           an image that is not base64 or not a PNG/JPEG that Pillow decodes, an image over
           the pixel limit, a bad Content-Length
      404  unknown path
      411  no Content-Length (chunked bodies are not accepted)
      413  Content-Length over the body limit (answered before the body is read; the
           connection is then closed)
      415  Content-Type is not application/json
      400  also: a scorer refused a prompt or its metadata as invalid (it raised
           :class:`~spotlight.errors.InputError`: a caption no shapes-world template fits, a
           text-rendering prompt that quotes nothing, a malformed GenEval record, a prompt with
           no GenEval record) — one line naming the scorer, the image and the reason
      500  a scorer crashed (any other exception), or returned a non-finite score (JSON has no
           NaN/Infinity) — the message names the scorer

``metadata`` carries each prompt's record fields from the prompt file (GenEval's ``tag`` /
``include`` / ``exclude``, an ``ocr_target``, a CSV/TSV row's other columns; ``{}`` for plain
text). A scorer whose ``__call__`` has a ``metadata`` parameter receives it (one dict per
image); others are called with images and prompts alone.

Composition follows Flow-GRPO ``flow_grpo/rewards.py: multi_score``: ``reward_fn`` is a
``{name: weight}`` dict and the reward is the weighted sum of each scorer's scores.

Scorers (registry :data:`SCORER_NAMES`):

* ``jpeg_compressibility`` = −(JPEG size at quality 95, kB); ``jpeg_incompressibility`` =
  +(kB) — the same values as Spotlight's built-in rewards (:func:`spotlight.rewards.reward_fn.jpeg_size_kb`;
  note Flow-GRPO's own ``jpeg_compressibility`` divides by 500 — use weight 0.002 for that).
* ``geneval_shapes``: the strict GenEval verdict (1.0 or 0.0) of each image for its prompt,
  by the rule-based detector of :mod:`spotlight.tasks.shapes.geneval` (GenEval's include / count /
  colour / position clauses on shapes-world captions); ``geneval_shapes_partial``: the
  fraction of the prompt's clauses that hold, in [0, 1] (a denser training signal, like
  Flow-GRPO's GenEval server's fractional score). A prompt that is no shapes-world caption
  fails the request (400, naming the scorer and quoting the prompt). Images of any size;
  the world's are 32×32.
* ``clip`` (alias ``pickscore``): PickScore-style preference (Kirstain et al. 2023; Flow-GRPO
  ``pickscore_scorer.py``): ``logit_scale.exp() · cos(image_embeds, text_embeds) / 26``, in
  float32, from a local ``transformers`` ``CLIPModel`` checkpoint + its processor
  (``yuvalkirstain/PickScore_v1`` with the processor of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``
  for real PickScore).
* ``geneval`` / ``geneval_partial``: GenEval's strict verdict (0/1) or the fraction of its
  clauses that hold, on real images: a local ``transformers`` object detector
  (``--detector-path``, COCO class names) and CLIP colour classification (``--clip-path``),
  each prompt's GenEval record from ``--geneval-metadata`` JSONL files
  (:mod:`spotlight.rewards.geneval`).
* ``aesthetic``: the LAION aesthetic predictor's 1-10 rating (Flow-GRPO's ``aesthetic``): an MLP
  head (``--aesthetic-head``) over CLIP ViT-L/14 image embeddings (``--aesthetic-clip-path``,
  default ``--clip-path``); :mod:`spotlight.rewards.aesthetic`.
* ``ocr``: Flow-GRPO's OCR reward, ``1 - normalised edit distance`` between the prompt's
  quoted text and the text RapidOCR reads in the image (:mod:`spotlight.rewards.ocr`;
  ONNX models inside the ``rapidocr_onnxruntime`` wheel, offline). A prompt without a
  quoted target fails the request (400, naming the scorer and quoting the prompt).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
import pathlib
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlsplit

from PIL import Image

from spotlight.errors import InputError, SpotlightError
from spotlight.rewards.reward_fn import REWARD_PROTOCOL_VERSION

logger = logging.getLogger("spotlight.rewards.server")

DEFAULT_PORT = 18085
"""Flow-GRPO's reward servers listen on 127.0.0.1:18085 too."""
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_BATCH = 512
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
PICKSCORE_SCALE = 26.0
"""PickScore divides ``logit_scale.exp() · cos`` by 26 to land roughly in [0, 1]."""
CLIP_MAX_TEXT_TOKENS = 77
SCORER_NAMES = (
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "geneval_shapes",
    "geneval_shapes_partial",
    "clip",
    "pickscore",
    "ocr",
    "geneval",
    "geneval_partial",
    "aesthetic",
)
NOT_BUILT_IN = {
    "imagereward": "its package (image-reward 1.5) pins timm 0.6.13 and fairscale 0.4.13, imports its "
    "training code (datasets, accelerate) and loads BLIP's tokenizer by hub id (bert-base-uncased) at "
    "construction",
    "hpsv2": "its package pins pytest 7.2.0 and protobuf<4 as run-time dependencies, and the OpenCLIP "
    "model it runs imports torchvision, whose registry wheels are CUDA builds that do not load against "
    "the CPU torch wheel this project is tested on",
}
"""Flow-GRPO rewards that are not built in, and why (README "Reward server"): serve them behind
the protocol, or, for HPSv2 in ``transformers``' CLIPModel format, with ``--scorer clip``."""
_DRAIN_MAX_BYTES = 64 * 1024 * 1024
_DRAIN_MAX_S = 2.0


class ScorerError(SpotlightError):
    """A scorer failed or returned unusable scores (served as HTTP 500)."""


class ScorerInputError(ScorerError):
    """A scorer refused its input as invalid (:class:`~spotlight.errors.InputError`): the
    request's fault, served as HTTP 400."""


class Scorer(Protocol):
    """Scores RGB images against their prompts.

    ``__call__(images, prompts)`` takes ``B`` RGB ``PIL.Image.Image`` (any size) and ``B``
    prompt strings and returns ``B`` floats in input order. ``thread_safe = False`` makes
    :class:`MultiScorer` serialise its calls with a lock.
    """

    thread_safe: bool

    def __call__(self, images: Sequence[Image.Image], prompts: Sequence[str]) -> list[float]: ...


# --------------------------------------------------------------------------------------- scorers


class JpegScorer:
    """DDPO JPEG reward: ``sign · (JPEG size at ``quality`` in kB, 1 kB = 1000 bytes)``.

    ``sign = -1`` is ``jpeg_compressibility``, ``+1`` is ``jpeg_incompressibility``. The
    prompt is ignored. Pure function of the pixels, thread-safe.
    """

    thread_safe = True

    def __init__(self, sign: float, quality: int = 95):
        self.sign = float(sign)
        self.quality = int(quality)

    def __call__(self, images: Sequence[Image.Image], prompts: Sequence[str]) -> list[float]:
        import numpy as np

        from spotlight.rewards.reward_fn import jpeg_size_kb

        return [self.sign * jpeg_size_kb(np.asarray(im.convert("RGB")), self.quality) for im in images]


class GenevalShapesScorer:
    """Rule-based GenEval of shapes-world images (:mod:`spotlight.tasks.shapes.geneval`).

    ``partial_credit = False`` (``geneval_shapes``) scores the strict verdict, 1.0 or 0.0;
    ``True`` (``geneval_shapes_partial``) the fraction of the prompt's clauses that hold.
    Pure function of pixels and prompt, thread-safe. Building it builds the detector's
    colour table (0.3-0.6 s, once per process).

    Raises (on call):
        ValueError: a prompt that is no shapes-world caption (the parser's message).
    """

    thread_safe = True

    def __init__(self, partial_credit: bool):
        import numpy as np

        from spotlight.tasks.shapes import geneval

        self.partial_credit = bool(partial_credit)
        geneval.classify_pixels(np.zeros((1, 1, 3), dtype=np.uint8))  # build the colour table now

    def __call__(
        self, images: Sequence[Image.Image], prompts: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> list[float]:
        """A prompt whose ``metadata`` is a GenEval record (``tag``, ``include``) is judged by it
        (:func:`spotlight.tasks.shapes.geneval.spec_from_metadata`), the others by their caption."""
        import numpy as np

        from spotlight.tasks.shapes import geneval

        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        metadata = metadata if metadata is not None else [None] * len(prompts)
        specs = [geneval.spec_from_metadata(p, m) or geneval.parse_prompt(p) for p, m in zip(prompts, metadata)]
        detected = geneval.detect_many([np.asarray(im.convert("RGB")) for im in images])
        scores = []
        for spec, objects in zip(specs, detected):
            correct, partial = geneval.verdict(spec, objects)
            scores.append(float(partial) if self.partial_credit else float(correct))
        return scores


def _check_clip_dir(path: str | pathlib.Path | None, what: str) -> pathlib.Path:
    if path is None or str(path) == "":
        raise SpotlightError(f"{what} is required for the clip/pickscore scorer (a local CLIPModel directory)")
    p = pathlib.Path(path).expanduser()
    if not p.is_dir():
        raise SpotlightError(f"{what} {p}: not a directory")
    return p


class ClipScorer:
    """PickScore-style CLIP preference score of each (image, prompt) pair.

    ``score_i = logit_scale.exp() · cos(E_img(image_i), E_txt(prompt_i)) / 26`` — the
    diagonal of CLIP's image-text logits, divided by PickScore's scale 26 (Flow-GRPO
    ``pickscore_scorer.py``). Embeddings are the projected ``CLIPModel`` features,
    L2-normalised; computed in float32 under ``torch.no_grad`` in batches of ``batch_size``;
    prompts are padded and truncated to ``min(77, max_position_embeddings)`` tokens.

    Args:
        model_path: local ``CLIPModel`` directory (``config.json`` with ``model_type: clip``
            + weights), loaded with ``local_files_only=True``.
        processor_path: local ``CLIPProcessor`` directory (image processor + tokenizer);
            default ``model_path``.
        device: ``"cuda"``, ``"cpu"``, …; default ``cuda`` when available.
        batch_size: images per forward pass.

    Raises:
        SpotlightError: a path is missing or not a loadable CLIP checkpoint/processor.
    """

    thread_safe = False  # one model, shared device memory: MultiScorer serialises calls

    def __init__(
        self,
        model_path: str | pathlib.Path,
        processor_path: str | pathlib.Path | None = None,
        device: str | None = None,
        batch_size: int = 32,
    ):
        mp = _check_clip_dir(model_path, "--clip-path")
        pp = _check_clip_dir(processor_path, "--clip-processor-path") if processor_path else mp
        cfg_file = mp / "config.json"
        try:
            model_type = json.loads(cfg_file.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError) as exc:
            raise SpotlightError(f"--clip-path {mp}: no readable config.json ({exc})") from None
        if model_type != "clip":
            raise SpotlightError(f"--clip-path {mp}: config.json has model_type {model_type!r}, expected 'clip'")
        if batch_size < 1:
            raise SpotlightError("clip batch_size must be >= 1")

        import torch
        from transformers import CLIPModel, CLIPProcessor

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            model = CLIPModel.from_pretrained(str(mp), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - many loader error types; report them all clearly
            raise SpotlightError(f"--clip-path {mp}: cannot load a CLIPModel: {type(exc).__name__}: {exc}") from None
        try:
            processor = CLIPProcessor.from_pretrained(str(pp), local_files_only=True)
        except Exception as exc:  # noqa: BLE001
            raise SpotlightError(
                f"processor at {pp}: cannot load a CLIPProcessor (image processor + tokenizer): "
                f"{type(exc).__name__}: {exc}"
            ) from None
        self.model = model.to(device=self.device, dtype=torch.float32).eval()
        self.image_processor = processor.image_processor
        self.tokenizer = processor.tokenizer
        self.batch_size = int(batch_size)
        self.max_text_tokens = min(CLIP_MAX_TEXT_TOKENS, int(model.config.text_config.max_position_embeddings))
        self.model_path, self.processor_path = mp, pp

    def __call__(self, images: Sequence[Image.Image], prompts: Sequence[str]) -> list[float]:
        import torch

        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        scores: list[float] = []
        with torch.no_grad():
            scale = self.model.logit_scale.exp().float()
            for lo in range(0, len(images), self.batch_size):
                imgs = [im.convert("RGB") for im in images[lo : lo + self.batch_size]]
                texts = list(prompts[lo : lo + self.batch_size])
                pixels = self.image_processor(images=imgs, return_tensors="pt")["pixel_values"]
                tok = self.tokenizer(
                    texts, padding=True, truncation=True, max_length=self.max_text_tokens, return_tensors="pt"
                )
                img_emb = _pooled(self.model.get_image_features(pixel_values=pixels.to(self.device, torch.float32)))
                txt_emb = _pooled(
                    self.model.get_text_features(
                        input_ids=tok["input_ids"].to(self.device),
                        attention_mask=tok["attention_mask"].to(self.device) if "attention_mask" in tok else None,
                    )
                )
                img_emb = img_emb.float() / img_emb.float().norm(dim=-1, keepdim=True)
                txt_emb = txt_emb.float() / txt_emb.float().norm(dim=-1, keepdim=True)
                batch = scale * (img_emb * txt_emb).sum(dim=-1) / PICKSCORE_SCALE
                scores.extend(float(s) for s in batch.cpu().tolist())
        return scores


def _pooled(out: Any):
    """Projected embeddings: a tensor (transformers 4.x) or ``.pooler_output`` (5.x)."""
    import torch

    return out if isinstance(out, torch.Tensor) else out.pooler_output


# ------------------------------------------------------------------------------------- registry


def parse_scorer_spec(spec: str) -> tuple[str, float]:
    """``"NAME"`` or ``"NAME:WEIGHT"`` → ``(name, weight)``; the weight defaults to 1.0.

    Raises:
        SpotlightError: unknown name (lists the known ones) or a weight that is not a finite number.
    """
    name, sep, weight_text = spec.strip().rpartition(":")
    if not sep:
        name, weight_text = weight_text, "1.0"
    name = name.strip().lower()
    if name in NOT_BUILT_IN:
        raise SpotlightError(
            f"scorer {name!r} is not built in: {NOT_BUILT_IN[name]}. Serve it behind the reward protocol "
            "(README 'Reward server') and point reward.url at it; built in: " + ", ".join(SCORER_NAMES)
        )
    if name not in SCORER_NAMES:
        raise SpotlightError(f"unknown scorer {name!r} in --scorer {spec!r}; known: {', '.join(SCORER_NAMES)}")
    try:
        weight = float(weight_text)
    except ValueError:
        raise SpotlightError(
            f"bad weight {weight_text!r} in --scorer {spec!r}: expected a number such as 1.0"
        ) from None
    if not math.isfinite(weight):
        raise SpotlightError(f"bad weight {weight_text!r} in --scorer {spec!r}: must be finite")
    return name, weight


def parse_scorer_specs(specs: Sequence[str]) -> dict[str, float]:
    """Several ``NAME[:WEIGHT]`` specs → Flow-GRPO's ``reward_fn`` dict ``{name: weight}``.

    Raises:
        SpotlightError: no spec, a bad spec, or the same name twice.
    """
    if not specs:
        raise SpotlightError(f"give at least one --scorer NAME[:WEIGHT] (known: {', '.join(SCORER_NAMES)})")
    weights: dict[str, float] = {}
    for spec in specs:
        name, weight = parse_scorer_spec(spec)
        if name in weights:
            raise SpotlightError(f"scorer {name!r} given twice")
        weights[name] = weight
    return weights


def build_scorer(
    name: str,
    *,
    clip_path: str | pathlib.Path | None = None,
    clip_processor_path: str | pathlib.Path | None = None,
    device: str | None = None,
    jpeg_quality: int = 95,
    clip_batch_size: int = 32,
    detector_path: str | pathlib.Path | None = None,
    geneval_metadata: Sequence[str | pathlib.Path] = (),
    aesthetic_head: str | pathlib.Path | None = None,
    aesthetic_clip_path: str | pathlib.Path | None = None,
) -> Scorer:
    """One scorer of the registry by name (see :data:`SCORER_NAMES`).

    Raises:
        SpotlightError: unknown name, or (clip/pickscore) a missing or invalid checkpoint.
    """
    if name == "jpeg_compressibility":
        return JpegScorer(-1.0, jpeg_quality)
    if name == "jpeg_incompressibility":
        return JpegScorer(+1.0, jpeg_quality)
    if name == "geneval_shapes":
        return GenevalShapesScorer(partial_credit=False)
    if name == "geneval_shapes_partial":
        return GenevalShapesScorer(partial_credit=True)
    if name == "ocr":
        from spotlight.rewards.ocr import OcrScorer

        return OcrScorer()
    if name == "aesthetic":
        from spotlight.rewards.aesthetic import AestheticScorer

        if aesthetic_head is None:
            raise SpotlightError("the aesthetic scorer needs --aesthetic-head FILE (the predictor's weights)")
        clip_dir = aesthetic_clip_path or clip_path
        if clip_dir is None:
            raise SpotlightError("the aesthetic scorer needs --aesthetic-clip-path DIR (CLIP ViT-L/14) or --clip-path")
        return AestheticScorer(clip_dir, aesthetic_head, device=device, batch_size=clip_batch_size)
    if name in ("geneval", "geneval_partial"):
        from spotlight.rewards.geneval import GenEvalScorer, load_metadata

        if detector_path is None:
            raise SpotlightError(f"the {name} scorer needs --detector-path DIR (a local transformers detector)")
        return GenEvalScorer(
            detector_path,
            clip_path,
            load_metadata(geneval_metadata),
            partial_credit=name == "geneval_partial",
            device=device,
        )
    if name in ("clip", "pickscore"):
        return ClipScorer(clip_path, clip_processor_path, device=device, batch_size=clip_batch_size)
    raise SpotlightError(f"unknown scorer {name!r}; known: {', '.join(SCORER_NAMES)}")


def build_multi_scorer(weights: Mapping[str, float], **options: Any) -> MultiScorer:
    """A :class:`MultiScorer` from ``{name: weight}``; ``options`` go to :func:`build_scorer`.

    ``clip`` and ``pickscore`` together share one loaded model.
    """
    built: dict[str, tuple[Scorer, float]] = {}
    clip: Scorer | None = None
    for name, weight in weights.items():
        if name in ("clip", "pickscore"):
            clip = clip or build_scorer(name, **options)
            built[name] = (clip, weight)
        else:
            built[name] = (build_scorer(name, **options), weight)
    return MultiScorer(built)


class MultiScorer:
    """Weighted sum of several scorers (Flow-GRPO ``rewards.py: multi_score``).

    Args:
        scorers: ``{name: (scorer, weight)}``; each scorer maps ``B`` RGB PIL images and
            ``B`` prompts to ``B`` floats. Weights are finite floats (any sign).

    :meth:`score` returns ``(total, per_scorer)``: ``total[i] = Σ_k w_k · s_k[i]`` and
    ``per_scorer = {name: [s_k[0], ...]}`` (unweighted), all Python floats in input order.
    Scorers with ``thread_safe = False`` are called under a per-scorer lock.
    """

    def __init__(self, scorers: Mapping[str, tuple[Scorer, float]]):
        if not scorers:
            raise SpotlightError("MultiScorer needs at least one scorer")
        self._scorers: dict[str, tuple[Scorer, float]] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._with_metadata: set[str] = set()  # scorers whose __call__ takes metadata
        for name, (scorer, weight) in scorers.items():
            w = float(weight)
            if not math.isfinite(w):
                raise SpotlightError(f"weight of scorer {name!r} must be finite, got {weight!r}")
            self._scorers[name] = (scorer, w)
            if _takes_metadata(scorer):
                self._with_metadata.add(name)
            if not getattr(scorer, "thread_safe", False):
                self._locks.setdefault(id(scorer), threading.Lock())

    @property
    def weights(self) -> dict[str, float]:
        """``{name: weight}`` in registration order."""
        return {name: w for name, (_, w) in self._scorers.items()}

    def score(
        self, images: Sequence[Image.Image], prompts: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Total and per-scorer scores of ``B`` (image, prompt) pairs; ``metadata`` (one dict per
        image, None = ``{}`` each) goes to the scorers that take it.

        Raises:
            ScorerInputError: a scorer refused a prompt or its metadata (it raised
                :class:`~spotlight.errors.InputError`); the message names the scorer.
            ScorerError: a scorer raised anything else, returned the wrong number of scores, or a
                non-finite score (NaN/inf); the message names the scorer.
        """
        n = len(images)
        if n != len(prompts):
            raise ScorerError(f"{n} images but {len(prompts)} prompts")
        metadata = [{} for _ in range(n)] if metadata is None else list(metadata)
        if n != len(metadata):
            raise ScorerError(f"{n} images but {len(metadata)} metadata records")
        per: dict[str, list[float]] = {}
        total = [0.0] * n
        for name, (scorer, weight) in self._scorers.items():
            if n == 0:
                per[name] = []
                continue
            lock = self._locks.get(id(scorer))
            args = (images, prompts, metadata) if name in self._with_metadata else (images, prompts)
            try:
                if lock is None:
                    raw = scorer(*args)
                else:
                    with lock:
                        raw = scorer(*args)
                values = [float(v) for v in raw]
            except InputError as exc:  # the request's prompts or metadata: a 400
                raise ScorerInputError(f"scorer {name!r} refused the request: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - any other scorer failure is a 500 naming the scorer
                raise ScorerError(f"scorer {name!r} failed: {type(exc).__name__}: {exc}") from exc
            if len(values) != n:
                raise ScorerError(f"scorer {name!r} returned {len(values)} scores for {n} images")
            bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
            if bad:
                raise ScorerError(
                    f"scorer {name!r} returned a non-finite score ({values[bad[0]]}) for "
                    f"image {bad[0]} ({len(bad)} of {n} non-finite)"
                )
            per[name] = values
            total = [t + weight * v for t, v in zip(total, values)]
        return total, per


# ------------------------------------------------------------------------------ request parsing


class _RequestError(Exception):
    def __init__(self, status: int, message: str, body_unread: bool = False):
        super().__init__(message)
        self.status, self.message, self.body_unread = status, message, body_unread


def _decode_image(item: Any, index: int, max_pixels: int) -> Image.Image:
    """``images[index]`` (base64 PNG/JPEG, optionally a ``data:`` URL) → an RGB PIL image."""
    if not isinstance(item, str):
        raise _RequestError(400, f"images[{index}] is a {type(item).__name__}, expected a base64 string")
    text = item
    if text.startswith("data:"):
        head, comma, text = text.partition(",")
        if not comma or not head.endswith(";base64"):
            raise _RequestError(400, f"images[{index}] is a data: URL without ';base64,'")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _RequestError(400, f"images[{index}] is not valid base64 ({exc})") from None
    try:
        with Image.open(io.BytesIO(raw)) as im:
            if im.format not in ("PNG", "JPEG"):
                raise _RequestError(400, f"images[{index}] is a {im.format} image; send PNG or JPEG")
            w, h = im.size
            if w * h > max_pixels:
                raise _RequestError(400, f"images[{index}] has {w}x{h} = {w * h} pixels, over the limit {max_pixels}")
            return im.convert("RGB")  # decodes the whole image; truncated data raises here
    except _RequestError:
        raise
    except (Image.UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise _RequestError(
            400, f"images[{index}] is not a decodable PNG/JPEG image ({type(exc).__name__}: {exc})"
        ) from None


def _takes_metadata(scorer: Any) -> bool:
    """The scorer's ``__call__`` has a ``metadata`` parameter."""
    import inspect

    try:
        return "metadata" in inspect.signature(scorer).parameters
    except (TypeError, ValueError):
        return False


def parse_request(
    body: bytes, max_batch: int = DEFAULT_MAX_BATCH, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> tuple[list[Image.Image], list[str], list[dict]]:
    """Validate a request body → (RGB PIL images, prompts, metadata). Raises ``_RequestError`` (HTTP 400)."""
    try:
        payload = json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _RequestError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(payload, dict):
        raise _RequestError(
            400, 'body must be a JSON object {"version": 2, "images": [...], "prompts": [...], "metadata": [...]}'
        )
    version = payload.get("version", 1)
    if version != REWARD_PROTOCOL_VERSION:
        old = " (no 'version' key: version 1, without per-image metadata)" if "version" not in payload else ""
        raise _RequestError(
            400,
            f"reward protocol version {version!r}{old} is not served; this server speaks version "
            f'{REWARD_PROTOCOL_VERSION}: {{"version": {REWARD_PROTOCOL_VERSION}, "images": [...], "prompts": [...], '
            '"metadata": [{...}, ...]} (one object per image); update the client',
        )
    for key in ("images", "prompts", "metadata"):
        if key not in payload:
            raise _RequestError(400, f"missing key {key!r}")
        if not isinstance(payload[key], list):
            raise _RequestError(400, f"{key!r} must be a list, got {type(payload[key]).__name__}")
    images, prompts, metadata = payload["images"], payload["prompts"], payload["metadata"]
    if len(images) != len(prompts):
        raise _RequestError(400, f"len(images) = {len(images)} != len(prompts) = {len(prompts)}")
    if len(images) != len(metadata):
        raise _RequestError(400, f"len(images) = {len(images)} != len(metadata) = {len(metadata)}")
    for i, m in enumerate(metadata):
        if not isinstance(m, dict):
            raise _RequestError(400, f"metadata[{i}] is a {type(m).__name__}, expected a JSON object")
    if len(images) > max_batch:
        raise _RequestError(400, f"batch of {len(images)} images is over the limit {max_batch}; split it")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise _RequestError(400, f"prompts[{i}] is a {type(p).__name__}, expected a string")
    decoded = [_decode_image(item, i, max_image_pixels) for i, item in enumerate(images)]
    return decoded, list(prompts), list(metadata)


# ------------------------------------------------------------------------------------ the server


class RewardServer(ThreadingHTTPServer):
    """The HTTP reward service (one thread per connection). Build it with :func:`make_server`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        scorer: MultiScorer,
        *,
        max_body_bytes: int,
        max_batch: int,
        max_image_pixels: int,
    ):
        self.scorer = scorer
        self.max_body_bytes = int(max_body_bytes)
        self.max_batch = int(max_batch)
        self.max_image_pixels = int(max_image_pixels)
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        """``http://HOST:PORT/`` of the bound socket (the real port when bound to port 0)."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"  # keep-alive: requests.Session reuses the connection
    server_version = "SpotlightReward/1"
    timeout = 300  # seconds a connection may stall mid-request before it is dropped

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("%s %s", self.client_address[0], format % args)

    # ---- responses
    def _send_json(self, status: int, obj: Any, close: bool = False) -> None:
        data = json.dumps(obj, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _send_error_json(self, status: int, message: str, body_unread: bool = False, declared: int = 0) -> None:
        logger.warning("%s %s %s -> %d: %s", self.client_address[0], self.command, self.path, status, message)
        self._send_json(status, {"error": message}, close=body_unread)
        if body_unread:
            self._discard_unread(declared)

    def _discard_unread(self, declared: int) -> None:
        """Lingering close: after answering without reading the body, read and drop (never
        store) what the client still sends — at most 64 MiB / 2 s — so that closing the socket
        with unread data does not reset the connection before the client reads the answer."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            return
        left = min(max(declared, 0), _DRAIN_MAX_BYTES) or _DRAIN_MAX_BYTES
        deadline = time.monotonic() + _DRAIN_MAX_S
        while left > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(65536, left))
            except OSError:
                break
            if not chunk:
                break
            left -= len(chunk)

    # ---- GET
    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = urlsplit(self.path).path
        if path == "/health":
            self._send_json(200, {"status": "ok", "scorers": self.server.scorer.weights})
        else:
            self._send_error_json(404, f"no such path {path!r}: use GET /health, POST / or POST /score")

    # ---- POST
    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise _RequestError(411, "chunked bodies are not accepted: send a Content-Length", body_unread=True)
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise _RequestError(411, "missing Content-Length", body_unread=True)
        try:
            length = int(length_text)
            if length < 0:
                raise ValueError
        except ValueError:
            raise _RequestError(400, f"bad Content-Length {length_text!r}", body_unread=True) from None
        if length > self.server.max_body_bytes:
            raise _RequestError(
                413,
                f"body of {length} bytes is over the limit of {self.server.max_body_bytes} "
                "bytes (--max-body-mb); send smaller batches",
                body_unread=True,
            )
        body = self.rfile.read(length)
        if len(body) != length:
            raise _RequestError(400, f"body ended after {len(body)} of {length} bytes", body_unread=True)
        return body

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        t0 = time.monotonic()
        path = urlsplit(self.path).path
        declared = 0
        try:
            try:
                declared = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                pass
            body = self._read_body()
            if path not in ("/", "/score"):
                raise _RequestError(404, f"no such path {path!r}: POST to / or /score")
            ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                raise _RequestError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
            images, prompts, metadata = parse_request(body, self.server.max_batch, self.server.max_image_pixels)
        except _RequestError as exc:
            self._send_error_json(exc.status, exc.message, exc.body_unread, declared)
            return
        except Exception as exc:  # noqa: BLE001 - a bug in validation must not kill the connection silently
            logger.exception("request validation crashed")
            self._send_error_json(500, f"internal error while reading the request: {type(exc).__name__}: {exc}")
            return
        try:
            total, per = self.server.scorer.score(images, prompts, metadata)
        except ScorerInputError as exc:
            self._send_error_json(400, str(exc))
            return
        except ScorerError as exc:
            self._send_error_json(500, str(exc))
            return
        self._send_json(200, {"rewards": total, "scores": per})
        logger.info("%s scored %d images in %.3f s", self.client_address[0], len(images), time.monotonic() - t0)


def make_server(
    scorer: MultiScorer,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> RewardServer:
    """Bind (but do not start) a reward server; ``port=0`` picks a free port (see ``.url``).

    Run it with ``server.serve_forever()`` (e.g. in a thread) and stop it with
    ``server.shutdown(); server.server_close()``.

    Args:
        scorer: the weighted scorers.
        host, port: address to bind (IPv4). The service has no authentication: keep it on
            loopback or a private network.
        max_body_bytes: larger ``Content-Length`` → 413 without reading the body.
        max_batch: most images per request (400 beyond).
        max_image_pixels: most pixels (W·H) per decoded image (400 beyond).

    Raises:
        OSError: the address cannot be bound (e.g. the port is in use).
    """
    if max_body_bytes < 1 or max_batch < 1 or max_image_pixels < 1:
        raise SpotlightError("max_body_bytes, max_batch and max_image_pixels must be >= 1")
    return RewardServer(
        (host, port), scorer, max_body_bytes=max_body_bytes, max_batch=max_batch, max_image_pixels=max_image_pixels
    )


def serve(
    scorer: MultiScorer,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    on_ready: Callable[[RewardServer], None] | None = None,
    **limits: int,
) -> None:
    """Serve until Ctrl-C (KeyboardInterrupt), then close the socket.

    ``on_ready(server)`` is called once the socket is bound (e.g. to print ``server.url``);
    ``limits`` are :func:`make_server`'s keyword limits.
    """
    server = make_server(scorer, host, port, **limits)
    try:
        if on_ready is not None:
            on_ready(server)
        logger.info("reward server on %s, scorers %s", server.url, scorer.weights)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
