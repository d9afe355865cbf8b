"""Spot-availability traces: load, slice, place onto local capacity, replay.

The Spotlight paper evaluates against the 12-hour Bamboo spot trace
(Thorpe et al. 2023; ``examples/traces/bamboo/p3-trace.csv``, MIT, see
``examples/traces/README.md``). A row is ``delta_ms,add|remove,node<k>``
(CRLF line endings, no header). The trace records *when* spot capacity
arrives and leaves but not *where*: §3.1 (Fig. 4) and §6.1 ("Spot Trace")
therefore assign each arrival and revocation at random to one of the spot
nodes. This module does the same, seeded, and turns the result into actions
a driver can apply to local spot agents:

* :func:`load_trace` -- read any published format Spotlight knows (detected by
  content, :data:`TRACE_FORMATS`) into :class:`TraceEvent` (times in seconds):
  :func:`load_bamboo_trace` (add/remove CSV), :func:`load_count_log` (Bamboo's
  GCP and older AWS logs: ``date, time[, zone], count``) and
  :func:`load_skypilot_trace` (SkyPilot spot-traces JSON: ``gap_seconds`` plus a
  per-tick count of live instances). Count-based formats become add/remove
  events through :func:`events_from_counts`.
* :func:`slice_trace` -- a window ``[start, start + duration)`` re-based to
  ``t = 0``, preceded by synthetic ``add`` events for every node already alive
  at ``start`` so the window starts from the right population.
* :func:`alive_counts` / :func:`alive_at` -- the alive-node step function.
* :class:`TracePlacement` -- each trace node is one spot GPU; map them onto
  ``num_agents x gpus_per_agent`` local slots (capped, proportional, or ``full``:
  the whole trace unscaled with removals hitting a random node, as the paper
  replays it) and emit :class:`ReplayAction`
  (``start_node`` / ``add_gpu`` / ``revoke_gpu`` / ``preempt_node``).
* :func:`fragmentation` / :func:`fragmentation_timeline` /
  :func:`fragmentation_summary` -- the Fig. 4 metric: a live GPU is
  *fragmented* when its node cannot host a complete SP group, i.e. an agent
  with ``n`` live GPUs has ``n % sp_degree`` fragmented GPUs.
* :class:`TraceReplayer` -- a cursor handing out actions as their time comes.

Pure logic: no processes, sockets or clocks; callers pass every time in.
"""

from __future__ import annotations

import bisect
import csv
import datetime
import json
import math
import os
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from spotlight.errors import plural

__all__ = [
    "ACTION_KINDS",
    "ReplayAction",
    "TraceEvent",
    "TracePlacement",
    "TraceReplayer",
    "alive_at",
    "alive_counts",
    "EXPECTED_ITERATION_S",
    "TRACE_FORMATS",
    "count_kinds",
    "default_time_scale",
    "detect_trace_format",
    "events_from_counts",
    "fragmentation",
    "fragmentation_summary",
    "fragmentation_timeline",
    "load_bamboo_trace",
    "load_count_log",
    "load_skypilot_trace",
    "load_trace",
    "pingpong_trace",
    "slice_trace",
]

TraceAction = Literal["add", "remove"]
ActionKind = Literal["add_gpu", "revoke_gpu", "preempt_node", "start_node"]
ACTION_KINDS: tuple[str, ...] = ("start_node", "add_gpu", "revoke_gpu", "preempt_node")
_GAINS = frozenset({"start_node", "add_gpu"})
_LOSSES = frozenset({"revoke_gpu", "preempt_node"})


@dataclass(frozen=True)
class TraceEvent:
    """One trace row: at ``t_s`` seconds, node ``node`` is added or removed."""

    t_s: float
    action: TraceAction
    node: str


@dataclass(frozen=True)
class ReplayAction:
    """One change to local spot capacity, ``t_s`` seconds after replay start.

    ``kind``:
      * ``start_node``   -- a GPU arrives on an agent that had none (a new spot VM joins);
      * ``add_gpu``      -- a GPU arrives on an agent that already has live GPUs;
      * ``revoke_gpu``   -- a GPU leaves an agent that keeps other live GPUs;
      * ``preempt_node`` -- the agent's last GPU leaves (the whole spot VM goes: a
        real cloud preemption notice).

    ``gpu`` is the slot index on the agent (``0 .. gpus_per_agent - 1``);
    :class:`TracePlacement` always sets it, ``None`` is allowed for callers that
    build agent-level actions themselves. ``trace_node`` is the trace node the
    GPU stands for.
    """

    t_s: float
    kind: ActionKind
    agent: int
    gpu: int | None
    trace_node: str


# ---------------------------------------------------------------------------
# Loading and slicing
# ---------------------------------------------------------------------------


