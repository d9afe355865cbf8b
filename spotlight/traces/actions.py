"""A spot trace as the simulator's capacity changes (paper §6.1): read the trace file, extend
it past its end (forward, backward, forward … :func:`spotlight.traces.formats.pingpong_trace`) and
place its arrivals and revocations on random spot nodes of the simulated cluster.

What ``spotlight simulate --trace`` replays, shared with the benchmark scripts
(``benchmarks/_runs.py``, ``benchmarks/simulate_scale.py``) so they simulate the same thing.
Pure: reads the trace file it is given and nothing else.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from spotlight.traces.formats import ReplayAction, TraceEvent, TracePlacement, load_trace, pingpong_trace

__all__ = ["TRACE_HORIZON_S", "spot_actions", "trace_actions"]

TRACE_HORIZON_S = 60 * 24 * 3600.0
"""How far :func:`trace_actions` extends a trace by default: 60 days, longer than any simulated job."""


def spot_actions(
    events: Sequence[TraceEvent], *, spot_nodes: int, gpus_per_node: int, seed: int, replicas: int = 1
) -> list[ReplayAction]:
    """Place a trace onto ``spot_nodes × gpus_per_node`` GPUs (paper §6.1: each arrival and
    revocation on a random node). ``replicas > 1`` superposes that many independent seeded
    placements of the trace, each on its own ``spot_nodes / replicas`` nodes (a cluster
    larger than the trace's peak: each copy follows the trace's shape).

    Raises:
        ValueError: ``spot_nodes`` not a multiple of ``replicas``.
    """
    if replicas < 1 or spot_nodes % replicas:
        raise ValueError(f"--spot-nodes ({spot_nodes}) must be a multiple of --trace-replicas ({replicas})")
    per = spot_nodes // replicas
    out = []
    for r in range(replicas):
        acts = TracePlacement(per, gpus_per_node, seed + r, scale_to_capacity=True).plan(events)
        out += [dataclasses.replace(a, agent=a.agent + r * per) for a in acts]
    out.sort(key=lambda a: a.t_s)
    return out


def trace_actions(
    trace: str | os.PathLike[str],
    *,
    spot_nodes: int,
    gpus_per_node: int,
    seed: int = 0,
    replicas: int = 1,
    until_s: float = TRACE_HORIZON_S,
) -> list[ReplayAction]:
    """The capacity changes of ``trace`` (any format :func:`~spotlight.traces.formats.load_trace` reads)
    on ``spot_nodes × gpus_per_node`` simulated spot GPUs: the whole trace from t = 0, extended
    to ``until_s`` seconds, placed by :func:`spot_actions` with ``seed`` and ``replicas``.

    Raises:
        ValueError: a trace with no events, a malformed trace file, ``spot_nodes`` not a
            multiple of ``replicas``.
        OSError: the trace cannot be read.
    """
    events = load_trace(trace)
    if not events:
        raise ValueError(f"trace {trace} has no events")
    return spot_actions(
        pingpong_trace(events, until_s),
        spot_nodes=spot_nodes,
        gpus_per_node=gpus_per_node,
        seed=seed,
        replicas=replicas,
    )
