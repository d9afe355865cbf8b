"""GPU visibility (agent/visibility.py): each Rollout Worker sees exactly its own device, mapped
through the agent's own ``CUDA_VISIBLE_DEVICES`` (Slurm, Kubernetes and container runtimes set it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from agent.main import AgentDaemon, control_gpus_error
from agent.visibility import visibility_error, worker_visible_devices
from spotlight import protocol as P
from spotlight.net.security import add_client, init_keys, load_client_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize(
    ("gpus", "visible", "want"),
    [
        ([2], "4,5,6,7", "6"),
        ([0], "4,5,6,7", "4"),
        ([3], " 4, 5 ,6,7 ", "7"),
        ([1], "GPU-aaaa,GPU-bbbb", "GPU-bbbb"),
        ([0], "MIG-1234", "MIG-1234"),
        ([2], None, "2"),  # unset: index = device
        ([5], "", ""),  # empty: no GPU visible, CPU slots
        ([0, 1], "6,7", "6,7"),
    ],
)
def test_worker_sees_its_device_through_the_agents_visibility(gpus, visible, want):
    assert worker_visible_devices(gpus, visible) == want
    assert visibility_error(gpus, visible) is None


def test_an_index_outside_the_visible_set_is_one_clear_error():
    bad = visibility_error([1, 4], "4,5,6,7")
    assert bad is not None and "[4]" in bad and "CUDA_VISIBLE_DEVICES=4,5,6,7" in bad and "0..3" in bad
    with pytest.raises(ValueError, match="outside this agent's visible devices"):
        worker_visible_devices([4], "4,5,6,7")
    # add-gpu of an invisible GPU is refused before anything changes
    assert "nothing added" in control_gpus_error("add", [4], [0, 1], "4,5,6,7")
    assert control_gpus_error("add", [2], [0, 1], "4,5,6,7") is None


@pytest.fixture
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    init_keys(d)
    add_client(d, "agent", "vis")
    return d


@pytest.mark.procs
def test_join_with_a_gpu_outside_cuda_visible_devices_fails_at_once(tmp_path, keys):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="4,5", SPOTLIGHT_AGENT_STATE=str(tmp_path / "state"), PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "agent.main", "join", "-c", "127.0.0.1:9", "--gpus", "0,2", "--keys", str(keys)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotlight-agent: error: --gpus: GPU index(es) [2]"), lines


@pytest.mark.procs
def test_spawned_workers_each_see_their_own_device(tmp_path, monkeypatch, keys):
    """Agent sees 4,5,6,7 (as under Slurm), SP groups of 2: the four real worker processes get
    CUDA_VISIBLE_DEVICES 4, 5, 6 and 7, one each (so every SP member runs on its own cuda:0)."""
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    d = AgentDaemon("127.0.0.1:9", [0, 1, 2, 3], keys=load_client_keys(keys, role="agent"), node_id="vis")
    d.warm_spare = False
    d.registered = P.Registered(
        node_id="vis",
        heartbeat_interval_s=1.0,
        lease_timeout_s=10.0,
        worker_batch_size=1,
        torch_threads=1,
        model={},
        sampler={},
        latest_version=0,
        sp_degree=2,
    )
    seen: dict[tuple[int, ...], str] = {}
    try:
        d.start_workers()
        assert len(d.procs) == 4 and len(d.sched.groups) == 2
        for wid, popen in d.procs.items():
            proc = psutil.Process(popen.pid)
            deadline = time.monotonic() + 120
            while "spotlight.workers" not in " ".join(proc.cmdline()):  # until exec'd
                assert time.monotonic() < deadline, "worker did not exec"
                time.sleep(0.01)
            seen[tuple(d.sched.workers[wid].gpus)] = proc.environ()["CUDA_VISIBLE_DEVICES"]
    finally:
        for p in d.procs.values():
            p.kill()
            p.wait()
        for s in (d.coord, d.workers_sock, d.control):
            s.close(linger=0)
    assert seen == {(0,): "4", (1,): "5", (2,): "6", (3,): "7"}


def test_workers_get_nccl_settings_that_never_kill_a_survivor_unless_the_operator_chose_otherwise():
    from agent.visibility import NCCL_WORKER_ENV, worker_nccl_env

    env = worker_nccl_env({"PATH": "/bin"})
    assert env == NCCL_WORKER_ENV
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort the communicator, keep the process
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in worker_nccl_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
