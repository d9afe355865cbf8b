"""The agent's warm spare bookkeeping (agent/main.py) with stand-in spare processes.

A stand-in speaks the spare's side of the hand-over (spotlight/workers/rollout/spare.py): it writes
``ready`` on the pipe named by ``--ready-fd``, reads one assignment line from stdin, records it
and then behaves as told (run like a worker, or exit with a given status). The real spare is
exercised end to end in tests/integration/test_warm_spare.py.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import psutil
import pytest

from agent.main import AgentDaemon
from agent.node_scheduler import SpareTiming, SPGroup, WorkerStatus
from spotlight import protocol as P
from spotlight.net.security import add_client, init_keys, load_client_keys
from spotlight.workers.rollout.spare import EXIT_SPARE_UNUSABLE, cuda_driver_loaded

FAKE_SPARE = (
    """
import json, os, sys, time
args = sys.argv[1:]
out, behaviour = args[0], args[1]
fd = int(args[args.index("--ready-fd") + 1])
if behaviour == "die-unused":
    sys.exit(1)
os.write(fd, b"ready\\n"); os.close(fd)
line = sys.stdin.readline()
if not line:
    sys.exit(0)
with open(out, "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "job": json.loads(line)}) + "\\n")
if behaviour == "refuse":
    sys.exit(%d)
time.sleep(600)
"""
    % EXIT_SPARE_UNUSABLE
)


@pytest.fixture
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    init_keys(d)
    add_client(d, "agent", "spare-test")
    return load_client_keys(d, role="agent")


def _registered(**kw) -> P.Registered:
    base = dict(
        node_id="n",
        heartbeat_interval_s=1.0,
        lease_timeout_s=10.0,
        worker_batch_size=1,
        torch_threads=1,
        model={},
        sampler={},
        latest_version=0,
    )
    return P.Registered(**{**base, **kw})


@pytest.fixture
def daemon(tmp_path, monkeypatch, keys):
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "state"))
    d = AgentDaemon("127.0.0.1:9", [0], keys=keys, node_id="spare-node")
    d.registered = _registered()
    script = tmp_path / "fake_spare.py"
    script.write_text(FAKE_SPARE)
    d.fake = {"out": tmp_path / "assigned.jsonl", "behaviour": "serve"}
    d._spare_cmd = lambda conf, fd: [
        sys.executable,
        str(script),
        str(d.fake["out"]),
        d.fake["behaviour"],
        "--ready-fd",
        str(fd),
    ]
    yield d
    d._stop_spare()
    for p in d.procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    for s in (d.coord, d.workers_sock, d.control):
        s.close(linger=0)


def _until(pred, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _ready_spare(d: AgentDaemon) -> int:
    d.start_spare()
    _until(lambda: (d.check_spare(), d.spare is not None and d.spare.ready)[1], "spare ready")
    return d.spare.proc.pid


def _assignments(d) -> list[dict]:
    path = d.fake["out"]
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_grant_hands_the_ready_spare_over_and_the_next_spare_follows(daemon):
    d = daemon
    pid = _ready_spare(d)
    assert d.spare_status() == {"pid": pid, "ready": True}
    wid = d.spawn_worker([1])
    assert d.procs[wid].pid == pid and d.sched.workers[wid].spare_pid == pid and d.spares_used == 1
    got = _until(lambda: _assignments(d), "the assignment")
    assert got == [{"pid": pid, "job": {"worker_id": wid, "gpus": [1], "cuda_visible_devices": "1"}}]
    assert d.spare is None
    d.check_spare()
    assert d.spare is None  # not before the worker it became serves (SP 1: said hello)
    d.sched.hello(wid, pid)
    d.check_spare()
    assert d.spare is not None and d.spare.proc.pid != pid  # the next spare, in the background
    nxt = d.spare.proc
    d.shutdown()
    assert d.spare is None and nxt.returncode == -signal.SIGKILL  # an idle spare is simply killed
    assert d.procs[wid].returncode == -signal.SIGTERM


def test_spare_of_an_old_configuration_is_not_used(daemon):
    d = daemon
    pid = _ready_spare(d)
    d.registered = _registered(worker_batch_size=4)  # e.g. a re-registration changed the config
    assert d._take_spare() is None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert d.sched.spare.due_at is not None  # a spare of the new configuration follows


def test_spare_that_dies_unused_is_restarted_then_given_up(daemon, monkeypatch):
    d = daemon
    monkeypatch.setattr(d.sched, "spare_timing", SpareTiming(retry_s=0.0))
    d.fake["behaviour"] = "die-unused"
    d.start_spare()
    for _ in range(d.sched.spare_timing.max_failures):
        _until(lambda: (d.check_spare(), d.spare is None)[1], "the spare's death noticed")
        d.sched.spare.first_deadline = None
        d.check_spare()  # due again at once (retry_s = 0): restarted
    assert d.warm_spare is False and d.spare is None


def test_spare_that_initialised_cuda_falls_back_to_a_cold_worker(daemon, monkeypatch):
    d = daemon
    d.fake["behaviour"] = "refuse"
    _ready_spare(d)
    spawned = []
    wid = d.spawn_worker([1])
    monkeypatch.setattr(d, "_spawn", lambda action: spawned.append(action))
    _until(lambda: d.procs[wid].poll() is not None, "the spare's refusal")
    assert d.procs[wid].returncode == EXIT_SPARE_UNUSABLE
    d.check_workers()
    assert d.warm_spare is False and d.spare is None
    # restarted cold (the real method would start the rollout worker)
    assert [(list(a.gpus), a.from_spare) for a in spawned] == [([1], False)]
    assert d.sched.workers[wid].status == WorkerStatus.EXITED


def test_cuda_driver_not_loaded_in_a_cpu_process():
    assert cuda_driver_loaded() is False


# --- revocation: a revoked worker whose part is over is killed, not waited for -----------------
def _sleeper():
    import subprocess

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_revoked_follower_is_killed_once_the_survivor_serves_and_a_leader_after_its_commit(daemon):
    d = daemon
    d.warm_spare = False
    d.registered = _registered(sp_degree=2)
    d.gpus = [0, 1, 2, 3]
    ids = {}
    for gpus in ([0], [1], [2], [3]):
        slot = d.sched.add_worker(gpus)
        d.sched.hello(slot.worker_id, 0)
        d.procs[slot.worker_id] = _sleeper()
        ids[gpus[0]] = slot.worker_id
    d.sched.groups = [
        SPGroup([ids[0], ids[1]], generation=1, formed=True),
        SPGroup([ids[2], ids[3]], generation=1, formed=True),
    ]

    def formed(generation: int, sp: int) -> None:
        d.on_worker([ids[0].encode(), *P.encode(P.GroupFormed(worker_id=ids[0], generation=generation, sp=sp))])

    # follower gpu1 revoked: it holds nothing; the survivor's GROUP_FORMED for generation 2 ends it
    d.revoke_gpus([1], grace_s=30)
    assert d.procs[ids[1]].poll() is None
    formed(generation=1, sp=2)  # a late report of the old generation
    assert d.procs[ids[1]].poll() is None
    formed(generation=2, sp=1)
    assert d.procs[ids[1]].wait(10) == -signal.SIGKILL
    assert d.procs[ids[0]].poll() is None  # the survivor is untouched
    # leader gpu2 revoked: it must commit first; once its COMMIT is forwarded it is ended
    d.revoke_gpus([2], grace_s=30)
    assert d.procs[ids[2]].poll() is None
    commit = P.Commit(
        worker_id=ids[2], items=[P.CommitItem(request_id="r1", lease_id=1, step=3, seed=7, weight_version=0)]
    )
    d.on_worker([ids[2].encode(), *P.encode(commit)])
    assert d.procs[ids[2]].wait(10) == -signal.SIGKILL
    d.check_workers()
    assert (
        ids[1] not in d.sched.revoking
        and ids[2] not in d.sched.revoking
        and d.sched.workers[ids[3]].status == WorkerStatus.READY
    )
