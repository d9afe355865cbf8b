"""A Rollout Worker whose batches fail (spotlight/workers/rollout/worker.py): every FAIL carries
the exception line and the streak; after three in a row the worker says it is unhealthy and
backs off. Real ZeroMQ: the test is the worker's agent (a ROUTER socket)."""

from __future__ import annotations

import threading

import pytest
import zmq

from spotlight import protocol as P
from spotlight.config import ModelConfig, SamplerConfig
from spotlight.store.tensor_wire import state_dict_to_bytes
from spotlight.workers.rollout.worker import FAIL_PROMPTS_ENV, FailureStreak, WorkerProcess, planted_failure


def _item(i: int, prompt_index: int, kind: str = "rollout") -> P.LeaseItem:
    return P.LeaseItem(
        lease_id=i + 1, request_id=f"r0-{i}", kind=kind, iteration=0, prompt_index=prompt_index, seed=i,
        weight_version=0,
    )  # fmt: skip


def test_planted_failure_matches_prompt_and_kind():
    planted_failure([_item(0, 3)], "")  # unset: nothing
    with pytest.raises(RuntimeError, match="planted failure for prompt 3"):
        planted_failure([_item(0, 1), _item(1, 3)], "3")
    planted_failure([_item(0, 3, "rollout")], "explore:3")
    with pytest.raises(RuntimeError):
        planted_failure([_item(0, 3, "explore")], "explore:3, 7")
    planted_failure([_item(0, 3, "rollout")], "explore:*")
    with pytest.raises(RuntimeError):
        planted_failure([_item(0, 9, "explore")], "explore:*")


def test_failure_streak_backs_off_doubling_and_resets():
    s = FailureStreak(unhealthy_after=3, base_s=1.0, max_s=5.0)
    assert [s.failed() for _ in range(2)] == [1, 2] and not s.unhealthy and s.backoff_s() == 0.0
    s.failed()
    assert s.unhealthy and s.backoff_s() == 1.0
    s.failed()
    assert s.backoff_s() == 2.0
    for _ in range(5):
        s.failed()
    assert s.backoff_s() == 5.0
    s.succeeded()
    assert not s.unhealthy and s.backoff_s() == 0.0


def test_worker_reports_each_error_and_turns_unhealthy(tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_PROMPTS_ENV, "2")
    ctx = zmq.Context()  # the worker terms zmq.Context.instance() when it closes
    agent = ctx.socket(zmq.ROUTER)
    agent.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/agent.sock"
    agent.bind(endpoint)
    worker = WorkerProcess(endpoint, "n0/gpu0", [0], ModelConfig(family="tiny"), SamplerConfig(), batch_size=2)
    worker.streak = FailureStreak(unhealthy_after=3, base_s=0.01, max_s=0.01)
    worker.agent_alive = lambda: True  # the test process is no agent that spawned it
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    fails = []
    try:
        while len(fails) < 4:
            assert agent.poll(60_000), "the worker went silent"
            ident, *frames = agent.recv_multipart()
            mtype, body, _ = P.decode(frames)
            if mtype == P.MsgType.PULL:
                items = [_item(2 * len(fails), 2), _item(2 * len(fails) + 1, 5)]
                agent.send_multipart([ident, *P.encode(P.Leases(worker_id="n0/gpu0", items=items))])
            elif mtype == P.MsgType.FETCH_WEIGHTS:
                weights = P.Weights(version=0, size_bytes=0)
                agent.send_multipart([ident, *P.encode(weights, [state_dict_to_bytes({})])])
            elif mtype == P.MsgType.FAIL:
                fails.append(body)
        agent.send_multipart([ident, *P.encode(P.Stop(commit=False, reason="test over"))])
        t.join(30)
    finally:
        agent.close()
        ctx.term()
        if not t.is_alive():
            worker.close(linger_s=0)
    assert all("RuntimeError: planted failure for prompt 2" in f.reason for f in fails)
    assert [f.consecutive_failures for f in fails] == [1, 2, 3, 4]
    assert [f.unhealthy for f in fails] == [False, False, True, True]
    assert fails[0].request_ids == ["r0-0", "r0-1"] and fails[0].lease_ids == [1, 2]


def test_a_long_exception_message_is_cut_so_the_fail_still_decodes():
    reason = "x" * 10_000
    msg = P.Fail(worker_id="w", request_ids=["r"], lease_ids=[1], reason=reason[: P.MAX_REASON_CHARS])
    assert P.decode(P.encode(msg))[1].reason == reason[: P.MAX_REASON_CHARS]
    with pytest.raises(P.ProtocolError):
        P.decode(P.encode(P.Fail(worker_id="w", request_ids=["r"], lease_ids=[1], reason=reason)))
