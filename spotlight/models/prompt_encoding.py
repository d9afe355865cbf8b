"""Where ``spotlight up`` encodes a run's prompts: on a GPU in bf16 when this host has one, in a
child process that exits before any trainer starts (docs/planning.md §6).

Qwen-Image's text encoder is Qwen2.5-VL-7B: 16.6 GB in bf16, hours for a large prompt set in
fp32 on a CPU. On a GPU host the prompts are encoded by a spawned child process that picks
the visible GPU with the most free memory (``torch.cuda.mem_get_info``), encodes there in
``model.dtype`` (bf16 with ``auto``), writes the prompt cache and exits: its weights, its
activations and its CUDA context are all gone before the coordinator starts the Train
Workers and the reserved Rollout Worker on those GPUs, and the coordinator process itself
never creates a CUDA context. A GPU without room for the text encoder (a trainer launched
on its own may hold it already) is skipped; with none left the child encodes on its CPU.
Without a GPU, or for a family with no text encoder on disk (the tiny family's MiniLM), the
coordinator encodes in-process on the CPU. Either way the batches report progress, and the
cache (:func:`~spotlight.models.families.base.cached_conditioning`) makes a second start
free.
"""

from __future__ import annotations

import logging
import pathlib
import queue as queue_mod
from typing import Callable

from spotlight.errors import SpotlightError

log = logging.getLogger("spotlight.models.prompt_encoding")

GPU_HEADROOM_BYTES = 2 << 30
"""Free GPU memory wanted beyond the text encoder's weights (activations of a batch, the
CUDA context)."""


class EncodeError(SpotlightError):
    """The prompts could not be encoded (the child's error, or the child died)."""


def pick_gpu(free_bytes: list[int], need_bytes: int) -> int | None:
    """The GPU (index into ``free_bytes``) with the most free memory if it holds
    ``need_bytes``, else None. Pure."""
    if not free_bytes:
        return None
    best = max(range(len(free_bytes)), key=lambda i: free_bytes[i])
    return best if free_bytes[best] >= need_bytes else None


def encode_run_prompts(
    model_cfg,
    prompts: list[str],
    cache_dir: pathlib.Path,
    *,
    on_start: Callable[[str, int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    child_device: str | None = None,
    torch_threads: int = 1,
):
    """The :class:`~spotlight.rl.sampler.Conditioning` of ``prompts`` for ``model_cfg``, from the
    prompt cache or encoded (module docstring). ``on_start(where, n)`` is called once before
    an encoding starts (``where``: e.g. ``cuda:1 (bfloat16)``), ``on_progress(done)`` after each
    batch; neither is called on a cache hit.

    Args:
        child_device: None: decide (this host's GPUs as ``nvidia-smi`` lists them, a text
            encoder on disk: a child process with "auto"; otherwise in-process on the CPU);
            "auto", "cpu" or "cuda:<i>": encode in a child process asking for that device
            (tests run the child on the CPU).

    Raises:
        ModelLoadError: the text encoder cannot be loaded (in-process).
        EncodeError: the child process failed (its error) or died.
        DiskSpaceError: the cache does not fit (in-process).
    """
    from spotlight.models.families import get_family
    from spotlight.models.families.base import cached_conditioning, prompt_cache_path

    family = get_family(model_cfg)
    if prompt_cache_path(family, prompts, cache_dir).is_file():
        return cached_conditioning(family, prompts, cache_dir)
    if child_device is None and family.text_encoder_bytes() > 0:
        from spotlight.util.gpus import host_gpus

        child_device = "auto" if host_gpus() is not None else None
    if child_device is None:
        import torch

        from spotlight.models.families import torch_dtype

        if on_start is not None:
            on_start(f"cpu ({str(torch_dtype(model_cfg.dtype, 'cpu')).removeprefix('torch.')})", len(prompts))
        torch.set_num_threads(max(1, torch_threads))
        return cached_conditioning(family, prompts, cache_dir, device="cpu", progress=on_progress)
    _encode_in_child(model_cfg, prompts, cache_dir, child_device, on_start, on_progress, torch_threads)
    return cached_conditioning(family, prompts, cache_dir)  # the child wrote it


def _encode_in_child(model_cfg, prompts, cache_dir, device, on_start, on_progress, torch_threads) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state shared or inherited
    messages = ctx.Queue()
    proc = ctx.Process(
        target=_child,
        args=(model_cfg, list(prompts), str(cache_dir), device, messages, torch_threads),
        name="spotlight-encode-prompts",
        daemon=True,
    )
    proc.start()
    try:
        while True:
            try:
                kind, value = messages.get(timeout=0.5)
            except queue_mod.Empty:
                if not proc.is_alive():
                    try:  # a last message may still be in the pipe
                        kind, value = messages.get(timeout=1.0)
                    except queue_mod.Empty:
                        raise EncodeError(f"the prompt-encoding process exited with code {proc.exitcode}") from None
                else:
                    continue
            if kind == "start" and on_start is not None:
                on_start(str(value), len(prompts))
            elif kind == "done" and on_progress is not None:
                on_progress(int(value))
            elif kind == "error":
                raise EncodeError(str(value))
            elif kind == "ok":
                break
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _choose_device(family, request: str):
    """``request`` as a torch device; "auto": the visible GPU with the most free memory if it
    holds the text encoder (:data:`GPU_HEADROOM_BYTES` more), else the CPU."""
    import torch

    if request != "auto":
        return torch.device(request)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    need = family.text_encoder_bytes() + GPU_HEADROOM_BYTES
    gpu = pick_gpu(free, need)
    if gpu is None:
        log.warning(
            "no GPU has %.1f GiB free for the text encoder (most free: %.1f GiB); encoding the prompts on the CPU",
            need / (1 << 30),
            max(free) / (1 << 30),
        )
        return torch.device("cpu")
    return torch.device("cuda", gpu)


def _child(model_cfg, prompts, cache_dir, device, messages, torch_threads) -> None:
    """The encoding process: choose the device, encode into the cache, report; exit."""
    try:
        import torch

        from spotlight.models.families import get_family, torch_dtype
        from spotlight.models.families.base import cached_conditioning

        torch.set_num_threads(max(1, torch_threads))
        family = get_family(model_cfg)
        dev = _choose_device(family, device)
        messages.put(("start", f"{dev} ({str(torch_dtype(model_cfg.dtype, dev)).removeprefix('torch.')})"))
        cached_conditioning(
            family, prompts, pathlib.Path(cache_dir), device=dev, progress=lambda n: messages.put(("done", n))
        )
        messages.put(("ok", None))
    except BaseException as exc:  # the parent shows it; nothing here may die silently
        messages.put(("error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, SpotlightError) else str(exc)))
