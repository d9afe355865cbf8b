"""The memory plan's numbers for a config small enough to compute by hand (docs/planning.md)."""

from __future__ import annotations

import re

import pytest

from spotlight.config import config_from_dict
from spotlight.core.memory_plan import CUDA_RESERVE_BYTES, GIB, ModelSize, plan_memory

P = 1_000_000_000  # parameters
A = 120 * 1024  # activation bytes per token per block at hidden 3072, bf16
SIZE = ModelSize(family="qwen-image", params=P, lora_params=10_000_000, hidden_size=3072, num_blocks=10)


def _cfg(**sections):
    base = {
        "model": {"family": "qwen-image", "pretrained_path": "/nowhere", "image_size": 64, "max_text_tokens": 16},
        "sampler": {"sde_window_size": 2},
        "data": {"prompts_per_iteration": 8, "group_size": 4, "num_control_prompts": 0},
        "train": {"num_train_workers": 2, "steps_per_iteration": 2},
        "cluster": {"reserved_rollout_gpus": [], "worker_batch_size": 2},
        "run": {"keep_weight_versions": 3, "iterations": 5},
    }
    for name, fields in sections.items():
        base[name] = base.get(name, {}) | fields
    return config_from_dict(base)


def _lines(lines) -> dict[str, int]:
    return {line.name: line.bytes for line in lines}


def test_full_fine_tuning_by_hand():
    plan = plan_memory(_cfg(), SIZE)
    # one forward = one rollout batch (worker_batch_size 2 rows) at one SDE window step (the
    # trainer's backward per step frees the graph): 2 rows × 2 (true CFG) × (16 image + 16 text)
    assert plan.rows_per_micro_batch == 2 and plan.tokens_per_micro_batch == 128
    assert plan.activation_checkpointing  # None = on for qwen-image
    assert _lines(plan.trainer_gpu) == {
        "parameters": 4 * P // 2,  # fp32 master, sharded over 2
        "gradients": 4 * P // 2,
        "Adam state": 8 * P // 2,
        # two bf16 blocks unsharded + one block's bf16 gradient and its fp32 reduction
        "gathered blocks": 2 * 2 * P // 10 + 6 * P // 10,
        "activations": 128 * 10 * 3072 * 2 + 128 * A,  # block inputs + one block recomputed
        "CUDA reserve": CUDA_RESERVE_BYTES,
    }
    assert _lines(plan.rollout_gpu) == {
        "model copy": 2 * P,
        "inference activations": 2 * 2 * 32 * A,
        "CUDA reserve": CUDA_RESERVE_BYTES,
    }
    assert plan.version_bytes == 2 * P
    disk = {
        "tensor store versions": (3 + 1) * 2 * P,  # the newest 3 and the one arriving
        "trainer spool": 2 * P,
        "trainer checkpoints": (1 + 1) * 12 * P,  # run.keep_train_checkpoints = 1, and the one being written
        "final model": 4 * P,
        # every request of an iteration with a commit: 8 prompts × (4 samples + 24 explored
        # candidates), each its latent and a 2-step window's 3 latents of 16 × 8 × 8 float32 values
        "committed rollout states": 8 * (4 + 24) * (2 + 2) * 16 * 8 * 8 * 4,
    }
    assert _lines(plan.disk) == disk
    assert _lines(plan.reserved_host)["trainer rank 0: version gather"] == 4 * P + 2 * P
    # 8 prompts × 4 samples, each a 64 px uint8 image and its 2-step SDE window's 3 float32
    # latents of 16 × 8 × 8 values, twice (as received, and stacked into the trainers' batch)
    assert _lines(plan.reserved_host)["coordinator: rollout samples"] == 32 * (3 * 64 * 64 + 2 * 3 * 16 * 8 * 8 * 4)
    assert _lines(plan.spot_host) == {"agent: cached versions (mmap)": 2 * 2 * P}
    # run.save_rollouts keeps every iteration's samples, once each (was: not in the disk plan)
    saved = plan_memory(_cfg(run={"save_rollouts": True}), SIZE)
    per_iteration = 32 * (3 * 64 * 64 + 3 * 16 * 8 * 8 * 4)
    assert _lines(saved.disk) == disk | {"saved rollouts (run.save_rollouts)": 5 * per_iteration}


