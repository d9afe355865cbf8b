"""Whether the pid a run's ``coordinator.json`` names is still that run's coordinator (torch-free).

``spotlight status`` asks it to tell a running run from a stopped one, and ``spotlight up
--resume`` to refuse a run whose coordinator still runs (README, "If the coordinator dies").
A pid in the file is only a number: after the coordinator exits (or the machine reboots)
another process may get it, and a hand-edited or copied file may name any process. A live
process counts as the coordinator only if it started before ``coordinator.json`` was written
(the coordinator writes it once it listens: a process that started later is another one), it
is not a zombie, and its command line mentions ``spotlight`` (or it is the asking process
itself: a coordinator run inside the caller, as tests do).

:func:`coordinator_verdict` decides from what is known of the process (pure);
:func:`process_facts` reads that from ``psutil`` and :func:`coordinator_not_running` puts the
two together for a run directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Optional

START_SLACK_S = 10.0
"""How much later than its ``coordinator.json`` a process may seem to have started and still be
the coordinator that wrote it (the file's time and a process's start time come from clocks read
differently: whole-second boot time, clock adjustments)."""

MARKER = "spotlight"
"""What a coordinator's command line holds (``spotlight up``, ``python -m spotlight…``)."""


def started_after(started_unix_s: Optional[float], written_unix_s: Optional[float]) -> bool:
    """Whether a process that started at ``started_unix_s`` started after a file written at
    ``written_unix_s`` (beyond :data:`START_SLACK_S`), and so is not the process the file names
    (False when either time is unknown: the check cannot be made). Pure."""
    if started_unix_s is None or written_unix_s is None:
        return False
    return started_unix_s > written_unix_s + START_SLACK_S


@dataclasses.dataclass(frozen=True)
class ProcessFacts:
    """What could be read of a live process; None where it could not (another user's process,
    no such information on this platform): that check is then skipped."""

    name: str = "?"
    zombie: Optional[bool] = None
    started_unix_s: Optional[float] = None
    cmdline: Optional[str] = None


def coordinator_verdict(
    pid, facts: Optional[ProcessFacts], written_unix_s: Optional[float], own_pid: int
) -> Optional[str]:
    """None when ``pid`` is the run's coordinator, still running; else why not, in words (""
    when the process has simply ended). Pure.

    Args:
        pid: the ``pid`` value of ``coordinator.json`` as read (any JSON value, or None).
        facts: the process with that pid (:func:`process_facts`), None when there is none.
        written_unix_s: when ``coordinator.json`` was written (its mtime), None if unknown.
        own_pid: the asking process's pid: it counts as the coordinator without the
            command-line check (a coordinator run inside the caller).
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return "coordinator.json names no pid" if pid is None else f"coordinator.json's pid {json.dumps(pid)} is no pid"
    if facts is None or facts.zombie:
        return ""
    if started_after(facts.started_unix_s, written_unix_s):
        return f"pid {pid} is now another process, started after coordinator.json was written"
    if pid == own_pid:
        return None
    if facts.cmdline is not None and MARKER not in facts.cmdline:
        return f"pid {pid} is now {facts.name}, not a Spotlight coordinator"
    return None


def process_facts(pid: int) -> Optional[ProcessFacts]:
    """What ``psutil`` tells of process ``pid`` (:class:`ProcessFacts`), None when there is no
    such process (or it ended while being read)."""
    import psutil

    try:
        proc = psutil.Process(pid)
    except (psutil.Error, ValueError, OverflowError):
        return None
    got = {}
    for key, read in (
        ("zombie", lambda: proc.status() == psutil.STATUS_ZOMBIE),
        ("started_unix_s", proc.create_time),
        ("cmdline", lambda: " ".join(proc.cmdline())),
        ("name", proc.name),
    ):
        try:
            got[key] = read()
        except psutil.NoSuchProcess:
            return None
        except psutil.Error:
            pass  # AccessDenied, ZombieProcess on some platforms: that check is skipped
    return ProcessFacts(**got)


def file_pid(run_dir: pathlib.Path):
    """The ``pid`` value of ``run_dir/coordinator.json`` as written (any JSON value), read even
    when the rest of the file is wrong; None when there is no such file, it is not a JSON
    object, or it names no pid."""
    try:
        info = json.loads((pathlib.Path(run_dir) / "coordinator.json").read_text())
    except (OSError, ValueError):
        return None
    return info.get("pid") if isinstance(info, dict) else None


def coordinator_not_running(run_dir: Optional[pathlib.Path], pid) -> Optional[str]:
    """:func:`coordinator_verdict` of ``pid`` (from ``run_dir/coordinator.json``; ``run_dir``
    None: the file's time is unknown, and that check is skipped) as this process sees it."""
    try:
        written = (pathlib.Path(run_dir) / "coordinator.json").stat().st_mtime if run_dir is not None else None
    except OSError:
        written = None
    valid = not isinstance(pid, bool) and isinstance(pid, int) and pid > 0
    return coordinator_verdict(pid, process_facts(pid) if valid else None, written, os.getpid())
