"""Signals from a cluster scheduler, to a real ``spotlight-agent join`` process serving the
coordinator's real control plane (:class:`spotlight.coordinator.fixed_run.FixedRun`).

SIGTERM is a node preemption notice (Kubernetes pod termination, Slurm ``--signal=TERM@<grace>``):
sent while a worker denoises, the coordinator sees a notice with the agent's deadline, the worker
commits its request (nothing is re-run from scratch) and the agent exits 0; a second SIGTERM stops
at once. SIGUSR1 with the revoked-GPUs file (agent/revocations.py) revokes one GPU of a running
node and gives it back.

No timing is asserted: the agent's processes are frozen (SIGSTOP) at a moment their worker events
(``$SPOTLIGHT_WORKER_EVENTS``) show a request mid-denoising, the signal is sent while they are
frozen, then they continue; every wait is on a condition with a generous deadline.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from spotlight.config import ClusterConfig, SamplerConfig, SpotlightConfig
from spotlight.coordinator.fixed_run import FixedRun
from spotlight.core.request_scheduler import RequestStatus
from spotlight.models.dit import build_transformer
from spotlight.net.security import add_client, init_keys, load_server_keys
from spotlight.rl.sampler import Conditioning
from spotlight.store.tensor_wire import save_version
from tests.integration.runs import freeze_mid_denoising, thaw
from tests.integration.waiting import wait_until

pytestmark = pytest.mark.procs

REPO = pathlib.Path(__file__).resolve().parents[3]
WAIT_S = 300
NUM_STEPS = 30


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> pathlib.Path:
    from spotlight.config import ModelConfig

    path = tmp_path_factory.mktemp("v0") / "v0.safetensors"
    save_version(build_transformer(ModelConfig()).state_dict(), path)
    return path


def _cond() -> Conditioning:
    g = torch.Generator().manual_seed(5)
    return Conditioning(torch.randn(1, 16, 384, generator=g), torch.ones(1, 16, dtype=torch.int64))


class Node:
    """A FixedRun coordinator and one real agent process ``n`` (no warm spare)."""

    def __init__(self, tmp: pathlib.Path, weights: pathlib.Path, grace_s: float, gpus: str = "0"):
        keys = tmp / "keys"
        init_keys(keys)
        add_client(keys, "agent", "n")
        cfg = SpotlightConfig(
            sampler=SamplerConfig(num_steps=NUM_STEPS, sde_window_size=8),
            cluster=ClusterConfig(
                heartbeat_interval_s=1.0, lease_timeout_s=600.0, worker_batch_size=1, torch_threads=1
            ),
        )
        self.run = FixedRun(cfg, tmp, keys=load_server_keys(keys), weights=weights, cond=_cond()).start()
        self.events = tmp / "events.jsonl"
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
            SPOTLIGHT_AGENT_STATE=str(tmp / "state"),
            SPOTLIGHT_WORKER_EVENTS=str(self.events),
        )
        self.log_path = tmp / "agent.log"
        cmd = [sys.executable, "-m", "agent.main", "join", "--coordinator", f"127.0.0.1:{self.run.port}"]
        self.state = tmp / "state"
        cmd += ["--gpus", gpus, "--node-id", "n", "--keys", str(keys), "--key", "n", "--no-warm-spare"]
        cmd += ["--grace-s", str(grace_s)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait(self, pred, what: str, timeout_s: float = WAIT_S):
        return wait_until(pred, what, timeout_s=timeout_s, alive=lambda: self.proc.poll() is None, logs=self.logs)

    def freeze_mid_denoising(self, max_step: int):
        return self.wait(lambda: freeze_mid_denoising(self.proc.pid, self.events, max_step), "a worker mid-denoising")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.run.stop()


def _histories(run: FixedRun) -> list[list[RequestStatus]]:
    return [[h[0] for h in r.history] for r in run.sched.requests()]


def test_sigterm_is_a_notice_with_the_grace_deadline_and_the_agent_drains_and_exits_0(tmp_path, weights):
    node = Node(tmp_path, weights, grace_s=45.0)
    frozen = []
    try:
        node.wait(lambda: node.run.num_results >= 1, "the worker to serve")
        frozen, _ = node.freeze_mid_denoising(NUM_STEPS - 4)
        sent_unix_s = time.time()
        node.proc.send_signal(signal.SIGTERM)  # the agent runs; its workers are frozen
        # the worker's STOP is queued before it continues (else it may finish this request and
        # pull another before the STOP reaches it: a race on how fast the tiny model denoises)
        node.wait(lambda: "stop sent" in node.logs(), "the agent to send its worker STOP")
        thaw(frozen)
        frozen = []
        rc = node.proc.wait(WAIT_S)
        assert rc == 0, node.logs()
        # the state directory this agent made held nothing worth keeping: gone with it (its
        # control socket, emptied weight cache and directories), not one left per start
        assert not node.state.exists(), sorted(node.state.rglob("*"))
        rec = node.run.instances.nodes["n"]
        # the coordinator handles the agent's messages on its own thread: wait, don't assume
        wait_until(
            lambda: rec.notices and {"notice", "leave"} <= {e["kind"] for e in node.run.events.to_list()},
            "the coordinator to record the notice and the agent's leave",
            timeout_s=WAIT_S,
            logs=node.logs,
        )
        (notice,) = rec.notices
        assert notice["source"] == "sigterm" and notice["scope"] == "node" and notice["kind"] == "terminate"
        assert sent_unix_s + 45.0 <= notice["deadline_unix_s"] <= time.time() + 45.0
        events = {e["kind"]: e["detail"] for e in node.run.events.to_list()}
        assert "sigterm terminate, deadline in" in events["notice"] and "leave" in events, events
        hist = _histories(node.run)
        # the request mid-denoising was committed; nothing the agent held is re-run from scratch
        assert any(RequestStatus.RECOMPUTE in h for h in hist), hist
        assert not any(RequestStatus.ABORTED in h for h in hist), hist
        assert not any(h[-1] is RequestStatus.IN_FLIGHT for h in hist), hist
    finally:
        thaw(frozen)
        node.close()


def test_a_second_sigterm_stops_at_once(tmp_path, weights):
    """The first SIGTERM drains with a 600 s grace; the worker is kept frozen, so it cannot
    commit; the second SIGTERM stops the agent long before that deadline (exit 128 + 15)."""
    node = Node(tmp_path, weights, grace_s=600.0)
    frozen = []
    try:
        node.wait(lambda: node.run.num_results >= 1, "the worker to serve")
        frozen, mid = node.freeze_mid_denoising(NUM_STEPS - 4)
        agent = [p for p in frozen if p.pid != mid[0].pid]
        node.proc.send_signal(signal.SIGTERM)
        node.proc.send_signal(signal.SIGCONT)  # the agent drains; its worker stays frozen
        thaw(agent)
        node.wait(lambda: node.run.instances.nodes["n"].notices, "the notice")
        node.proc.send_signal(signal.SIGTERM)
        rc = node.proc.wait(120)  # far inside the 600 s grace
        assert rc == 128 + signal.SIGTERM, node.logs()
        assert "stopped at once by SIGTERM" in node.logs()
        node.wait(lambda: node.run.instances.nodes["n"].status.value == "dead", "the agent's goodbye", 60)
    finally:
        thaw(frozen)
        node.close()


def test_revocation_file_changes():
    from agent.revocations import revocation_changes

    ch = revocation_changes("1\n", [0, 1, 2], set())
    assert ch.revoke == (1,) and ch.give_back == () and not ch.error
    ch = revocation_changes("1, 2 7", [0, 2], {1})  # 1 already taken, 7 never on this node
    assert ch.revoke == (2,) and ch.give_back == () and ch.unknown == (7,)
    ch = revocation_changes("", [0], {1, 2})  # the scheduler gave everything back
    assert ch.revoke == () and ch.give_back == (1, 2)
    ch = revocation_changes("gpu1", [0, 1], {2})
    assert ch.error and ch.revoke == () and ch.give_back == ()


def _agent_status(node: Node) -> dict:
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "agent.main", "agent-status", "--node-id", "n", "--state-dir", str(node.state)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def test_sigusr1_with_the_revoked_gpus_file_revokes_and_gives_back_one_gpu(tmp_path, weights):
    node = Node(tmp_path, weights, grace_s=30.0, gpus="0,1")
    try:
        node.wait(
            lambda: len(node.run.instances.nodes.get("n").gpus if "n" in node.run.instances.nodes else []) == 2,
            "the node to register with 2 GPUs",
        )
        st = node.wait(lambda: (s := _agent_status(node)) and len(s["workers"]) == 2 and s, "two workers")
        path = pathlib.Path(st["revoked_gpus_file"])
        assert path == node.state / "n" / "revoked-gpus"
        path.write_text("1\n")
        node.proc.send_signal(signal.SIGUSR1)
        node.wait(lambda: _agent_status(node).get("gpus") == [0], "GPU 1 to be revoked")
        # the agent's own status changes before its notice reaches the coordinator's thread
        node.wait(lambda: node.run.instances.nodes["n"].notices, "the coordinator to record the notice")
        (notice,) = node.run.instances.nodes["n"].notices
        assert notice["source"] == "revoke" and notice["scope"] == "gpu:1"
        node.wait(lambda: node.run.instances.nodes["n"].gpus == [0], "the coordinator to see GPU 1 gone")
        node.proc.send_signal(signal.SIGUSR1)  # the same file again: nothing changes
        path.write_text("")
        node.proc.send_signal(signal.SIGUSR1)
        node.wait(lambda: _agent_status(node).get("gpus") == [0, 1], "GPU 1 to be given back")
        node.wait(lambda: node.run.instances.nodes["n"].gpus == [0, 1], "the coordinator to see GPU 1 again")
        assert len(node.run.instances.nodes["n"].notices) == 1
        assert node.proc.poll() is None  # the node kept running throughout
    finally:
        node.close()
