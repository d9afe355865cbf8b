"""GenEval's verdict on real images: an object detector and a colour classifier from local
paths, GenEval's rules (Ghosh et al. 2023, ``evaluation/evaluate_images.py``) over their output.

A prompt's GenEval metadata (``tag``, ``include`` = ``[{class, count, color?, position?}]``,
``exclude`` = ``[{class, count}]``) says what must be in the image. The rules, as GenEval
applies them (our implementation):

* **detections** of a class count when their confidence is above :data:`THRESHOLD` (0.3), or
  :data:`COUNTING_THRESHOLD` (0.9) for ``counting`` prompts; at most :data:`MAX_OBJECTS` per
  class, most confident first;
* **include** entry: its ``count`` most confident detections must exist; with ``color``, at
  least ``count`` of them must be classified as that colour; with ``position = [relation, j]``,
  every one of them must stand in ``relation`` to every object matched by entry ``j`` (GenEval's
  relative-position rule with its 0.1 threshold: :func:`spotlight.tasks.shapes.world.relations_between`,
  shared with the shapes task), and entry ``j`` must have matched;
* **exclude** entry: fewer than ``count`` detections of the class (counting prompts exclude
  ``count + 1``, so the count is exact);
* the **strict** verdict is 1 when every clause holds; **partial credit** is the fraction of
  clauses that hold (the shapes task's training reward, :mod:`spotlight.tasks.shapes.geneval`).

GenEval detects with Mask2Former (mmdetection) and classifies colours with CLIP ViT-L/14 on the
object's masked crop. Here the detector is any ``transformers`` object-detection model loaded
from a local directory (``AutoModelForObjectDetection``: DETR, Deformable DETR, RT-DETR, … with
COCO's 80 class names, as GenEval's) and colours come from a local ``CLIPModel`` zero-shot over
``"a photo of a {color} {class}"`` on the box crop (no mask: boxes only). Scores therefore differ
from GenEval's published numbers by the detector's quality; the rules are GenEval's.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence

from spotlight.errors import InputError, SpotlightError

THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")


@dataclasses.dataclass(frozen=True)
class Detection:
    """One detected object: its class name, confidence and box ``(x0, y0, x1, y1)`` in pixels."""

    label: str
    score: float
    box: tuple[float, float, float, float]


def select_objects(detections: Sequence[Detection], tag: str) -> dict[str, list[Detection]]:
    """The detections that count, by class, most confident first (module docstring)."""
    threshold = COUNTING_THRESHOLD if tag == "counting" else THRESHOLD
    out: dict[str, list[Detection]] = {}
    for d in sorted(detections, key=lambda d: -d.score):
        if d.score > threshold and len(out.setdefault(d.label, [])) < MAX_OBJECTS:
            out[d.label].append(d)
    return {k: v for k, v in out.items() if v}


def check_record(metadata: object) -> None:
    """Refuse a GenEval record that :func:`clauses` cannot judge, naming what is wrong: not an
    object, no ``include``/``exclude`` entry, an entry without a string ``class`` and an integer
    ``count`` >= 1, a ``color`` that is no string, a ``position`` that is no ``[relation, j]`` with
    an earlier entry ``j``.

    Raises:
        InputError: (a ValueError) the record is malformed.
    """
    if not isinstance(metadata, Mapping):
        raise InputError(f"GenEval metadata must be a JSON object, got {type(metadata).__name__}")
    entries = {}
    for key in ("include", "exclude"):
        val = metadata.get(key, [])
        if not isinstance(val, list):
            raise InputError(f"GenEval metadata {key!r} must be a list, got {type(val).__name__}")
        entries[key] = val
    if not entries["include"] and not entries["exclude"]:
        raise InputError("GenEval metadata with no include or exclude entry")
    for key, val in entries.items():
        for k, req in enumerate(val):
            where = f"GenEval metadata {key}[{k}]"
            if not isinstance(req, Mapping) or not isinstance(req.get("class"), str):
                raise InputError(f"{where} needs a 'class' (a string) and a 'count': {req!r}")
            count = req.get("count")
            if type(count) is not int or count < 1:
                raise InputError(f"{where}: 'count' must be an integer >= 1, got {count!r}")
            if key == "exclude":
                continue
            if "color" in req and not isinstance(req["color"], str):
                raise InputError(f"{where}: 'color' must be a string, got {req['color']!r}")
            if "position" in req:
                pos = req["position"]
                ok = isinstance(pos, list) and len(pos) == 2 and isinstance(pos[0], str) and type(pos[1]) is int
                if not ok or not 0 <= pos[1] < k:
                    raise InputError(
                        f"{where}: 'position' must be [relation, j] with j an earlier include entry, got {pos!r}"
                    )


def clauses(
    metadata: Mapping, objects: Mapping[str, Sequence[Detection]], color_of: Callable[[Detection], str] | None = None
) -> list[tuple[str, bool]]:
    """Every clause of ``metadata`` checked against ``objects`` (:func:`select_objects`), as
    ``(description, holds)``; ``color_of`` names a detection's colour (needed for colour clauses).

    Raises:
        InputError: (a ValueError) malformed metadata (:func:`check_record`).
    """
    check_record(metadata)
    out: list[tuple[str, bool]] = []
    matched: list[list[Detection] | None] = []
    for k, req in enumerate(metadata.get("include", [])):
        name, count = req["class"], req["count"]
        found = list(objects.get(name, []))[:count]
        ok = len(found) >= count
        out.append((f"{count} {name} (found {len(found)})", ok))
        if "color" in req:
            if color_of is None:
                raise ValueError(f"include[{k}] has a colour but no colour classifier was given")
            colors = [color_of(d) for d in found] if ok else []
            c_ok = ok and colors.count(req["color"]) >= count
            out.append((f"{count} {req['color']} {name} (colours {colors})", c_ok))
            ok = ok and c_ok
        if "position" in req:
            rel, j = req["position"]
            targets = matched[j]
            from spotlight.tasks.shapes.world import relations_between

            p_ok = bool(ok and targets) and all(rel in relations_between(a.box, b.box) for a in found for b in targets)
            out.append((f"{name} {rel} {metadata['include'][j]['class']}", p_ok))
            ok = ok and p_ok
        matched.append(found if ok else None)
    for req in metadata.get("exclude", []):
        name, count = str(req["class"]), int(req["count"])
        n = len(objects.get(name, []))
        out.append((f"fewer than {count} {name} (found {n})", n < count))
    return out


def verdict(
    metadata: Mapping, detections: Sequence[Detection], color_of: Callable[[Detection], str] | None = None
) -> tuple[bool, float]:
    """``(strict, partial credit)`` of ``detections`` for a prompt's GenEval ``metadata``."""
    check_record(metadata)
    checked = clauses(metadata, select_objects(detections, str(metadata.get("tag", ""))), color_of)
    n_ok = sum(ok for _, ok in checked)
    return n_ok == len(checked), n_ok / len(checked)


