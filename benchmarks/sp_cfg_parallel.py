"""Where CFG-parallel pays: one Qwen-Image denoising forward (true CFG, positive + negative rows)
on an SP 2 group, Ulysses over the whole ``[2B]`` batch vs. CFG-parallel (``cluster.sp_cfg_parallel``:
the positive rows on rank 0, the negative ones on rank 1, one all-gather per step), against one
process, for a few image sizes (docs/architecture.md §6).

The model is a saved tiny checkpoint of Qwen-Image's real classes with a wider transformer
(``--layers`` blocks of ``--heads`` × 64); both modes run in one real group of two processes
(spotlight.workers.sp.group.SPGroupMember, gloo on CPU), re-formed in turn ``--rounds`` times
(so both see the same load), each timing ``--repeats`` forwards after one warm-up. CPU caveat:
gloo over loopback on 2 shared cores makes every collective far dearer than NVLink, so the
absolute numbers say little about GPUs; what carries over is the count of
collectives per forward: Ulysses pays 4 all-to-alls per attention layer (q, k, v in; out), CFG-
parallel one all-gather per forward, with the same compute split in two.

    python benchmarks/sp_cfg_parallel.py            # ~5 min on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BATCH = 2
TEXT_TOKENS = 32


def _cfg(ckpt: str, image_size: int):
    from spotlight.config import ModelConfig

    return ModelConfig(
        family="qwen-image",
        pretrained_path=ckpt,
        image_size=image_size,
        max_text_tokens=TEXT_TOKENS,
        guidance_scale=4.0,
    )


def _inputs(family, seed: int = 0):
    import torch

    from spotlight.models.families.qwen_image import TINY_TEXT_CONFIG
    from spotlight.rl.sampler import Conditioning

    g = torch.Generator().manual_seed(seed)
    dim = TINY_TEXT_CONFIG["hidden_size"]
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.int64)
    cond = Conditioning(
        torch.randn(BATCH, TEXT_TOKENS, dim, generator=g),
        mask,
        {"neg.embeds": torch.randn(1, TEXT_TOKENS, dim, generator=g), "neg.mask": mask[:1].clone()},
    )
    latents = torch.randn(BATCH, *family.latent_shape, generator=g)
    return latents, torch.full((BATCH,), 0.7), cond


def _rank(rank: int, ports: list[int], ckpt: str, image_size: int, rounds: int, repeats: int, q) -> None:
    """One rank: ``rounds`` times, a group in each mode (Ulysses, then CFG-parallel) in turn, each
    timing ``repeats`` forwards after a warm-up, so both modes see the same machine load."""
    import torch

    torch.set_num_threads(1)
    from spotlight.workers.sp import group as G

    cfg = _cfg(ckpt, image_size)
    members = {mode: G.SPGroupMember(cfg, f"b{rank}", torch.device("cpu"), cfg_parallel=mode) for mode in (False, True)}
    weights = members[False].family.build_transformer(torch.float32).state_dict() if rank == 0 else None
    latents, sigma, cond = _inputs(members[False].family)
    times: dict[bool, list[float]] = {False: [], True: []}
    port = iter(ports)
    for _ in range(rounds):
        for mode, m in members.items():
            given = weights if m.weights_version is None else None
            m.form(G.GroupSpec(("b0", "b1"), "127.0.0.1", next(port), 1), state_dict=given, version=0)
            vfn = m.velocity_fn()
            with torch.no_grad():
                for i in range(repeats + 1):
                    torch.distributed.barrier()
                    t0 = time.perf_counter()
                    vfn(latents, sigma, cond)
                    if i:
                        times[mode].append(time.perf_counter() - t0)
            m.leave()
    if rank == 0:
        q.put({mode: statistics.median(t) for mode, t in times.items()})


def _single(ckpt: str, image_size: int, repeats: int) -> float:
    import torch

    from spotlight.models.families import get_family

    torch.set_num_threads(1)
    family = get_family(_cfg(ckpt, image_size))
    model = family.build_transformer(torch.float32)
    latents, sigma, cond = _inputs(family)
    vfn = family.make_velocity_fn(model)
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            vfn(latents, sigma, cond)
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _group(ckpt: str, image_size: int, rounds: int, repeats: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    socks = []
    for _ in range(2 * rounds):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    procs = [ctx.Process(target=_rank, args=(r, ports, ckpt, image_size, rounds, repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=1800)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="128,256,512", help="image sides (16 px per token side)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards per mode and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two modes in one pair of processes")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "sp_cfg_parallel.json"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from spotlight.models.families.qwen_image import make_random_checkpoint

    work = pathlib.Path(tempfile.mkdtemp(prefix="spotlight-cfgp-"))
    kw = {
        "num_layers": args.layers,
        "num_attention_heads": args.heads,
        "attention_head_dim": 64,
        "axes_dims_rope": (16, 24, 24),
    }
    ckpt = str(make_random_checkpoint(work / "ckpt", transformer_kwargs=kw))
    rows = []
    print(f"Qwen-Image, {args.layers} blocks x {args.heads} heads x 64, batch {BATCH} + CFG, {TEXT_TOKENS} text tokens")
    print(f"{'image':>6} {'tokens':>7} {'SP 1 s':>8} {'Ulysses 2 s':>12} {'CFG-par 2 s':>12} {'CFG-par / Ulysses':>18}")
    for size in [int(x) for x in args.sizes.split(",")]:
        tokens = (size // 16) ** 2
        one = _single(ckpt, size, args.repeats)
        both = _group(ckpt, size, args.rounds, args.repeats)
        uly, cfgp = both[False], both[True]
        rows.append(
            {"image_size": size, "image_tokens": tokens, "sp1_s": one, "ulysses2_s": uly, "cfg_parallel2_s": cfgp}
        )
        print(f"{size:>6} {tokens:>7} {one:8.3f} {uly:12.3f} {cfgp:12.3f} {cfgp / uly:18.2f}", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"layers": args.layers, "heads": args.heads, "batch": BATCH, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
