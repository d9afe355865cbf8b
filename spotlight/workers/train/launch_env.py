"""Where a Train Worker rank stands when torch's own launcher (``torchrun``) or Slurm's ``srun``
started it, and the NCCL settings every trainer runs with. Torch-free and pure: functions of an
environment mapping (docs/architecture.md §10, README "Multi-node training").

``torchrun`` gives every worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_WORLD_SIZE`` (its number of nodes), ``MASTER_ADDR`` and ``MASTER_PORT`` (the ``env://``
rendezvous, served by torchrun's agent). ``srun`` without torchrun gives ``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NNODES`` and ``SLURM_STEP_TASKS_PER_NODE``;
``MASTER_ADDR`` and ``MASTER_PORT`` are the batch script's to export (``deploy/slurm/reserved.sbatch``).

Ranks are laid out node-major (rank = node × GPUs per node + local rank), which is what both
launchers do with their default (block) distribution, so the 2-D HSDP mesh's ``shard`` dimension
(:func:`mesh_shape`) is the GPUs of one node and its ``replicate`` dimension goes across nodes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from spotlight.errors import SpotlightError

MESH_DIM_NAMES = ("replicate", "shard")
"""Names of the 2-D HSDP mesh's dimensions: across nodes (gradients all-reduced), within a node
(parameters sharded, FSDP2)."""

NCCL_ENV = {
    # CleanUpOnly: on a collective's error or timeout the watchdog aborts the communicators and
    # the blocked call raises in the rank's own code; it never tears the process down (1, which
    # torchrun sets by default) and never leaves it to die unannounced (3, torch's default).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # The heartbeat monitor kills the whole process when the watchdog thread looks stuck
    # (e.g. inside an abort); the trainer's own peer watch bounds that wait instead.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # no flight-recorder dump on a timeout (it writes per-rank files and waits for them)
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
"""NCCL watchdog settings of every Train Worker (:func:`nccl_env`): a dead peer is handled by the
rank's :class:`~spotlight.workers.train.peer_watch.PeerWatch` (which aborts the communicator),
and nothing in torch may kill a surviving rank in the middle of its own work."""

FORCED_NCCL_ENV = frozenset({"TORCH_NCCL_ASYNC_ERROR_HANDLING"})
"""Set even where the environment already has a value: ``torchrun`` puts
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (tear the process down) into every worker's environment
unless the variable was set where torchrun itself ran."""


class LaunchError(SpotlightError):
    """The launcher's environment does not describe a rank this entry point can run."""


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """One rank's place in the trainer group, as its launcher described it.

    Attributes:
        rank, world_size: the global rank and the number of ranks (= ``train.num_train_workers``).
        local_rank, local_world_size: the rank on its node and the ranks per node (its GPU is
            ``cuda:<local_rank>`` when the node's GPUs are all visible to it).
        num_nodes: nodes the group spans (``world_size = num_nodes × local_world_size``).
        master_addr, master_port: the ``env://`` rendezvous.
        launcher: ``torchrun`` or ``srun``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: str

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r}: expected an integer") from None
    if value < minimum:
        raise LaunchError(f"{name}={value}: must be >= {minimum}")
    return value


def slurm_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed task counts (``SLURM_STEP_TASKS_PER_NODE``, e.g. ``"4(x2),3"``) as one
    count per node (``[4, 4, 3]``).

    Raises:
        LaunchError: not in Slurm's format.
    """
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE={text!r}: expected counts such as 4(x2),3")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """This rank's :class:`LaunchEnv` from ``env`` (``os.environ``): torchrun's variables when
    ``RANK`` is set, else srun's.

    Raises:
        LaunchError: neither launcher's variables, a missing rendezvous address, inconsistent
            counts, or nodes with different numbers of ranks (HSDP needs the same on each).
    """
    if "RANK" in env:
        launcher = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE", minimum=1)
        local_rank = _int(env, "LOCAL_RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in env else world
        if "GROUP_WORLD_SIZE" in env:
            nodes = _int(env, "GROUP_WORLD_SIZE", minimum=1)
            if nodes * local_world != world:
                raise LaunchError(
                    f"WORLD_SIZE={world} is not GROUP_WORLD_SIZE={nodes} nodes × LOCAL_WORLD_SIZE={local_world}: "
                    "every node must run the same number of ranks (torchrun --nproc-per-node)"
                )
        else:
            nodes = world // local_world
    elif "SLURM_PROCID" in env:
        launcher = "srun"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS", minimum=1)
        local_rank = _int(env, "SLURM_LOCALID")
        nodes = _int(env, "SLURM_NNODES", minimum=1) if "SLURM_NNODES" in env else 1
        per_node = slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or f"{world // nodes}(x{nodes})")
        if len(set(per_node)) != 1 or len(per_node) != nodes:
            raise LaunchError(
                f"SLURM_STEP_TASKS_PER_NODE={env.get('SLURM_STEP_TASKS_PER_NODE')!r} over {nodes} nodes: every node "
                "must run the same number of ranks (srun --ntasks-per-node)"
            )
        local_world = per_node[0]
    else:
        raise LaunchError(
            "no launcher environment: run this entry point under torchrun (which sets RANK, WORLD_SIZE, "
            "LOCAL_RANK) or srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID)"
        )
    if world % local_world or nodes * local_world != world:
        raise LaunchError(
            f"{world} ranks cannot be laid out as {nodes} nodes × {local_world} ranks: every node must run "
            "the same number of ranks"
        )
    if not (rank < world and local_rank < local_world):
        raise LaunchError(f"rank {rank} (local {local_rank}) is outside {world} ranks ({local_world} per node)")
    if rank % local_world != local_rank:
        raise LaunchError(
            f"rank {rank} is local rank {local_rank} on its node, but ranks must be laid out node by node "
            f"(rank = node × {local_world} + local rank): use the launcher's default (block) distribution"
        )
    addr = env.get("MASTER_ADDR", "")
    if not addr or "MASTER_PORT" not in env:
        raise LaunchError(
            "MASTER_ADDR and MASTER_PORT must name the rendezvous (torchrun sets them; under srun export "
            "MASTER_ADDR=<first node> MASTER_PORT=<free port>)"
        )
    port = _int(env, "MASTER_PORT", minimum=1)
    return LaunchEnv(rank, world, local_rank, local_world, nodes, addr, port, launcher)


def mesh_shape(world_size: int, num_nodes: int) -> tuple[int, ...]:
    """The trainer's device mesh: ``(world_size,)`` on one node (FSDP2 over every rank), else
    ``(num_nodes, world_size // num_nodes)`` with dimensions :data:`MESH_DIM_NAMES` (HSDP:
    parameters sharded over a node's GPUs, replicated across nodes).

    Raises:
        ValueError: ``world_size`` is not a multiple of ``num_nodes``.
    """
    if num_nodes < 1 or world_size < 1 or world_size % num_nodes:
        raise ValueError(f"{world_size} ranks cannot be split evenly over {num_nodes} nodes")
    return (world_size,) if num_nodes == 1 else (num_nodes, world_size // num_nodes)


def cuda_index(local_rank: int, local_world_size: int, visible_devices: int) -> int:
    """The CUDA device a rank uses: ``local_rank`` when the node's GPUs are all visible to it,
    0 when the launcher bound one GPU to each rank (``srun --gpus-per-task=1``).

    Raises:
        LaunchError: fewer visible GPUs than ranks on the node, and not exactly one.
    """
    if visible_devices == 1:
        return 0
    if visible_devices >= local_world_size:
        return local_rank
    raise LaunchError(
        f"{visible_devices} GPUs visible to local rank {local_rank} of {local_world_size}: give each node as many "
        "GPUs as ranks (or bind one GPU to each rank)"
    )


def nccl_env(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The variables of :data:`NCCL_ENV` to set in ``env``: ``(updates, notes)``. A variable the
    user set keeps its value, except those of :data:`FORCED_NCCL_ENV`; ``notes`` says what was
    replaced (one line each)."""
    updates, notes = {}, []
    for name, value in NCCL_ENV.items():
        have = env.get(name)
        if have is None:
            updates[name] = value
        elif have != value and name in FORCED_NCCL_ENV:
            updates[name] = value
            notes.append(
                f"{name}={have} replaced by {value}: the trainer aborts its communicator itself when a peer "
                "dies, and must not be torn down mid-step"
            )
    return updates, notes