def load_bamboo_trace(path: str | os.PathLike[str]) -> list[TraceEvent]:
    """Parse a Bamboo trace CSV (``delta_ms,add|remove,node``; CRLF or LF).

    Returns events sorted by time (stable: rows sharing a timestamp keep file
    order), times converted from milliseconds to seconds. Blank lines are
    skipped. Raises :class:`ValueError` naming ``path:line`` for a malformed
    row (wrong field count, non-integer or negative delta, unknown action,
    empty node) and for an inconsistent one (``add`` of a node that is alive,
    ``remove`` of a node that is not).
    """
    rows: list[tuple[int, int, TraceEvent]] = []  # (delta_ms, line, event)
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            where = f"{os.fspath(path)}:{line}"
            if len(row) != 3:
                raise ValueError(
                    f"{where}: expected 3 fields 'delta_ms,add|remove,node', got {len(row)}: {_excerpt(','.join(row))}"
                )
            delta_txt, action, node = (cell.strip() for cell in row)
            try:
                delta_ms = int(delta_txt)
            except ValueError:
                raise ValueError(f"{where}: delta {_excerpt(delta_txt)} is not an integer number of ms") from None
            if delta_ms < 0:
                raise ValueError(f"{where}: negative delta {delta_ms} ms")
            if action not in ("add", "remove"):
                raise ValueError(f"{where}: action {_excerpt(action)} is neither 'add' nor 'remove'")
            if not node:
                raise ValueError(f"{where}: empty node name")
            rows.append((delta_ms, line, TraceEvent(delta_ms / 1000.0, action, node)))  # type: ignore[arg-type]
    rows.sort(key=lambda r: r[0])  # stable
    alive: set[str] = set()
    for _, line, ev in rows:
        where = f"{os.fspath(path)}:{line}"
        if ev.action == "add":
            if ev.node in alive:
                raise ValueError(f"{where}: 'add' of node {_excerpt(ev.node)} that is already alive")
            alive.add(ev.node)
        else:
            if ev.node not in alive:
                raise ValueError(f"{where}: 'remove' of node {_excerpt(ev.node)} that is not alive")
            alive.discard(ev.node)
    return [ev for _, _, ev in rows]


TRACE_FORMATS: dict[str, str] = {
    "bamboo": "Bamboo add/remove CSV (delta_ms,add|remove,node)",
    "count-log": "Bamboo GCP/AWS count log (date, time[, zone], count per line)",
    "skypilot": 'SkyPilot spot-traces JSON ({"metadata": {"gap_seconds": N}, "data": [count, ...]})',
}
"""Format name -> one-line description, for :func:`load_trace` and its error messages."""

_EXCERPT_CHARS = 60

_COUNT_LINE = re.compile(
    r"^\s*(?P<date>\d{4}-\d{2}-\d{2})[,\sT]+(?P<time>\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?)(?:Z|[+-]\d{2}:?\d{2})?"
    r"(?:[,;\s]+(?P<zone>[A-Za-z][\w.-]*))?[,;\s]+(?P<count>\d+)\s*$"
)


def _excerpt(text: str, limit: int = _EXCERPT_CHARS) -> str:
    """``repr`` of at most ``limit`` characters of ``text`` (``…`` marks a cut): error
    messages quote input, never dump it."""
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "…")


def events_from_counts(samples: Sequence[tuple[float, int]], *, seed: int | None = None) -> list[TraceEvent]:
    """Add/remove events from a count-of-live-instances time series.

    ``samples`` are ``(t_s, count)`` pairs sorted by time (seconds, any origin; counts
    >= 0). Times are re-based so the first sample is ``t = 0``. Between consecutive
    samples the count difference becomes that many ``add`` events (synthetic node ids
    ``node0``, ``node1``, … in arrival order, never reused) or ``remove`` events. A
    count-based trace does not say *which* instance left: removals hit the most
    recently added alive node (``seed=None``, deterministic) or a node drawn with
    ``random.Random(seed)`` from the alive ones. Equal counts produce no event.

    Raises:
        ValueError: a negative count or a time before the previous sample's.
    """
    rng = random.Random(seed) if seed is not None else None
    out: list[TraceEvent] = []
    alive: list[str] = []
    next_id = 0
    t0 = samples[0][0] if samples else 0.0
    prev_t = t0
    for t, count in samples:
        if count < 0:
            raise ValueError(f"negative instance count {count} at t={t - t0}s")
        if t < prev_t:
            raise ValueError(f"samples not sorted by time (t={t - t0}s after t={prev_t - t0}s)")
        prev_t = t
        while len(alive) < count:
            node = f"node{next_id}"
            next_id += 1
            alive.append(node)
            out.append(TraceEvent(t - t0, "add", node))
        while len(alive) > count:
            node = alive.pop() if rng is None else alive.pop(rng.randrange(len(alive)))
            out.append(TraceEvent(t - t0, "remove", node))
    return out


def _read_text(path: str | os.PathLike[str]) -> str:
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return f.read()
    except UnicodeDecodeError:
        raise ValueError(
            f"{os.fspath(path)}: not a UTF-8 text file; accepted trace formats: {'; '.join(TRACE_FORMATS.values())}"
        ) from None


