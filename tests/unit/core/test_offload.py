"""A reserved GPU shared by a Rollout Worker and a Train Worker (spotlight/core/offload.py): who
shares, what the coordinator says, what the worker does, when the update may train, and what the
metrics row gets."""

from __future__ import annotations

import pytest

from spotlight.core.offload import (
    RELEASE_TIMEOUT_S,
    DeviceWord,
    Move,
    OffloadMeter,
    Residency,
    device_word,
    next_move,
    offload_enabled,
    release_wait_over,
    shares_trainer_gpu,
    trainer_gpus,
)

R, D = Residency, DeviceWord


def test_only_reserved_workers_on_a_trainer_gpu_share_it():
    train = trainer_gpus(2)
    assert train == {0, 1} and trainer_gpus(0) == frozenset()
    assert shares_trainer_gpu(is_spot=False, worker_gpus=[1], train_gpus=train)
    assert shares_trainer_gpu(is_spot=False, worker_gpus=[2, 1], train_gpus=train)  # an SP group touching it
    assert not shares_trainer_gpu(is_spot=False, worker_gpus=[2], train_gpus=train)
    assert not shares_trainer_gpu(is_spot=True, worker_gpus=[0], train_gpus=train)  # another machine's GPU 0


@pytest.mark.parametrize(
    ("setting", "device", "family", "want"),
    [
        (None, "cuda", "qwen-image", True),
        (None, "cuda", "tiny", False),
        (None, "cpu", "qwen-image", False),
        (True, "cpu", "tiny", True),
        (False, "cuda", "flux", False),
    ],
)
def test_the_setting_resolves_per_worker(setting, device, family, want):
    assert offload_enabled(setting, device_type=device, family=family) is want


def test_the_coordinator_says_release_only_to_an_idle_shared_worker_while_training():
    word = lambda **kw: device_word(
        **{"enabled": True, "shares_gpu": True, "training_active": True, "leased": False} | kw
    )  # noqa: E731
    assert word() is D.RELEASE
    assert word(leased=True) is D.RECLAIM  # work in hand: the weights must be on the device
    assert word(training_active=False) is D.RECLAIM
    assert word(shares_gpu=False) is D.NONE and word(enabled=False) is D.NONE


@pytest.mark.parametrize(
    ("residency", "word", "has_work", "want"),
    [
        (R.RESIDENT, D.RELEASE, False, Move.OFFLOAD),
        (R.RELEASED, D.RELEASE, False, None),  # already released
        (R.RELEASED, D.RECLAIM, False, Move.RELOAD),  # training ended: back before the next lease
        (R.RELEASED, D.NONE, False, None),  # an agent's own reply: stay released
        (R.RELEASED, D.NONE, True, Move.RELOAD),  # work always runs on the device
        (R.RELEASED, D.RELEASE, True, Move.RELOAD),
        (R.RESIDENT, D.RECLAIM, True, None),
        (R.RESIDENT, D.NONE, False, None),
        (R.UNMANAGED, D.RELEASE, False, None),  # disabled or an older worker: never moves
    ],
)
def test_the_worker_moves(residency, word, has_work, want):
    assert next_move(residency, word.value, has_work=has_work) is want


def test_an_unknown_word_is_an_error_not_a_move():
    with pytest.raises(ValueError):
        next_move(R.RESIDENT, "sleep", has_work=False)


def test_the_update_waits_for_every_awaited_worker_or_the_timeout():
    both = {"reserved-0/gpu0": R.RELEASED, "reserved-0/gpu1": R.RESIDENT}
    assert not release_wait_over(both, started_at=10.0, now=11.0)
    assert release_wait_over(both, started_at=10.0, now=10.0 + RELEASE_TIMEOUT_S)
    assert release_wait_over({"reserved-0/gpu0": "released"}, started_at=10.0, now=10.0)
    assert release_wait_over({}, started_at=10.0, now=10.0)  # nobody shares a trainer GPU: no wait


def test_the_meter_reports_the_slowest_worker_and_starts_over():
    m = OffloadMeter()
    assert m.take() == {
        "time/offload_s": 0.0,
        "time/reload_s": 0.0,
        "time/offload_wait_s": 0.0,
        "device/offloads": 0.0,
        "device/reloads": 0.0,
    }
    m.moved("a", "offload", 1.5)
    m.moved("b", Move.OFFLOAD, 2.0)
    m.moved("a", "reload", 0.5)
    m.moved("a", "reload", 0.25)
    m.moved("b", "reload", 0.0)  # a CPU move: counted, takes no time
    m.waited(2.2)
    row = m.take()
    assert row == {
        "time/offload_s": 2.0,
        "time/reload_s": 0.75,
        "time/offload_wait_s": 2.2,
        "device/offloads": 2.0,
        "device/reloads": 3.0,
    }
    assert m.take()["device/offloads"] == 0.0
