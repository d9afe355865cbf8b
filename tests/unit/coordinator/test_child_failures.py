"""A child that fails says why where its parent reports it, and routine events are no errors.

* A child process (trainer, agent, worker) that exits non-zero is reported with its cause, the
  exception line of its log, and the last lines of that log; before, only "exited with code 1"
  reached the console while the cause stayed in ``logs/<child>.log``.
* A worker's cause travels with the leases it gives back, so the coordinator's console shows it.
* The control plane names peers by node id and key, never by ZeroMQ routing id
  (``rejected message from b'\\x00\\xe4<\\x98k' (?)`` before), a stale session's message is INFO,
  and a spot node that goes silent is INFO (a reserved one a WARNING; both were ERROR).

Real processes (:func:`spotlight.util.procs.spawn_logged`, a real Rollout Worker, a real
``spotlight-agent``) and the real control plane.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import types

import pytest
import zmq

from spotlight import protocol as P
from spotlight.util.procs import LOG_DIR_ENV, ChildExit, log_mark, spawn_logged

pytestmark = pytest.mark.procs  # real agent, worker and trainer processes that fail

NO_SPACE = "import errno, os\nraise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/runs/x/tensor_store')\n"


def _run_child(env: dict, code: str, name: str = "trainer-0"):
    mark = log_mark(name, env)
    proc = spawn_logged([sys.executable, "-c", code], name, env=env)
    proc.wait(timeout=120)
    return proc.returncode, mark


def test_a_failed_child_is_reported_with_its_exception_and_its_log(tmp_path):
    env = {"PATH": "/usr/bin:/bin", LOG_DIR_ENV: str(tmp_path / "logs")}
    (tmp_path / "logs").mkdir()
    # an earlier run's crash in the same log file is not this child's cause
    (tmp_path / "logs" / "trainer-0.log").write_text("Traceback (most recent call last):\nValueError: old\n")
    rc, mark = _run_child(env, "print('loading the model', flush=True)\n" + NO_SPACE)
    failed = ChildExit.of("train worker rank 0", rc, mark)
    assert failed.summary == (
        "train worker rank 0 exited with code 1: disk full at /runs/x/tensor_store: "
        "OSError: [Errno 28] No space left on device: '/runs/x/tensor_store'"
    )
    lines = failed.report().splitlines()
    assert lines[0] == failed.summary
    assert lines[1] == f"  last lines of {tmp_path / 'logs' / 'trainer-0.log'}:"
    assert lines[2] == "    Traceback (most recent call last):" and lines[-1].endswith(
        "No space left on device: '/runs/x/tensor_store'"
    )
    assert "old" not in failed.report() and "loading the model" not in failed.report()


def test_a_child_killed_by_a_signal_says_which(tmp_path):
    env = {"PATH": "/usr/bin:/bin", LOG_DIR_ENV: str(tmp_path / "logs")}
    rc, mark = _run_child(env, "import os, signal\nprint('step 3', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert rc == -signal.SIGKILL
    failed = ChildExit.of("train worker rank 0", rc, mark)
    assert failed.summary == "train worker rank 0 was killed by SIGKILL"
    assert failed.report().splitlines()[1:] == [f"  last lines of {mark.path}:", "    step 3"]


def test_a_child_on_the_terminal_has_no_log_tail(tmp_path):
    env = {"PATH": "/usr/bin:/bin", LOG_DIR_ENV: str(tmp_path / "logs"), "SPOTLIGHT_LOG_ECHO": "1"}
    assert log_mark("trainer-0", env) is None  # --verbose: the traceback is on the console already
    assert ChildExit.of("train worker rank 0", 1, None).report() == "train worker rank 0 exited with code 1"


# ---------------------------------------------------------------- a Rollout Worker under its agent


def test_a_crashed_workers_cause_goes_back_with_its_leases(tmp_path, monkeypatch, caplog):
    """A real Rollout Worker that cannot start (a model config it refuses) under a real agent
    daemon: the agent logs its traceback's last lines, and the FAIL that gives its leases back
    carries the exception, which the coordinator's console shows ("worker … gave back …")."""
    from agent.main import AgentDaemon
    from spotlight.net.security import add_client, init_keys, load_client_keys

    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "state"))
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "logs"))
    init_keys(tmp_path / "keys")
    add_client(tmp_path / "keys", "agent", "spot-a")
    ctx = zmq.Context.instance()
    coord = ctx.socket(zmq.ROUTER)
    coord.setsockopt(zmq.LINGER, 0)
    port = coord.bind_to_random_port("tcp://127.0.0.1")
    d = AgentDaemon(f"127.0.0.1:{port}", [0], keys=load_client_keys(tmp_path / "keys", role="agent"), node_id="crash")
    d.registered = P.Registered(
        node_id="crash",
        heartbeat_interval_s=1.0,
        lease_timeout_s=10.0,
        worker_batch_size=1,
        torch_threads=1,
        model={"family": "no-such-family"},
        sampler={},
        latest_version=0,
    )
    try:
        wid = d.spawn_worker([0])
        d.sched.leased(wid, [("r1", 7)], time.monotonic())  # it held a lease when it died
        d.procs[wid].wait(timeout=180)
        sent = []
        d._to_coord = sent.append  # what the agent tells the coordinator
        with caplog.at_level(logging.ERROR, logger="spotlight.agent"):
            d.check_workers()
    finally:
        for p in d.procs.values():  # its replacement
            p.kill()
            p.wait()
        for s in (d.coord, d.workers_sock, d.control):
            s.close(linger=0)
        coord.close()
    (fail,) = [m for m in sent if isinstance(m, P.Fail)]
    assert fail.request_ids == ["r1"] and fail.lease_ids == [7]
    assert (
        fail.reason
        == "worker exited with code 1: msgspec.ValidationError: Invalid enum value 'no-such-family' - at `$.family`"
    )
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    text = record.getMessage()
    assert text.startswith(f"worker {wid} exited with code 1: msgspec.ValidationError: Invalid enum value")
    assert "; restarting it\n  last lines of " in text and "Traceback (most recent call last):" in text