def load_count_log(path: str | os.PathLike[str], *, seed: int | None = None) -> list[TraceEvent]:
    """Parse a count log: Bamboo's GCP logs (``2021-12-11, 11:11:30, 55``) and older AWS
    logs (the same with a zone, ``2021-06-01 12:00:00 us-east-1a 30``), one sample per line.

    Fields are separated by commas and/or spaces; the time may carry a ``T`` separator,
    fractional seconds and a UTC offset (ignored: samples share one clock). The last field
    is the number of live instances at that moment. With a zone column, counts are per
    zone and the live total is the sum of every zone's latest count. Blank lines, ``#``
    comments and one header line without digits are skipped; samples are sorted by time
    (stable). Events come from :func:`events_from_counts` (``seed``: which node a removal
    hits), times in seconds from the first sample.

    Raises:
        ValueError: a malformed line (the message names ``path:line`` and quotes at most
            60 characters of it), or no sample at all.
        OSError: the file cannot be read.
    """
    where = os.fspath(path)
    samples: list[tuple[float, str, int]] = []
    header_ok = True
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        m = _COUNT_LINE.match(text)
        if m is None:
            if header_ok and not any(c.isdigit() for c in text):
                header_ok = False
                continue
            raise ValueError(f"{where}:{n}: expected 'date, time[, zone], count' (count log), got {_excerpt(text)}")
        header_ok = False
        try:
            hms = m["time"].split(":")
            ts = datetime.datetime.fromisoformat(m["date"]) + datetime.timedelta(
                hours=int(hms[0]), minutes=int(hms[1]), seconds=float(hms[2]) if len(hms) > 2 else 0.0
            )
            if int(hms[0]) > 23 or int(hms[1]) > 59 or (len(hms) > 2 and float(hms[2]) >= 61):
                raise ValueError
        except ValueError:
            raise ValueError(f"{where}:{n}: invalid date or time {_excerpt(m['date'] + ' ' + m['time'])}") from None
        samples.append((ts.replace(tzinfo=datetime.timezone.utc).timestamp(), m["zone"] or "", int(m["count"])))
    if not samples:
        raise ValueError(f"{where}: no samples (expected lines 'date, time[, zone], count')")
    samples.sort(key=lambda s: s[0])
    per_zone: dict[str, int] = {}
    totals: list[tuple[float, int]] = []
    for t, zone, count in samples:
        per_zone[zone] = count
        total = sum(per_zone.values())
        if totals and totals[-1][0] == t:
            totals[-1] = (t, total)
        else:
            totals.append((t, total))
    return events_from_counts(totals, seed=seed)


def load_skypilot_trace(path: str | os.PathLike[str], *, seed: int | None = None) -> list[TraceEvent]:
    """Parse a SkyPilot spot-traces JSON file (``skypilot-org/spot-traces``, the NSDI '24
    "Can't Be Late" data): ``{"metadata": {"gap_seconds": G}, "data": [c0, c1, …]}``.

    Reading (the repository's README): tick ``i`` is at ``i × G`` seconds and ``c_i`` is
    the number of instances available (alive) then. Availability traces of a single
    node are 0/1 series, multi-node availability and preemption traces count the live
    instances of an ``n``-node request (``0 … n``); both read the same way, a drop being
    that many preemptions. ``gap_seconds`` is also accepted at the top level. Counts must
    be non-negative integers (``3.0`` is accepted). Events come from
    :func:`events_from_counts` (``seed``: which node a removal hits).

    Raises:
        ValueError: not JSON, no ``gap_seconds`` > 0 or no ``data`` list, a bad count
            (the message names its index and quotes at most 60 characters).
        OSError: the file cannot be read.
    """
    where = os.fspath(path)
    try:
        doc = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(doc, dict):
        raise ValueError(
            f"{where}: expected a JSON object with 'metadata.gap_seconds' and 'data', got a JSON {type(doc).__name__}"
        )
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    gap = meta.get("gap_seconds", doc.get("gap_seconds"))
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not gap > 0 or math.isinf(gap):
        raise ValueError(
            f"{where}: 'metadata.gap_seconds' must be a positive number of seconds, got {_excerpt(json.dumps(gap))}"
        )
    data = doc.get("data")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where}: 'data' must be a non-empty list of per-tick instance counts")
    samples = []
    for i, c in enumerate(data):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 or c != int(c):
            raise ValueError(
                f"{where}: data[{i}] = {_excerpt(json.dumps(c))} is not a non-negative integer instance count"
            )
        samples.append((i * float(gap), int(c)))
    return events_from_counts(samples, seed=seed)


