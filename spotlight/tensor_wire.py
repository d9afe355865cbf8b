"""Tensors ↔ raw ZeroMQ frames, and weights ↔ safetensors bytes (no pickle anywhere).

Used by workers, the trainer and the coordinator; the agent daemon relays frames
without importing this module (it imports torch).
"""

from __future__ import annotations

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
                f"tensor {meta.name!r}: {len(frame)} bytes for shape {meta.shape} {meta.dtype} (expected {numel * itemsize})"
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
