"""Warm spare on a live node: a granted GPU is served by the pre-started spare process.

A real ``spotlight-agent join`` (one GPU, ``sp_degree = 2`` from the coordinator, so its worker
serves alone at SP 1) talks CURVE to the real control plane in this process, which speaks the
real protocol: the coordinator's own control plane serving a run that never ends
(:class:`spotlight.coordinator.fixed_run.FixedRun`: weights in chunks, rollout requests with fresh
seeds whenever a worker pulls). Then: ``add-gpu 1`` (the spare becomes the new worker, receives the weights from its
peer and the group serves at SP 2; a new spare starts), ``revoke 1`` (SP 1 again), ``add-gpu 1``
(the second spare is used), and finally ``kill -9`` of the agent, after which none of its
processes may remain.

Every finished request is compared with the same request denoised by a single-GPU
:class:`~spotlight.workers.rollout.worker.RolloutExecutor` in this process: the reconfigurations
(some happen in the middle of a request's denoising) change nothing in the results.
No timing is asserted; every wait is on a condition with a generous deadline.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
import zmq

from spotlight import protocol as P
from spotlight.config import ClusterConfig, ModelConfig, SamplerConfig, SpotlightConfig
from spotlight.coordinator.fixed_run import FixedRun
from spotlight.models.dit import build_transformer
from spotlight.net.security import add_client, init_keys, load_server_keys
from spotlight.rl.sampler import Conditioning
from spotlight.store.tensor_wire import save_version, unpack_tensors
from tests.integration.waiting import wait_until

REPO = pathlib.Path(__file__).resolve().parents[2]
WAIT_S = 300
SAMPLER = SamplerConfig(num_steps=30, sde_window_size=8)
CHUNK_BYTES = 256 * 1024  # the version travels in many chunks, a window of 4 at a time


def _config():
    """SP 2 for spot nodes, one request per batch, the tiny default model, chunks of 256 KiB."""
    return SpotlightConfig(
        sampler=SAMPLER,
        cluster=ClusterConfig(
            sp_degree=2,
            heartbeat_interval_s=1.0,
            lease_timeout_s=600.0,
            worker_batch_size=1,
            torch_threads=1,
            weight_chunk_bytes=CHUNK_BYTES,
        ),
    )


def _cond() -> Conditioning:
    g = torch.Generator().manual_seed(5)
    return Conditioning(torch.randn(1, 16, 384, generator=g), torch.ones(1, 16, dtype=torch.int64))


def _control(node_id: str, request: dict) -> dict:
    from spotlight.net.agent_paths import control_endpoint

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control_endpoint(node_id))
    try:
        sock.send(json.dumps(request).encode())
        if not sock.poll(30_000):
            return {}
        return json.loads(sock.recv())
    finally:
        sock.close()


def _wait(pred, what: str, proc: subprocess.Popen, timeout_s: float = WAIT_S):
    """:func:`wait_until` on ``pred``, failing early if the agent ``proc`` exits."""
    return wait_until(pred, what, timeout_s=timeout_s, alive=lambda: proc.poll() is None)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spare")
    keys = tmp / "keys"
    init_keys(keys)
    add_client(keys, "agent", "n")
    weights = build_transformer(ModelConfig()).state_dict()
    size_bytes, _ = save_version(weights, tmp / "v0.safetensors")
    coord = FixedRun(_config(), tmp, keys=load_server_keys(keys), weights=tmp / "v0.safetensors", cond=_cond()).start()
    mp = pytest.MonkeyPatch()
    mp.setenv("SPOTLIGHT_AGENT_STATE", str(tmp / "state"))  # the agent's and _control's (agent_paths)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), SPOTLIGHT_WORKER_EVENTS=str(tmp / "events.jsonl"))
    log = open(tmp / "agent.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent.main",
            "join",
            "--coordinator",
            f"127.0.0.1:{coord.port}",
            "--gpus",
            "0",
            "--node-id",
            "n",
            "--keys",
            str(keys),
            "--key",
            "n",
            "--warm-spare",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    facts: dict = {"tmp": tmp}
    try:
        status = lambda: _control("n", {"cmd": "status"})  # noqa: E731

        def serving(sp):
            s = status()
            return s if s.get("groups") and len(s["groups"][0]["members"]) == sp and s["groups"][0]["serving"] else None

        def spare_ready(other_than=None):
            s = status()
            return s if s.get("spare") and s["spare"]["ready"] and s["spare"]["pid"] != other_than else None

        _wait(lambda: serving(1), "SP 1 serving", proc)
        spare1 = _wait(spare_ready, "the first spare", proc)["spare"]["pid"]
        added = _control("n", {"cmd": "add", "gpus": [1]})
        s = _wait(lambda: serving(2), "SP 2 serving after the grant", proc)
        facts["grant1"] = {"spare_pid": spare1, "started": added["started"], "status": s}
        s = _wait(lambda: spare_ready(other_than=spare1), "the next spare", proc)
        spare2 = s["spare"]["pid"]
        facts["spare2"] = spare2
        facts["spare1_alive_after_grant"] = not _gone(spare1)
        n_results = len(coord.results)
        _wait(lambda: len(coord.results) >= n_results + 2, "results at SP 2", proc)
        assert _control("n", {"cmd": "revoke", "gpus": [1], "grace_s": 20})["ok"]
        _wait(lambda: (s := serving(1)) and s["gpus"] == [0], "SP 1 after the revocation", proc)
        _wait(lambda: _gone(spare1), "the revoked worker's exit", proc)
        added = _control("n", {"cmd": "add", "gpus": [1]})
        s = _wait(lambda: serving(2), "SP 2 serving after the second grant", proc)
        facts["grant2"] = {"spare_pid": spare2, "started": added["started"], "status": s}
        n_results = len(coord.results)
        _wait(lambda: len(coord.results) >= n_results + 2, "results at SP 2 again", proc)
        # the agent is killed: its spare (PR_SET_PDEATHSIG) and workers must not outlive it
        s = _wait(spare_ready, "a spare to be idle", proc)
        pids = [s["spare"]["pid"], *[p for p in s["worker_pids"].values() if p and not _gone(p)]]
        facts["pids_at_kill"] = pids
        facts["agent_children_at_kill"] = [c.pid for c in psutil.Process(proc.pid).children()]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_gone(p) for p in facts["agent_children_at_kill"]):
            time.sleep(0.1)
        facts["left_after_kill"] = [p for p in facts["agent_children_at_kill"] if not _gone(p)]
        facts["results"] = dict(coord.results)
        facts["chunks_served"], facts["version_chunks"] = coord.weight_chunks_served, -(-size_bytes // CHUNK_BYTES)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in facts.get("agent_children_at_kill", []):
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        coord.stop()
        log.close()
        mp.undo()
    facts["log"] = (tmp / "agent.log").read_text()
    facts["events"] = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines() if line.strip()]
    facts["weights"] = weights
    return facts


def test_grant_is_served_by_the_spare_process(run):
    for grant in ("grant1", "grant2"):
        g = run[grant]
        wid = g["started"][0]
        assert g["status"]["worker_pids"][wid] == g["spare_pid"], run["log"][-3000:]  # the spare became the worker
        assert g["status"]["from_spare"][wid] == g["spare_pid"]
    assert run["grant2"]["status"]["spares_used"] == 2
    assert run["spare2"] != run["grant1"]["spare_pid"] and run["spare1_alive_after_grant"]
    assert "weights: broadcast" in run["log"]  # the new worker got the weights from its peer
    assert (
        run["version_chunks"] > 4 and run["chunks_served"] >= run["version_chunks"]
    )  # v0 came in chunks, a window at a time


def test_spare_and_workers_die_with_the_agent(run):
    assert run["pids_at_kill"] and set(run["pids_at_kill"]) <= set(run["agent_children_at_kill"])
    assert run["left_after_kill"] == [], f"processes outlived the agent: {run['left_after_kill']}"


def test_results_across_joins_and_revocations_are_identical(run):
    from spotlight.workers.rollout.worker import RolloutExecutor

    results = run["results"]
    assert len(results) >= 4
    # the leader re-formed in the middle of a request at least once (between its steps)
    leader = [e for e in run["events"] if e.get("worker") == "n/gpu0" and e["event"] in ("step", "formed")]
    mid = [
        b
        for a, b in zip(leader, leader[1:])
        if b["event"] == "formed" and a["event"] == "step" and 0 < a["step"] < SAMPLER.num_steps
    ]
    assert mid, "no reconfiguration happened while a request was being denoised"
    cfg = ModelConfig()
    ex = RolloutExecutor(cfg, SAMPLER)
    ex.add_version(0, run["weights"])
    tensors = _cond().to_tensors()
    for seed, got in sorted(results.items()):
        item = P.LeaseItem(
            lease_id=seed,
            request_id=f"r{seed}",
            kind="rollout",
            iteration=0,
            prompt_index=0,
            seed=seed,
            weight_version=0,
        )
        msg, frames = ex.run("ref", P.Leases(worker_id="ref", items=[item]), dict(tensors)).result
        ref = unpack_tensors(msg.tensors, frames)
        torch.testing.assert_close(got["window_latents"], ref["window_latents"], atol=1e-4, rtol=0, msg=f"seed {seed}")
        torch.testing.assert_close(got["log_probs"], ref["log_probs"], atol=1e-3, rtol=1e-5, msg=f"seed {seed}")
