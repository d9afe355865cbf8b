"""How busy the workers were: lease-holding time over alive time, per worker (pure).

The iteration core keeps one meter and feeds it the worker events its shell reports
(:meth:`spotlight.core.iteration.IterationCore.worker_seen` and friends); ``spot/busy_fraction``
in ``metrics.jsonl`` is read from it over each iteration's training window.
"""

from __future__ import annotations

import collections
import math

__all__ = ["BusyMeter"]


class BusyMeter:
    """How busy workers were over a time window: lease-holding time over alive time.

    A worker is *alive* from the first time it is ``seen`` until ``gone``; it is *busy* from
    a lease grant (``start``) until its result, commit or failure (``end``). Pure: the shell
    passes ``now`` (seconds). Feeds ``spot/busy_fraction``.
    """

    def __init__(self, *, keep_s: float = 600.0) -> None:
        self.keep_s = keep_s
        self.is_spot: dict[str, bool] = {}
        self._alive: dict[str, list[list[float | None]]] = {}  # worker -> [[start, end|None], ...]
        self._busy: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self._open: dict[str, float] = {}

    def seen(self, worker_id: str, is_spot: bool, now: float) -> None:
        self.is_spot[worker_id] = is_spot
        spans = self._alive.setdefault(worker_id, [])
        if not spans or spans[-1][1] is not None:
            spans.append([now, None])

    def gone(self, worker_id: str, now: float) -> None:
        self.end(worker_id, now)
        spans = self._alive.get(worker_id)
        if spans and spans[-1][1] is None:
            spans[-1][1] = now

    def start(self, worker_id: str, now: float) -> None:
        if worker_id not in self._open:
            self._open[worker_id] = now

    def end(self, worker_id: str, now: float) -> None:
        t0 = self._open.pop(worker_id, None)
        if t0 is not None:
            self._busy[worker_id].append((t0, now))

    def fraction(self, t0: float, t1: float, *, spot: bool = True) -> float:
        """Busy worker-seconds / alive worker-seconds of spot (or reserved) workers in [t0, t1];
        NaN when none was alive or the window is empty."""
        if t1 <= t0:
            return math.nan
        alive = busy = 0.0
        for w, spans in self._alive.items():
            if self.is_spot.get(w) != spot:
                continue
            for a, b in spans:
                alive += max(0.0, min(t1 if b is None else b, t1) - max(a, t0))
            for a, b in self._busy.get(w, ()):
                busy += max(0.0, min(b, t1) - max(a, t0))
            if w in self._open:
                busy += max(0.0, t1 - max(self._open[w], t0))
        return min(1.0, busy / alive) if alive > 0 else math.nan

    def forget(self, before: float) -> None:
        """Drop busy intervals and closed alive spans that ended before ``before``."""
        for w in list(self._busy):
            self._busy[w] = [(a, b) for a, b in self._busy[w] if b >= before]
        for w in list(self._alive):
            self._alive[w] = [s for s in self._alive[w] if s[1] is None or s[1] >= before]
