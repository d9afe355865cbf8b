"""Who may register a node id (InstanceManager.claim): the same agent process reconnecting, a
new process once the holder is silent past the heartbeat timeout, never a second live one."""

from __future__ import annotations

from spotlight.core.instance_manager import InstanceManager


def _held(timeout_s: float = 10.0) -> InstanceManager:
    im = InstanceManager(heartbeat_timeout_s=timeout_s)
    im.register("spot-0", "s1", [0], True, now=100.0, instance_id="aaaa")
    im.heartbeat("spot-0", now=105.0)
    return im


def test_free_or_dead_node_id_is_new():
    im = InstanceManager(heartbeat_timeout_s=10.0)
    assert im.claim("spot-0", "bbbb", now=1.0).decision == "new"
    im = _held()
    im.goodbye("spot-0", now=106.0, reason="exit")
    assert im.claim("spot-0", "bbbb", now=106.5).decision == "new"


def test_same_instance_reconnecting_is_accepted():
    im = _held()
    c = im.claim("spot-0", "aaaa", now=106.0)
    assert c.accepted and c.decision == "same"


def test_other_instance_while_holder_is_alive_is_refused():
    im = _held()
    c = im.claim("spot-0", "bbbb", now=107.0)
    assert not c.accepted and c.decision == "in_use"
    assert c.holder_instance == "aaaa" and c.alive_since == 100.0 and c.silent_s == 2.0
    assert c.retry_after_s == 8.0  # the holder must stay silent 8 s more before the id is free
    # at exactly the timeout the holder still counts as alive (reap uses the same bound)
    assert im.claim("spot-0", "bbbb", now=115.0).decision == "in_use"
    # claim changes nothing: the holder keeps its session
    assert im.session_ok("spot-0", "s1")


def test_other_instance_after_holder_timed_out_is_accepted():
    im = _held()
    c = im.claim("spot-0", "bbbb", now=115.5)  # silent 10.5 s > 10 s
    assert c.accepted and c.decision == "replaces_silent" and c.silent_s == 10.5
    im.register("spot-0", "s2", [0], True, now=115.5, instance_id="bbbb")
    assert im.nodes["spot-0"].instance_id == "bbbb" and im.session_ok("spot-0", "s2")
    # now the old process is the one refused if it comes back while the new one is alive
    assert im.claim("spot-0", "aaaa", now=116.0).decision == "in_use"


def test_agents_without_instance_id_reregister_as_before():
    im = _held()
    assert im.claim("spot-0", "", now=106.0).decision == "same"
    im2 = InstanceManager(heartbeat_timeout_s=10.0)
    im2.register("spot-0", "s1", [0], True, now=100.0)
    assert im2.claim("spot-0", "bbbb", now=101.0).decision == "same"
