"""On CUDA an SP group's NCCL process group is bound to the member's GPU (``device_id`` of
``init_process_group``). No GPU needed: CUDA and ``init_process_group`` are stand-ins."""

from __future__ import annotations

import torch

from tests.unit.workers.train.test_nccl_device_id import _fake_cuda


def test_sp_group_binds_its_nccl_group_to_its_gpu(monkeypatch):
    from spotlight.config import ModelConfig
    from spotlight.workers.sp.group import GroupSpec, SPGroupMember

    calls = []
    _fake_cuda(monkeypatch, calls)
    member = SPGroupMember(ModelConfig(), "w1", torch.device("cuda", 1))
    member.rank = 1
    member._init_process_group(GroupSpec(members=("w0", "w1"), master_addr="127.0.0.1", master_port=1, generation=0))
    ((args, kwargs),) = calls
    assert args == ("nccl",) and kwargs["device_id"] == torch.device("cuda", 1)
    cpu = SPGroupMember(ModelConfig(), "w0", torch.device("cpu"))
    cpu.rank = 0
    cpu._init_process_group(GroupSpec(members=("w0", "w1"), master_addr="127.0.0.1", master_port=1, generation=0))
    assert calls[1][0] == ("gloo",) and calls[1][1]["device_id"] is None
