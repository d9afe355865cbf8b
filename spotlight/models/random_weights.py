"""Random-weight checkpoints of any size, written block by block: never the whole model at once.

A real-size check (``scripts/gpu-check``: Qwen-Image's 20.4 B-parameter transformer, 41 GB in
bf16) needs a diffusers checkpoint on disk, since the run loads it the way a user's run does
(``spotlight up --local``: the Train Workers' sharded load, the Rollout Workers'
``from_pretrained``). Building the model whole first would need 82 GB of host memory in fp32
(docs/architecture.md §10: no process holds a whole model it only needs a shard of). Instead
the transformer is described on the ``meta`` device (names, shapes: no memory), and its weights
are made one *group* at a time (the blocks outside the transformer's repeated blocks, then each
block), on any device, cast, copied to the host, written and dropped. The files are the
layout diffusers' ``save_pretrained`` writes for a sharded model: ``config.json``,
``diffusion_pytorch_model-0000k-of-0000n.safetensors`` (whole groups per file, about
``max_shard_bytes`` each) and ``diffusion_pytorch_model.safetensors.index.json``; a single
file is ``diffusion_pytorch_model.safetensors`` with no index.

Each group is seeded on its own (``seed`` and its index), so a block's weights do not depend on
the shard size or the device order of earlier groups (on one device kind: CUDA and CPU random
streams differ). Family-specific code says what a group is
(:func:`spotlight.models.families.qwen_image.write_random_transformer`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence

import torch

from spotlight.store.tensor_wire import SafetensorsStream

__all__ = ["Group", "StreamedWrite", "plan_shards", "write_sharded_safetensors"]

WEIGHTS_NAME = "diffusion_pytorch_model"
"""diffusers' file stem for model weights (``diffusion_pytorch_model.safetensors``)."""


@dataclasses.dataclass(frozen=True)
class Group:
    """Tensors made together: ``names`` (in file order) and ``make()``, which returns them, on the
    host in their final dtype, with the bytes it held on the host while making them beyond the
    returned tensors (a model built on the CPU in fp32 before its cast; 0 when built on a GPU)."""

    label: str
    names: tuple[str, ...]
    make: Callable[[], tuple[dict[str, torch.Tensor], int]]


@dataclasses.dataclass(frozen=True)
class StreamedWrite:
    """What :func:`write_sharded_safetensors` wrote and held.

    Attributes:
        files: the weight files, in order (file names in ``folder``).
        params: parameters written; ``data_bytes``: their bytes (the index's ``total_size``).
        groups: groups made; ``largest_group_bytes``: the largest one's bytes.
        peak_host_bytes: the most bytes of tensors the writer held on the host at once (a
            group, plus what making it held): about one block, whatever the model's size.
    """

    folder: pathlib.Path
    files: tuple[str, ...]
    params: int
    data_bytes: int
    groups: int
    largest_group_bytes: int
    peak_host_bytes: int


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= int(d)
    return n


def plan_shards(group_bytes: Sequence[int], max_shard_bytes: int) -> list[list[int]]:
    """Indices of whole groups per file, in order: a new file starts when the next group would
    take the current one past ``max_shard_bytes`` (a group larger than that gets a file of its own)."""
    shards: list[list[int]] = []
    size = 0
    for i, b in enumerate(group_bytes):
        if not shards or (size + b > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += b
    return shards


def write_sharded_safetensors(
    folder: str | pathlib.Path,
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    groups: Sequence[Group],
    *,
    max_shard_bytes: int = 5 << 30,
    progress: Callable[[str], None] | None = None,
) -> StreamedWrite:
    """Write ``groups`` (together exactly the tensors of ``specs``: name → dtype, shape) into
    sharded safetensors files and diffusers' index in ``folder``, making one group at a time.

    Raises:
        ValueError: the groups do not cover ``specs`` exactly once, or a group made tensors of
            other names, dtypes or shapes than its specs say.
        OSError: a file cannot be written.
    """
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    listed = [name for g in groups for name in g.names]
    if sorted(listed) != sorted(specs) or len(set(listed)) != len(listed):
        missing, extra = sorted(set(specs) - set(listed)), sorted(set(listed) - set(specs))
        raise ValueError(f"groups do not cover the model's tensors once: missing {missing[:3]}, unknown {extra[:3]}")
    sizes = [sum(_nbytes(*specs[n]) for n in g.names) for g in groups]
    shards = plan_shards(sizes, max_shard_bytes)
    n = len(shards)
    files = (
        [f"{WEIGHTS_NAME}.safetensors"]
        if n == 1
        else [f"{WEIGHTS_NAME}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    weight_map: dict[str, str] = {}
    peak = params = 0
    for k, members in enumerate(shards):
        names = [name for i in members for name in groups[i].names]
        with SafetensorsStream(folder / files[k], [(name, *specs[name]) for name in names]) as out:
            for i in members:
                g = groups[i]
                tensors, making_bytes = g.make()
                if list(tensors) != list(g.names):
                    raise ValueError(
                        f"group {g.label} made {sorted(tensors)[:3]}…, its specs list {list(g.names)[:3]}…"
                    )
                held = sum(t.numel() * t.element_size() for t in tensors.values())
                peak = max(peak, held + int(making_bytes))
                for name in g.names:
                    out.write(name, tensors[name])  # checks dtype and shape against the spec
                    params += tensors[name].numel()
                del tensors
                if progress is not None:
                    progress(f"{g.label} → {files[k]}")
        weight_map.update({name: files[k] for name in names})
    if n > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / f"{WEIGHTS_NAME}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return StreamedWrite(
        folder=folder,
        files=tuple(files),
        params=params,
        data_bytes=sum(sizes),
        groups=len(groups),
        largest_group_bytes=max(sizes, default=0),
        peak_host_bytes=peak,
    )