def load_metadata(paths: Sequence[str | pathlib.Path]) -> dict[str, dict]:
    """Prompt → GenEval metadata from JSONL files (GenEval's ``evaluation_metadata.jsonl`` and
    our training set). Raises SpotlightError naming file and line on a malformed record."""
    from spotlight.util.text import decode_utf8

    out: dict[str, dict] = {}
    for path in paths:
        p = pathlib.Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise SpotlightError(f"--geneval-metadata {p}: {exc.strerror or exc}") from None
        try:
            lines = decode_utf8(raw, str(p)).splitlines()
        except ValueError as exc:
            raise SpotlightError(str(exc)) from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out[str(rec["prompt"])] = rec
            except (ValueError, KeyError, TypeError) as exc:
                raise SpotlightError(f"{p}:{n}: not a GenEval record with a 'prompt' ({exc})") from None
    return out


class GenEvalScorer:
    """GenEval's verdict per image (a reward-server scorer): strict 0/1, or the fraction of
    clauses that hold with ``partial_credit``.

    Args:
        detector_path: local ``AutoModelForObjectDetection`` directory (with its image processor).
        clip_path: local ``CLIPModel`` + processor directory for the colour classifier.
        metadata: prompt → GenEval record; a request's own per-image metadata (when the wire
            carries it) is used first.
        device: torch device (default: CUDA when available).
    """

    thread_safe = False

    def __init__(
        self,
        detector_path: str | pathlib.Path,
        clip_path: str | pathlib.Path | None,
        metadata: Mapping[str, dict],
        *,
        partial_credit: bool = False,
        device: str | None = None,
    ):
        import torch
        from transformers import AutoImageProcessor, AutoModelForObjectDetection

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.partial_credit = partial_credit
        self.metadata = dict(metadata)
        dp = pathlib.Path(detector_path).expanduser()
        if not (dp / "config.json").is_file():
            raise SpotlightError(f"--detector-path {dp}: no config.json (a local transformers detector directory)")
        try:
            self.detector = (
                AutoModelForObjectDetection.from_pretrained(dp, local_files_only=True).to(self.device).eval()
            )
            self.processor = AutoImageProcessor.from_pretrained(dp, local_files_only=True)
        except (OSError, ValueError, ImportError) as exc:
            raise SpotlightError(f"--detector-path {dp}: cannot load a detector: {type(exc).__name__}: {exc}") from None
        self.labels = {int(k): str(v) for k, v in self.detector.config.id2label.items()}
        self.clip = self.clip_processor = None
        if clip_path is not None:
            from transformers import CLIPModel, CLIPProcessor

            cp = pathlib.Path(clip_path).expanduser()
            try:
                self.clip = CLIPModel.from_pretrained(cp, local_files_only=True).to(self.device).eval()
                self.clip_processor = CLIPProcessor.from_pretrained(cp, local_files_only=True)
            except (OSError, ValueError) as exc:
                raise SpotlightError(f"--clip-path {cp}: cannot load CLIP: {type(exc).__name__}: {exc}") from None

    def detect(self, images) -> list[list[Detection]]:
        """Every detection above the lower threshold in each RGB PIL image."""
        import torch

        inputs = self.processor(images=list(images), return_tensors="pt").to(self.device)
        with torch.no_grad():
            outputs = self.detector(**inputs)
        sizes = [(im.height, im.width) for im in images]
        results = self.processor.post_process_object_detection(outputs, threshold=THRESHOLD, target_sizes=sizes)
        return [
            [
                Detection(self.labels.get(int(lab), str(int(lab))), float(s), tuple(float(x) for x in box))
                for s, lab, box in zip(r["scores"].tolist(), r["labels"].tolist(), r["boxes"].tolist())
            ]
            for r in results
        ]

    def color_of(self, image, d: Detection) -> str:
        """CLIP zero-shot colour of ``d``'s box crop of ``image``."""
        import torch

        if self.clip is None:
            raise SpotlightError("a colour clause needs --clip-path (GenEval classifies colours with CLIP)")
        x0, y0, x1, y1 = (int(round(v)) for v in d.box)
        crop = image.crop((max(0, x0), max(0, y0), max(x0 + 1, x1), max(y0 + 1, y1)))
        texts = [f"a photo of a {c} {d.label}" for c in COLORS]
        inputs = self.clip_processor(text=texts, images=[crop], return_tensors="pt", padding=True).to(self.device)
        with torch.no_grad():
            logits = self.clip(**inputs).logits_per_image[0]
        return COLORS[int(logits.argmax())]

    def __call__(self, images, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> list[float]:
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        records = []
        for i, p in enumerate(prompts):
            rec = (metadata[i] if metadata is not None and metadata[i] and "include" in metadata[i] else None) or (
                self.metadata.get(p)
            )
            if rec is None:
                raise InputError(f"no GenEval metadata for prompt {p!r} (give --geneval-metadata FILE.jsonl)")
            check_record(rec)  # before any detection: a malformed record is the request's fault
            records.append(rec)
        images = [im.convert("RGB") for im in images]
        scores = []
        for im, rec, dets in zip(images, records, self.detect(images)):
            strict, partial = verdict(rec, dets, lambda d, im=im: self.color_of(im, d))
            scores.append(float(partial) if self.partial_credit else float(strict))
        return scores
