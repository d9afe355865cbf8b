"""A trainer that spans nodes (CPU, gloo): the 2-D HSDP mesh of 2 "nodes" × 1 rank takes exactly
the optimizer step of one rank, saves and resumes its checkpoint; a killed peer makes the
survivor's collective fail as a lost peer (the CPU half of the NCCL abort path)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from spotlight.workers.train.train_worker import FlowGRPOTrainer
from tests.unit.spawned import exit_together, leave_now
from tests.unit.workers.train.test_train_worker import ROLLOUT_MBS, SEEDS, TEXT_DIM, _cfg, _select, make_rollout

pytestmark = [pytest.mark.procs, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]


def _hsdp_rank(rank: int, world: int, store_path: str, out_dir: str, batch: dict) -> None:
    """Rank ``rank`` of 2 nodes × 1 rank: rows 0-2 on node 0 (three micro-batches), 3-5 on node 1."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        cfg = _cfg(kl_beta=0.1)
        tr = FlowGRPOTrainer(
            cfg, rank=rank, world_size=world, device=torch.device("cpu"), text_dim=TEXT_DIM, num_nodes=2
        )
        rows, mbs = ([0, 1, 2], [[0], [1], [2]]) if rank == 0 else ([3, 4, 5], [[0, 1, 2]])
        metrics = tr.train_step(_select(batch, rows), mbs, iteration=0)
        p = next(iter(tr.model.parameters()))
        facts = {
            "mesh": list(tr.mesh.shape),
            "names": list(tr.mesh.mesh_dim_names),
            "placements": [type(pl).__name__ for pl in p.placements],
            "metrics": metrics,
        }
        sd = tr.full_state_dict()
        tr.save_checkpoint(os.path.join(out_dir, "ckpt"))
        again = FlowGRPOTrainer(
            cfg, rank=rank, world_size=world, device=torch.device("cpu"), text_dim=TEXT_DIM, num_nodes=2
        )
        again.load_checkpoint(os.path.join(out_dir, "ckpt"))
        resumed = again.full_state_dict()
        if rank == 0:
            save_file(sd, os.path.join(out_dir, "hsdp.safetensors"))
            save_file(resumed, os.path.join(out_dir, "resumed.safetensors"))
            with open(os.path.join(out_dir, "hsdp.json"), "w") as f:
                json.dump(facts, f)
        exit_together()
    finally:
        dist.destroy_process_group()


def test_hsdp_over_two_nodes_takes_the_one_rank_step_and_resumes(pg, tmp_path):
    """FSDP2 averages each gradient over the shard group, then over the replicate group: the
    trainer's loss scale (world size / global element count) gives the one-big-batch gradient."""
    cfg = _cfg(kl_beta=0.1)
    rollout = make_rollout(cfg)
    one = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    ref_m = one.train_step(rollout, ROLLOUT_MBS, iteration=0)
    ref = one.full_state_dict()
    mp.spawn(_hsdp_rank, args=(2, str(tmp_path / "store"), str(tmp_path), rollout), nprocs=2, join=True)
    facts = json.loads((tmp_path / "hsdp.json").read_text())
    assert facts["mesh"] == [2, 1] and facts["names"] == ["replicate", "shard"]
    assert facts["placements"] == ["Replicate", "Shard"]
    sd = load_file(str(tmp_path / "hsdp.safetensors"))
    assert set(sd) == set(ref)
    worst = max((sd[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < 1e-6, worst
    m = facts["metrics"]
    assert m["train/ratio_max_dev"] == 0.0 and m["train/num_samples"] == len(SEEDS)
    assert m["train/grad_norm"] == pytest.approx(ref_m["train/grad_norm"], rel=1e-5)
    assert m["train/loss"] == pytest.approx(ref_m["train/loss"], abs=1e-9)
    assert m["train/kl"] == pytest.approx(ref_m["train/kl"], rel=1e-5, abs=1e-12)
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    assert all(torch.equal(resumed[k], sd[k]) for k in sd)


def _doomed_rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    """Rank 1 is killed (SIGKILL) while rank 0 waits in a collective for it."""
    from spotlight.workers.train.train_worker import is_peer_failure

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(4))
        verdict = {"raised": None}
    except Exception as exc:
        verdict = {"raised": type(exc).__name__, "peer_failure": is_peer_failure(exc), "message": str(exc)[:300]}
    with open(os.path.join(out_dir, "survivor.json"), "w") as f:
        json.dump(verdict, f)
    leave_now()  # the peer is dead: tearing gloo down now can abort (SIGABRT, seen in a full run)


def test_a_killed_peer_makes_the_survivors_collective_fail_as_a_lost_peer(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_doomed_rank, args=(r, 2, str(tmp_path / "store"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert procs[1].exitcode == -signal.SIGKILL and procs[0].exitcode == 0
    verdict = json.loads((tmp_path / "survivor.json").read_text())
    assert verdict["raised"] and verdict["peer_failure"], verdict


def _mismatched_rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    """Rank 0 starts from weights with one key too many: every rank refuses them with rank 0's words."""
    from spotlight.models.families import ModelLoadError

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        bogus = {"not.a.parameter": torch.zeros(1)}
        try:
            FlowGRPOTrainer(
                _cfg(),
                rank=rank,
                world_size=world,
                device=torch.device("cpu"),
                text_dim=TEXT_DIM,
                initial_state_dict=bogus,
            )
            said = "loaded"
        except ModelLoadError as exc:
            said = str(exc)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(said)
        exit_together()
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank_in_rank0s_words(tmp_path):
    """The refusal travels from rank 0 as tensors (no pickle over the process group's transport)."""
    mp.spawn(_mismatched_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert said[0] == said[1] and "do not fit its config" in said[0] and "'not.a.parameter'" in said[0]