# ---------------------------------------------------------------- a local agent under `spotlight up`


def test_a_local_agent_that_fails_is_reported_once_with_its_log(tmp_path, monkeypatch):
    from spotlight.cli.up_local import LocalCluster
    from spotlight.net.security import add_client, init_keys

    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "logs"))
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "agents"))
    init_keys(tmp_path / "keys")
    add_client(tmp_path / "keys", "agent", "local")
    said = []
    run = types.SimpleNamespace(keys_dir=tmp_path / "keys")
    cluster = LocalCluster(run, types.SimpleNamespace(endpoint="127.0.0.1:9"), say=said.append)
    cluster._spawn("spot-0", [1, 1], reserved=False)  # the agent refuses a GPU listed twice
    cluster.procs[0].wait(timeout=120)
    cluster.check()
    cluster.check()
    assert len(said) == 1, said
    first, *rest = said[0].splitlines()
    assert first == (
        "[yellow]warning:[/yellow] local agent spot-0 exited with code 2: spotlight-agent: error: "
        "--gpus must list distinct non-negative indices, got '1,1' (the run goes on without it)"
    ), said[0]
    assert rest[0] == f"  last lines of {tmp_path / 'logs' / 'agent-spot-0.log'}:"


# ---------------------------------------------------------------- the control plane's log lines


class _Server:
    """The control plane's side of the sockets: replies are kept, not sent."""

    def __init__(self):
        self.sent = []
        self.describe_peer = None

    def send(self, channel, identity, msg, frames=None):
        self.sent.append((identity, msg))
        return True


@pytest.fixture
def control(tmp_path):
    from spotlight.config import load_config
    from tests.factories import control_plane

    workers = types.SimpleNamespace(worker_seen=lambda *a: None, worker_gone=lambda *a: None)
    return control_plane(tmp_path, load_config(), run=types.SimpleNamespace(), workers=workers, server=_Server())


def _inbound(identity: bytes, principal, msg):
    from spotlight.coordinator.server import PUBLIC, Inbound

    return Inbound(PUBLIC, identity, principal, P.MsgType[type(msg).__name__.upper()], msg, [])


def _register(cp, identity: bytes, principal, node_id: str, *, is_spot: bool = True) -> str:
    cp.handle(
        _inbound(
            identity,
            principal,
            P.Register(protocol_version=P.PROTOCOL_VERSION, node_id=node_id, gpus=[0], is_spot=is_spot),
        )
    )
    return cp.server.sent[-1][1].session


