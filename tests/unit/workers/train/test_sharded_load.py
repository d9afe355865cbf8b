"""Train Worker build: meta device, FSDP2 sharding, then each rank's shards from the diffusers
checkpoint (gloo, 1 and 2 ranks, a tiny random Qwen-Image checkpoint of the real classes).

(a) after the sharded load the full state dict is the checkpoint's; (b) one train step on
2 ranks gives the 1-rank weights; (c) the parameters were meta until the load and each rank
holds about half of them; (d) the LoRA KL reference is the policy with its adapter disabled
(no copy) and gives the base model's output; the adapter's initial weights are the same on
every rank and after a restart.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from spotlight.config import ModelConfig, SamplerConfig, SpotlightConfig, TrainConfig
from spotlight.models.families import get_family
from spotlight.models.families.qwen_image import make_random_checkpoint
from spotlight.rl.sampler import Conditioning, Sampler
from spotlight.workers.train.train_worker import FlowGRPOTrainer
from tests.unit.spawned import exit_together

pytestmark = [pytest.mark.procs, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]

SEEDS = [21, 22, 23, 24]
T_TOKENS = 6
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]


def _cfg(ckpt, **train) -> SpotlightConfig:
    return SpotlightConfig(
        model=ModelConfig(
            family="qwen-image", pretrained_path=str(ckpt), image_size=32, max_text_tokens=T_TOKENS, guidance_scale=1.0
        ),
        sampler=SamplerConfig(num_steps=4, sde_window_size=2),
        train=TrainConfig(**train),
    )


def checkpoint_state(ckpt) -> dict[str, torch.Tensor]:
    files = sorted((ckpt / "transformer").glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def make_family_rollout(cfg: SpotlightConfig) -> dict[str, torch.Tensor]:
    """A real SDE rollout of SEEDS with the checkpoint's (unsharded) transformer."""
    fam = get_family(cfg.model)
    model = fam.build_transformer(torch.float32)
    sampler = Sampler(cfg.sampler, fam.latent_shape, fam.sigmas(cfg.sampler.num_steps, cfg.sampler.shift))
    dim = int(model.config.joint_attention_dim)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(len(SEEDS), T_TOKENS, dim, generator=g)
    mask = torch.ones(len(SEEDS), T_TOKENS, dtype=torch.int64)
    mask[1, 4:] = 0
    with torch.no_grad():
        st = sampler.run(sampler.initial_state(SEEDS), fam.make_velocity_fn(model), Conditioning(embeds, mask))
    return {
        "window_latents": torch.stack(st.window_latents, 1),
        "log_probs": torch.stack(st.log_probs, 1),
        "advantages": torch.tensor(ADVANTAGES),
        "cond.embeds": embeds,
        "cond.mask": mask,
    }


def _rows(batch, rows):
    return {k: v[rows].clone() for k, v in batch.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("qwen-ckpt"), seed=7)


@pytest.fixture(scope="module")
def rollout(ckpt):
    return make_family_rollout(_cfg(ckpt))


