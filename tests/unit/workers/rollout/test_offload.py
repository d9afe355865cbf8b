"""A reserved Rollout Worker gives its device memory back while a Train Worker uses its GPU
(spotlight/workers/rollout/offload.py, the worker loop in worker.py, spotlight/core/offload.py).

The CPU has no device memory to give back, so by default nothing moves there; the tests also
run the real copy (``copy_on_cpu``) to check that the weights come back bit for bit, and drive
a real worker over real ZeroMQ through release → released → reclaim with work."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from spotlight import protocol as P
from spotlight.config import ModelConfig, SamplerConfig
from spotlight.models.families import get_family
from spotlight.store.tensor_wire import pack_tensors, state_dict_to_bytes, unpack_tensors
from spotlight.workers.rollout.offload import ModelOffloader
from spotlight.workers.rollout.worker import WorkerProcess


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 4)
        self.b.weight = torch.nn.Parameter(self.a.weight.detach().t().clone())
        self.c = torch.nn.Linear(4, 3, bias=False)
        self.c.weight = self.a.weight  # tied: one parameter, two owners
        self.register_buffer("scale", torch.arange(3.0))

    def forward(self, x):
        return self.b(self.a(x) * self.scale) + self.c(x).sum()


def _bytes(module) -> int:
    params = {id(p): p for p in module.parameters()}.values()
    return sum(t.numel() * t.element_size() for t in [*params, *module.buffers()])


def test_offload_and_reload_restore_the_weights_and_keep_the_parameter_objects():
    torch.manual_seed(0)
    m = _Tied()
    x = torch.randn(2, 4)
    want = m(x)
    params = dict(m.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    off = ModelOffloader("cpu", copy_on_cpu=True, chunk_bytes=128)
    stats = off.offload(m)
    assert off.offloaded and stats.size_bytes == _bytes(m) and stats.seconds >= 0
    # carved from 128-byte chunks at 64-byte boundaries: a.weight 48 + a.bias 12 | b.weight 48 + b.bias 16 | scale 12
    assert off.host_bytes == 3 * 128
    host_ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    assert all(host_ptrs[n] != ptrs[n] for n in ptrs)  # now in the host buffers
    assert m.c.weight is m.a.weight  # still tied
    assert torch.equal(m(x), want)
    with pytest.raises(RuntimeError, match="host memory already"):
        off.offload(m)
    back = off.reload(m)
    assert not off.offloaded and back.size_bytes == stats.size_bytes
    assert dict(m.named_parameters()) == params  # the same Parameter objects (optimizers, hooks hold them)
    assert torch.equal(m(x), want)
    with pytest.raises(RuntimeError, match="on its device already"):
        off.reload(m)
    off.offload(m)  # the host buffers are reused, not allocated again
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == host_ptrs
    assert off.host_bytes == 3 * 128


def test_a_tensor_larger_than_a_chunk_gets_its_own():
    m = torch.nn.Linear(16, 16)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    off = ModelOffloader("cpu", copy_on_cpu=True, chunk_bytes=256)  # the weight is 1 KiB, the bias 64 B
    off.offload(m)
    assert off.host_bytes == 1024 + 256
    off.reload(m)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in want.items())


def test_on_the_cpu_nothing_moves_but_the_state_and_bytes_are_kept():
    m = _Tied()
    ptrs = [p.data_ptr() for p in m.parameters()]
    off = ModelOffloader("cpu")
    assert off.offload(m).size_bytes == _bytes(m) and off.offloaded
    assert [p.data_ptr() for p in m.parameters()] == ptrs and off.host_bytes == 0
    assert off.reload(m).size_bytes == _bytes(m) and not off.offloaded


# ------------------------------------------------------------------ the worker loop, real ZeroMQ
def _items(first: int) -> list[P.LeaseItem]:
    return [
        P.LeaseItem(
            lease_id=first + i, request_id=f"r{first + i}", kind="rollout", iteration=0, prompt_index=i, seed=i,
            weight_version=0,
        )
        for i in range(2)
    ]  # fmt: skip


def test_a_worker_releases_when_told_and_reloads_before_work(tmp_path):
    model_cfg, sampler_cfg = ModelConfig(family="tiny"), SamplerConfig(num_steps=3, sde_window_size=1)
    family = get_family(model_cfg)
    version0 = state_dict_to_bytes(family.build_transformer(torch.float32).state_dict())
    cond = {
        "cond.embeds": torch.randn(2, 4, 384, generator=torch.Generator().manual_seed(1)),
        "cond.mask": torch.ones(2, 4, dtype=torch.int64),
    }
    metas, frames = pack_tensors(cond)
    ctx = zmq.Context()
    agent = ctx.socket(zmq.ROUTER)
    agent.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/agent.sock"
    agent.bind(endpoint)
    worker = WorkerProcess(
        endpoint, "reserved-0/gpu0", [0], model_cfg, sampler_cfg, batch_size=2, offload_while_training=True
    )
    worker.agent_alive = lambda: True
    worker.executor.offloader = ModelOffloader("cpu", copy_on_cpu=True, chunk_bytes=1 << 20)  # really copy
    replies = [
        P.Leases(worker_id="reserved-0/gpu0", items=_items(1), tensors=metas, device="reclaim"),
        P.Leases(worker_id="reserved-0/gpu0", device="release"),  # training on its GPU began
        P.Leases(worker_id="reserved-0/gpu0"),  # an agent's own reply says nothing: stay released
        P.Leases(worker_id="reserved-0/gpu0", items=_items(3), tensors=metas),  # work: reload first
    ]
    pulls, results = [], []
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    try:
        while True:
            assert agent.poll(60_000), "the worker went silent"
            ident, *raw = agent.recv_multipart()
            mtype, body, payload = P.decode(raw)
            if mtype == P.MsgType.PULL:
                pulls.append(body)
                if not replies:
                    break
                reply = replies.pop(0)
                agent.send_multipart([ident, *P.encode(reply, frames if reply.items else [])])
            elif mtype == P.MsgType.FETCH_WEIGHTS:
                agent.send_multipart([ident, *P.encode(P.Weights(version=0, size_bytes=0), [version0])])
            elif mtype == P.MsgType.RESULT:
                results.append(unpack_tensors(body.tensors, payload))
        agent.send_multipart([ident, *P.encode(P.Stop(commit=False, reason="test over"))])
        t.join(30)
    finally:
        agent.close()
        ctx.term()
    model_bytes = _bytes(worker.executor.transformer)
    seen = [(p.residency, [(m.kind, m.size_bytes) for m in p.moves]) for p in pulls]
    assert seen == [
        ("resident", []),
        ("resident", []),  # after the first batch
        ("released", [("offload", model_bytes)]),
        ("released", []),
        ("resident", [("reload", model_bytes)]),  # reloaded before the second batch ran
    ]
    assert len(results) == 2 and not worker.executor.released
    # the same seeds after the round trip through host memory: the same images and log-probs
    assert torch.equal(results[0]["images"], results[1]["images"])
    assert torch.equal(results[0]["log_probs"], results[1]["log_probs"])


def test_a_reload_out_of_memory_leaves_the_model_in_host_memory():
    m = _Tied()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    off = ModelOffloader("cpu", copy_on_cpu=True, chunk_bytes=1024)
    off.offload(m)
    host = {n: p.data_ptr() for n, p in m.named_parameters()}
    real_empty, calls = torch.empty, []

    def empty(*args, **kw):  # the third device tensor does not fit
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory (planted)")
        return real_empty(*args, **kw)

    torch.empty = empty
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            off.reload(m)
    finally:
        torch.empty = real_empty
    assert off.offloaded and {n: p.data_ptr() for n, p in m.named_parameters()} == host  # nothing moved
    off.reload(m)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in want.items())


def _worker(tmp_path, **kw):
    w = WorkerProcess(
        f"ipc://{tmp_path}/none.sock", "reserved-0/gpu0", [0], ModelConfig(family="tiny"), SamplerConfig(),
        batch_size=2, offload_while_training=True, **kw,
    )  # fmt: skip
    w.executor.transformer = torch.nn.Linear(4, 4)
    return w


def test_a_worker_that_cannot_offload_keeps_its_weights_and_stops_managing(tmp_path, monkeypatch):
    w = _worker(tmp_path)
    try:
        monkeypatch.setattr(w.executor, "release_device", lambda: (_ for _ in ()).throw(RuntimeError("pinned")))
        assert w.residency.value == "resident"
        assert w.follow_device_word("release", has_work=False) is None
        assert w.residency.value == "" and w._pull().residency == ""  # the update no longer waits for it
    finally:
        w.close(0)


def test_a_failed_reload_is_raised_and_nothing_is_reported(tmp_path, monkeypatch):
    w = _worker(tmp_path)
    try:
        assert w.follow_device_word("release", has_work=False).value == "offload"
        monkeypatch.setattr(w.executor, "reclaim_device", lambda: (_ for _ in ()).throw(RuntimeError("OOM")))
        with pytest.raises(RuntimeError, match="OOM"):
            w.follow_device_word("reclaim", has_work=True)
        pull = w._pull()
        assert pull.residency == "released" and [m.kind for m in pull.moves] == ["offload"]
    finally:
        w.close(0)
