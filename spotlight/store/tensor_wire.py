"""Tensors ↔ raw ZeroMQ frames, and weights ↔ safetensors bytes (no pickle anywhere).

Used by workers, the trainer and the coordinator; the agent daemon relays frames
without importing this module (it imports torch).
"""

from __future__ import annotations

import json
import math
import pathlib

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from spotlight.protocol import ProtocolError, TensorMeta

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorMeta], list[bytes]]:
    """Describe and serialise CPU tensors.

    Returns:
        ``(metas, frames)``: one :class:`TensorMeta` and one raw little-endian frame per tensor.

    Raises:
        ValueError: a dtype that the wire does not carry.
    """
    metas, frames = [], []
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not supported on the wire")
        metas.append(TensorMeta(name, _NAMES[t.dtype], list(t.shape)))
        if t.dtype == torch.bfloat16:
            frames.append(t.view(torch.int16).numpy().tobytes())
        else:
            frames.append(t.numpy().tobytes())
    return metas, frames


def unpack_tensors(metas: list[TensorMeta], frames: list) -> dict[str, torch.Tensor]:
    """Rebuild tensors from metas and raw frames (copies, so they are writable).

    Raises:
        ProtocolError: unknown dtype, a duplicate name, more than 8 dimensions, a negative
            or absurd (>= 2**40) dimension, or a frame whose size does not match its shape.
    """
    out = {}
    if len(frames) < len(metas):
        raise ProtocolError(f"{len(metas)} tensors declared, {len(frames)} frames present")
    for meta, frame in zip(metas, frames):
        dtype = _DTYPES.get(meta.dtype)
        if dtype is None:
            raise ProtocolError(f"tensor {meta.name!r}: unknown dtype {meta.dtype!r}")
        if meta.name in out:
            raise ProtocolError(f"tensor {meta.name!r} appears twice")
        if len(meta.shape) > 8:
            raise ProtocolError(f"tensor {meta.name!r}: {len(meta.shape)} dimensions (at most 8)")
        numel = span = 1
        for d in meta.shape:
            if not isinstance(d, int) or d < 0 or d >= 1 << 40:
                raise ProtocolError(f"tensor {meta.name!r}: bad dimension in {meta.shape}")
            numel *= d
            span *= max(d, 1)  # also bounds empty tensors, whose strides torch still computes
        if span >= 1 << 40:
            raise ProtocolError(f"tensor {meta.name!r}: shape {meta.shape} is beyond any frame")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(frame) != numel * itemsize:  # checked before anything is copied
            raise ProtocolError(
                f"tensor {meta.name!r}: {len(frame)} bytes for shape {meta.shape} {meta.dtype} (expected "
                f"{numel * itemsize})"
            )
        buf = bytearray(bytes(frame))
        if numel == 0:
            out[meta.name] = torch.empty(meta.shape, dtype=dtype)
        else:
            out[meta.name] = torch.frombuffer(buf, dtype=dtype).reshape(meta.shape)
    return out


def state_dict_to_bytes(state_dict: dict[str, torch.Tensor]) -> bytes:
    """A model state dict as one safetensors blob."""
    return st_save({k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()})


