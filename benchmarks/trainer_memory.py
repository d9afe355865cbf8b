"""Peak host memory of a Train Worker rank: 1 rank vs 2 ranks (FSDP2, gloo), activation
checkpointing off vs on (docs/memory.md).

A random-weight Qwen-Image checkpoint of the real diffusers classes with a ~0.2 B-parameter
transformer (``--layers`` blocks of width ``--heads`` × 128; the VAE and text encoder stay
tiny) is written to a temporary folder in float32; then, for each configuration, fresh rank
processes (``torch.multiprocessing.spawn``, a gloo group over a file store, one thread each)
build the :class:`~spotlight.workers.train.train_worker.FlowGRPOTrainer` exactly as a run
does (meta device, ``fully_shard``, each rank's shards from the checkpoint), then run one
full fine-tuning train step (AdamW state allocated, fp32 on the CPU) on a batch of
``--samples`` samples split evenly over the ranks. Each rank reports its peak resident set
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after the imports, after the build and load,
and after the step; the parent prints one Markdown table and the ratios.

Usage: ``nice -n 10 python benchmarks/trainer_memory.py`` (about 5-10 minutes on 2 shared
CPU cores; two fp32 ranks together stay under 6 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 1024 * 1024
T_TOKENS = 16


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _cfg(ckpt: str, image_size: int, activation_checkpointing: bool):
    from spotlight.config import ModelConfig, SamplerConfig, SpotlightConfig, TrainConfig

    return SpotlightConfig(
        model=ModelConfig(
            family="qwen-image",
            pretrained_path=ckpt,
            image_size=image_size,
            max_text_tokens=T_TOKENS,
            guidance_scale=1.0,
        ),
        sampler=SamplerConfig(num_steps=10, sde_window_size=2),
        train=TrainConfig(activation_checkpointing=activation_checkpointing),
    )


def _rank(rank: int, world: int, store: str, out: str, ckpt: str, image_size: int, ac: bool, samples: int) -> None:
    import torch
    import torch.distributed as dist

    from spotlight.workers.train.train_worker import FlowGRPOTrainer

    torch.set_num_threads(1)
    cfg = _cfg(ckpt, image_size, ac)
    from spotlight.models.families import get_family

    get_family(cfg.model).transformer_cls()  # diffusers imported before the baseline
    rss = {"imports": _maxrss_bytes()}
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        t0 = time.perf_counter()
        tr = FlowGRPOTrainer(cfg, rank=rank, world_size=world, device=torch.device("cpu"))
        load_s = time.perf_counter() - t0
        rss["loaded"] = _maxrss_bytes()
        local = sum(p.to_local().numel() for p in tr.model.parameters())
        total = sum(p.numel() for p in tr.model.parameters())
        n = samples // world
        g = torch.Generator().manual_seed(rank)
        shape = tr.family.latent_shape
        dim = int(tr._diffusers_config["joint_attention_dim"])
        batch = {
            "window_latents": torch.randn(n, cfg.sampler.sde_window_size + 1, *shape, generator=g),
            "advantages": torch.randn(n, generator=g),
            "cond.embeds": torch.randn(n, T_TOKENS, dim, generator=g),
            "cond.mask": torch.ones(n, T_TOKENS, dtype=torch.int64),
        }
        from spotlight.rl.sampler import Conditioning

        with torch.no_grad():  # the stored log-probs: the current weights' (ratio 1, finite loss)
            cond = Conditioning.from_tensors(batch)
            batch["log_probs"], _ = tr.sampler.window_log_probs(tr.velocity_fn, batch["window_latents"], cond)
        rss["before_step"] = _maxrss_bytes()
        t1 = time.perf_counter()
        metrics = tr.train_step(batch, [list(range(n))], iteration=0)
        step_s = time.perf_counter() - t1
        rss["stepped"] = _maxrss_bytes()
        assert metrics["train/optimizer_steps"] == 1.0, metrics
        report = {
            "rank": rank,
            "world": world,
            "activation_checkpointing": ac,
            "rss_bytes": rss,
            "local_params": local,
            "total_params": total,
            "load_s": load_s,
            "step_s": step_s,
            "samples": n,
        }
        with open(os.path.join(out, f"w{world}-ac{int(ac)}-r{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _write_checkpoint(_index: int, path: str, layers: int, heads: int, head_dim: int, image_size: int) -> None:
    from spotlight.models.families.qwen_image import make_random_checkpoint

    make_random_checkpoint(
        path,
        seed=0,
        transformer_kwargs=dict(
            num_layers=layers, num_attention_heads=heads, attention_head_dim=head_dim, axes_dims_rope=(16, 56, 56)
        ),
        image_size=image_size,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=9, help="transformer blocks (default 9: ~0.2 B parameters)")
    ap.add_argument("--heads", type=int, default=6, help="attention heads of width 128 (default 6: width 768)")
    ap.add_argument("--image-size", type=int, default=256, help="image side, pixels (default 256: 256 tokens)")
    ap.add_argument("--samples", type=int, default=2, help="samples in the update, split over the ranks (default 2)")
    args = ap.parse_args(argv)

    import torch.multiprocessing as mp

    head_dim = 128
    with tempfile.TemporaryDirectory(prefix="trainer-memory-") as tmp:
        tmp = pathlib.Path(tmp)
        t0 = time.perf_counter()
        ckpt = tmp / "ckpt"
        # in a child: the parent stays small while the ranks run
        mp.spawn(_write_checkpoint, args=(str(ckpt), args.layers, args.heads, head_dim, args.image_size), nprocs=1)
        size = sum(f.stat().st_size for f in (ckpt / "transformer").glob("*.safetensors"))
        print(
            f"checkpoint: {args.layers} blocks, width {args.heads * head_dim}, transformer files {size / MIB:.0f} MiB "
            f"(fp32), written in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        results = []
        for world in (1, 2):
            for ac in (False, True):
                out = tmp / f"w{world}-ac{int(ac)}"
                out.mkdir()
                t1 = time.perf_counter()
                mp.spawn(
                    _rank,
                    args=(world, str(out / "store"), str(out), str(ckpt), args.image_size, ac, args.samples),
                    nprocs=world,
                    join=True,
                )
                for f in sorted(out.glob("*.json")):
                    results.append(json.loads(f.read_text()))
                print(
                    f"  {world} rank(s), checkpointing {'on' if ac else 'off'}: {time.perf_counter() - t1:.0f} s",
                    flush=True,
                )
    _print_table(results, args)
    return 0


def _print_table(results: list[dict], args) -> None:
    total = results[0]["total_params"]
    print(
        f"\nQwen-Image transformer, {total / 1e6:.0f} M parameters (fp32), {args.image_size}² "
        f"({(args.image_size // 16) ** 2} image + {T_TOKENS} text tokens), window 2, "
        f"{args.samples} samples per update, "
        "full fine-tuning, AdamW; peak RSS per rank (MiB):\n"
    )
    print(
        "| ranks | activation ckpt | rank | params held | after imports | after build + load | after train step "
        "| step − imports | load s | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rss = {k: v / MIB for k, v in r["rss_bytes"].items()}
        print(
            f"| {r['world']} | {'on' if r['activation_checkpointing'] else 'off'} | {r['rank']} "
            f"| {r['local_params'] / r['total_params']:.3f} | {rss['imports']:.0f} | {rss['loaded']:.0f} "
            f"| {rss['stepped']:.0f} | {rss['stepped'] - rss['imports']:.0f} | {r['load_s']:.1f} | {r['step_s']:.1f} |"
        )

    def peak(world, ac, rank=0, key="stepped"):
        (r,) = [x for x in results if x["world"] == world and x["activation_checkpointing"] == ac and x["rank"] == rank]
        return r["rss_bytes"][key] - r["rss_bytes"]["imports"]

    print("\nRatios (peak RSS above the imports, per rank):\n")
    for ac in (False, True):
        tag = "on" if ac else "off"
        for rank in (0, 1):
            print(
                f"* 2 ranks / 1 rank, checkpointing {tag}, rank {rank}: "
                f"build + load {peak(2, ac, rank, 'loaded') / peak(1, ac, 0, 'loaded'):.2f}, "
                f"after the step {peak(2, ac, rank) / peak(1, ac):.2f}"
            )
    for world in (1, 2):
        step_on = peak(world, True) - peak(world, True, key="before_step")
        step_off = peak(world, False) - peak(world, False, key="before_step")
        print(
            f"* checkpointing on / off, {world} rank(s), rank 0: "
            f"after the step {peak(world, True) / peak(world, False):.2f}; "
            f"growth during the step {step_on / MIB:.0f} / {step_off / MIB:.0f} MiB"
        )


if __name__ == "__main__":
    sys.exit(main())
