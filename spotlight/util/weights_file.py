"""Weights on disk (safetensors files, ``final/`` and ``best/`` folders), checked before a command
loads them: one error naming the file and the library's reason (``header too small``, ``incomplete
metadata``) instead of a ``SafetensorError`` traceback, found before minutes of encoding and
sampling rather than after. ``spotlight profile --weights``, ``spotlight bench stale-ranking``
(a run's ``tensor_store/weights/v<N>.safetensors``) and ``spotlight eval`` (a run's ``final/``)
use it."""

from __future__ import annotations

import pathlib

from spotlight.errors import InputError

LORA_FILE = "pytorch_lora_weights.safetensors"
"""The LoRA adapter of a ``final/`` or ``best/`` folder (diffusers' format)."""


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
    readable (:func:`check_safetensors`).

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
        return
    if not (path / "config.json").is_file():
        raise WeightsFileError(f"{label}: neither a transformer folder (config.json) nor LoRA weights ({LORA_FILE})")
    for f in sorted(path.glob("*.safetensors")):
        check_safetensors(f)
