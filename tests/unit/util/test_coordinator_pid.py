"""Whether a run's ``coordinator.json`` pid is still its coordinator: the one decision that
``spotlight status`` and ``spotlight up --resume`` share (:mod:`spotlight.util.coordinator_pid`)."""

from __future__ import annotations

import os
import time

import pytest

from spotlight.util.coordinator_pid import (
    START_SLACK_S,
    ProcessFacts,
    coordinator_not_running,
    coordinator_verdict,
    process_facts,
)

WRITTEN = 1.7e9  # when coordinator.json was written
OWN = 4242  # the asking process
COORD = ProcessFacts(name="spotlight", zombie=False, started_unix_s=WRITTEN - 5, cmdline="python -m spotlight up")
DEAD_PID = 2**22 + 12345  # beyond pid_max on Linux: a process that cannot exist


def test_a_spotlight_process_started_before_the_file_is_the_coordinator():
    assert coordinator_verdict(77, COORD, WRITTEN, OWN) is None
    # the file's time and the start time come from clocks read differently: a little later is fine
    later = ProcessFacts(zombie=False, started_unix_s=WRITTEN + START_SLACK_S - 1, cmdline="spotlight up")
    assert coordinator_verdict(77, later, WRITTEN, OWN) is None


@pytest.mark.parametrize(
    "pid, said",
    [
        (None, "coordinator.json names no pid"),
        ("77", 'coordinator.json\'s pid "77" is no pid'),
        (True, "coordinator.json's pid true is no pid"),
        (0, "coordinator.json's pid 0 is no pid"),
        (-3, "coordinator.json's pid -3 is no pid"),
        (7.5, "coordinator.json's pid 7.5 is no pid"),
    ],
)
def test_what_is_no_pid_is_no_coordinator(pid, said):
    assert coordinator_verdict(pid, COORD, WRITTEN, OWN) == said


def test_an_ended_process_or_a_zombie_has_simply_ended():
    assert coordinator_verdict(77, None, WRITTEN, OWN) == ""
    assert coordinator_verdict(77, ProcessFacts(zombie=True, cmdline="spotlight"), WRITTEN, OWN) == ""


def test_a_process_started_after_the_file_was_written_took_a_reused_pid():
    """As after a reboot, or a coordinator that exited long ago: its command line mentioning
    spotlight (another run's coordinator, a shell in a spotlight checkout) does not make it this
    run's coordinator; nor does being the asking process."""
    reused = ProcessFacts(zombie=False, started_unix_s=WRITTEN + START_SLACK_S + 1, cmdline="spotlight up")
    said = "pid 77 is now another process, started after coordinator.json was written"
    assert coordinator_verdict(77, reused, WRITTEN, OWN) == said
    assert coordinator_verdict(OWN, reused, WRITTEN, OWN) == said.replace("77", str(OWN))


def test_a_process_that_is_not_spotlight_is_no_coordinator_unless_it_asks():
    sleeper = ProcessFacts(name="sleep", zombie=False, started_unix_s=WRITTEN - 60, cmdline="sleep 600")
    assert coordinator_verdict(77, sleeper, WRITTEN, OWN) == "pid 77 is now sleep, not a Spotlight coordinator"
    assert coordinator_verdict(OWN, sleeper, WRITTEN, OWN) is None  # a coordinator run inside the caller


def test_a_check_that_cannot_be_made_is_skipped():
    """Another user's process, a platform without the information, a file whose time is unknown:
    the process counts as running, as a bare pid did."""
    unknown = ProcessFacts()
    assert coordinator_verdict(77, unknown, WRITTEN, OWN) is None
    late = ProcessFacts(zombie=False, started_unix_s=WRITTEN + 3600, cmdline="spotlight up")
    assert coordinator_verdict(77, late, None, OWN) is None


def test_process_facts_reads_a_live_process_and_none_for_a_dead_pid(tmp_path):
    me = process_facts(os.getpid())
    assert me is not None and me.zombie is False and me.cmdline and me.name
    assert me.started_unix_s is not None and me.started_unix_s <= time.time()
    assert process_facts(DEAD_PID) is None
    assert coordinator_not_running(tmp_path, DEAD_PID) == ""
    assert coordinator_not_running(None, os.getpid()) is None  # no file: no time to check
    (tmp_path / "coordinator.json").write_text("{}")
    old = me.started_unix_s - 3600
    os.utime(tmp_path / "coordinator.json", (old, old))
    assert "started after coordinator.json was written" in coordinator_not_running(tmp_path, os.getpid())
