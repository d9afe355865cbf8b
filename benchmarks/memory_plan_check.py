"""The memory plan (:mod:`spotlight.core.memory_plan`) against a measured train step.

One Flow-GRPO train step of the embedded default (the tiny family, full fine-tuning, KL to the
base model, fp32 on the CPU, FSDP2 over a gloo world of 1) runs in a fresh child process per
micro-batch size; the child reports its resident set before the trainer is built and its peak
resident set (``ru_maxrss``) after the step. The growth is compared with the plan's "trainer
GPU" total for the same config on ``device = "cpu"`` (on the CPU the trainer's GPU memory is
host memory).

``--table`` prints instead the plan of the Qwen-Image 20 B preset for the paper's Table 2 configs
(``examples/paper/*.toml``), LoRA as configured and full fine-tuning, micro-batches of the whole
rank batch and of one row, against 80 GB GPUs (no train step runs).

Usage: ``python benchmarks/memory_plan_check.py [--rows 8 --rows 32]`` (one child per size; 8 min on
2 shared cores), ``python benchmarks/memory_plan_check.py --table`` (under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import types


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cfg():
    from spotlight.config import load_config

    return load_config(None)


def child(rows: int) -> dict:
    """One train step with micro-batches of ``rows`` rows; RSS before the trainer and at peak."""
    import torch
    import torch.distributed as dist

    from spotlight.workers.train.train_worker import FlowGRPOTrainer

    torch.set_num_threads(2)
    cfg = _cfg()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29_500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    n = cfg.data.prompts_per_iteration * cfg.data.group_size
    w = cfg.sampler.sde_window_size
    g = torch.Generator().manual_seed(0)
    tokens, channels = 64, 48  # 32 px in 4x4 patches
    batch = {
        "window_latents": torch.randn(n, w + 1, tokens, channels, generator=g),
        "log_probs": torch.zeros(n, w),
        "advantages": torch.randn(n, generator=g),
        "cond.embeds": torch.randn(n, cfg.model.max_text_tokens, 384, generator=g),
        "cond.mask": torch.ones(n, cfg.model.max_text_tokens, dtype=torch.int64),
    }
    micro_batches = [list(range(i, min(n, i + rows))) for i in range(0, n, rows)]
    before = _rss_bytes()
    trainer = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"))
    after_build = _rss_bytes()
    trainer.train_step(batch, micro_batches, iteration=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.destroy_process_group()
    return {"rows": rows, "before_bytes": before, "after_build_bytes": after_build, "peak_bytes": peak}


def estimate(rows: int) -> dict:
    from spotlight.core.memory_plan import MemoryPlan, plan_memory
    from spotlight.models.param_count import count_model

    cfg = _cfg()
    plan = plan_memory(_view(cfg, micro_batch_size=rows), count_model(cfg), device="cpu")
    lines = {line.name: line.bytes for line in plan.trainer_gpu if line.name != "rollout worker"}
    return lines | {
        "total": MemoryPlan.total(tuple(plan.trainer_gpu))
        - sum(line.bytes for line in plan.trainer_gpu if line.name == "rollout worker"),
        "tokens": plan.tokens_per_micro_batch,
    }


def _view(cfg, **train):
    """``cfg`` with train fields it may not have yet (``micro_batch_size``), as the plan reads them."""
    t = types.SimpleNamespace(**{f: getattr(cfg.train, f) for f in cfg.train.__struct_fields__} | train)
    return types.SimpleNamespace(**{f: getattr(cfg, f) for f in cfg.__struct_fields__} | {"train": t})


def table() -> None:
    """The Table 2 plans (module docstring)."""
    import pathlib

    from spotlight.config import EXAMPLES_DIR, load_config
    from spotlight.core.memory_plan import GIB, plan_memory
    from spotlight.models.param_count import count_model

    def g(x: int) -> str:
        return f"{x / GIB:.1f}"

    print(
        "| config | rows | trainer GPU: params / grads / Adam / gathered blocks / activations / rollout copy "
        "| trainer GPU | rollout GPU | fits 80 GB | disk: versions / trainer ckpts / final |"
    )
    print("|---|---:|---|---:|---:|---|---|")
    for path in sorted(pathlib.Path(EXAMPLES_DIR / "paper").glob("*.toml")):
        for lora in (None, 0):
            over = {"cluster.gpu_memory_gib": 80e9 / GIB} | ({} if lora is None else {"train.lora_rank": lora})
            cfg = load_config(path, over)
            size = count_model(cfg, "qwen-image-20b")
            for rows in (None, 1):
                p = plan_memory(_view(cfg, micro_batch_size=rows), size)
                t = {line.name: line.bytes for line in p.trainer_gpu}
                d = [line.bytes for line in p.disk]
                kind = f"LoRA r{cfg.train.lora_rank}" if cfg.train.lora_rank else "full FT"
                parts = [t[k] for k in ("parameters", "gradients", "Adam state", "gathered blocks", "activations")]
                parts.append(t.get("rollout worker", 0))
                print(
                    f"| {path.stem} {kind} | {p.rows_per_micro_batch} | {' / '.join(map(g, parts))} "
                    f"| {g(p.trainer_gpu_bytes)} | {g(p.rollout_gpu_bytes)} | {'no' if p.problems() else 'yes'} "
                    f"| {' / '.join(map(g, d))} |"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, action="append", help="micro-batch rows (repeatable; default 8 and 32)")
    ap.add_argument("--table", action="store_true", help="print the Table 2 plans instead (no train step)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        table()
        return
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    mib = 1 << 20
    print(
        "| rows | tokens | estimate MiB (params+grads+Adam+KL ref+blocks, activations) | measured growth MiB | error |"
    )
    print("|---:|---:|---|---:|---:|")
    for rows in args.rows or [8, 32]:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(rows)], check=True, capture_output=True, text=True
        ).stdout
        got = json.loads(out.strip().splitlines()[-1])
        est = estimate(rows)
        measured = got["peak_bytes"] - got["before_bytes"]
        state = est["total"] - est["activations"]
        err = (est["total"] - measured) / measured
        print(
            f"| {rows} | {est['tokens']} | {est['total'] / mib:.0f} ({state / mib:.0f} + "
            f"{est['activations'] / mib:.0f}) | {measured / mib:.0f} | {err:+.0%} |"
        )


if __name__ == "__main__":
    main()
