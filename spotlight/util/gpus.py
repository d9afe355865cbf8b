"""This host's GPUs as the driver reports them, without touching CUDA in this process.

``spotlight up`` checks the memory plan against the GPU size when ``cluster.gpu_memory_gib``
is unset (docs/planning.md §1). It asks ``nvidia-smi`` rather than ``torch.cuda``: a CUDA
context in the coordinator would stay for the whole run on GPU 0, where trainer rank 0
trains.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

MIB = 1 << 20


def parse_gpu_indices(text: str) -> list[int]:
    """Comma-separated GPU indices as given on a command line (``"0,1"``); a blank text is none.

    Raises:
        ValueError: an empty element (``"0,,1"``, a trailing comma: a typo that would otherwise
            drop a GPU silently) or one that is not an integer, named in one line.
    """
    if not text.strip():
        return []
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"{text[:40]!r} has an empty element; give comma-separated indices like 0,1")
        try:
            out.append(int(item))
        except ValueError:
            raise ValueError(f"{item[:20]!r} is not a GPU index; give comma-separated indices like 0,1") from None
    return out


@dataclasses.dataclass(frozen=True)
class HostGpus:
    """The GPUs this host's processes may use."""

    indices: tuple[int, ...]
    """Physical indices (``nvidia-smi``'s), those ``CUDA_VISIBLE_DEVICES`` leaves visible."""
    memory_bytes: tuple[int, ...]
    """Total memory of each, in the same order."""

    @property
    def smallest_bytes(self) -> int:
        return min(self.memory_bytes)

    def describe(self) -> str:
        """E.g. ``4 GPUs of 79.6 GiB (nvidia-smi)``: what a message names as the limit's source."""
        n = len(self.indices)
        return f"{n} GPU{'s' if n != 1 else ''} of {self.smallest_bytes / (1 << 30):.1f} GiB (nvidia-smi)"


def parse_nvidia_smi(text: str, visible: str | None = None) -> HostGpus | None:
    """``nvidia-smi --query-gpu=index,memory.total --format=csv,noheader,nounits`` output
    (``"0, 81559"`` per line, MiB) → :class:`HostGpus`, keeping the GPUs a numeric
    ``CUDA_VISIBLE_DEVICES`` (``visible``) names; None when no GPU is listed or visible. Pure.

    A ``CUDA_VISIBLE_DEVICES`` of UUIDs or MIG names keeps every GPU (the smallest then bounds
    the check); an empty one hides them all.
    """
    gpus: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            gpus[int(parts[0])] = int(float(parts[1]) * MIB)
        except ValueError:
            continue
    if visible is not None:
        visible = visible.strip()
        if not visible:
            return None
        try:
            wanted = [int(v) for v in visible.split(",") if v.strip()]
        except ValueError:
            wanted = None  # UUIDs / MIG names: keep all
        if wanted is not None:
            gpus = {i: gpus[i] for i in wanted if i in gpus}
    if not gpus:
        return None
    order = sorted(gpus)
    return HostGpus(tuple(order), tuple(gpus[i] for i in order))


def host_gpus(timeout_s: float = 10.0) -> HostGpus | None:
    """This host's visible GPUs from ``nvidia-smi`` (None: no ``nvidia-smi``, no GPU, or it failed)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(out, os.environ.get("CUDA_VISIBLE_DEVICES"))