def test_lora_micro_batch_without_checkpointing_and_a_shared_rollout_gpu():
    cfg = _cfg(
        train={"lora_rank": 8, "micro_batch_size": 1, "activation_checkpointing": False},
        cluster={"reserved_rollout_gpus": [0], "offload_rollout_while_training": False},
    )
    plan = plan_memory(cfg, SIZE)
    T = SIZE.lora_params
    tokens = 1 * 2 * 32  # 1 row × true CFG × 32 tokens
    assert plan.tokens_per_micro_batch == tokens and not plan.activation_checkpointing
    got = _lines(plan.trainer_gpu)
    assert got["parameters"] == 2 * P // 2 + 4 * T // 2  # bf16 frozen base + fp32 adapter
    assert got["gradients"] == 4 * T // 2 and got["Adam state"] == 8 * T // 2
    assert got["activations"] == tokens * 10 * A
    worker = 2 * (P + T)
    assert got["rollout worker"] == worker + 2 * 2 * 32 * A
    assert plan.version_bytes == 2 * T and plan.train_checkpoint_bytes == 12 * T


def test_an_offloading_rollout_worker_counts_only_what_its_copy_exceeds_the_training_transients_by():
    lora = {"lora_rank": 8, "micro_batch_size": 1, "activation_checkpointing": False}
    cfg = _cfg(train=lora, cluster={"reserved_rollout_gpus": [0]})  # None: on CUDA, qwen-image
    plan = plan_memory(cfg, SIZE)
    T = SIZE.lora_params
    got = _lines(plan.trainer_gpu)
    copy = 2 * (P + T) + 2 * 2 * 32 * A
    transients = got["gradients"] + got["gathered blocks"] + got["activations"]
    assert got["rollout worker"] == copy - transients > 0
    # the GPU's peak: resident state + the larger of the training transients and the worker's copy
    resident = got["parameters"] + got["Adam state"] + got["CUDA reserve"]
    assert plan.trainer_gpu_bytes == resident + max(transients, copy)
    assert _lines(plan.reserved_host)["rollout worker: released copy (pinned)"] == 2 * (P + T)
    never = plan_memory(
        _cfg(train=lora, cluster={"reserved_rollout_gpus": [0], "offload_rollout_while_training": False}), SIZE
    )
    assert never.trainer_gpu_bytes - plan.trainer_gpu_bytes == transients
    assert "rollout worker: released copy (pinned)" not in _lines(never.reserved_host)
    # huge activations: the copy fits inside them, and the line is 0
    big = plan_memory(
        _cfg(
            model={"image_size": 512}, train=lora | {"micro_batch_size": None}, cluster={"reserved_rollout_gpus": [0]}
        ),
        SIZE,
    )
    assert _lines(big.trainer_gpu)["activations"] > copy and _lines(big.trainer_gpu)["rollout worker"] == 0
    # the CPU gives nothing back, whatever the setting; tiny never offloads by default
    cpu = plan_memory(
        _cfg(train=lora, cluster={"reserved_rollout_gpus": [0], "offload_rollout_while_training": True}),
        SIZE,
        device="cpu",
    )
    assert _lines(cpu.trainer_gpu)["rollout worker"] == 4 * (P + T) + 2 * 2 * 32 * (2 * A)  # fp32
    tiny = ModelSize(family="tiny", params=P, lora_params=T, hidden_size=3072, num_blocks=10)
    off = _cfg(train=lora, cluster={"reserved_rollout_gpus": [0], "offload_rollout_while_training": False})
    assert plan_memory(cfg, tiny).trainer_gpu == plan_memory(off, tiny).trainer_gpu


