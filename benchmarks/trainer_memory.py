"""Peak host memory of a Train Worker rank: 1 rank vs 2 ranks (FSDP2, gloo), activation
checkpointing off vs on, against the memory plan's estimate (docs/memory.md, docs/planning.md).

A random-weight Qwen-Image checkpoint of the real diffusers classes is written in float32,
cut into safetensors files of ``--shard-mb`` (the real checkpoint comes in shards too); its
transformer has Qwen-Image's block (24 heads × 128 at full size; here ``--heads`` × 128,
MLP × 4, ``--layers`` blocks: 12 × 8 = 0.69 B parameters); the VAE and text encoder stay tiny.
For each configuration fresh rank processes (``torch.multiprocessing.spawn``, a gloo group
over a file store, one thread each) build the
:class:`~spotlight.workers.train.train_worker.FlowGRPOTrainer` exactly as a run does (meta
device, ``fully_shard``, each rank's shards from the checkpoint), then run one train step as
Flow-GRPO's Qwen-Image recipe does (LoRA r64 on the default targets, true CFG: 2 rows per
sample, ``--samples`` samples per rank, one per forward, backward per SDE window step).

Each rank reports its resident set after the imports (the baseline), the peak while building
and loading, and the peak during the train step alone (Linux ``VmHWM``, reset through
``/proc/self/clear_refs`` between phases); the parent prints one Markdown table per rank,
the ratios, the activation bytes per token and block the off/on difference implies, and
the memory plan's estimate for the same config (``spotlight.core.memory_plan`` on the CPU:
fp32) with its error.

The RSS counts what glibc's allocator keeps, not only live tensors: with its default dynamic
mmap threshold, freed blocks of up to 32 MiB stay in the heap. ``--mmap-threshold 65536`` sets
``MALLOC_MMAP_THRESHOLD_`` for the ranks, so every freed block of 64 KiB or more goes back to
the OS at once and the RSS follows the live tensors (closer to what a GPU's caching allocator
holds); the results name the allocator setting.

Usage: ``nice -n 10 python benchmarks/trainer_memory.py --out benchmarks/results/trainer_memory.json``
(defaults: 0.69 B, 512², LoRA r64; about 20-40 minutes on 2 shared CPU cores, 9 GiB at once;
``--resume`` continues a run whose ranks were killed, ``--wait-free-gib 9`` waits for memory on
a shared machine, ``--reprint FILE`` prints the tables again). ``--lora-rank 0`` trains every
parameter (16 bytes per parameter per rank: use ``--heads 6 --layers 9``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 1024 * 1024
T_TOKENS = 16


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rss() -> int:
    return _status_bytes("VmRSS")


def _peak() -> int:
    return _status_bytes("VmHWM")


def _reset_peak() -> None:
    """Start a new peak (``VmHWM`` := the current RSS; Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _cfg(args, ckpt: str, activation_checkpointing: bool, world: int):
    from spotlight.config import (
        ClusterConfig,
        DataConfig,
        ModelConfig,
        SamplerConfig,
        SpotlightConfig,
        TrainConfig,
    )

    return SpotlightConfig(
        model=ModelConfig(
            family="qwen-image",
            pretrained_path=ckpt,
            image_size=args.image_size,
            max_text_tokens=T_TOKENS,
            guidance_scale=4.0 if args.cfg else 1.0,
        ),
        sampler=SamplerConfig(num_steps=10, sde_window_size=args.window),
        train=TrainConfig(
            activation_checkpointing=activation_checkpointing,
            lora_rank=args.lora_rank,
            num_train_workers=world,
            micro_batch_size=1,
        ),
        # the plan's rows: one sample per forward; no reserved Rollout Worker on the trainer ranks
        cluster=ClusterConfig(worker_batch_size=1, reserved_rollout_gpus=[]),
        data=DataConfig(prompts_per_iteration=args.samples * world, group_size=2, num_control_prompts=0),
    )


def _rank(rank: int, world: int, store: str, out: str, ckpt: str, ac: bool, args) -> None:
    import torch
    import torch.distributed as dist

    from spotlight.rl.sampler import Conditioning
    from spotlight.workers.train.train_worker import FlowGRPOTrainer

    torch.set_num_threads(1)
    cfg = _cfg(args, ckpt, ac, world)
    from spotlight.models.families import get_family

    get_family(cfg.model).transformer_cls()  # diffusers imported before the baseline
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        rss = {"baseline": _rss()}
        _reset_peak()
        t0 = time.perf_counter()
        tr = FlowGRPOTrainer(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
        load_s = time.perf_counter() - t0
        rss["load_peak"], rss["loaded"] = _peak(), _rss()
        local = sum(p.to_local().numel() for p in tr.model.parameters())
        total = sum(p.numel() for p in tr.model.parameters())
        trainable = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
        n = args.samples
        g = torch.Generator().manual_seed(rank)
        shape = tr.family.latent_shape
        dim = int(tr._diffusers_config["joint_attention_dim"])
        batch = {
            "window_latents": torch.randn(n, cfg.sampler.sde_window_size + 1, *shape, generator=g),
            "advantages": torch.randn(n, generator=g),
            "cond.embeds": torch.randn(n, T_TOKENS, dim, generator=g),
            "cond.mask": torch.ones(n, T_TOKENS, dtype=torch.int64),
        }
        if args.cfg:  # the negative prompt's row, shared
            batch["cond.neg.embeds"] = torch.randn(1, T_TOKENS, dim, generator=g)
            batch["cond.neg.mask"] = torch.ones(1, T_TOKENS, dtype=torch.int64)
        with torch.no_grad():  # the stored log-probs: the current weights' (ratio 1, finite loss)
            cond = Conditioning.from_tensors(batch)
            batch["log_probs"], _ = tr.sampler.window_log_probs(tr.velocity_fn, batch["window_latents"], cond)
        rss["before_step"] = _rss()
        _reset_peak()
        t1 = time.perf_counter()
        metrics = tr.train_step(batch, [[i] for i in range(n)], iteration=0)
        step_s = time.perf_counter() - t1
        rss["step_peak"] = _peak()
        assert metrics["train/optimizer_steps"] == 1.0, metrics
        report = {
            "rank": rank,
            "world": world,
            "activation_checkpointing": ac,
            "bytes": rss,
            "local_params": local,
            "total_params": total,
            "trainable_params": trainable,
            "load_s": load_s,
            "step_s": step_s,
        }
        with open(os.path.join(out, f"w{world}-ac{int(ac)}-r{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _write_checkpoint(_index: int, path: str, args) -> None:
    from spotlight.models.families.qwen_image import make_random_checkpoint

    make_random_checkpoint(
        path,
        seed=0,
        transformer_kwargs=dict(
            num_layers=args.layers, num_attention_heads=args.heads, attention_head_dim=128, axes_dims_rope=(16, 56, 56)
        ),
        image_size=args.image_size,
        max_shard_size=f"{args.shard_mb}MB",
    )


def _count(args, ckpt: str) -> dict:
    """The checkpoint's transformer as the plan counts it (on the meta device)."""
    import dataclasses

    from spotlight.models.param_count import count_model

    return dataclasses.asdict(count_model(_cfg(args, ckpt, True, 1)))


def _plan(args, size: dict, world: int, ac: bool) -> dict:
    """The memory plan's trainer terms (bytes) for the benchmark's config on the CPU."""
    from spotlight.core.memory_plan import ModelSize, plan_memory

    plan = plan_memory(_cfg(args, "/checkpoint", ac, world), ModelSize(**size), device="cpu")
    lines = {line.name: line.bytes for line in plan.trainer_gpu}
    return lines | {"total": plan.trainer_gpu_bytes, "tokens": plan.tokens_per_micro_batch}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    ap.add_argument("--heads", type=int, default=12, help="attention heads of width 128 (default 12: width 1536)")
    ap.add_argument("--image-size", type=int, default=512, help="image side, pixels (default 512: 1024 tokens)")
    ap.add_argument("--samples", type=int, default=1, help="samples per rank, one per forward (default 1)")
    ap.add_argument("--window", type=int, default=1, help="SDE window steps (default 1; the peak is per step)")
    ap.add_argument("--lora-rank", type=int, default=64, help="LoRA rank (default 64; 0 = full fine-tuning)")
    ap.add_argument("--no-cfg", dest="cfg", action="store_false", help="no true CFG (1 row per sample, not 2)")
    ap.add_argument("--shard-mb", type=int, default=500, help="checkpoint file size, MB (default 500)")
    ap.add_argument("--worlds", default="1,2", help="rank counts to run (default 1,2)")
    ap.add_argument("--out", type=pathlib.Path, help="also write the measurements to this JSON file (after each run)")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --out, run the others")
    ap.add_argument("--reprint", type=pathlib.Path, help="print the tables of an --out file (no run)")
    ap.add_argument(
        "--mmap-threshold",
        type=int,
        default=0,
        help="glibc MALLOC_MMAP_THRESHOLD_ of the ranks, bytes (0: glibc's dynamic default). 65536 returns every "
        "freed tensor of 64 KiB or more to the OS at once, so the RSS follows the live tensors",
    )
    ap.add_argument(
        "--wait-free-gib",
        type=float,
        default=0.0,
        help="before each run wait until the host has this much memory available (a shared machine)",
    )
    args = ap.parse_args(argv)
    if args.reprint is not None:
        doc = json.loads(args.reprint.read_text())
        args = argparse.Namespace(**doc["args"])
        _print(doc["results"], doc["size"], args, [int(w) for w in args.worlds.split(",")])
        return 0

    import torch.multiprocessing as mp

    worlds = [int(w) for w in args.worlds.split(",")]
    if args.mmap_threshold:  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    with tempfile.TemporaryDirectory(prefix="trainer-memory-") as tmp:
        tmp = pathlib.Path(tmp)
        t0 = time.perf_counter()
        ckpt = tmp / "ckpt"
        # in a child: the parent stays small while the ranks run
        mp.spawn(_write_checkpoint, args=(str(ckpt), args), nprocs=1)
        files = sorted((ckpt / "transformer").glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(
            f"checkpoint: {args.layers} blocks, width {args.heads * 128}, transformer {size / MIB:.0f} MiB (fp32) in "
            f"{len(files)} files, written in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        results, size = [], _count(args, str(ckpt))
        if args.resume and args.out is not None and args.out.is_file():
            results = json.loads(args.out.read_text())["results"]
        for world in worlds:
            for ac in (False, True):
                if any(r["world"] == world and r["activation_checkpointing"] == ac for r in results):
                    continue
                _wait_for_memory(args.wait_free_gib)
                out = tmp / f"w{world}-ac{int(ac)}"
                out.mkdir()
                t1 = time.perf_counter()
                mp.spawn(
                    _rank, args=(world, str(out / "store"), str(out), str(ckpt), ac, args), nprocs=world, join=True
                )
                for f in sorted(out.glob("*.json")):
                    results.append(json.loads(f.read_text()))
                _save(args, size, results)
                print(
                    f"  {world} rank(s), checkpointing {'on' if ac else 'off'}: {time.perf_counter() - t1:.0f} s",
                    flush=True,
                )
    _print(results, size, args, worlds)
    return 0


def _save(args, size: dict, results: list[dict]) -> None:
    if args.out is not None:
        saved = {k: v for k, v in vars(args).items() if k not in ("out", "reprint", "resume", "wait_free_gib")}
        sys.path.insert(0, str(REPO / "benchmarks"))
        from _provenance import provenance

        doc = {"provenance": provenance(), "args": saved, "size": size, "results": results}
        args.out.write_text(json.dumps(doc, indent=1))


def _wait_for_memory(gib: float) -> None:
    """Block until ``MemAvailable`` is at least ``gib`` GiB (0: no wait)."""
    if gib <= 0:
        return
    said = False
    while True:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        if avail >= gib * (1 << 30):
            return
        if not said:
            print(f"  waiting for {gib:g} GiB of available memory ({avail / (1 << 30):.1f} now)", flush=True)
            said = True
        time.sleep(10)


def _print(results: list[dict], size: dict, args, worlds: list[int]) -> None:
    from spotlight.core.memory_plan import BLOCK_ACT_BYTES_PER_TOKEN

    done = {(r["world"], r["activation_checkpointing"]) for r in results}
    worlds = [w for w in worlds if (w, False) in done and (w, True) in done]  # the pairs measured
    plans = {(w, ac): _plan(args, size, w, ac) for w, ac in sorted(done)}
    r0 = results[0]
    total, trainable = r0["total_params"], r0["trainable_params"]
    rows = 2 if args.cfg else 1
    tokens = rows * ((args.image_size // 16) ** 2 + T_TOKENS)
    kind = f"LoRA r{args.lora_rank} ({trainable / 1e6:.0f} M trainable)" if args.lora_rank else "full fine-tuning"
    print(
        f"\nQwen-Image transformer, {(total - trainable if args.lora_rank else total) / 1e9:.3f} B parameters "
        f"({4 * (total - trainable if args.lora_rank else total) / MIB:.0f} MiB fp32), width "
        f"{args.heads * 128}, {args.layers} blocks; {kind}, AdamW, fp32 on the CPU; {args.image_size}² with "
        f"{'true CFG' if args.cfg else 'no CFG'}: {tokens} tokens per forward ({rows} row(s) × "
        f"{(args.image_size // 16) ** 2} image + {T_TOKENS} text), {args.samples} sample(s) per rank, SDE window "
        f"{args.window}; glibc allocator: "
        f"{f'MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}' if getattr(args, 'mmap_threshold', 0) else 'default'}. "
        "MiB above the baseline (the rank's RSS after imports and process group):\n"
    )
    print(
        "| ranks | activation ckpt | rank | params held | baseline | build + load peak | held after load "
        "| train step peak | step growth | plan estimate | plan error | load s | step s |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        b = r["bytes"]
        base = b["baseline"]
        plan = plans[(r["world"], r["activation_checkpointing"])]
        step = b["step_peak"] - base
        print(
            f"| {r['world']} | {'on' if r['activation_checkpointing'] else 'off'} | {r['rank']} "
            f"| {r['local_params'] / total:.3f} | {base / MIB:.0f} | {(b['load_peak'] - base) / MIB:.0f} "
            f"| {(b['loaded'] - base) / MIB:.0f} | {step / MIB:.0f} | {(b['step_peak'] - b['before_step']) / MIB:.0f} "
            f"| {plan['total'] / MIB:.0f} | {(plan['total'] - step) / step:+.0%} | {r['load_s']:.0f} "
            f"| {r['step_s']:.0f} |"
        )

    def get(world, ac, rank=0, key="step_peak"):
        (r,) = [x for x in results if x["world"] == world and x["activation_checkpointing"] == ac and x["rank"] == rank]
        return r["bytes"][key] - r["bytes"]["baseline"]

    print("\nPlan terms (MiB, fp32):\n")
    for (world, ac), plan in sorted(plans.items()):
        terms = ", ".join(f"{k} {v / MIB:.0f}" for k, v in plan.items() if k not in ("total", "tokens") and v)
        print(f"* {world} rank(s), checkpointing {'on' if ac else 'off'}: {terms}")
    print("\nRatios and derived numbers:\n")
    model = 4 * total  # the whole model a rank would hold unsharded (LoRA: base and adapter)
    if 2 in worlds and 1 in worlds:
        for ac in (False, True):
            tag = "on" if ac else "off"
            for rank in (0, 1):
                print(
                    f"* 2 ranks / 1 rank, checkpointing {tag}, rank {rank}: held after load "
                    f"{get(2, ac, rank, 'loaded') / get(1, ac, 0, 'loaded'):.2f}, train step peak "
                    f"{get(2, ac, rank) / get(1, ac):.2f}; rank {rank}'s step peak − half the model (fp32) = "
                    f"{(get(2, ac, rank) - model / 2) / MIB:.0f} MiB (1 rank: peak − the whole model = "
                    f"{(get(1, ac) - model) / MIB:.0f} MiB)"
                )
    blocks, d = args.layers, args.heads * 128
    for world in worlds:
        off, on = get(world, False), get(world, True)
        # off − on = tokens·(blocks·a − blocks·d·4 − a)  →  a
        a = ((off - on) / tokens + blocks * d * 4) / (blocks - 1)
        grow_on = get(world, True) - get(world, True, key="before_step")
        grow_off = get(world, False) - get(world, False, key="before_step")
        print(
            f"* checkpointing on / off, {world} rank(s), rank 0: train step peak {on / off:.2f} "
            f"({on / MIB:.0f} / {off / MIB:.0f} MiB); step growth {grow_on / grow_off:.2f} "
            f"({grow_on / MIB:.0f} / {grow_off / MIB:.0f} MiB); implied a = {a / 1024:.0f} KiB per token per block "
            f"(fp32, width {d}) = {a * 3072 / d / 2 / 1024:.0f} KiB scaled to bf16 at width 3072 "
            f"(the plan uses {BLOCK_ACT_BYTES_PER_TOKEN // 1024})"
        )


if __name__ == "__main__":
    sys.exit(main())
