"""Which device a Rollout Worker sees: the agent's GPU indices mapped through its own visibility.

``spotlight-agent join --gpus 0,1`` names GPUs *as the agent sees them*. A cluster scheduler
often restricts what the agent sees already: Slurm sets ``CUDA_VISIBLE_DEVICES`` for a job's GPUs
(GRES), the Kubernetes device plugin and ``docker --gpus`` do the same for a container. Index
``i`` of ``--gpus`` is then the ``i``-th entry of the agent's ``CUDA_VISIBLE_DEVICES``
(``4,5,6,7`` and GPU 2 → physical device ``6``), and each worker gets exactly its own device as
its ``CUDA_VISIBLE_DEVICES``, so it always runs on ``cuda:0`` (an SP group member too: every
member is its own process with its own device). Without ``CUDA_VISIBLE_DEVICES`` index ``i`` is
device ``i``. Entries may be indices, ``GPU-<uuid>`` or ``MIG-<uuid>``; they are passed on as
written.

An empty ``CUDA_VISIBLE_DEVICES`` hides every GPU: the agent's "GPUs" are then CPU slots (local
runs, CPU containers) and every worker gets an empty ``CUDA_VISIBLE_DEVICES`` too.

Pure: no environment reads here; the daemon passes its own ``CUDA_VISIBLE_DEVICES`` in.
"""

from __future__ import annotations

__all__ = ["NCCL_WORKER_ENV", "visible_entries", "visibility_error", "worker_nccl_env", "worker_visible_devices"]


def visible_entries(agent_visible: str | None) -> list[str] | None:
    """The agent's ``CUDA_VISIBLE_DEVICES`` as a list of entries; None when it is unset (every
    device visible, index = device), ``[]`` when it is empty (no GPU: CPU slots)."""
    if agent_visible is None:
        return None
    return [e.strip() for e in agent_visible.split(",") if e.strip()]


def visibility_error(gpus: list[int], agent_visible: str | None) -> str | None:
    """Why ``gpus`` (the agent's ``--gpus``) are not all in the agent's visible set, or None."""
    entries = visible_entries(agent_visible)
    if not entries:  # unset: any index; empty: CPU slots
        return None
    outside = sorted(g for g in gpus if not 0 <= g < len(entries))
    if outside:
        return (
            f"GPU index(es) {outside} outside this agent's visible devices: CUDA_VISIBLE_DEVICES={agent_visible} "
            f"holds {len(entries)} (indices 0..{len(entries) - 1}); --gpus counts within that set"
        )
    return None


def worker_visible_devices(gpus: list[int], agent_visible: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of the worker on ``gpus`` (the agent's indices).

    ``ValueError`` (with :func:`visibility_error`'s text) for an index outside the visible set."""
    entries = visible_entries(agent_visible)
    if entries is None:
        return ",".join(str(g) for g in gpus)
    if not entries:
        return ""
    bad = visibility_error(gpus, agent_visible)
    if bad is not None:
        raise ValueError(bad)
    return ",".join(entries[g] for g in gpus)


NCCL_WORKER_ENV = {
    # CleanUpOnly: on a collective's error or timeout the NCCL watchdog aborts the communicator
    # (the blocked collective raises, the SP member rolls its denoising state back to the last
    # completed step and commits it) instead of killing the whole process with its in-flight
    # batch (torch's default, 3 = SkipCleanUp, tears the process down).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # the heartbeat monitor kills a process whose watchdog looks stuck (e.g. inside an abort of
    # a communicator whose peer died): a survivor must not be killed for its peer's death
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
"""NCCL settings of every Rollout Worker the agent starts (docs/architecture.md §6: a peer's
death aborts the communicator; nothing may kill a survivor's in-flight work). A value the
agent's own environment sets wins (an operator's deliberate choice)."""


def worker_nccl_env(agent_env: dict[str, str]) -> dict[str, str]:
    """:data:`NCCL_WORKER_ENV` entries the agent's environment ``agent_env`` does not set."""
    return {k: v for k, v in NCCL_WORKER_ENV.items() if k not in agent_env}
