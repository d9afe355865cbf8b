"""On CUDA the Train Worker's NCCL process group is bound to its rank's GPU (``device_id`` of
``init_process_group``). No GPU needed: CUDA's availability and ``init_process_group`` are
stand-ins that record the call."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from spotlight.workers.sp import rendezvous


def _fake_cuda(monkeypatch, calls: list) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rendezvous, "bound_store", lambda *a, **k: "store")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))


def test_train_worker_binds_its_nccl_group_to_its_gpu(monkeypatch):
    from spotlight.workers.train.train_worker import _init_process_group

    calls = []
    _fake_cuda(monkeypatch, calls)
    device = _init_process_group(argparse.Namespace(rank=3, world_size=4, master_port=1234))
    assert device == torch.device("cuda", 1)
    ((_, kwargs),) = calls
    assert kwargs["backend"] == "nccl" and kwargs["device_id"] == torch.device("cuda", 1)


def test_train_worker_on_the_cpu_has_no_device_id(monkeypatch):
    from spotlight.workers.train.train_worker import _init_process_group

    calls = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _init_process_group(argparse.Namespace(rank=0, world_size=2, master_port=1234)) == torch.device("cpu")
    ((_, kwargs),) = calls
    assert kwargs["backend"] == "gloo" and kwargs["device_id"] is None


def test_a_rank_under_torchrun_binds_nccl_to_its_local_rank_with_the_env_rendezvous(monkeypatch):
    from spotlight.workers.train.launch import join_process_group, pick_device
    from spotlight.workers.train.launch_env import LaunchEnv

    calls = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    env = LaunchEnv(rank=6, world_size=8, local_rank=2, local_world_size=4, num_nodes=2, master_addr="a",
                    master_port=1, launcher="torchrun")  # fmt: skip
    device, gpu = pick_device(env)
    assert device == torch.device("cuda", 2) and gpu == 6  # the host's GPU 6, billed as such
    join_process_group(env, device)
    ((_, kwargs),) = calls
    assert kwargs == {
        "backend": "nccl",
        "init_method": "env://",
        "rank": 6,
        "world_size": 8,
        "device_id": torch.device("cuda", 2),
    }
