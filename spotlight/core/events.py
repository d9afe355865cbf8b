"""The run's event log: what happened to nodes, weights and iterations, with times.

Pure (docs/architecture.md §2): the coordinator appends with its own ``now``; nothing here reads a clock.
``spotlight status`` shows the tail of it, so a node shown ``dead`` has the event that says
why (heartbeat timeout, goodbye, preemption notice) next to it.

Event kinds (``EventLog.append``'s ``kind``):

    join       a node registered (detail: GPUs, spot or reserved)
    leave      a node said goodbye (detail: its reason)
    dead       a node missed its heartbeats (detail: how long it was silent)
    notice     a preemption notice (detail: source, kind, seconds to the deadline)
    revoke     a GPU-scoped revocation notice (detail: source, GPUs)
    add        GPUs added to a live node (detail: which)
    remove     GPUs gone from a live node without a notice
    reform     a node's workers changed (an SP group re-formed; detail: worker → GPUs)
    commit     a draining worker committed partial work (detail: requests, steps)
    detector   a node's preemption detector turned unhealthy or recovered (detail: its error)
    gave-up    a node stopped starting workers on some GPUs: they failed every start (detail: which, why)
    unhealthy  a Rollout Worker whose consecutive batches all failed backs off (detail: its last error)
    parked     a request failed on cluster.max_request_failures leases and is not run again (detail: error)
    weights    a weight version was published (detail: version, size)
    iteration  an iteration ended (detail: 1-based number, reward)
    resume     the coordinator continued a run from its checkpoint
    finish     the run finished (or stopped: detail says why)
"""

from __future__ import annotations

import collections
import math

EVENT_LOG_LENGTH = 200
"""Events kept (the oldest fall off): enough for a screenful and a run's last minutes."""


class EventLog:
    """A bounded, append-only list of ``{t_s, kind, node, detail}`` events.

    Args:
        maxlen: events kept; older ones are dropped.
        start_s: the clock reading (seconds, the caller's clock) that ``t_s`` counts from.
    """

    def __init__(self, maxlen: int = EVENT_LOG_LENGTH, start_s: float = 0.0):
        self.start_s = start_s
        self._events: collections.deque[dict] = collections.deque(maxlen=maxlen)

    def append(self, now: float, kind: str, node: str = "", detail: str = "") -> None:
        """Record one event at ``now`` (same clock as ``start_s``; stored as seconds since it)."""
        self._events.append({"t_s": round(now - self.start_s, 3), "kind": kind, "node": node, "detail": detail})

    def continue_from(self, start_s: float, earlier) -> None:
        """Continue an earlier coordinator's log (a resumed run): replace what is here with
        ``earlier`` (its ``to_list``) on a time line that starts at ``start_s``."""
        self.start_s = start_s
        self._events.clear()
        self.extend(earlier)

    def extend(self, events) -> None:
        """Append events recorded earlier (``to_list`` dicts of an earlier coordinator of the same
        run, their ``t_s`` already on this log's time line); malformed entries are skipped."""
        for e in events or []:
            if isinstance(e, dict) and isinstance(e.get("t_s"), (int, float)):
                self._events.append(
                    {
                        "t_s": float(e["t_s"]),
                        "kind": str(e.get("kind", "")),
                        "node": str(e.get("node", "")),
                        "detail": str(e.get("detail", "")),
                    }
                )

    def to_list(self) -> list[dict]:
        """The kept events, oldest first, as JSON-able dicts ``{t_s: float, kind, node, detail: str}``."""
        return [dict(e) for e in self._events]

    def __len__(self) -> int:
        return len(self._events)


def eta_s(elapsed_s: float, iterations_done: int, iterations_total: int) -> float | None:
    """Seconds left: mean time per finished iteration so far × iterations left.

    Args:
        elapsed_s: seconds since the iterations counted in ``iterations_done`` began.
        iterations_done: iterations finished in that time (0: no estimate yet).
        iterations_total: iterations of the whole run.

    Returns:
        seconds (float), 0.0 when every iteration is done, or None before the first one ends.
    """
    remaining = max(0, iterations_total - iterations_done)
    if remaining == 0:
        return 0.0
    if iterations_done <= 0 or not math.isfinite(elapsed_s) or elapsed_s < 0:
        return None
    return elapsed_s / iterations_done * remaining


def cost_summary(
    spot_gpu_s: float, reserved_gpu_s: float, spot_usd_per_gpu_hour: float, reserved_usd_per_gpu_hour: float
) -> dict:
    """What the GPUs used so far cost, and what the same GPU-hours would cost all on reserved.

    Args:
        spot_gpu_s, reserved_gpu_s: GPU-seconds (GPUs × seconds alive) of spot and reserved nodes.
        spot_usd_per_gpu_hour, reserved_usd_per_gpu_hour: prices (``[cost]`` in the config).

    Returns:
        ``{spot_gpu_hours, reserved_gpu_hours, spot_usd, reserved_usd, total_usd,
        all_reserved_usd, spot_usd_per_gpu_hour, reserved_usd_per_gpu_hour}`` (hours, USD).
    """
    sh, rh = spot_gpu_s / 3600.0, reserved_gpu_s / 3600.0
    spot_usd, reserved_usd = sh * spot_usd_per_gpu_hour, rh * reserved_usd_per_gpu_hour
    return {
        "spot_gpu_hours": sh,
        "reserved_gpu_hours": rh,
        "spot_usd": spot_usd,
        "reserved_usd": reserved_usd,
        "total_usd": spot_usd + reserved_usd,
        "all_reserved_usd": (sh + rh) * reserved_usd_per_gpu_hour,
        "spot_usd_per_gpu_hour": spot_usd_per_gpu_hour,
        "reserved_usd_per_gpu_hour": reserved_usd_per_gpu_hour,
    }
