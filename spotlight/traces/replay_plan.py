"""What ``spotlight up --local`` replays onto its spot agents: a trace (slice or whole) or
synthetic preemption cycles, as :class:`~spotlight.traces.formats.ReplayAction` s for the
:class:`~spotlight.traces.driver.TraceDriver`.

Pure: reads the trace file it is given and nothing else; no processes, sockets or clocks.
Every bad value raises :class:`ValueError` with one line naming the option.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from spotlight.errors import plural
from spotlight.traces.formats import (
    EXPECTED_ITERATION_S,
    ReplayAction,
    TracePlacement,
    count_kinds,
    default_time_scale,
    fragmentation,
    load_trace,
    slice_trace,
)

__all__ = ["TRACE_MODES", "LocalReplay", "plan_local_replay"]

TRACE_MODES: dict[str, str] = {
    "slice": "a slice of the trace, its GPU count scaled to the local agents' GPUs (proportional placement)",
    "full": "the whole trace from t = 0, unscaled: the agents must hold its peak; removals hit a random node "
    "(paper §3.1/§6.1)",
}
"""``--trace-mode`` values -> one-line description."""


@dataclass(frozen=True)
class LocalReplay:
    """Actions (seconds of the replay clock = wall seconds) and the lines to show the user
    (rich markup allowed)."""

    actions: list[ReplayAction]
    notes: list[str] = field(default_factory=list)


def plan_local_replay(
    *,
    iterations: int,
    agents: int,
    gpus_per_agent: int,
    trace: str | os.PathLike[str] | None = None,
    trace_mode: Literal["slice", "full"] = "slice",
    time_scale: float | None = None,
    trace_start_s: float = 3000.0,
    trace_duration_s: float = 1800.0,
    seed: int = 0,
    preemption_cycles: int | None = None,
    cycle_down_s: float = 5.0,
    cycle_iteration_s: float = EXPECTED_ITERATION_S,
) -> LocalReplay:
    """Plan the spot-capacity changes of a local run.

    Exactly one source: ``trace`` (a file :func:`spotlight.traces.formats.load_trace` reads) or
    ``preemption_cycles`` (paper §6.5 Fig. 13: that many revocation/recovery cycles per
    iteration on the full ``agents × gpus_per_agent`` pool, each taking half the pool's
    GPUs for ``cycle_down_s`` seconds, in windows of ``cycle_iteration_s`` seconds for
    ``iterations`` iterations; :func:`spotlight.traces.synthetic.preemption_cycles`).

    Trace modes (:data:`TRACE_MODES`): ``slice`` replays ``[trace_start_s, +trace_duration_s)``
    scaled to the local GPUs; ``full`` the whole trace unscaled
    (:class:`~spotlight.traces.formats.TracePlacement` ``full=True``; the slice options are ignored).
    ``time_scale`` is trace seconds per wall second; ``None`` stretches the replayed span
    over ``iterations × EXPECTED_ITERATION_S`` (:func:`~spotlight.traces.formats.default_time_scale`).

    Raises:
        ValueError: both sources or neither, an unknown mode, an empty slice, a trace whose
            peak the agents cannot hold (the message says how many agents it needs), cycles
            that overlap, non-positive sizes or times; malformed trace files.
        OSError: the trace cannot be read.
    """
    if (trace is None) == (preemption_cycles is None):
        raise ValueError("give either --trace or --preemption-cycles (one source of spot capacity changes)")
    if preemption_cycles is not None:
        return _plan_cycles(
            iterations, agents, gpus_per_agent, preemption_cycles, cycle_down_s, cycle_iteration_s, seed, time_scale
        )
    if trace_mode not in TRACE_MODES:
        raise ValueError(f"--trace-mode {trace_mode!r}: expected one of {', '.join(TRACE_MODES)}")
    if agents < 1:
        raise ValueError("--trace needs at least one spot agent (--agents)")
    events = load_trace(trace, seed=seed)
    name = os.path.basename(os.fspath(trace))
    events, span_s, what = _replayed_span(events, trace, trace_mode, trace_start_s, trace_duration_s)
    time_scale, notes = _resolve_time_scale(time_scale, span_s, trace_mode, iterations)
    placement = TracePlacement(
        agents, gpus_per_agent, seed, scale_to_capacity=trace_mode == "slice", full=trace_mode == "full"
    )
    try:
        actions = placement.plan(events, time_scale=time_scale, end_s=span_s)
    except ValueError as exc:
        raise ValueError(f"--trace-mode {trace_mode}: {exc}") from None
    notes.append(
        f"trace {name}: {what} replayed in {span_s / time_scale:.0f}s onto {agents}×{gpus_per_agent} GPUs: "
        f"{count_kinds(actions)}, fragmentation at SP 2 {fragmentation(actions, 2, end_s=span_s / time_scale):.2f}"
    )
    return LocalReplay(actions, notes)


def _replayed_span(
    events: list, trace: str | os.PathLike[str], trace_mode: str, trace_start_s: float, trace_duration_s: float
) -> tuple[list, float, str]:
    """The events to replay, the trace seconds they span and a phrase naming them: the slice
    ``[trace_start_s, +trace_duration_s)`` or, in ``full`` mode, the whole trace."""
    if trace_mode == "slice":
        end_s = events[-1].t_s if events else 0.0
        if trace_start_s >= end_s:  # the slice would be the final population, constant: no replay at all
            raise ValueError(
                f"{os.fspath(trace)}: the trace ends at {end_s:.0f}s, before --trace-start-s {trace_start_s:.0f}s; "
                f"choose --trace-start-s below {end_s:.0f} (e.g. 0) or --trace-mode full"
            )
        events = slice_trace(events, trace_start_s, trace_duration_s)
        if not events:
            raise ValueError(
                f"{os.fspath(trace)}: no spot capacity in the slice [{trace_start_s:.0f}s, +{trace_duration_s:.0f}s) "
                "(choose --trace-start-s)"
            )
        return events, trace_duration_s, f"slice [{trace_start_s:.0f}s, +{trace_duration_s:.0f}s)"
    if not events:
        raise ValueError(f"{os.fspath(trace)}: the trace has no events")
    return events, max(events[-1].t_s, 1.0), f"whole trace ({events[-1].t_s:.0f}s, unscaled)"


def _resolve_time_scale(
    time_scale: float | None, span_s: float, trace_mode: str, iterations: int
) -> tuple[float, list[str]]:
    """``--time-scale`` or its default (the span stretched over the run's expected length),
    with a note saying which, or warning that the replay ends long before the run."""
    notes = []
    expected_run_s = iterations * EXPECTED_ITERATION_S
    if time_scale is None:
        time_scale = default_time_scale(span_s, iterations)
        notes.append(
            f"trace time scale {time_scale:.3g} (default): the {span_s:.0f}s {trace_mode} is stretched over "
            f"~{expected_run_s:.0f}s, the expected length of {plural(iterations, 'iteration')} at "
            f"~{EXPECTED_ITERATION_S:.0f}s each (the embedded default on CPU); set it with --time-scale"
        )
    elif not (time_scale > 0):
        raise ValueError(f"--time-scale must be > 0, got {time_scale}")
    elif span_s / time_scale < 0.5 * expected_run_s:
        notes.append(
            f"[yellow]warning:[/yellow] --time-scale {time_scale:g} replays the {span_s:.0f}s {trace_mode} in "
            f"{span_s / time_scale:.0f}s, less than half the run's expected ~{expected_run_s:.0f}s: after it the "
            "spot pool stays as the trace ends"
        )
    return time_scale, notes


def _plan_cycles(
    iterations: int,
    agents: int,
    gpus_per_agent: int,
    cycles: int,
    down_s: float,
    iteration_s: float,
    seed: int,
    time_scale: float | None,
) -> LocalReplay:
    from spotlight.traces.synthetic import preemption_cycles

    if time_scale is not None:
        raise ValueError(
            "--time-scale applies to --trace; synthetic cycles are timed by --cycle-iteration-s and --cycle-down-s "
            "(wall seconds)"
        )
    if agents < 1:
        raise ValueError("--preemption-cycles needs at least one spot agent (--agents)")
    try:
        actions = preemption_cycles(
            agents,
            gpus_per_agent,
            cycles_per_iteration=cycles,
            iteration_s=iteration_s,
            iterations=iterations,
            down_s=down_s,
            seed=seed,
        )
    except ValueError as exc:
        raise ValueError(f"--preemption-cycles {cycles}: {exc}") from None
    pool = agents * gpus_per_agent
    note = (
        f"synthetic preemption trace: {cycles} cycle{'s' if cycles != 1 else ''} per ~{iteration_s:g}s iteration "
        f"for {plural(iterations, 'iteration')} on {agents}×{gpus_per_agent} spot GPUs, "
        f"each taking {pool // 2} GPU{'s' if pool // 2 != 1 else ''} for {down_s:g}s: {count_kinds(actions)}"
    )
    return LocalReplay(actions, [note])
