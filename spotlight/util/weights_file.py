"""Weights on disk (safetensors files, ``final/`` and ``best/`` folders), checked before a command
loads them: one error naming the file and the library's reason (``header too small``, ``incomplete
metadata``) instead of a ``SafetensorError`` traceback, found before minutes of encoding and
sampling rather than after. ``spotlight profile --weights``, ``spotlight bench stale-ranking``
(a run's ``tensor_store/weights/v<N>.safetensors``) and ``spotlight eval`` (a run's ``final/``)
use it.

A readable file can still be the wrong weights: a weight version of another model size, another
LoRA rank, or of no transformer at all. :func:`check_weight_version` compares its tensor names and
shapes (the header only) with those of the run's transformer (:class:`VersionLayout`, built
weightless: :func:`spotlight.studies.profiling.version_layout`), as a Rollout Worker loads a
version (:func:`spotlight.models.lora.load_version`; docs/architecture.md §7): one line naming the
file instead of torch's size-mismatch traceback, or a study that silently scores other weights.

A readable file can also hold other bytes than were saved (a disk or a copy that flipped some):
safetensors checks a file's size against its header, not its contents. A run writes a
:data:`DIGEST_FILE` (``sha256sum``'s format: ``sha256sum -c SHA256SUMS`` checks it too) into every
``final/`` and ``best/`` (:func:`write_digests`), and :func:`check_weights_dir` compares every file
it lists with it (docs/evaluation.md, "What it writes")."""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Iterable, Mapping

from spotlight.errors import InputError

LORA_FILE = "pytorch_lora_weights.safetensors"
"""The LoRA adapter of a ``final/`` or ``best/`` folder (diffusers' format)."""


DIGEST_FILE = "SHA256SUMS"
"""The SHA-256 of every other file of a ``final/`` or ``best/`` folder, one ``<hex>  <name>`` line each
(``sha256sum``'s format)."""

_DIGEST_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


class WeightsFileError(InputError):
    """A weights file or folder that cannot be loaded; the message names the path and why."""


def _label(path: pathlib.Path, option: str) -> str:
    return f"{option} {path}" if option else str(path)


def _reason(exc: BaseException) -> str:
    """An OS or library error as a short phrase."""
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def check_safetensors(path: str | pathlib.Path, *, option: str = "") -> None:
    """``path`` is a readable safetensors file that holds tensors (only its header is read: the
    library checks that the header's tensors cover the file exactly, so a truncated or padded file
    fails here too).

    Args:
        option: the command-line option that named ``path`` (``--weights``), put before it.

    Raises:
        WeightsFileError: one line naming ``option`` and ``path``, and why not.
    """
    from safetensors import SafetensorError, safe_open

    path = pathlib.Path(path)
    label = _label(path, option)
    if not path.exists():
        raise WeightsFileError(f"{label}: no such file")
    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        raise WeightsFileError(f"{label}: {what}, not a safetensors file")
    try:
        with safe_open(str(path), framework="pt") as f:
            empty = not list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise WeightsFileError(f"{label}: not a readable safetensors file ({_reason(exc)})") from None
    if empty:
        raise WeightsFileError(f"{label}: a safetensors file without tensors")


