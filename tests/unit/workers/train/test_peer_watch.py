"""A Train Worker rank notices a dead peer and aborts its communicator (no GPU: torch's NCCL abort
is a recorded stand-in; the heartbeats go through a real torch.distributed in-memory store)."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from spotlight.workers.train.peer_watch import PeerLiveness, PeerWatch, abort_communicators
from tests.integration.waiting import wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_peer_whose_counter_stops_is_dead_after_the_timeout():
    live = PeerLiveness([1, 2], timeout_s=10.0, now=0.0)
    for t in range(1, 12):  # a heartbeat a second: rank 1 beats, rank 2 stopped after its first
        dead = live.observe({1: t, 2: 1}, float(t))
        assert dead == ([2] if t > 11 else [])
    assert live.observe({1: 12, 2: 1}, 12.0) == [2]


def test_a_watch_that_was_itself_stopped_blames_no_peer():
    """The whole group SIGSTOPped together (or this rank starved): after the pause nobody is dead."""
    live = PeerLiveness([1], timeout_s=10.0, now=0.0)
    assert live.observe({1: 1}, 1.0) == []
    assert live.observe({1: 1}, 100.0) == []  # 99 s without an observation: our own pause
    assert live.observe({1: 2}, 101.0) == []
    # observed every second from here on: the peer's silence is its own
    assert [live.observe({1: 2}, float(t)) for t in range(102, 113)][-2:] == [[], [1]]


def test_beat_reads_peers_from_the_store_and_names_the_silent_one():
    store, clock = dist.HashStore(), Clock()
    watch = PeerWatch(store, rank=0, world_size=3, timeout_s=5.0, clock=clock)
    live = PeerLiveness([1, 2], 5.0, clock())
    for t in range(1, 8):
        clock.t = float(t)
        store.add(watch._key(1), 1)  # rank 1 beats; rank 2 never does
        reason = watch.beat(live)
    assert reason is not None and "train rank 2 stopped responding" in reason
    assert int(store.add(watch._key(0), 0)) == 7  # our own counter went up every beat


def test_a_store_that_stopped_answering_means_a_lost_peer():
    class GoneStore:
        def add(self, key, value):
            raise RuntimeError("Connection reset by peer")

    watch = PeerWatch(GoneStore(), rank=1, world_size=2)
    reason = watch.beat(PeerLiveness([0], 60.0, 0.0))
    assert "rendezvous store stopped answering" in reason and "Connection reset by peer" in reason


def test_fail_aborts_once_and_keeps_the_reason():
    calls = []
    watch = PeerWatch(dist.HashStore(), rank=0, world_size=2, abort=lambda: calls.append(1) or True, exit_after_s=None)
    watch.fail("rank 1 died")
    watch.fail("again")
    assert calls == [1] and watch.lost == "rank 1 died" and watch.aborted


def test_the_watch_thread_aborts_when_a_peer_goes_silent():
    aborted = threading.Event()
    watch = PeerWatch(
        dist.HashStore(), rank=0, world_size=2, interval_s=0.01, timeout_s=0.2, abort=aborted.set, exit_after_s=None
    ).start()
    try:
        wait_until(aborted.is_set, "the watch to abort the communicator", timeout_s=60)
        assert "train rank 1" in watch.lost
    finally:
        watch.stop()


def test_a_stopped_watch_blames_nobody():
    aborted = threading.Event()
    watch = PeerWatch(dist.HashStore(), rank=0, world_size=2, interval_s=0.01, timeout_s=0.05, abort=aborted.set)
    watch.start()
    watch.stop()  # SHUTDOWN reached this rank: peers may leave from now on
    assert not watch._thread.is_alive() and watch.lost is None and not aborted.is_set()


def test_a_group_of_one_has_no_watch_thread():
    watch = PeerWatch(dist.HashStore(), rank=0, world_size=1).start()
    assert watch._thread is None


@pytest.mark.parametrize(("backend", "expected"), [("nccl", True), ("gloo", False)])
def test_abort_communicators_calls_torchs_nccl_abort(monkeypatch, backend, expected):
    calls = []
    with monkeypatch.context() as m:  # undone before the test ends (the `procs` guard asks is_initialized)
        m.setattr(dist, "is_initialized", lambda: True)
        m.setattr(dist, "get_backend", lambda group=None: backend)
        m.setattr(c10d, "_abort_process_group", lambda group=None: calls.append(group))
        assert abort_communicators() is expected
    assert calls == ([None] if expected else [])


# ---------------------------------------------------------------- the rank's serve loop


class FakeTrainer:
    device = "cpu"

    def __init__(self, error: Exception):
        self.error = error

    def train_step(self, batch, micro_batches, *, iteration):
        raise self.error


class FakeWatch:
    def __init__(self, lost: str | None = None):
        self.lost, self.stopped = lost, False

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def coordinator_pair():
    """A ROUTER standing for the coordinator and the rank's DEALER, over inproc ZeroMQ."""
    import zmq

    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://coordinator")
    dealer.setsockopt(zmq.IDENTITY, b"rank1")
    dealer.connect("inproc://coordinator")
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


def _process(dealer, trainer, watch):
    import argparse

    from spotlight.config import SpotlightConfig
    from spotlight.workers.train.train_worker import _TrainerProcess

    args = argparse.Namespace(rank=1, world_size=2, spool_dir=None, checkpoint_dir=None)
    return _TrainerProcess(args, SpotlightConfig(), trainer, dealer, alive=lambda: True, watch=watch)


def _send(router, msg) -> None:
    from spotlight import protocol as P

    router.send_multipart([b"rank1", *P.encode(msg)])


def test_a_collective_that_fails_on_a_dead_peer_ends_the_rank_with_the_peer_lost_status(coordinator_pair, caplog):
    from spotlight import protocol as P
    from spotlight.workers.train.peer_watch import EXIT_PEER_LOST

    router, dealer = coordinator_pair
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:50845. This is typically caused by …")
    _send(router, P.TrainBatch(iteration=0, version=0, micro_batches=[]))
    with caplog.at_level("ERROR", logger="spotlight.train"):
        assert _process(dealer, FakeTrainer(gloo), FakeWatch()).serve() == EXIT_PEER_LOST
    assert "rank 1 stops: another rank of the trainer group is gone (a collective failed: RuntimeError" in caplog.text


def test_a_rank_whose_own_step_fails_still_crashes_with_its_error(coordinator_pair):
    from spotlight import protocol as P

    router, dealer = coordinator_pair
    _send(router, P.TrainBatch(iteration=0, version=0, micro_batches=[]))
    with pytest.raises(ValueError, match="a bug"):
        _process(dealer, FakeTrainer(ValueError("a bug")), FakeWatch()).serve()


def test_a_peer_lost_while_idle_ends_the_rank_unless_the_run_is_over(coordinator_pair, caplog):
    from spotlight import protocol as P
    from spotlight.workers.train.peer_watch import EXIT_PEER_LOST

    router, dealer = coordinator_pair
    _send(router, P.Shutdown(reason="run finished"))  # the coordinator stopped every rank: a peer left first
    assert _process(dealer, FakeTrainer(ValueError()), FakeWatch("train rank 0 stopped responding")).serve() == 0
    with caplog.at_level("ERROR", logger="spotlight.train"):
        assert _process(dealer, FakeTrainer(ValueError()), FakeWatch("train rank 0 stopped responding")).serve() == (
            EXIT_PEER_LOST
        )
    assert "another rank of the trainer group is gone (train rank 0 stopped responding)" in caplog.text
