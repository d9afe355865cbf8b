"""Which published weight versions the Tensor Store may delete (``run.keep_weight_versions``).

Pure: the shell (``coordinator/trainer_group.py``) lists the versions on disk and the ones
still needed, and deletes what :func:`versions_to_delete` returns (docs/planning.md, "Disk").
"""

from __future__ import annotations

from collections.abc import Iterable


def versions_to_delete(on_disk: Iterable[int], *, newest: int, keep: int, needed: Iterable[int] = ()) -> list[int]:
    """Versions of ``on_disk`` older than the newest ``keep`` (counted back from ``newest``, the
    version just published) that nothing in ``needed`` still uses -- a version a live worker
    holds, an unfinished request must run with, or the last run checkpoint names. ``keep = 0``
    keeps every version. Ascending."""
    if keep <= 0:
        return []
    floor = newest - keep + 1
    needed = set(needed)
    return sorted(v for v in set(on_disk) if v < floor and v not in needed)