def detect_trace_format(path: str | os.PathLike[str]) -> str:
    """The :data:`TRACE_FORMATS` key of the trace at ``path``, from its content (not its
    name): a JSON object is ``skypilot``; otherwise the first line that is not blank, a
    ``#`` comment or a header decides: ``delta,add|remove,node`` is ``bamboo``,
    ``date, time[, zone], count`` is ``count-log``.

    Raises:
        ValueError: none of them, in one line naming the accepted formats and quoting at
            most 60 characters of the file.
        OSError: the file cannot be read.
    """
    text = _read_text(path)
    head = text.lstrip()
    if head.startswith("{"):
        return "skypilot"
    seen: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if _COUNT_LINE.match(line):
            return "count-log"
        row = next(csv.reader([line]))
        if len(row) == 3 and row[1].strip() in ("add", "remove"):
            return "bamboo"
        seen.append(line)
        if len(seen) == 1 and not any(c.isdigit() for c in line):
            continue  # maybe a header: look at the next line too
        break
    what = f"first line {_excerpt(seen[0])}" if seen else "no data"
    raise ValueError(f"{os.fspath(path)}: unknown trace format ({what}); accepted: {'; '.join(TRACE_FORMATS.values())}")


def load_trace(path: str | os.PathLike[str], *, seed: int | None = None) -> list[TraceEvent]:
    """Load a spot trace in any format of :data:`TRACE_FORMATS`, detected by content
    (:func:`detect_trace_format`): the one entry point of ``spotlight up --trace`` and
    ``spotlight simulate --trace``. Returns time-sorted events, times in seconds from the
    trace's start. ``seed`` only matters for count-based formats (which node a removal
    hits, :func:`events_from_counts`).

    Raises:
        ValueError: an unknown format or a malformed trace; one line that names the file
            once (and the line where there is one) and quotes at most 60 characters.
        OSError: the file cannot be read.
    """
    fmt = detect_trace_format(path)
    if fmt == "bamboo":
        return load_bamboo_trace(path)
    if fmt == "count-log":
        return load_count_log(path, seed=seed)
    return load_skypilot_trace(path, seed=seed)


EXPECTED_ITERATION_S = 30.0
"""Estimated wall seconds per iteration of a local run, for :func:`default_time_scale`:
the embedded default (shapes task) on 2 CPU cores takes 30-48 s an iteration (README's
main job); a rough figure, not a measurement of the run at hand."""


def default_time_scale(duration_s: float, iterations: int, *, iteration_s: float = EXPECTED_ITERATION_S) -> float:
    """Trace seconds per wall second that stretch a ``duration_s``-second trace slice over
    a run's expected length, ``iterations × iteration_s`` seconds (``spotlight up --trace``
    without ``--time-scale``). Below 1 the replay is slower than real time.

    Raises:
        ValueError: a non-positive duration, iteration count or iteration time.
    """
    if not (duration_s > 0 and iterations >= 1 and iteration_s > 0):
        raise ValueError(
            f"need duration_s > 0, iterations >= 1 and iteration_s > 0, got {duration_s}, {iterations}, {iteration_s}"
        )
    return duration_s / (iterations * iteration_s)


def _alive_before(events: Iterable[TraceEvent], t_s: float) -> dict[str, None]:
    """Nodes alive just before ``t_s`` (events with ``t < t_s`` applied), in arrival order."""
    alive: dict[str, None] = {}
    for ev in events:
        if ev.t_s >= t_s:
            break
        if ev.action == "add":
            alive[ev.node] = None
        else:
            alive.pop(ev.node, None)
    return alive


