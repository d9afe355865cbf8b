"""What a reserved Rollout Worker pays to give its GPU memory back while the update trains there.

Measures :class:`spotlight.workers.rollout.offload.ModelOffloader` (docs/memory.md, "A GPU shared
by rollout and training") on real-width Qwen-Image transformer blocks (3072 wide, 0.34 B
parameters each, bf16, built on the meta device and given uninitialised memory: the bytes, not
their values, are what is timed):

* on this machine's CPU, the copy path (``copy_on_cpu``: device → host chunks → device, each a
  host ``memcpy``): seconds per offload and per reload, GB/s, and the bookkeeping per tensor;
* on a CUDA device when there is one (``--device cuda``), the real path: device → pinned host
  chunks → device. The first offload includes allocating the pinned chunks; the numbers of the
  later rounds are the steady state a run pays every iteration.

The third cost, the round trip of the release (the update waits until the worker's next PULL
says "released"), is ``time/offload_wait_s`` in a run's metrics.jsonl (the CPU dry run of
``scripts/gpu-check`` prints it).

Usage::

    python benchmarks/offload.py                     # 1 block (0.68 GB), CPU, 3 rounds
    python benchmarks/offload.py --blocks 4 --device cuda --rounds 5

GB = 10^9 bytes. A full Qwen-Image copy is 60 blocks (41 GB): multiply.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def blocks_module(n: int, device: str):
    import torch
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    with torch.device("meta"):
        blocks = torch.nn.ModuleList(
            QwenImageTransformerBlock(dim=3072, num_attention_heads=24, attention_head_dim=128) for _ in range(n)
        )
    return blocks.to(torch.bfloat16).to_empty(device=device)


def measure(blocks: int, device: str, rounds: int) -> dict:
    import torch

    from spotlight.workers.rollout.offload import ModelOffloader

    module = blocks_module(blocks, device)
    tensors = len({id(p) for p in module.parameters()}) + len(list(module.buffers()))
    off = ModelOffloader(device, copy_on_cpu=device == "cpu")
    rows = []
    for r in range(rounds):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        a = off.offload(module)
        b = off.reload(module)
        rows.append({"round": r, "offload_s": a.seconds, "reload_s": b.seconds, "bytes": a.size_bytes})
    steady = rows[1:] or rows
    out = {
        "device": device,
        "blocks": blocks,
        "tensors": tensors,
        "bytes": rows[0]["bytes"],
        "host_bytes": off.host_bytes,
        "rounds": rows,
        "offload_s": min(r["offload_s"] for r in steady),
        "reload_s": min(r["reload_s"] for r in steady),
        "first_offload_s": rows[0]["offload_s"],
    }
    out["offload_gb_per_s"] = out["bytes"] / out["offload_s"] / 1e9
    out["reload_gb_per_s"] = out["bytes"] / out["reload_s"] / 1e9
    out["qwen_image_estimate_s"] = {  # 60 blocks at the measured rates
        "offload": out["offload_s"] * 60 / blocks,
        "reload": out["reload_s"] * 60 / blocks,
    }
    return out


def main() -> None:
    from benchmarks._provenance import provenance, provenance_line

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1, help="real-width Qwen-Image blocks (0.68 GB bf16 each)")
    ap.add_argument("--device", default="cpu", help="cpu (the copy path) or cuda (pinned host memory)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=pathlib.Path, default=None, help="also write the result here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    r = measure(args.blocks, args.device, max(1, args.rounds))
    print(provenance_line())
    print(
        f"{r['blocks']} Qwen-Image block(s), {r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB bf16 on {r['device']} "
        f"(host chunks {r['host_bytes'] / 1e9:.2f} GB)"
    )
    print(
        f"offload {r['offload_s']:.3f} s ({r['offload_gb_per_s']:.1f} GB/s; first {r['first_offload_s']:.3f} s), "
        f"reload {r['reload_s']:.3f} s ({r['reload_gb_per_s']:.1f} GB/s)"
    )
    est = r["qwen_image_estimate_s"]
    print(f"at these rates a 60-block (41 GB) copy: offload {est['offload']:.1f} s, reload {est['reload']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(r | {"provenance": provenance()}, indent=1))


if __name__ == "__main__":
    main()
