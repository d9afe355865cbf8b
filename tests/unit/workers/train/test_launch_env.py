"""Where a rank stands under torchrun or srun, its mesh, its GPU and its NCCL settings (pure)."""

from __future__ import annotations

import pytest

from spotlight.workers.train.launch_env import (
    NCCL_ENV,
    LaunchEnv,
    LaunchError,
    cuda_index,
    launch_env,
    mesh_shape,
    nccl_env,
    slurm_tasks_per_node,
)

RDZV = {"MASTER_ADDR": "node-a", "MASTER_PORT": "29500"}


def torchrun(rank: int, local_rank: int, world: int = 8, local_world: int = 4, nodes: int = 2) -> dict:
    """The variables torchrun puts into a worker's environment."""
    return RDZV | {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_WORLD_SIZE": str(nodes),
        "GROUP_RANK": str(rank // local_world),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def srun(procid: int, localid: int, ntasks: int = 8, nodes: int = 2, per_node: str = "4(x2)") -> dict:
    return RDZV | {
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NNODES": str(nodes),
        "SLURM_STEP_TASKS_PER_NODE": per_node,
    }


def test_torchrun_rank_on_the_second_node():
    env = launch_env(torchrun(rank=6, local_rank=2))
    assert env == LaunchEnv(6, 8, 2, 4, 2, "node-a", 29500, "torchrun")
    assert env.node_rank == 1


def test_srun_rank_and_slurms_compressed_task_counts():
    assert launch_env(srun(procid=5, localid=1)) == LaunchEnv(5, 8, 1, 4, 2, "node-a", 29500, "srun")
    assert slurm_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert slurm_tasks_per_node("8") == [8]
    with pytest.raises(LaunchError, match="SLURM_STEP_TASKS_PER_NODE"):
        slurm_tasks_per_node("4x2")


def test_torchrun_wins_over_slurm_variables():
    """torchrun started by srun: torchrun's variables describe the worker."""
    env = launch_env(srun(procid=1, localid=0, ntasks=2, nodes=2, per_node="1(x2)") | torchrun(rank=5, local_rank=1))
    assert (env.rank, env.launcher, env.local_world_size) == (5, "torchrun", 4)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({}, "no launcher environment"),
        (torchrun(0, 0) | {"GROUP_WORLD_SIZE": "3"}, "same number of ranks"),
        (srun(0, 0, per_node="4,3", ntasks=7), "same number of ranks"),
        (torchrun(9, 1), "outside"),
        (torchrun(5, 0), "node by node"),  # rank 5 would be local rank 1 with 4 per node
        ({k: v for k, v in torchrun(0, 0).items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
        (torchrun(0, 0) | {"RANK": "zero"}, "RANK='zero'"),
    ],
)
def test_bad_launcher_environments_are_one_clear_line(env, words):
    with pytest.raises(LaunchError, match=words):
        launch_env(env)


def test_mesh_is_1d_on_one_node_and_nodes_by_gpus_across_nodes():
    assert mesh_shape(4, 1) == (4,)
    assert mesh_shape(8, 2) == (2, 4)
    assert mesh_shape(2, 2) == (2, 1)
    with pytest.raises(ValueError):
        mesh_shape(6, 4)


def test_cuda_index_is_the_local_rank_unless_one_gpu_is_bound_to_each_rank():
    assert cuda_index(3, 4, 8) == 3
    assert cuda_index(3, 4, 1) == 0  # srun --gpus-per-task=1
    with pytest.raises(LaunchError, match="2 GPUs visible"):
        cuda_index(3, 4, 2)


def test_nccl_env_overrides_torchruns_teardown_and_keeps_the_users_other_choices():
    updates, notes = nccl_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    assert updates == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert len(notes) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 replaced by 2" in notes[0]
    assert nccl_env(NCCL_ENV) == ({}, [])
    assert nccl_env({})[0] == NCCL_ENV