def slice_trace(events: Sequence[TraceEvent], start_s: float, duration_s: float) -> list[TraceEvent]:
    """The window ``[start_s, start_s + duration_s)`` re-based to ``t = 0``.

    Begins with one synthetic ``add`` at ``t = 0`` for every node alive just
    before ``start_s`` (in arrival order), then the window's own events with
    ``t - start_s``. Events exactly at ``start_s`` land at ``t = 0`` after the
    synthetic adds, so the population after all ``t = 0`` events equals the
    trace's alive count at ``start_s``. ``events`` must be time-sorted.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if start_s < 0:
        raise ValueError(f"start_s must be >= 0, got {start_s}")
    end_s = start_s + duration_s
    out = [TraceEvent(0.0, "add", node) for node in _alive_before(events, start_s)]
    out.extend(TraceEvent(ev.t_s - start_s, ev.action, ev.node) for ev in events if start_s <= ev.t_s < end_s)
    return out


def pingpong_trace(events: Sequence[TraceEvent], until_s: float, *, period_s: float | None = None) -> list[TraceEvent]:
    """Extend a trace to ``until_s`` by playing it forward, then backward, then forward...

    A backward pass replays the events in reverse order with ``add`` and ``remove``
    swapped and times mirrored (``k·P + (P - t)`` in pass k), so the alive set is
    continuous at every turn: no synthetic bulk preemption or arrival is invented at a
    loop boundary, and event rates stay those of the trace (the initial ``t = 0``
    population is set up once). ``period_s`` (default: the last event's time + 600 s, so
    the trace's last change is undone 20 minutes later, not at the same instant) is the
    length P of one pass. For simulations longer than the trace
    (the 12-hour Bamboo trace vs a multi-day job). ``events`` must be time-sorted.

    Raises:
        ValueError: empty trace or ``period_s`` not after the last event.
    """
    if not events:
        raise ValueError("cannot extend an empty trace")
    period = float(period_s if period_s is not None else events[-1].t_s + 600.0)
    if period <= 0 or period < events[-1].t_s:
        raise ValueError(f"period_s must be > 0 and >= the last event's time ({events[-1].t_s}s), got {period}")
    flip = {"add": "remove", "remove": "add"}
    out: list[TraceEvent] = []
    k = 0
    while k * period < until_s:
        base = k * period
        if k % 2 == 0:
            out.extend(TraceEvent(base + ev.t_s, ev.action, ev.node) for ev in events if k == 0 or ev.t_s > 0)
        else:
            out.extend(
                TraceEvent(base + period - ev.t_s, flip[ev.action], ev.node) for ev in reversed(events) if ev.t_s > 0
            )
        k += 1
    return [ev for ev in out if ev.t_s < until_s]


def alive_counts(events: Sequence[TraceEvent]) -> list[tuple[float, int]]:
    """Step function of the alive-node count: ``(t, count after all events at t)``.

    One entry per distinct timestamp (events sharing a time are collapsed);
    the count is 0 before the first entry. ``events`` must be time-sorted.
    """
    steps: list[tuple[float, int]] = []
    alive: set[str] = set()
    for ev in events:
        if ev.action == "add":
            alive.add(ev.node)
        else:
            alive.discard(ev.node)
        if steps and steps[-1][0] == ev.t_s:
            steps[-1] = (ev.t_s, len(alive))
        else:
            steps.append((ev.t_s, len(alive)))
    return steps


def alive_at(events: Sequence[TraceEvent], t_s: float) -> int:
    """Alive-node count at ``t_s`` (all events with ``t <= t_s`` applied)."""
    count = 0
    for t, c in alive_counts(events):
        if t > t_s:
            break
        count = c
    return count


# ---------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------


class TracePlacement:
    """Maps trace nodes (each = one spot GPU) onto local capacity: ``num_agents x gpus_per_agent`` slots.

    Each arrival that gets a GPU is placed on a random agent (uniform over the
    agents that have a free slot, ``random.Random(seed)``), on that agent's
    lowest free slot (paper §3.1 / §6.1: the trace has no placement, so
    arrivals are spread uniformly at random over the spot nodes). A node keeps
    its slot until the trace removes it, so every local GPU lives exactly as
    long as a real trace node did. Removing a placed node frees its slot:
    ``revoke_gpu`` if its agent keeps other GPUs, ``preempt_node`` if it was the
    agent's last GPU. An arrival on an agent with no live GPUs is
    ``start_node``, otherwise ``add_gpu``.

    The trace has up to 32 alive nodes, local clusters usually far fewer
    slots. Two ways to fit it (both available, chosen per instance):

    * ``scale_to_capacity=False`` (default) -- *capped*: an arrival gets a slot
      if one is free, otherwise it is ``unplaced`` (counted in :attr:`stats`)
      and its later removal is ignored; there is no back-fill. This is a spot
      request capped at ``capacity`` GPUs: every emitted event is a real trace
      event with its real timing, including bulk preemptions, and each local
      GPU's lifetime is a real node lifetime. The default because it invents
      nothing; the cost is that while the trace is above capacity the local
      pool only shrinks with the placed nodes' removals and refills only on
      new arrivals, so the local alive count tracks the trace's shape loosely.
    * ``scale_to_capacity=True`` -- *proportional*: after every timestamp's
      events the number of local GPUs is set to
      ``round(alive * min(1, capacity / max_alive))`` (half up), where
      ``max_alive`` is the peak of the planned events. Removals of placed
      nodes are mirrored first; then surplus GPUs are revoked at random, or
      missing ones added, labelled by that timestamp's arrivals first and then
      by random alive-but-unplaced nodes (back-fill). Follows the aggregate
      availability curve (the Fig. 4 "available GPUs" line) at the price of
      synthetic revocations / back-fills that the trace does not contain.

    * ``full=True`` -- *the paper's replay* (§3.1 Fig. 4, §6.1): the whole trace
      at its own GPU count, nothing scaled or dropped. The local capacity must
      hold the trace's peak (:meth:`plan` raises :class:`ValueError` saying how
      many agents it needs). A trace records when a GPU leaves, not where, so
      each removal hits a random agent among those with live GPUs (uniform, the
      seeded RNG) and frees one of its GPUs at random; each arrival goes to a
      random agent with a free slot, as in the other modes. The local alive
      count equals the trace's at every instant.

    :meth:`plan` is deterministic for a seed (each call starts a fresh
    ``random.Random(seed)``) and returns actions sorted by time.
    """

    def __init__(
        self, num_agents: int, gpus_per_agent: int, seed: int, *, scale_to_capacity: bool = False, full: bool = False
    ) -> None:
        if num_agents < 1:
            raise ValueError(f"num_agents must be >= 1, got {num_agents}")
        if gpus_per_agent < 1:
            raise ValueError(f"gpus_per_agent must be >= 1, got {gpus_per_agent}")
        self.num_agents = num_agents
        self.gpus_per_agent = gpus_per_agent
        self.seed = seed
        if full and scale_to_capacity:
            raise ValueError("full replays the trace unscaled: it excludes scale_to_capacity")
        self.scale_to_capacity = scale_to_capacity
        self.full = full
        self._stats: dict | None = None

    @property
    def capacity(self) -> int:
        return self.num_agents * self.gpus_per_agent

    @property
    def stats(self) -> dict:
        """Summary of the last :meth:`plan` call.

        ``placed`` / ``unplaced``: distinct trace nodes that did / never did get
        a slot; ``scaled_down``: placed nodes revoked by proportional scaling
        while still alive in the trace (0 when capped); ``max_alive``: trace
        peak; ``max_local_alive``: local peak; ``kinds``: action counts per
        kind; ``fragmentation`` (time-weighted mean fragmented/live ratio at
        ``sp_degree = 2``), ``fragmented_gpu_time_share`` and
        ``time_any_fragmented`` (see :func:`fragmentation_summary`) over
        ``[0, horizon_s]``; ``mode``: ``"capped"`` or ``"proportional"``.
        """
        if self._stats is None:
            raise RuntimeError("TracePlacement.stats is available after plan()")
        return dict(self._stats)

    # -- planning -----------------------------------------------------------

    def plan(
        self, events: Sequence[TraceEvent], *, time_scale: float = 1.0, end_s: float | None = None
    ) -> list[ReplayAction]:
        """Turn time-sorted ``events`` into local actions; action ``t_s = event.t_s / time_scale``.

        ``end_s`` (trace seconds, before scaling; default: the last event's
        time) only sets the horizon for the fragmentation numbers in
        :attr:`stats`. Raises :class:`ValueError` for an ``add`` of a node that
        is alive or a ``remove`` of one that is not.
        """
        if not time_scale > 0 or math.isinf(time_scale):
            raise ValueError(f"time_scale must be a positive finite number, got {time_scale}")
        self._rng = random.Random(self.seed)
        self._slots: list[list[str | None]] = [[None] * self.gpus_per_agent for _ in range(self.num_agents)]
        # agents with a free GPU and with a live one, in index order (kept as the slots change,
        # so placing or removing one GPU costs no scan of every agent at 100 000 nodes)
        self._free_agents: list[int] = list(range(self.num_agents)) if self.gpus_per_agent else []
        self._busy_agents: list[int] = []
        self._where: dict[str, tuple[int, int]] = {}
        self._actions: list[ReplayAction] = []
        self._scale = time_scale
        self._ever_placed: set[str] = set()
        self._scaled_down = 0

        trace_alive: dict[str, None] = {}
        seen: dict[str, None] = {}
        max_alive = 0
        for ev in events:  # validate and find the peak first
            if ev.action == "add":
                if ev.node in trace_alive:
                    raise ValueError(f"t={ev.t_s}s: 'add' of node {_excerpt(ev.node)} that is already alive")
                trace_alive[ev.node] = None
                seen[ev.node] = None
            elif ev.action == "remove":
                if ev.node not in trace_alive:
                    raise ValueError(f"t={ev.t_s}s: 'remove' of node {_excerpt(ev.node)} that is not alive")
                del trace_alive[ev.node]
            else:
                raise ValueError(f"t={ev.t_s}s: unknown action {_excerpt(ev.action)}")
            max_alive = max(max_alive, len(trace_alive))
        if any(b.t_s < a.t_s for a, b in zip(events, events[1:])):
            raise ValueError("events must be sorted by time")

        if self.full:
            if max_alive > self.capacity:
                need = -(-max_alive // self.gpus_per_agent)
                raise ValueError(
                    f"the whole trace peaks at {plural(max_alive, 'alive GPU')} but {plural(self.num_agents, 'agent')} "
                    f"x {plural(self.gpus_per_agent, 'GPU')} hold "
                    f"{self.capacity}: a full replay needs at least {plural(need, 'agent')} of "
                    f"{plural(self.gpus_per_agent, 'GPU')} (or slice the trace)"
                )
            self._plan_full(events)
        elif self.scale_to_capacity:
            self._plan_proportional(events, max_alive)
        else:
            self._plan_capped(events)

        actions = self._actions
        horizon = (end_s if end_s is not None else (events[-1].t_s if events else 0.0)) / time_scale
        summary = fragmentation_summary(actions, 2, end_s=horizon)
        self._stats = {
            "mode": "full" if self.full else "proportional" if self.scale_to_capacity else "capped",
            "placed": len(self._ever_placed),
            "unplaced": len(seen) - len(self._ever_placed),
            "scaled_down": self._scaled_down,
            "max_alive": max_alive,
            "max_local_alive": max((n for _, n, _ in fragmentation_timeline(actions, 2)), default=0),
            "kinds": count_kinds(actions),
            "horizon_s": horizon,
            "fragmentation": summary["mean_ratio"],
            "fragmented_gpu_time_share": summary["gpu_time_share"],
            "time_any_fragmented": summary["time_any_fragmented"],
        }
        return list(actions)

    def _place(self, t_s: float, node: str) -> bool:
        if not self._free_agents:
            return False
        agent = self._rng.choice(self._free_agents)
        slots = self._slots[agent]
        had = sum(s is not None for s in slots)
        gpu = slots.index(None)
        slots[gpu] = node
        if None not in slots:
            del self._free_agents[bisect.bisect_left(self._free_agents, agent)]
        if not had:
            bisect.insort(self._busy_agents, agent)
        self._where[node] = (agent, gpu)
        self._ever_placed.add(node)
        kind: ActionKind = "add_gpu" if had else "start_node"
        self._actions.append(ReplayAction(t_s / self._scale, kind, agent, gpu, node))
        return True

    def _free(self, t_s: float, node: str) -> None:
        agent, gpu = self._where.pop(node)
        slots = self._slots[agent]
        if None not in slots:
            bisect.insort(self._free_agents, agent)
        slots[gpu] = None
        left = sum(s is not None for s in slots)
        if not left:
            del self._busy_agents[bisect.bisect_left(self._busy_agents, agent)]
        kind: ActionKind = "revoke_gpu" if left else "preempt_node"
        self._actions.append(ReplayAction(t_s / self._scale, kind, agent, gpu, node))

    def _plan_capped(self, events: Sequence[TraceEvent]) -> None:
        for ev in events:
            if ev.action == "add":
                self._place(ev.t_s, ev.node)  # False -> unplaced (counted via _ever_placed)
            elif ev.node in self._where:
                self._free(ev.t_s, ev.node)
            # else: removal of an unplaced node -> nothing happens locally

    def _plan_full(self, events: Sequence[TraceEvent]) -> None:
        """Local GPUs are interchangeable here: a removal frees a random live GPU, labelled
        (``trace_node``) by the arrival that brought it, whichever trace node left."""
        for ev in events:
            if ev.action == "add":
                label, k = ev.node, 1
                while label in self._where:  # that name still labels a live GPU (an earlier removal hit another one)
                    label, k = f"{ev.node}#{k}", k + 1
                placed = self._place(ev.t_s, label)
                assert placed, "capacity was checked against the peak"
                self._ever_placed.discard(label)
                self._ever_placed.add(ev.node)
                continue
            agent = self._rng.choice(self._busy_agents)  # the trace does not say where: a random node with live GPUs
            victim = self._rng.choice([x for x in self._slots[agent] if x is not None])
            self._free(ev.t_s, victim)

    def _plan_proportional(self, events: Sequence[TraceEvent], max_alive: int) -> None:
        ratio = min(1.0, self.capacity / max_alive) if max_alive else 1.0
        trace_alive: dict[str, None] = {}
        i = 0
        while i < len(events):
            t = events[i].t_s
            group = []
            while i < len(events) and events[i].t_s == t:
                group.append(events[i])
                i += 1
            arrivals: list[str] = []
            for ev in group:  # mirror removals of placed nodes, in trace order
                if ev.action == "add":
                    trace_alive[ev.node] = None
                    arrivals.append(ev.node)
                else:
                    del trace_alive[ev.node]
                    if ev.node in arrivals:
                        arrivals.remove(ev.node)
                    if ev.node in self._where:
                        self._free(t, ev.node)
            target = min(self.capacity, math.floor(len(trace_alive) * ratio + 0.5))
            while len(self._where) > target:  # scale down: random placed GPU
                victim = self._rng.choice(sorted(self._where))
                self._free(t, victim)
                self._scaled_down += 1
            while len(self._where) < target:  # scale up: this timestamp's arrivals, then back-fill
                fresh = [n for n in arrivals if n not in self._where]
                if fresh:
                    node = fresh[0]
                else:
                    waiting = [n for n in trace_alive if n not in self._where]
                    node = self._rng.choice(waiting)
                if not self._place(t, node):  # cannot happen: target <= capacity
                    break


def count_kinds(actions: Iterable[ReplayAction]) -> dict[str, int]:
    """Number of actions of each kind (every kind present, zeros included)."""
    c = Counter(a.kind for a in actions)
    return {k: c.get(k, 0) for k in ACTION_KINDS}


# ---------------------------------------------------------------------------
# Fragmentation (paper §3.1, Fig. 4)
# ---------------------------------------------------------------------------


def fragmentation_timeline(actions: Sequence[ReplayAction], sp_degree: int) -> list[tuple[float, int, int]]:
    """``(t, live GPUs, fragmented GPUs)`` after all actions at each distinct ``t``.

    An agent with ``n`` live GPUs contributes ``n % sp_degree`` fragmented
    GPUs: they cannot form a complete SP group on that node (paper §3.1; for
    ``sp_degree = 2`` these are the lone GPUs on agents with an odd count).
    Actions are taken in time order (stable); a loss on an agent with no live
    GPU raises :class:`ValueError`.
    """
    if sp_degree < 1:
        raise ValueError(f"sp_degree must be >= 1, got {sp_degree}")
    per_agent: Counter[int] = Counter()
    out: list[tuple[float, int, int]] = []
    live = frag = 0  # kept as each action changes one agent's count (no sum over every agent)
    for a in sorted(actions, key=lambda x: x.t_s):
        n = per_agent[a.agent]
        if a.kind in _GAINS:
            per_agent[a.agent] = n + 1
        elif a.kind in _LOSSES:
            if n <= 0:
                raise ValueError(f"t={a.t_s}s: {a.kind} on agent {a.agent} which has no live GPU")
            per_agent[a.agent] = n - 1
        else:
            raise ValueError(f"unknown action kind {a.kind!r}")
        live += per_agent[a.agent] - n
        frag += per_agent[a.agent] % sp_degree - n % sp_degree
        if out and out[-1][0] == a.t_s:
            out[-1] = (a.t_s, live, frag)
        else:
            out.append((a.t_s, live, frag))
    return out


def fragmentation_summary(
    actions: Sequence[ReplayAction], sp_degree: int, *, end_s: float | None = None
) -> dict[str, float]:
    """Time-weighted fragmentation over ``[0, end_s]`` (default ``end_s``: last action).

    * ``mean_ratio`` -- time-weighted mean of ``fragmented / live`` over the
      time with at least one live GPU (the mean of Fig. 4-right's CDF);
    * ``gpu_time_share`` -- fragmented GPU-seconds / live GPU-seconds;
    * ``time_any_fragmented`` -- share of ``[0, end_s]`` with >= 1 fragmented GPU;
    * ``live_time`` -- seconds with at least one live GPU.

    All are 0.0 when there is no live GPU-time.
    """
    steps = fragmentation_timeline(actions, sp_degree)
    if end_s is None:
        end_s = steps[-1][0] if steps else 0.0
    ratio_s = live_s = live_gpu_s = frag_gpu_s = any_frag_s = 0.0
    for k, (t, live, frag) in enumerate(steps):
        t_next = steps[k + 1][0] if k + 1 < len(steps) else end_s
        dt = max(0.0, min(t_next, end_s) - max(t, 0.0))
        if dt <= 0 or live == 0:
            continue
        live_s += dt
        ratio_s += dt * frag / live
        live_gpu_s += dt * live
        frag_gpu_s += dt * frag
        if frag:
            any_frag_s += dt
    return {
        "mean_ratio": ratio_s / live_s if live_s else 0.0,
        "gpu_time_share": frag_gpu_s / live_gpu_s if live_gpu_s else 0.0,
        "time_any_fragmented": any_frag_s / end_s if end_s > 0 else 0.0,
        "live_time": live_s,
    }


def fragmentation(actions: Sequence[ReplayAction], sp_degree: int, *, end_s: float | None = None) -> float:
    """Fig. 4 metric: time-weighted mean share of live GPUs that are fragmented.

    A GPU is fragmented when its agent cannot host a complete SP group with it
    (``n % sp_degree`` of an agent's ``n`` live GPUs). Averaged over the time in
    ``[0, end_s]`` with at least one live GPU; see :func:`fragmentation_summary`.
    """
    return fragmentation_summary(actions, sp_degree, end_s=end_s)["mean_ratio"]


# ---------------------------------------------------------------------------
# Replay cursor
# ---------------------------------------------------------------------------


class TraceReplayer:
    """Stateful cursor for a driver loop over planned actions.

    ``due(now_s)`` returns, in time order, the not-yet-returned actions with
    ``t_s <= now_s - start_s``; each action is returned exactly once. Times are
    whatever clock the caller uses (pass the same clock for ``start_s`` and
    ``now_s``); the replayer reads none itself.
    """

    def __init__(self, actions: Sequence[ReplayAction], start_s: float = 0.0) -> None:
        self._actions = sorted(actions, key=lambda a: a.t_s)  # stable
        self.start_s = start_s
        self._next = 0

    def due(self, now_s: float) -> list[ReplayAction]:
        elapsed = now_s - self.start_s
        i = self._next
        while i < len(self._actions) and self._actions[i].t_s <= elapsed:
            i += 1
        out = self._actions[self._next : i]
        self._next = i
        return out

    @property
    def next_due_s(self) -> float | None:
        """Caller-clock time at which the next action falls due; ``None`` when done."""
        if self._next >= len(self._actions):
            return None
        return self.start_s + self._actions[self._next].t_s

    @property
    def remaining(self) -> int:
        return len(self._actions) - self._next

    @property
    def done(self) -> bool:
        return self._next >= len(self._actions)