def test_cpu_is_fp32_and_a_wider_model_scales_the_coefficient():
    wide = ModelSize(family="qwen-image", params=P, lora_params=0, hidden_size=6144, num_blocks=10)
    plan = plan_memory(_cfg(), wide, device="cpu")
    got = _lines(plan.trainer_gpu)
    assert "CUDA reserve" not in got
    assert got["gathered blocks"] == 2 * 4 * P // 10 + 4 * P // 10  # fp32: the gradient reduces in place
    # a = 120 KiB × (6144 / 3072) × (4 / 2)
    assert got["activations"] == 128 * 10 * 6144 * 4 + 128 * A * 4
    assert plan.version_bytes == 4 * P


def test_limit_refusal_names_the_numbers():
    fits = plan_memory(_cfg(cluster={"gpu_memory_gib": 10.0}), SIZE)
    assert fits.trainer_gpu_bytes < 10 * GIB and fits.problems() == []
    tight = plan_memory(_cfg(cluster={"gpu_memory_gib": 8.0}), SIZE)
    (problem,) = tight.problems()
    assert problem.startswith("a trainer GPU needs 9.4 GiB but cluster.gpu_memory_gib = 8 (")
    assert "Adam state 3.7 GiB" in problem and "activations 0.0 GiB" not in problem  # terms under 1 GiB: MiB
    assert re.search(r"activations \d+\.\d MiB", problem), problem
    assert plan_memory(_cfg(), SIZE).problems() == []  # no limit, no check
    # a need just over the limit never reads as the limit ("needs 1.0 GiB but … = 1")
    need = tight.trainer_gpu_bytes
    (close,) = plan_memory(_cfg(cluster={"gpu_memory_gib": round(need / GIB, 1)}), SIZE).problems()
    shown = float(re.match(r"a trainer GPU needs ([0-9.]+) GiB", close)[1])
    assert shown > round(need / GIB, 1), close
    # a limit found on this host's GPU checks the trainer GPU only, and says where it came from
    (mine,) = tight.problems(limit_source="GPU 0 (nvidia-smi)", kinds=("trainer GPU",))
    assert mine.startswith("a trainer GPU needs 9.4 GiB but GPU 0 (nvidia-smi) = 8 (")


def test_kl_reference_is_held_in_the_compute_dtype_and_lora_has_none():
    full = _lines(plan_memory(_cfg(train={"kl_beta": 0.04}), SIZE).trainer_gpu)
    assert full["KL reference"] == 2 * P // 2  # bf16 on CUDA, sharded over 2 ranks
    cpu = _lines(plan_memory(_cfg(train={"kl_beta": 0.04}), SIZE, device="cpu").trainer_gpu)
    assert cpu["KL reference"] == 4 * P // 2  # fp32 on the CPU
    lora = _lines(plan_memory(_cfg(train={"kl_beta": 0.04, "lora_rank": 8}), SIZE).trainer_gpu)
    assert "KL reference" not in lora  # the policy with its adapter disabled


def test_rows_are_one_rollout_batch_cut_to_the_micro_batch_never_merged():
    assert plan_memory(_cfg(train={"micro_batch_size": 64}), SIZE).rows_per_micro_batch == 2  # worker batch 2
    big = _cfg(cluster={"worker_batch_size": 16}, train={"micro_batch_size": 4})
    assert plan_memory(big, SIZE).rows_per_micro_batch == 4
    # never more than the iteration's samples (8 prompts × 4)
    assert plan_memory(_cfg(cluster={"worker_batch_size": 64}), SIZE).rows_per_micro_batch == 32
    # the SDE window does not multiply the activations: one step's graph lives at a time
    wide = plan_memory(_cfg(sampler={"sde_window_size": 4}), SIZE)
    assert wide.tokens_per_micro_batch == plan_memory(_cfg(), SIZE).tokens_per_micro_batch


