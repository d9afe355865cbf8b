"""The memory plan (:mod:`spotlight.core.memory_plan`) of the paper's setups at full size.

Prints the plan of the Qwen-Image 20 B preset for the paper's Table 2 configs
(``examples/paper/*.toml``: 4 trainer GPUs, the reserved Rollout Worker on GPU 0), LoRA as
configured and as full fine-tuning, with training forwards of one rollout batch
(``train.micro_batch_size`` unset) and of one sample, against 80 GB GPUs (no train step runs).

How close the plan is to measured peaks is ``benchmarks/trainer_memory.py``'s job: it runs
the trainer at real width on the CPU and prints the plan's estimate and error beside each
measured rank (``benchmarks/RESULTS.md``, "Train Worker memory").

Usage: ``python benchmarks/memory_plan_check.py`` (under a minute).
"""

from __future__ import annotations

import argparse


def table() -> None:
    """The Table 2 plans (module docstring)."""
    import pathlib

    from spotlight.config import EXAMPLES_DIR, load_config
    from spotlight.core.memory_plan import GIB, plan_memory, uses_true_cfg
    from spotlight.models.param_count import count_model

    def g(x: int) -> str:
        return f"{x / GIB:.1f}"

    print(
        "| config | rows × CFG | trainer GPU: params / grads / Adam / gathered blocks / activations / rollout copy "
        "/ CUDA | trainer GPU | without the rollout copy | rollout GPU | fits 80 GB | disk peak: versions / spool / "
        "trainer ckpts / final / best / committed states = total |"
    )
    print("|---|---:|---|---:|---:|---:|---|---|")
    names = (
        "parameters",
        "gradients",
        "Adam state",
        "gathered blocks",
        "activations",
        "rollout worker",
        "CUDA reserve",
    )
    DISK = (  # noqa: N806  (the table's disk columns, in order; 0 where the plan has no such line)
        "tensor store versions",
        "trainer spool",
        "trainer checkpoints",
        "final model",
        "best model (eval.keep_best)",
        "committed rollout states",
    )
    for path in sorted(pathlib.Path(EXAMPLES_DIR / "paper").glob("*.toml")):
        for lora in (None, 0):
            for rows in (None, 1):
                over = {"cluster.gpu_memory_gib": 80e9 / GIB} | ({} if lora is None else {"train.lora_rank": lora})
                if rows is not None:
                    over["train.micro_batch_size"] = rows
                cfg = load_config(path, over)
                p = plan_memory(cfg, count_model(cfg, "qwen-image-20b"))
                t = {line.name: line.bytes for line in p.trainer_gpu}
                disk = {line.name: line.bytes for line in p.disk}
                d = [disk.get(k, 0) for k in DISK]
                kind = f"LoRA r{cfg.train.lora_rank}" if cfg.train.lora_rank else "full FT"
                cfg_rows = 2 if uses_true_cfg(cfg.model.family, cfg.model.guidance_scale) else 1
                print(
                    f"| {path.stem} {kind} | {p.rows_per_micro_batch} × {cfg_rows} "
                    f"| {' / '.join(g(t.get(k, 0)) for k in names)} | {g(p.trainer_gpu_bytes)} "
                    f"| {g(p.trainer_gpu_bytes - t.get('rollout worker', 0))} | {g(p.rollout_gpu_bytes)} "
                    f"| {'no' if p.problems() else 'yes'} | {' / '.join(map(g, d))} = {g(p.disk_bytes)} |"
                )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    table()


if __name__ == "__main__":
    main()
