"""OCR reward for text rendering (Flow-GRPO's OCR task), offline.

The reward of an image whose prompt asks for the quoted text ``"T"`` is Flow-GRPO's::

    t = T without spaces, lower case;  r = the recognised text, the same way
    reward = 1                              if t occurs in r
           = 1 - min(lev(r, t), |t|) / |t|  otherwise          (lev: Levenshtein distance)

so a perfect rendering scores 1, an image with no text 0, and a near miss in between.
Recognition runs RapidOCR (PP-OCRv4 detection + recognition as ONNX models, on
onnxruntime): the models ship inside the ``rapidocr_onnxruntime`` wheel, so nothing is
downloaded at run time. Install with ``pip install 'spotlight-rl[ocr]'``. Its accuracy on
rendered text (fonts, sizes, blur, noise) is measured by ``benchmarks/ocr_reward.py``
(``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from spotlight.errors import InputError, SpotlightError
from spotlight.tasks.prompt_sets import ocr_target


def normalise(text: str) -> str:
    """Flow-GRPO's normalisation: spaces removed, lower case."""
    return "".join(text.split()).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_reward(recognised: str, target: str) -> float:
    """``1 - min(lev, |t|)/|t|`` over normalised texts, 1 when the target occurs in the recognised text.

    Raises:
        InputError: (a ValueError) an empty target (nothing to render).
    """
    t, r = normalise(target), normalise(recognised)
    if not t:
        raise InputError("empty OCR target")
    if t in r:
        return 1.0
    return 1.0 - min(levenshtein(r, t), len(t)) / len(t)


def prompt_target(prompt: str) -> str:
    """The quoted target of a text-rendering prompt.

    Raises:
        InputError: (a ValueError) the prompt quotes nothing (the message quotes the prompt).
    """
    t = ocr_target(prompt)
    if t is None or not normalise(t):
        from spotlight.util.text import quoted_prompt

        raise InputError(f'OCR prompt has no "quoted" target text: {quoted_prompt(prompt)}')
    return t


class OcrScorer:
    """Scores RGB PIL images against the quoted text of their prompts (see the module docstring).

    ``min_confidence`` drops recognised lines the recogniser scores below it (Flow-GRPO keeps
    every line with a positive score). Not thread-safe (one onnxruntime session).

    Raises (on build):
        SpotlightError: ``rapidocr_onnxruntime`` is not installed.
    Raises (on call):
        InputError: (a ValueError) a prompt without a quoted target.
    """

    thread_safe = False

    def __init__(self, min_confidence: float = 0.0):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError:
            raise SpotlightError(
                "the ocr scorer needs RapidOCR: pip install 'spotlight-rl[ocr]' "
                "(rapidocr_onnxruntime; its ONNX models ship inside the wheel)"
            ) from None
        self.min_confidence = float(min_confidence)
        self._engine = RapidOCR()
        self._lock = threading.Lock()

    def recognise(self, image) -> str:
        """All text lines RapidOCR reads in ``image`` (an RGB PIL image), in reading order, joined."""
        import numpy as np

        arr = np.asarray(image.convert("RGB"))[:, :, ::-1]  # RapidOCR takes OpenCV's BGR
        with self._lock:
            result, _ = self._engine(np.ascontiguousarray(arr))
        if not result:
            return ""
        return " ".join(text for _box, text, conf in result if float(conf) > self.min_confidence)

    def __call__(self, images: Sequence, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> list[float]:
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        targets = []
        for i, p in enumerate(prompts):
            meta = metadata[i] if metadata is not None and i < len(metadata) else None
            given = (meta or {}).get("ocr_target") if isinstance(meta, dict) else None
            targets.append(str(given) if given else prompt_target(p))
        return [ocr_reward(self.recognise(im), t) for im, t in zip(images, targets)]


def render_text_image(
    text: str,
    *,
    size_px: int = 512,
    font_px: int = 40,
    font: str = "DejaVuSans.ttf",
    blur_px: float = 0.0,
    noise_std: float = 0.0,
    seed: int = 0,
):
    """An RGB PIL image of ``text`` centred on a light background (checks and benchmarks of
    the reward); a text wider than the canvas at ``font_px`` is drawn smaller, to fit.
    ``font`` is a file name in matplotlib's bundled fonts (DejaVu, STIX, …) or a path;
    ``blur_px`` a Gaussian blur radius; ``noise_std`` Gaussian pixel noise (0-255 scale).
    """
    import pathlib

    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    path = pathlib.Path(font)
    if not path.is_file():
        import matplotlib

        path = pathlib.Path(matplotlib.get_data_path()) / "fonts" / "ttf" / font
    im = Image.new("RGB", (size_px, size_px), (236, 228, 214))
    draw = ImageDraw.Draw(im)
    while True:  # shrink a text wider than 92 % of the canvas until it fits
        face = ImageFont.truetype(str(path), font_px)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=face)
        if right - left <= 0.92 * size_px or font_px <= 8:
            break
        font_px = max(8, int(font_px * 0.9))
    xy = ((size_px - (right - left)) / 2 - left, (size_px - (bottom - top)) / 2 - top)
    draw.text(xy, text, fill=(24, 24, 28), font=face)
    if blur_px > 0:
        im = im.filter(ImageFilter.GaussianBlur(blur_px))
    if noise_std > 0:
        rng = np.random.default_rng(seed)
        arr = np.asarray(im).astype(np.float32) + rng.normal(0.0, noise_std, (size_px, size_px, 3))
        im = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    return im