def test_disk_counts_the_kept_trainer_checkpoints_and_the_one_being_written():
    plan = plan_memory(_cfg(run={"keep_train_checkpoints": 3}), SIZE)
    assert _lines(plan.disk)["trainer checkpoints"] == (3 + 1) * 12 * P
    every = plan_memory(_cfg(run={"keep_weight_versions": 0, "iterations": 5}), SIZE)
    assert _lines(every.disk)["tensor store versions"] == (5 + 1) * 2 * P  # v0 .. v5
    assert plan.disk_bytes == sum(_lines(plan.disk).values())


def test_disk_counts_best_and_the_committed_rollout_states():
    """Was: neither ``best/`` (a whole model copy for a full fine-tune, kept with held-out
    evaluation) nor the committed states of preempted rollouts were in the disk plan."""
    plan = plan_memory(_cfg(eval={"every": 2, "prompts_path": "/p.txt"}), SIZE)
    assert _lines(plan.disk)["best model (eval.keep_best)"] == 2 * 2 * P  # bf16 copy and its replacement
    assert "best model (eval.keep_best)" not in _lines(
        plan_memory(_cfg(eval={"every": 2, "prompts_path": "/p.txt", "keep_best": False}), SIZE).disk
    )
    lora = plan_memory(_cfg(eval={"every": 1, "prompts_path": "/p.txt"}, train={"lora_rank": 8}), SIZE)
    assert _lines(lora.disk)["best model (eval.keep_best)"] == 2 * 4 * SIZE.lora_params
    quiet = plan_memory(_cfg(explore={"enabled": False}), SIZE)
    assert _lines(quiet.disk)["committed rollout states"] == 8 * 4 * (2 + 2) * 16 * 8 * 8 * 4
    assert quiet.disk_bytes == sum(_lines(quiet.disk).values())


def test_gpu_memory_field_is_validated():
    from spotlight.config import ConfigError

    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="cluster.gpu_memory_gib"):
            _cfg(cluster={"gpu_memory_gib": bad})


def test_keep_train_checkpoints_is_validated():
    from spotlight.config import ConfigError

    with pytest.raises(ConfigError, match="run.keep_train_checkpoints: must be >= 1"):
        _cfg(run={"keep_train_checkpoints": 0})


def test_over_several_nodes_each_gpu_holds_its_share_of_one_nodes_replica():
    """HSDP (train.num_train_nodes > 1): every node holds a replica sharded over its own GPUs, so
    2 nodes × 2 GPUs hold per GPU what 1 node × 2 does, twice the share of 4 GPUs on one node
    (was: the plan divided by all 4 ranks, and passed configs whose shards could not fit)."""
    sharded = ("parameters", "gradients", "Adam state")
    two_by_two = _lines(plan_memory(_cfg(train={"num_train_workers": 4, "num_train_nodes": 2}), SIZE).trainer_gpu)
    one_by_two = _lines(plan_memory(_cfg(train={"num_train_workers": 2}), SIZE).trainer_gpu)
    one_by_four = _lines(plan_memory(_cfg(train={"num_train_workers": 4}), SIZE).trainer_gpu)
    assert {k: two_by_two[k] for k in sharded} == {k: one_by_two[k] for k in sharded}
    assert {k: two_by_two[k] for k in sharded} == {k: 2 * one_by_four[k] for k in sharded}
    # the reserved rollout GPU 2 is a trainer rank's on one node of 4, not on a node of 2
    shared = {"reserved_rollout_gpus": [2]}
    one_node = plan_memory(_cfg(train={"num_train_workers": 4}, cluster=shared), SIZE)
    two_nodes = plan_memory(_cfg(train={"num_train_workers": 4, "num_train_nodes": 2}, cluster=shared), SIZE)
    assert "rollout worker" in _lines(one_node.trainer_gpu) and "rollout worker" not in _lines(two_nodes.trainer_gpu)