def load_safetensors(path: str | pathlib.Path, *, option: str = "") -> dict:
    """The tensors of the safetensors file ``path`` (:func:`check_safetensors` first, to fail
    before any work: the file may still change between the check and the load).

    Raises:
        WeightsFileError: as :func:`check_safetensors` says it.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise WeightsFileError(
            f"{_label(pathlib.Path(path), option)}: not a readable safetensors file ({_reason(exc)})"
        ) from None


def check_weights_dir(path: str | pathlib.Path, *, option: str = "") -> None:
    """``path`` is trained weights a run saved (``final/``, ``best/``): a LoRA adapter
    (:data:`LORA_FILE`) or a transformer folder (``config.json``), every safetensors file in it
    readable (:func:`check_safetensors`), and, where it has a :data:`DIGEST_FILE`, the files a
    loader reads (the adapter; or ``config.json``, the safetensors files and their index) listed
    there and every listed file holding the bytes that were saved (:func:`digest_problem`;
    read once: about 1.1 s per GiB on one core).

    Raises:
        WeightsFileError: one line naming the folder or its bad file, and why.
    """
    path = pathlib.Path(path)
    label = _label(path, option)
    if not path.exists():
        raise WeightsFileError(f"{label}: no such file or directory")
    if not path.is_dir():
        raise WeightsFileError(
            f"{label}: a file, not a weights folder (a run's final/ or best/: "
            f"config.json and its safetensors files, or {LORA_FILE})"
        )
    lora = path / LORA_FILE
    if lora.exists():
        check_safetensors(lora)
        read = [LORA_FILE]
    elif not (path / "config.json").is_file():
        raise WeightsFileError(f"{label}: neither a transformer folder (config.json) nor LoRA weights ({LORA_FILE})")
    else:
        files = sorted(path.glob("*.safetensors"))
        for f in files:
            check_safetensors(f)
        read = [
            "config.json",
            *(f.name for f in files),
            *(f.name for f in sorted(path.glob("*.safetensors.index.json"))),
        ]
    problem = digest_problem(path, must_list=read)
    if problem:
        raise WeightsFileError(f"{label}: {problem}")


def _sha256(path: pathlib.Path) -> str:
    from spotlight.store.weight_sync import file_digest  # the weight versions' digest, 8 MiB reads

    return file_digest(path, "sha256").partition(":")[2]


def folder_size_bytes(folder: str | pathlib.Path) -> int:
    """The bytes of the regular files directly in ``folder`` (0 when it is no folder)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def write_digests(folder: str | pathlib.Path) -> pathlib.Path:
    """Write :data:`DIGEST_FILE` into ``folder``: the SHA-256 of each of its regular files (the
    folder a save just wrote, so read back from the page cache), sorted by name, through a
    temporary file. Returns its path."""
    from spotlight.util.atomic_file import write_text_atomic

    folder = pathlib.Path(folder)
    names = sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and not p.is_symlink() and p.name != DIGEST_FILE and not p.name.startswith(".")
    )
    out = folder / DIGEST_FILE
    write_text_atomic(out, "".join(f"{_sha256(folder / n)}  {n}\n" for n in names))
    return out


def _quoted(line: str, limit: int = 80) -> str:
    return repr(line if len(line) <= limit else line[:limit] + "…")


def read_digests(folder: str | pathlib.Path) -> dict[str, str] | None:
    """The file name → SHA-256 (lowercase hex) that ``folder``'s :data:`DIGEST_FILE` lists; None
    when it has none. Reads what ``sha256sum -c`` reads: blank lines are skipped, hex may be
    uppercase, a name may start with ``./``; a name must be a file of the folder itself (``../x``,
    ``/x`` and ``sub/x`` are refused: nothing outside the folder is read).

    Raises:
        ValueError: why the listing cannot be read, as one phrase.
    """
    listing = pathlib.Path(folder) / DIGEST_FILE
    if not listing.exists():
        return None
    try:
        lines = listing.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{DIGEST_FILE} is unreadable ({_reason(exc) if isinstance(exc, OSError) else 'not text'})"
        ) from None
    expected: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        m = _DIGEST_LINE.match(line)
        if m is None:
            raise ValueError(f"{DIGEST_FILE} line {number} is not '<sha256>  <file name>': {_quoted(line)}")
        name = m.group(2)
        while name.startswith("./"):
            name = name[2:]
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{DIGEST_FILE} line {number} names {_quoted(m.group(2))}, not a file of this folder")
        expected[name] = m.group(1).lower()
    if not expected:
        raise ValueError(f"{DIGEST_FILE} lists no file")
    return expected


def digest_problem(folder: str | pathlib.Path, must_list: Iterable[str] = ()) -> str | None:
    """Why the files of ``folder`` are not those its :data:`DIGEST_FILE` lists (None: they are,
    or the folder has no such file: a folder saved before runs wrote one, or by hand). Reads
    every listed file once.

    In order: the digest file is unreadable or a line is not ``<sha256>  <name>``
    (:func:`read_digests`), a name of ``must_list`` (the files a loader reads) is not listed, a
    listed file is missing, a file's bytes differ from those saved. A file neither listed nor
    in ``must_list`` (a note beside the weights) is not read."""
    folder = pathlib.Path(folder)
    try:
        expected = read_digests(folder)
    except ValueError as exc:
        return str(exc)
    if expected is None:
        return None
    for name in must_list:
        if name not in expected:
            return f"{name} is not listed in {DIGEST_FILE}, so its bytes cannot be checked"
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing (listed in {DIGEST_FILE})"
        try:
            found = _sha256(path)
        except OSError as exc:
            return f"{name} is unreadable ({_reason(exc)})"
        if found != digest:
            return (
                f"{name} holds other bytes than were saved (its SHA-256 is {found[:12]}…, "
                f"{DIGEST_FILE} says {digest[:12]}…): the file was changed or damaged after the save"
            )
    return None


