"""The trace driver's pacing (spotlight/traces/driver.py): an action on a node that has not
registered yet waits for it, and the agent's later actions keep their order behind it."""

from __future__ import annotations

from spotlight.traces.driver import TraceDriver
from spotlight.traces.formats import ReplayAction


class RecordingDriver(TraceDriver):
    """The real pacing logic; ``apply`` records instead of starting processes."""

    def apply(self, action) -> None:
        if action.kind == "start_node":
            self.node_of_agent[action.agent] = self._node_id(action.agent)
            self.restarts[action.agent] = self.restarts.get(action.agent, 0) + 1
        elif action.kind == "preempt_node":
            self.node_of_agent.pop(action.agent, None)
        self.applied.append({"t_s": action.t_s, "kind": action.kind, "agent": action.agent})


def _driver(tmp_path, actions, registered):
    listing = {"agents": {}}
    return RecordingDriver(
        actions,
        coordinator="tcp://127.0.0.1:1",
        keys_dir=tmp_path,
        cloud="aws",
        grace_s=5.0,
        listing=listing,
        listing_path=tmp_path / "local_agents.json",
        node_ready=lambda node: node in registered,
    )


def test_actions_wait_for_their_agent_to_register_and_keep_their_order(tmp_path):
    a = [
        ReplayAction(0.0, "start_node", 0, 0, "n0"),
        ReplayAction(0.0, "start_node", 1, 0, "n1"),
        ReplayAction(2.0, "add_gpu", 0, 1, "n2"),
        ReplayAction(3.0, "revoke_gpu", 1, 0, "n1"),
        ReplayAction(4.0, "preempt_node", 0, 0, "n0"),
        ReplayAction(5.0, "start_node", 0, 0, "n3"),
    ]
    registered: set[str] = {"spot-1"}
    d = _driver(tmp_path, a, registered)
    d.step(10.0)  # everything is due; spot-0 has not registered: its actions wait, spot-1's do not
    assert [(x["kind"], x["agent"]) for x in d.applied] == [("start_node", 0), ("start_node", 1), ("revoke_gpu", 1)]
    assert not d.done
    registered.add("spot-0")
    d.step(11.0)
    # spot-0's held actions in trace order; the restart (spot-0-r1) needs no registration to start
    assert [(x["kind"], x["agent"]) for x in d.applied[3:]] == [("add_gpu", 0), ("preempt_node", 0), ("start_node", 0)]
    assert d.done and d.node_of_agent[0] == "spot-0-r1"


def test_without_node_ready_every_due_action_applies_at_once(tmp_path):
    a = [
        ReplayAction(0.0, "start_node", 0, 0, "n0"),
        ReplayAction(1.0, "revoke_gpu", 0, 0, "n0"),
        ReplayAction(9.0, "add_gpu", 0, 0, "n0"),
    ]
    d = _driver(tmp_path, a, set())
    d.node_ready = None
    d.step(1.0)
    assert [x["kind"] for x in d.applied] == ["start_node", "revoke_gpu"] and not d.done
    d.step(9.0)
    assert d.done