def bytes_to_state_dict(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_dict_to_bytes` (safetensors: header + raw data, no code)."""
    return st_load(bytes(blob))


# ---------------------------------------------------------------- weight versions as files

_ST_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_DTYPES = {v: k for k, v in _ST_NAMES.items()}


def safetensors_header(
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, int]:
    """The JSON header of a safetensors file holding ``specs`` (name, dtype, shape) in this order,
    padded so the data starts 8-byte aligned, and the size of its data section. The tensors'
    bytes follow the 8-byte little-endian header length and the header, back to back.

    Raises:
        ValueError: a dtype safetensors cannot hold here, or a name given twice.
    """
    header, pos = {}, 0
    for name, dtype, shape in specs:
        if dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be written to a safetensors file here")
        if name in header:
            raise ValueError(f"tensor {name!r} is listed twice")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
    return raw, pos


class SafetensorsStream:
    """Writes one safetensors file tensor by tensor, its header first (from ``specs``, known
    before any tensor exists), so a file of any size is written holding one tensor at a time.
    ``safetensors.safe_open`` / ``load_file`` and diffusers read the result.

    Tensors must come in the order of ``specs``, each with its spec's dtype and shape;
    :meth:`close` checks that every one came.

    Raises:
        ValueError: (``write``) a tensor out of order or of another dtype or shape; (``close``)
            tensors missing; (constructor) as :func:`safetensors_header`.
        OSError: the file cannot be written.
    """

    def __init__(self, path: str | pathlib.Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path = pathlib.Path(path)
        self.specs = list(specs)
        raw, self.data_bytes = safetensors_header(self.specs)
        self.size_bytes = 8 + len(raw) + self.data_bytes
        self._next = 0
        self._f = open(self.path, "wb")
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.specs):
            raise ValueError(f"{self.path.name}: {name!r} is one tensor too many")
        want, dtype, shape = self.specs[self._next]
        if name != want or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"{self.path.name}: expected {want!r} {dtype} {list(shape)} next, got {name!r} {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
        if tensor.numel():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self._f.write(memoryview(flat))
        self._next += 1

    def close(self) -> None:
        self._f.close()
        if self._next != len(self.specs):
            missing = [name for name, _, _ in self.specs[self._next :]]
            raise ValueError(f"{self.path.name}: {len(missing)} tensors never written, e.g. {missing[:3]}")

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def save_version(state_dict: dict[str, torch.Tensor], path, *, digest: str = "sha256") -> tuple[int, str]:
    """Write a state dict as a safetensors file, streaming one tensor at a time, and digest it
    on the way (no second pass over the file, no whole-file buffer: unlike
    :func:`state_dict_to_bytes`, memory stays at the state dict plus one tensor's CPU copy
    when it lives on a GPU).

    Tensors are laid out by element size (largest first), then name, as safetensors itself
    does, so every tensor starts at a multiple of its element size and
    :func:`mmap_state_dict` can map it without copying. ``safetensors.torch.load_file``
    reads the result.

    Args:
        state_dict: name → tensor (any device; made contiguous on the CPU one at a time).
        path: file to write (replaced).
        digest: ``"sha256"`` or ``"blake2b"`` (:mod:`spotlight.store.weight_sync`).

    Returns:
        ``(size_bytes, "<algorithm>:<hex>")``.

    Raises:
        ValueError: a dtype safetensors cannot hold here (complex, float8, …).
        OSError: the file cannot be written.
        DiskSpaceError: the file would not fit (checked before writing).
    """
    from spotlight.store.weight_sync import new_hasher

    entries = []
    for name, t in state_dict.items():
        if t.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be written to a weight version")
        entries.append((name, t))
    entries.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    raw, pos = safetensors_header([(name, t.dtype, tuple(t.shape)) for name, t in entries])
    from spotlight.util.disk import ensure_free_space

    ensure_free_space(pathlib.Path(path).parent, 8 + len(raw) + pos, f"weight version {pathlib.Path(path).name}")
    h = new_hasher(digest)
    with open(path, "wb") as f:
        for piece in (len(raw).to_bytes(8, "little"), raw):
            f.write(piece)
            h.update(piece)
        for _, t in entries:
            if t.numel() == 0:
                continue
            flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            mv = memoryview(flat)
            f.write(mv)
            h.update(mv)
    return 8 + len(raw) + pos, f"{digest}:{h.hexdigest()}"


def mmap_state_dict(path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as views of a private memory map of the file: nothing is
    read until used, and what is read lives in the page cache (shared with every other
    reader of the file, e.g. the agent that cached it), not in this process's heap.
    Loading them into a model (``load_state_dict``) copies them into its parameters, so a
    worker holds one version (mapped) plus its model.

    The map is copy-on-write: writing to a tensor copies only the touched pages, never
    the file. Tensors whose offset is not a multiple of their element size (files from
    other writers) are copied.

    Raises:
        WeightSyncError: a malformed or inconsistent header
            (:func:`spotlight.store.weight_sync.read_safetensors_header`).
        OSError: the file cannot be opened.
    """
    import mmap

    from spotlight.store.weight_sync import WeightSyncError, read_safetensors_header

    header, start, size = read_safetensors_header(path)
    out: dict[str, torch.Tensor] = {}
    if size == start:
        for name, info in header.items():
            out[name] = torch.empty(info["shape"], dtype=_st_dtype(name, info["dtype"]))
        return out
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for name, info in header.items():
        dtype = _st_dtype(name, info["dtype"])
        b, e = info["data_offsets"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = (e - b) // itemsize
        if count == 0:
            out[name] = torch.empty(info["shape"], dtype=dtype)
        elif (start + b) % itemsize == 0:
            out[name] = torch.frombuffer(mm, dtype=dtype, count=count, offset=start + b).reshape(info["shape"])
        else:
            out[name] = torch.frombuffer(bytearray(mm[start + b : start + e]), dtype=dtype).reshape(info["shape"])
    if not out and header:
        raise WeightSyncError(f"{path}: no tensors")
    return out


def _st_dtype(name: str, st_name: str) -> torch.dtype:
    from spotlight.store.weight_sync import WeightSyncError

    dtype = _ST_DTYPES.get(st_name)
    if dtype is None:
        raise WeightSyncError(f"tensor {name!r}: dtype {st_name} is not supported by this loader")
    return dtype