def _local_numel(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def _two_ranks(rank: int, world: int, store: str, out_dir: str, ckpt: str, batch: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        import pathlib

        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        ckpt = pathlib.Path(ckpt)
        report = {}
        tr = FlowGRPOTrainer(_cfg(ckpt, kl_beta=0.1), rank=rank, world_size=world, device=torch.device("cpu"))
        report["was_meta"] = tr.was_meta_before_load
        report["local"] = _local_numel(tr.model)
        report["total"] = sum(p.numel() for p in tr.model.parameters())
        report["ref_local"] = _local_numel(tr.reference)
        report["ref_frozen"] = not any(p.requires_grad for p in tr.reference.parameters())
        loaded = tr.full_state_dict()
        ref = get_model_state_dict(tr.reference, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_file(loaded, os.path.join(out_dir, "loaded.safetensors"))
            save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out_dir, "reference.safetensors"))
        rows = [0, 1, 2] if rank == 0 else [3]
        mbs = [[0], [1, 2]] if rank == 0 else [[0]]
        tr.train_step(_rows(batch, rows), mbs, iteration=0)
        trained = tr.full_state_dict()
        if rank == 0:
            save_file(trained, os.path.join(out_dir, "trained.safetensors"))
        lora = FlowGRPOTrainer(_cfg(ckpt, lora_rank=2), rank=rank, world_size=world, device=torch.device("cpu"))
        v0 = lora.version_state_dict()
        if rank == 0:
            save_file(v0, os.path.join(out_dir, "lora_v0.safetensors"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        exit_together()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(ckpt, rollout, tmp_path_factory):
    out = tmp_path_factory.mktemp("two-ranks")
    mp.spawn(_two_ranks, args=(2, str(out / "store"), str(out), str(ckpt), rollout), nprocs=2, join=True)
    return out


def test_sharded_load_equals_the_checkpoint_and_was_never_whole(ckpt, two_rank_run):
    want = checkpoint_state(ckpt)
    for name in ("loaded", "reference"):
        got = load_file(str(two_rank_run / f"{name}.safetensors"))
        assert set(got) == set(want), name
        assert all(torch.equal(got[k], want[k].float()) for k in want), name
    for rank in (0, 1):
        r = json.loads((two_rank_run / f"rank{rank}.json").read_text())
        assert r["was_meta"]  # built on meta and sharded before any weight existed
        assert r["total"] == sum(v.numel() for v in want.values())
        # FSDP2 shards dim 0 of every parameter: each rank holds about half (uneven rows round up)
        assert 0.4 * r["total"] < r["local"] < 0.6 * r["total"], r
        assert r["ref_local"] == r["local"] and r["ref_frozen"]


def test_two_rank_step_matches_one_rank(pg, ckpt, rollout, two_rank_run):
    tr = FlowGRPOTrainer(_cfg(ckpt, kl_beta=0.1), rank=0, world_size=1, device=torch.device("cpu"))
    assert tr.was_meta_before_load
    m = tr.train_step(rollout, [[0, 1, 2, 3]], iteration=0)  # the rollout's batch composition
    assert m["train/ratio_max_dev"] == 0.0  # the sharded load is the rollout's model, bit for bit
    one = tr.full_state_dict()
    two = load_file(str(two_rank_run / "trained.safetensors"))
    assert set(one) == set(two)
    assert any(not torch.equal(one[k], v.float()) for k, v in checkpoint_state(ckpt).items())
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, worst


def test_lora_reference_is_the_policy_without_its_adapter(pg, ckpt, rollout, two_rank_run):
    cfg = _cfg(ckpt, lora_rank=2, kl_beta=0.1, learning_rate=1e-2)
    tr = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"))
    # the adapter's start: the same on 2 ranks, in a second trainer (a restart), B = 0, A seeded
    v0 = tr.version_state_dict()
    again = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu")).version_state_dict()
    two = load_file(str(two_rank_run / "lora_v0.safetensors"))
    assert set(v0) == set(two) == set(again) and v0
    assert all(torch.equal(v0[k], two[k]) and torch.equal(v0[k], again[k]) for k in v0)
    assert all(not v.any() for k, v in v0.items() if "lora_B" in k)
    assert all(v.std() > 0 for k, v in v0.items() if "lora_A" in k)

    assert tr.reference is None  # no second model: the KL reference is the policy, adapter off
    base_storage = {n: p.to_local().data_ptr() for n, p in tr.model.named_parameters() if "lora_" not in n}
    tr.train_step(rollout, [[0, 1], [2, 3]], iteration=0)
    tr.train_step(rollout, [[0, 1], [2, 3]], iteration=1)
    assert {n: p.to_local().data_ptr() for n, p in tr.model.named_parameters() if "lora_" not in n} == base_storage

    fam = get_family(cfg.model)
    base = fam.build_transformer(torch.float32)
    x = rollout["window_latents"][:, 0]
    cond = Conditioning(rollout["cond.embeds"], rollout["cond.mask"])
    sigma = torch.full((x.shape[0],), 0.6)
    with torch.no_grad():
        want = fam.make_velocity_fn(base)(x, sigma, cond)
        policy = tr.velocity_fn(x, sigma, cond)
        tr.model.disable_adapters()
        try:
            reference = tr.velocity_fn(x, sigma, cond)
        finally:
            tr.model.enable_adapters()
    assert not torch.allclose(policy, want, atol=1e-6)  # the adapter trained
    assert torch.allclose(reference, want, atol=1e-6, rtol=1e-5)