ROUTE = b"\x00\xe4<\x98k"


def test_a_stale_session_is_info_and_names_the_node_not_the_routing_id(control, caplog):
    from spotlight.net.security import Principal

    agent = Principal("agent", "local")
    _register(control, ROUTE, agent, "spot-0")
    hb = P.Heartbeat(node_id="spot-0", session="from-an-earlier-coordinator")
    with caplog.at_level(logging.INFO, logger="spotlight.coordinator"):
        control.handle(_inbound(b"\x00\x01\x02\x03\x04", agent, hb))  # the agent of before a restart
        control.handle(_inbound(ROUTE, agent, hb))  # its current connection, a stale session
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "rejected" in r.getMessage()]
    assert lines == [
        (
            "INFO",
            "rejected message from agent.local for node spot-0 (not registered on this connection): unknown_session: "
            "HEARTBEAT from an unregistered or stale session (node 'spot-0')",
        ),
        (
            "INFO",
            "rejected message from node spot-0 (agent.local): unknown_session: "
            "HEARTBEAT from an unregistered or stale session (node 'spot-0')",
        ),
    ]
    assert all("b'" not in text and "\\x" not in text for _, text in lines)
    assert control.server.describe_peer(ROUTE) == "node spot-0 (agent.local)"  # the server's log lines too
    forged = control.peer_name(b"x", principal=agent, claimed_node="a\nFAKE LOG LINE")
    assert forged == "agent.local for node 'a\\nFAKE LOG LINE' (not registered on this connection)"  # quoted, one line


def test_a_silent_spot_node_is_info_a_silent_reserved_node_a_warning(control, caplog):
    from spotlight.net.security import Principal

    _register(control, b"spot", Principal("agent", "local"), "spot-0")
    _register(control, b"res", Principal("reserved", "local"), "reserved-0", is_spot=False)
    with caplog.at_level(logging.INFO, logger="spotlight.coordinator"):
        control.housekeeping(time.monotonic() + 3600)
    lost = sorted((r.levelname, r.getMessage()) for r in caplog.records if "missed heartbeats" in r.getMessage())
    timeout = control.cfg.cluster.heartbeat_timeout_s
    assert lost == [
        ("INFO", f"spot node spot-0 missed heartbeats for {timeout:.0f}s: re-enqueueing its requests"),
        ("WARNING", f"reserved node reserved-0 missed heartbeats for {timeout:.0f}s: re-enqueueing its requests"),
    ]


def test_a_ranks_prefixed_traceback_is_read_like_any_other(tmp_path):
    """torch.distributed writes a rank's traceback as ``[rank0]: Traceback …`` lines."""
    log = tmp_path / "trainer-0.log"
    log.write_text(
        "12:00:00 trainer-0 INFO ready\n[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "x.py", line 1, in <module>\n[rank0]:     publish()\n'
        "[rank0]: OSError: [Errno 28] No space left on device\n"
    )
    from spotlight.util.procs import LogMark

    failed = ChildExit.of("train worker rank 0", 1, LogMark(str(log), 0))
    assert failed.summary == (
        "train worker rank 0 exited with code 1: disk full: OSError: [Errno 28] No space left on device"
    )
    assert failed.tail == (
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "    publish()",
        "OSError: [Errno 28] No space left on device",
    )


def test_a_ranks_traceback_with_its_blank_lines_keeps_the_exception(tmp_path):
    """A blank line of a rank's traceback is the bare prefix ``[rank0]:``: it used to end the
    traceback early, so the console showed ``[rank0]:`` instead of the exception."""
    log = tmp_path / "trainer-0.log"
    log.write_text(
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "<frozen runpy>", line 198, in _run_module_as_main\n'
        '[rank0]:   File "train_worker.py", line 1362, in <module>\n'
        "[rank0]:\n"
        '[rank0]:   File "train_worker.py", line 900, in train_step\n'
        "[rank0]:     loss.backward()\n"
        "[rank0]: RuntimeError: the real cause\n"
    )
    from spotlight.util.procs import LogMark

    failed = ChildExit.of("train worker rank 0", 1, LogMark(str(log), 0))
    assert failed.summary == "train worker rank 0 exited with code 1: RuntimeError: the real cause"
    assert failed.tail[-1] == "RuntimeError: the real cause" and "[rank0]:" not in failed.tail
