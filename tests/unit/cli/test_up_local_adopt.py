"""A resumed ``spotlight up --local`` adopts the agents of the crashed coordinator that still
run, and only those: a pid in ``local_agents.json`` is only a number, so a live ``agent.main``
process that started after the listing was written (another run's agent that got the pid) is not
adopted, and a malformed entry is skipped, never a traceback."""

from __future__ import annotations

import pytest

from spotlight.cli.up_local import _adopt
from tests.fakes import marked_sleeper

pytestmark = pytest.mark.procs


@pytest.fixture
def agent_sleeper():
    """A live process whose command line holds ``agent.main``, as a local agent's does; and its start time."""
    with marked_sleeper("agent.main") as sleeper:
        yield sleeper


def test_an_agent_started_before_the_listing_is_adopted(agent_sleeper):
    pid, started = agent_sleeper
    p = _adopt({"pid": pid, "spot": True, "gpus": [0]}, started + 1)
    assert p is not None and p.pid == pid


def test_a_process_that_took_the_pid_after_the_listing_is_not_adopted(agent_sleeper):
    pid, started = agent_sleeper
    assert _adopt({"pid": pid, "spot": True, "gpus": [0]}, started - 3600) is None


@pytest.mark.parametrize("pid", ["12", True, -3, 0, None, 1.5, [1]])
def test_a_malformed_pid_is_skipped(pid):
    assert _adopt({"pid": pid, "spot": True, "gpus": [0]}, None) is None


def test_an_agent_with_a_mock_cloud_is_not_adopted(agent_sleeper):
    pid, started = agent_sleeper
    assert _adopt({"pid": pid, "cloud": "http://127.0.0.1:1"}, started + 1) is None
