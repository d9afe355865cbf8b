"""The SP group worker's socket loop (spotlight/workers/sp/group_worker.py) with real ZeroMQ,
real worker processes and gloo: the test is the node's agent (a ROUTER socket).

* a leader whose every batch fails reports each failure with its streak, turns unhealthy and
  keeps leading its group (it used to exit after one failed batch, so its streak restarted
  with every replacement process and it never reported unhealthy);
* a peer that dies mid-batch: the leader commits the batch at its last completed step (nothing
  is recomputed from step 0) and re-forms when the agent sends the next generation.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp
import zmq

from spotlight import protocol as P
from spotlight.config import ModelConfig, SamplerConfig
from spotlight.store.tensor_wire import pack_tensors, state_dict_to_bytes
from spotlight.workers.rollout.worker import FAIL_PROMPTS_ENV
from tests.factories import free_ports

pytestmark = pytest.mark.procs

SAMPLER = SamplerConfig(num_steps=6, sde_window_start=0, sde_window_size=2)
CONF = {
    "model": {"family": "tiny"},
    "sampler": {"num_steps": 6, "sde_window_start": 0, "sde_window_size": 2},
    "worker_batch_size": 2,
    "torch_threads": 1,
    "sp_degree": 2,
    "lora": {},
}


def _worker_main(endpoint: str, worker_id: str, gpu: int, die_at_forward: int) -> None:
    """A group worker process; ``die_at_forward > 0``: this process dies abruptly inside that
    forward (a GPU lost without notice)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from spotlight.workers.rollout.worker import make_worker
    from spotlight.workers.sp import group as G

    if die_at_forward:
        original = G.SPGroupMember.velocity_fn
        calls = []

        def velocity_fn(self):
            inner = original(self)

            def dying(*args):
                calls.append(1)
                if len(calls) == die_at_forward:
                    os._exit(1)
                return inner(*args)

            return dying

        G.SPGroupMember.velocity_fn = velocity_fn
    worker = make_worker(endpoint, worker_id, [gpu], CONF)
    worker.agent_alive = lambda: True  # the test process is the agent, not our parent
    worker.streak.base_s = worker.streak.max_s = 0.05
    rc = worker.run()
    worker.close(linger_s=1)
    os._exit(rc or 0)


