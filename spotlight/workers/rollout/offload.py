"""Moving a Rollout Worker's model between its device and host memory (the shell of
``spotlight/core/offload.py``, which decides when).

A reserved Rollout Worker on a GPU a Train Worker also uses gives the GPU its model's memory
back while the update trains there (docs/memory.md, "A GPU shared by rollout and training"):
every parameter and buffer is copied into a host buffer (pinned on CUDA, so the copy runs at
the link's speed and asynchronously) and the module points at it; the device memory goes back
to the driver (``torch.cuda.empty_cache``). The reload copies them into fresh device tensors.
The host buffers are allocated by the first offload and kept for the next ones (allocating
41 GB of pinned memory costs seconds each time), so the reserved host holds one copy of the
worker's weights for as long as the worker lives. They are views into pinned chunks of
:data:`HOST_CHUNK_BYTES` (a power of two): torch's pinned allocator rounds every allocation up
to a power of two, which would cost up to twice the weights' size if each tensor were
allocated on its own. Parameter objects stay the same (only their
``.data`` moves), so LoRA adapters, hooks and optimizers that hold them keep working.

On the CPU there is no device memory to give back: the move is a no-op by default (the same
states, messages and accounting run, which is what the CPU tests exercise); ``copy_on_cpu``
makes it a real host-to-host copy so the swapping itself can be tested.
"""

from __future__ import annotations

import dataclasses
import time

import torch

__all__ = ["HOST_CHUNK_BYTES", "ModelOffloader", "MoveStats"]

HOST_CHUNK_BYTES = 1 << 30
"""Size of the pinned host chunks the offloaded tensors are carved from (a power of two, so the
pinned allocator's rounding wastes nothing; larger tensors get an allocation of their own)."""
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class MoveStats:
    """One move: the bytes of the weights (moved, or held where the move is a no-op) and its
    wall-clock seconds (the device synchronised)."""

    size_bytes: int
    seconds: float


class ModelOffloader:
    """Offloads and reloads one module's parameters and buffers.

    Args:
        device: the module's device when resident.
        pin_memory: page-lock the host buffers (default: on CUDA).
        copy_on_cpu: on a CPU device, really copy to separate host buffers (tests) instead of
            leaving the tensors where they are.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        pin_memory: bool | None = None,
        copy_on_cpu: bool = False,
        chunk_bytes: int = HOST_CHUNK_BYTES,
    ):
        self.device = torch.device(device)
        self.pin_memory = (self.device.type == "cuda") if pin_memory is None else bool(pin_memory)
        self.copy_on_cpu = copy_on_cpu
        self.chunk_bytes = int(chunk_bytes)
        self.offloaded = False
        self._host: dict[tuple[int, str, str], torch.Tensor] = {}
        self._chunks: list[torch.Tensor] = []

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this offloader keeps (its chunks; 0 before the first real move)."""
        return sum(c.numel() for c in self._chunks)

    def _carve(self, slots: list) -> None:
        """Host buffers for every slot, carved from chunks of :attr:`chunk_bytes` in order (each
        tensor at a 64-byte boundary), a tensor larger than a chunk in one of its own."""
        self._host, self._chunks = {}, []
        used = self.chunk_bytes  # no chunk yet
        for owner, kind, name, t in slots:
            n = t.numel() * t.element_size()
            start = -(-used // _ALIGN) * _ALIGN
            if n > self.chunk_bytes:
                chunk, start = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin_memory), 0
                self._chunks.insert(0, chunk)  # the open chunk stays last
            else:
                if start + n > self.chunk_bytes:
                    self._chunks.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pin_memory))
                    start = 0
                chunk, used = self._chunks[-1], start + n
            self._host[(id(owner), kind, name)] = chunk[start : start + n].view(t.dtype).view(t.shape)

    def _moves(self) -> bool:
        return self.device.type != "cpu" or self.copy_on_cpu

    @staticmethod
    def _slots(module: torch.nn.Module):
        """``(owner, "param" | "buffer", name, tensor)`` for every parameter (each once, even when
        tied) and buffer of ``module``."""
        seen: set[int] = set()
        for owner in module.modules():
            for name, p in owner._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield owner, "param", name, p
            for name, b in owner._buffers.items():
                if b is not None:
                    yield owner, "buffer", name, b

    @staticmethod
    def _point(owner: torch.nn.Module, kind: str, name: str, tensor, new: torch.Tensor) -> None:
        if kind == "param":
            tensor.data = new
        else:
            owner._buffers[name] = new

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _fits(self, slots: list) -> bool:
        """The host buffers carved before are for exactly these tensors."""
        keys = {(id(owner), kind, name): t for owner, kind, name, t in slots}
        return keys.keys() == self._host.keys() and all(
            self._host[k].shape == t.shape and self._host[k].dtype == t.dtype for k, t in keys.items()
        )

    def offload(self, module: torch.nn.Module) -> MoveStats:
        """Move ``module``'s tensors to host memory and free their device memory. The host
        buffers are allocated before anything moves: when that fails the module is untouched.

        Raises:
            RuntimeError: it is offloaded already (or the host memory cannot be allocated).
        """
        if self.offloaded:
            raise RuntimeError("the model is in host memory already")
        t0 = time.perf_counter()
        size = 0
        moving = self._moves()
        slots = list(self._slots(module))
        if moving and not self._fits(slots):
            self._carve(slots)
        with torch.no_grad():
            for owner, kind, name, t in slots:
                size += t.numel() * t.element_size()
                if not moving:
                    continue
                host = self._host[(id(owner), kind, name)]
                host.copy_(t.detach(), non_blocking=self.pin_memory)
                self._point(owner, kind, name, t, host)
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.offloaded = True
        return MoveStats(size, time.perf_counter() - t0)

    def reload(self, module: torch.nn.Module) -> MoveStats:
        """Move ``module``'s tensors back onto the device (the host buffers are kept for the next
        offload). The device tensors are allocated before anything moves: out of device memory
        (a Train Worker still holding it) leaves the module in host memory, to try again.

        Raises:
            RuntimeError: it is not offloaded (or the device is out of memory).
        """
        if not self.offloaded:
            raise RuntimeError("the model is on its device already")
        t0 = time.perf_counter()
        slots = list(self._slots(module))
        size = sum(t.numel() * t.element_size() for *_, t in slots)
        if self._moves():
            # every device tensor first: out of memory here leaves the model whole in host memory
            devs = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for *_, t in slots]
            with torch.no_grad():
                for (owner, kind, name, t), dev in zip(slots, devs):
                    dev.copy_(t.detach(), non_blocking=self.pin_memory)
                    self._point(owner, kind, name, t, dev)
            del devs
        self._sync()
        self.offloaded = False
        return MoveStats(size, time.perf_counter() - t0)
