"""Restart reconfiguration and the live-migration switch of the agent.

A real :class:`agent.main.AgentDaemon` with real worker processes on its real ipc socket;
the worker processes are stand-ins that speak the worker protocol (hello, then wait for
STOP and record it), since a real rollout worker would need a coordinator and a model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from agent.main import AgentDaemon
from agent.node_scheduler import WorkerStatus
from spotlight import protocol as P
from spotlight.net.security import add_client, init_keys, load_client_keys

STANDIN = r"""
import json, os, sys, zmq
from spotlight import protocol as P
endpoint, wid, out = sys.argv[1:4]
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.IDENTITY, wid.encode()); s.setsockopt(zmq.LINGER, 1000)
s.connect(endpoint)
s.send_multipart(P.encode(P.WorkerHello(worker_id=wid, gpus=[0], pid=os.getpid())))
while True:
    mtype, body, _ = P.decode(s.recv_multipart())
    if mtype == P.MsgType.STOP:
        with open(out, "a") as f:
            f.write(json.dumps({"worker": wid, "commit": body.commit}) + "\n")
        sys.exit(0)
"""


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "state"))
    init_keys(tmp_path / "keys")
    add_client(tmp_path / "keys", "agent", "spot-a")
    d = AgentDaemon(
        "127.0.0.1:9", [0, 1, 2], keys=load_client_keys(tmp_path / "keys", role="agent"), node_id="n", warm_spare=False
    )
    out = tmp_path / "stops.jsonl"
    out.touch()

    def launch(worker_id, gpus, env):  # a cold start of a stand-in instead of a rollout worker
        return subprocess.Popen([sys.executable, "-c", STANDIN, d.worker_endpoint, worker_id, str(out)])

    d._launch = launch
    d.heartbeat = lambda now: None  # no coordinator here
    yield d, out
    for p in d.procs.values():
        p.kill()
        p.wait()
    for s in (d.coord, d.workers_sock, d.control):
        s.close(linger=0)


def _register(d, **kw) -> None:
    d.registered = P.Registered(
        node_id="n",
        heartbeat_interval_s=1.0,
        lease_timeout_s=10.0,
        worker_batch_size=1,
        torch_threads=1,
        model={},
        sampler={},
        latest_version=0,
        **kw,
    )


def _pump(d, until, timeout_s=60.0) -> None:
    """Run the agent's worker-socket and housekeeping steps until ``until()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "agent did not get there"
        if d.workers_sock.poll(50):
            d.on_worker(d.workers_sock.recv_multipart())
        d.check_workers()


def _ready(d) -> set[str]:
    return {s.worker_id for s in d.sched.workers.values() if s.status == WorkerStatus.READY}


def _stops(out) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_restart_reconfiguration_stops_every_worker_and_starts_fresh_ones(daemon):
    d, out = daemon
    _register(d, reconfiguration="restart", live_migration=False)
    d.start_workers()
    _pump(d, lambda: len(_ready(d)) == 3)
    first = set(_ready(d))
    d.revoke_gpus([1], grace_s=30.0)
    # every worker of the node stops (not only GPU 1's), giving its work back (no live migration)
    _pump(d, lambda: len(_ready(d)) == 2 and not (_ready(d) & first))
    assert sorted(s["worker"] for s in _stops(out)) == sorted(first)
    assert all(s["commit"] is False for s in _stops(out))
    assert sorted(tuple(d.sched.workers[w].gpus) for w in _ready(d)) == [(0,), (2,)]
    assert d.gpus == [0, 2] and d.restarts == 1
    second = set(_ready(d))
    d.add_gpus([1])  # an addition restarts the node too
    _pump(d, lambda: len(_ready(d)) == 3 and not (_ready(d) & second))
    assert d.restarts == 2 and len(_stops(out)) == 5


def test_elastic_revocation_stops_only_the_revoked_worker_and_commits(daemon):
    d, out = daemon
    _register(d)  # defaults: elastic, live migration on
    d.start_workers()
    _pump(d, lambda: len(_ready(d)) == 3)
    d.revoke_gpus([1], grace_s=30.0)
    _pump(d, lambda: len(_stops(out)) == 1 and len(d.procs) == 2)
    assert _stops(out) == [{"worker": "n/gpu1", "commit": True}]
    assert len(_ready(d)) == 2 and d.restarts == 0


def test_without_live_migration_an_elastic_revocation_does_not_commit(daemon):
    d, out = daemon
    _register(d, live_migration=False)
    d.start_workers()
    _pump(d, lambda: len(_ready(d)) == 3)
    d.revoke_gpus([1], grace_s=30.0)
    _pump(d, lambda: len(_stops(out)) == 1)
    assert _stops(out) == [{"worker": "n/gpu1", "commit": False}]


def test_a_gpu_whose_worker_fails_every_start_is_given_up_and_reported(daemon):
    """A worker that exits with an error before its hello on every start (here GPU 1's: a
    stand-in that refuses its config) is restarted WORKER_MAX_START_FAILURES − 1 times, then
    that GPU gets no worker and the node's heartbeat says why; the other GPUs serve."""
    from agent.node_scheduler import WORKER_MAX_START_FAILURES

    d, out = daemon
    healthy = d._launch
    starts: list[str] = []

    def launch(worker_id, gpus, env):
        if gpus != [1]:
            return healthy(worker_id, gpus, env)
        starts.append(worker_id)
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('cannot read the config')"])

    d._launch = launch
    _register(d)
    d.start_workers()
    _pump(d, lambda: bool(d.workers_error) and len(_ready(d)) == 2)
    assert len(starts) == WORKER_MAX_START_FAILURES
    assert "GPUs [1] failed 5 starts in a row (last exit code 1)" in d.workers_error, d.workers_error
    assert sorted(tuple(d.sched.workers[w].gpus) for w in _ready(d)) == [(0,), (2,)]
    assert d.sched.given_up_gpus() == [1]  # what the heartbeat's gpus_given_up carries
    d.check_workers()  # nothing more is started on GPU 1
    assert len(starts) == WORKER_MAX_START_FAILURES and sorted(d.procs) == sorted(_ready(d))