class Agent:
    """The test's side of the worker sockets."""

    def __init__(self, tmp_path):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"ipc://{tmp_path}/agent.sock"
        self.sock.bind(self.endpoint)
        self.procs = []
        self.pids: dict[str, int] = {}
        self.hellos = 0

    def start(self, worker_id: str, gpu: int, die_at_forward: int = 0):
        p = mp.get_context("spawn").Process(
            target=_worker_main, args=(self.endpoint, worker_id, gpu, die_at_forward), daemon=True
        )
        p.start()
        self.procs.append(p)
        return p

    def send(self, worker_id: str, msg, frames=None):
        self.sock.send_multipart([worker_id.encode(), *P.encode(msg, frames)])

    def recv(self, want: set, timeout_s: float = 240.0):
        """The next message of a type in ``want`` (answering weight fetches on the way)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(int(left * 1000)), f"no {want} from the workers"
            ident, *frames = self.sock.recv_multipart()
            mtype, body, payload = P.decode(frames)
            if mtype == P.MsgType.WORKER_HELLO:
                self.pids[body.worker_id] = body.pid
                self.hellos += 1
            if mtype == P.MsgType.FETCH_WEIGHTS:
                from spotlight.models.dit import build_transformer

                sd = build_transformer(ModelConfig()).state_dict()
                self.send(ident.decode(), P.Weights(version=0, size_bytes=0), [state_dict_to_bytes(sd)])
                continue
            if mtype in want:
                return ident.decode(), mtype, body, payload

    def form(self, members, port, generation):
        form = P.GroupForm(
            members=list(members),
            master_addr="127.0.0.1",
            master_port=port,
            generation=generation,
            version=0,
            pids=[self.pids.get(m, 0) for m in members],
        )
        for m in members:
            self.send(m, form)
        formed = set()
        while formed != set(members):
            wid, _, body, _ = self.recv({P.MsgType.GROUP_FORMED})
            assert body.generation == generation
            formed.add(wid)

    def leases(self, worker_id: str, prompt: int, first_id: int, n: int = 2):
        g = torch.Generator().manual_seed(prompt)
        cond = {"cond.embeds": torch.randn(n, 16, 384, generator=g), "cond.mask": torch.ones(n, 16, dtype=torch.long)}
        metas, frames = pack_tensors(cond)
        items = [
            P.LeaseItem(
                lease_id=first_id + i,
                request_id=f"r{first_id + i}",
                kind="rollout",
                iteration=0,
                prompt_index=prompt,
                seed=first_id + i,
                weight_version=0,
            )
            for i in range(n)
        ]
        self.send(worker_id, P.Leases(worker_id=worker_id, items=items, tensors=metas), frames)

    def close(self):
        for m in self.pids:
            try:
                self.send(m, P.Stop(commit=False, reason="test over"))
            except zmq.ZMQError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        self.sock.close()
        self.ctx.term()


def test_an_sp_leader_whose_batches_fail_turns_unhealthy_and_keeps_its_group(tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_PROMPTS_ENV, "rollout:2")
    agent = Agent(tmp_path)
    try:
        leader, follower = agent.start("n/gpu0", 0), agent.start("n/gpu1", 1)
        for _ in range(2):
            agent.recv({P.MsgType.WORKER_HELLO})
        agent.form(["n/gpu0", "n/gpu1"], free_ports(1)[0], 1)
        fails, lease = [], 1
        while len(fails) < 4:
            wid, mtype, body, _ = agent.recv({P.MsgType.PULL, P.MsgType.FAIL})
            if mtype == P.MsgType.PULL:
                agent.leases(wid, 2, lease)
                lease += 2
            else:
                fails.append(body)
        agent.recv({P.MsgType.PULL})
        agent.leases("n/gpu0", 5, 100)  # a request that works: the group still serves it
        _, _, result, _ = agent.recv({P.MsgType.RESULT})
        assert leader.is_alive() and follower.is_alive()
    finally:
        agent.close()
    assert all("RuntimeError: planted failure for prompt 2" in f.reason for f in fails)
    assert [f.consecutive_failures for f in fails] == [1, 2, 3, 4]
    assert [f.unhealthy for f in fails] == [False, False, True, True]
    assert [i.request_id for i in result.items] == ["r100", "r101"] and result.num_gpus == 2.0
    assert agent.hellos == 2  # the same two processes all along (no worker restarted)


def test_a_peer_that_dies_mid_batch_leaves_a_commit_at_its_last_step_and_the_leader_reforms(tmp_path):
    agent = Agent(tmp_path)
    ports = free_ports(2)
    try:
        agent.start("n/gpu0", 0)
        follower = agent.start("n/gpu1", 1, die_at_forward=3)  # inside step 2 of the first batch
        for _ in range(2):
            agent.recv({P.MsgType.WORKER_HELLO})
        agent.form(["n/gpu0", "n/gpu1"], ports[0], 1)
        wid, _, _, _ = agent.recv({P.MsgType.PULL})
        agent.leases(wid, 1, 1)
        _, _, commit, _ = agent.recv({P.MsgType.COMMIT, P.MsgType.FAIL, P.MsgType.RESULT})
        follower.join(30)
        agent.form(["n/gpu0"], ports[1], 2)  # the survivor re-forms alone, from memory
        agent.recv({P.MsgType.PULL})
    finally:
        agent.close()
    assert isinstance(commit, P.Commit), commit
    assert [(i.request_id, i.step) for i in commit.items] == [("r1", 2), ("r2", 2)]
    assert follower.exitcode == 1


def test_a_warm_spares_member_becomes_the_group_workers_member(tmp_path):
    """The warm spare prepares an SP member for the run's settings (LoRA included) before it is
    assigned; the worker it becomes takes that member (it used to fail on an attribute the member
    did not have, so every grant with a spare crashed and restarted cold)."""
    from spotlight.workers.rollout.spare import warm_up
    from spotlight.workers.rollout.worker import make_worker

    conf = dict(CONF, lora={"rank": 2, "alpha": 4.0, "target_modules": []})
    member = warm_up(conf)
    assert member is not None and member.lora == conf["lora"]
    worker = make_worker(f"ipc://{tmp_path}/a.sock", "n/gpu1", [1], conf, member=member)
    try:
        assert worker.member is member and member.worker_id == "n/gpu1"
        assert worker.executor.lora == conf["lora"]
    finally:
        worker.close(linger_s=0)
    other = warm_up(CONF)  # prepared for full weights: not for a LoRA run
    with pytest.raises(ValueError, match="another SP configuration"):
        make_worker(f"ipc://{tmp_path}/b.sock", "n/gpu2", [2], conf, member=other)
