"""Synthetic preemption traces: n revocation/recovery cycles per iteration (paper §6.5, Fig. 13).

The paper's adaptiveness study uses "a synthetic spot trace where preemption events occur
within the time window of one training iteration, each reducing the spot GPU count from 8 to
4 and recovering to 8 after 5 s", swept from 1 to 8 events per iteration. Taking one GPU from
each of 4 two-GPU nodes leaves every node fragmented (its survivor runs at SP = 1), which is
what the paper's text describes ("lower throughput on fragmented GPUs running at SP=1").

:func:`preemption_cycles` builds such a trace as :class:`spotlight.traces.formats.ReplayAction` s, the
form both the simulator (``spotlight.sim``) and the local trace driver
(``spotlight.traces.driver``) consume. Pure: no clocks; the caller gives every time.
"""

from __future__ import annotations

import random

from spotlight.traces.formats import ReplayAction

__all__ = ["preemption_cycles"]


def preemption_cycles(
    num_agents: int,
    gpus_per_agent: int,
    *,
    cycles_per_iteration: int,
    iteration_s: float,
    iterations: int,
    revoke_gpus: int | None = None,
    down_s: float = 5.0,
    start_s: float = 0.0,
    seed: int = 0,
) -> list[ReplayAction]:
    """A full spot pool from ``t = 0`` and ``cycles_per_iteration`` revocation cycles per iteration.

    Every agent starts with all its GPUs (``start_node`` then ``add_gpu`` at ``t = 0``). In
    iteration ``i`` (the window ``[start_s + i·iteration_s, start_s + (i+1)·iteration_s)``) the
    cycles are evenly spaced; each revokes ``revoke_gpus`` GPUs (default: half the pool),
    spread over the agents — one from each of the agents with the most live GPUs, ties broken
    by a seeded RNG — and gives every one of them back ``down_s`` later. An agent never loses its
    last GPU unless ``revoke_gpus`` demands it (then it is a ``preempt_node``, and coming back a
    ``start_node``).

    Args:
        num_agents, gpus_per_agent: the spot pool (paper Fig. 13: 4 × 2).
        cycles_per_iteration: revocation/recovery cycles per iteration (0 = a static pool).
        iteration_s: expected iteration length in seconds (of the replay clock).
        iterations: number of iteration windows to fill.
        revoke_gpus: GPUs taken per cycle (default ``num_agents·gpus_per_agent // 2``).
        down_s: seconds until the revoked GPUs come back (paper: 5 s).
        start_s: when the first window opens.
        seed: RNG seed of the tie-breaks.

    Returns:
        Actions sorted by time.

    Raises:
        ValueError: non-positive sizes or times, ``revoke_gpus`` above the pool, or cycles so
            dense that a cycle starts before the previous one's GPUs are back.
    """
    pool = num_agents * gpus_per_agent
    if num_agents < 1 or gpus_per_agent < 1:
        raise ValueError(f"need at least one agent and one GPU per agent, got {num_agents} x {gpus_per_agent}")
    if cycles_per_iteration < 0 or iterations < 0:
        raise ValueError("cycles_per_iteration and iterations must be >= 0")
    if not iteration_s > 0 or not down_s > 0:
        raise ValueError(f"iteration_s and down_s must be > 0, got {iteration_s}, {down_s}")
    k = pool // 2 if revoke_gpus is None else revoke_gpus
    if not 1 <= k <= pool:
        raise ValueError(f"revoke_gpus must be between 1 and the pool size {pool}, got {k}")
    spacing = iteration_s / cycles_per_iteration if cycles_per_iteration else iteration_s
    if cycles_per_iteration and down_s >= spacing:
        raise ValueError(
            f"{cycles_per_iteration} cycles of {down_s}s per {iteration_s}s iteration overlap; "
            "lower down_s or the cycle count"
        )
    rng = random.Random(seed)
    live = [list(range(gpus_per_agent)) for _ in range(num_agents)]
    actions: list[ReplayAction] = []
    for a in range(num_agents):
        for g in range(gpus_per_agent):
            actions.append(ReplayAction(start_s, "start_node" if g == 0 else "add_gpu", a, g, f"a{a}g{g}"))
    for i in range(iterations):
        for c in range(cycles_per_iteration):
            t = start_s + i * iteration_s + (c + 0.5) * spacing
            taken: list[tuple[int, int]] = []
            for _ in range(k):
                most = max(len(gs) for gs in live)
                agent = rng.choice([a for a, gs in enumerate(live) if len(gs) == most])
                gpu = live[agent].pop()
                kind = "revoke_gpu" if live[agent] else "preempt_node"
                actions.append(ReplayAction(t, kind, agent, gpu, f"a{agent}g{gpu}"))
                taken.append((agent, gpu))
            for agent, gpu in taken:
                kind = "add_gpu" if live[agent] else "start_node"
                live[agent].append(gpu)
                live[agent].sort()
                actions.append(ReplayAction(t + down_s, kind, agent, gpu, f"a{agent}g{gpu}"))
    actions.sort(key=lambda x: x.t_s)  # stable: same-time actions keep their order
    return actions