@dataclasses.dataclass(frozen=True)
class VersionLayout:
    """The tensors a weight version of a run's transformer may and must hold.

    Attributes:
        shapes: every state-dict name of the Rollout Worker's transformer (with LoRA: the frozen
            base's and the adapter's) and its shape; a version may hold no other name.
        required: the names a version must hold: every one in full fine-tuning, the adapter's
            (``lora_*``) with LoRA.
        what: the weights as a refusal names them (``"QwenImageTransformer2DModel transformer"``,
            ``"LoRA adapter (rank 32) of QwenImageTransformer2DModel"``).
        hint: the settings that fix these shapes (said after a mismatch).
    """

    shapes: Mapping[str, tuple[int, ...]]
    required: frozenset[str]
    what: str
    hint: str = ""


def _some(names, n: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(repr(x) for x in names[:n]) + more


def version_problem(found: Mapping[str, tuple[int, ...]], layout: VersionLayout) -> str | None:
    """Why the tensors ``found`` (name → shape) are not a weight version of ``layout``'s
    transformer (None: they load); the checks of :func:`spotlight.models.lora.load_version`,
    whose ``load_state_dict`` would fail with a size-mismatch traceback, in words. Pure.

    In order: no name matches (another model, or a diffusers-format LoRA file: a study would
    score nothing it was asked to), a tensor of another shape (another model size or LoRA rank),
    names the transformer lacks, names the version lacks.
    """
    found = {n: tuple(s) for n, s in found.items()}
    hint = f" ({layout.hint})" if layout.hint else ""
    if not found:
        return "holds no tensors"
    if not set(found) & layout.required:
        return (
            f"holds no weights of this run's {layout.what}: no tensor name in the file "
            f"(e.g. {min(found)!r}) is one of the model's (e.g. {min(layout.required)!r})"
        )
    wrong = [n for n in sorted(found) if n in layout.shapes and found[n] != tuple(layout.shapes[n])]
    if wrong:
        n = wrong[0]
        return (
            f"not a weight version of this run's {layout.what}: {len(wrong)} tensors of another shape, "
            f"e.g. {n!r} is {list(found[n])} in the file but {list(layout.shapes[n])} in the model{hint}"
        )
    unknown = [n for n in found if n not in layout.shapes]
    if unknown:
        return (
            f"not a weight version of this run's {layout.what}: {len(unknown)} tensors the model does not have, "
            f"e.g. {_some(unknown)}{hint}"
        )
    missing = layout.required - set(found)
    if missing:
        return (
            f"not a weight version of this run's {layout.what}: lacks {len(missing)} of its "
            f"{len(layout.required)} tensors, e.g. {_some(missing)}{hint}"
        )
    return None


def tensor_shapes(path: str | pathlib.Path, *, option: str = "") -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor of the safetensors file ``path``, from its header alone
    (:func:`check_safetensors` first).

    Raises:
        WeightsFileError: as :func:`check_safetensors` says it.
    """
    from safetensors import SafetensorError, safe_open

    check_safetensors(path, option=option)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise WeightsFileError(
            f"{_label(pathlib.Path(path), option)}: not a readable safetensors file ({_reason(exc)})"
        ) from None


def check_weight_version(path: str | pathlib.Path, layout: VersionLayout, *, option: str = "") -> None:
    """``path`` is a readable safetensors file holding a weight version of ``layout``'s
    transformer (:func:`version_problem`; only its header is read).

    Raises:
        WeightsFileError: one line naming ``option`` and ``path``, and why not.
    """
    problem = version_problem(tensor_shapes(path, option=option), layout)
    if problem:
        raise WeightsFileError(f"{_label(pathlib.Path(path), option)}: {problem}")


def check_loaded_version(
    state_dict: Mapping, layout: VersionLayout, path: str | pathlib.Path, *, option: str = ""
) -> None:
    """:func:`check_weight_version` of tensors already loaded from ``path`` (the file may have
    changed between its check and its load).

    Raises:
        WeightsFileError: one line naming ``option`` and ``path``, and why not.
    """
    problem = version_problem({n: tuple(t.shape) for n, t in state_dict.items()}, layout)
    if problem:
        raise WeightsFileError(f"{_label(pathlib.Path(path), option)}: {problem}")
