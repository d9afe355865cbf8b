"""Honest accounting: every GPU the run holds is billed for the time it is held.

Pure Instance Manager, times given: Train Worker ranks (a hold), reserved and spot agent nodes
joining, shrinking and leaving at known times; the meter must equal the sum over every
process's GPU-seconds times its price (a GPU shared by a trainer rank and a colocated
reserved Rollout Worker counted once).
"""

from __future__ import annotations

import math

import pytest

from spotlight.core.instance_manager import InstanceManager, cost_metrics

SPOT, RESERVED = 2.87, 10.08  # USD per GPU-hour (paper Appendix A)


def _run_timeline(im: InstanceManager) -> None:
    """Trainers on 2 GPUs of host "res" over [0, 100]; a reserved agent on "res" with GPUs
    1 (shared with trainer rank 1) and 2 over [5, 90]; spot-a with 2 GPUs from 10, one GPU
    revoked at 30, gone at 50; spot-b with 1 GPU from 20, silent after 25, reaped at 40."""
    im.hold("trainers", [0, 1], 0.0, host="res")
    im.register("reserved-0", "r", [1, 2], False, 5.0, host="res")
    im.register("spot-a", "a", [0, 1], True, 10.0)
    im.register("spot-b", "b", [0], True, 20.0)
    im.heartbeat("spot-b", 25.0)
    im.heartbeat("reserved-0", 30.0)
    im.heartbeat("spot-a", 30.0, gpus=[0])
    im.heartbeat("spot-a", 38.0)
    for t in (39.0, 40.0):
        im.heartbeat("reserved-0", t)
    assert set(im.reap(40.0)) == {"spot-b"}  # 15 s silent > 10 s
    im.goodbye("spot-a", 50.0, "preempted")
    for t in range(50, 91, 5):
        im.heartbeat("reserved-0", float(t))
    im.goodbye("reserved-0", 90.0, "run finished")
    im.release("trainers", 100.0)
    im.integrate(200.0)  # nothing is held any more: no cost after 100


def test_cost_meter_equals_sum_of_every_process_gpu_seconds_times_price():
    im = InstanceManager(heartbeat_timeout_s=10.0)
    _run_timeline(im)
    # (process, GPU it runs on, seconds held, price); ("res", 1) hosts two processes
    processes = [
        ("trainer-0", ("res", 0), 100.0, RESERVED),
        ("trainer-1", ("res", 1), 100.0, RESERVED),
        ("reserved-0/gpu1", ("res", 1), 85.0, RESERVED),
        ("reserved-0/gpu2", ("res", 2), 85.0, RESERVED),
        ("spot-a/gpu0", ("spot-a", 0), 40.0, SPOT),
        ("spot-a/gpu1", ("spot-a", 1), 20.0, SPOT),
        ("spot-b/gpu0", ("spot-b", 0), 20.0, SPOT),
    ]
    per_gpu: dict[tuple, tuple[float, float]] = {}
    for _, gpu, seconds, price in processes:  # a shared GPU is paid once, for as long as anyone holds it
        per_gpu[gpu] = (max(seconds, per_gpu.get(gpu, (0.0, 0.0))[0]), price)
    expected_usd = sum(s * p for s, p in per_gpu.values()) / 3600.0
    assert im.gpu_seconds(spot=False) == pytest.approx(100 + 100 + 85)
    assert im.gpu_seconds(spot=True) == pytest.approx(40 + 20 + 20)
    assert im.cost_usd(SPOT, RESERVED) == pytest.approx(expected_usd)


def test_trainers_on_their_own_gpus_are_billed_beside_every_worker():
    """No colocation (trainers on a host of their own): the meter is the plain sum over processes."""
    im = InstanceManager(heartbeat_timeout_s=10.0)
    im.hold("trainers", [0, 1, 2, 3], 0.0, host="train-host")
    im.register("reserved-0", "r", [0], False, 0.0, host="rollout-host")  # same index, another host
    im.register("spot-a", "a", [0, 1], True, 0.0)
    im.integrate(60.0)
    assert im.billed_gpus() == {False: 5, True: 2}
    assert im.cost_usd(SPOT, RESERVED) == pytest.approx((4 * 60 * RESERVED + 60 * RESERVED + 2 * 60 * SPOT) / 3600.0)


def test_status_gpu_counts_are_the_billed_gpus_trainers_included():
    """`spotlight status` counted the agents' GPUs only, while the cost meter also bills the
    Train Workers' GPUs: the counts are now the billed GPUs, split by use."""
    im = InstanceManager(heartbeat_timeout_s=10.0)
    im.hold("trainers", [0, 1], 0.0, host="res")
    im.register("reserved-0", "r", [1, 2], False, 0.0, host="res")  # GPU 1 shared with trainer rank 1
    im.register("spot-a", "a", [0, 1], True, 0.0)
    counts = im.gpu_counts()
    assert counts == {"spot": 2, "reserved": 3, "train": 2, "reserved_rollout": 2}
    im.integrate(0.0)
    im.integrate(60.0)
    assert (
        im.gpu_seconds(spot=False) == 60.0 * counts["reserved"] and im.gpu_seconds(spot=True) == 60.0 * counts["spot"]
    )
    im.goodbye("reserved-0", 60.0, "run finished")
    assert im.gpu_counts() == {"spot": 2, "reserved": 2, "train": 2, "reserved_rollout": 0}


def test_hold_is_billed_without_any_agent_and_stops_at_release():
    im = InstanceManager(heartbeat_timeout_s=10.0)
    im.hold("trainers", [0, 1], 10.0)
    im.integrate(70.0)
    assert im.gpu_seconds(spot=False) == 120.0 and im.gpu_seconds(spot=True) == 0.0
    im.release("trainers", 100.0)
    im.integrate(500.0)
    assert im.gpu_seconds(spot=False) == 180.0
    im.release("unknown", 600.0)  # no-op
    with pytest.raises(ValueError, match="distinct"):
        im.hold("bad", [0, 0], 600.0)


def test_cost_metrics_row():
    # one reserved GPU-hour and two spot GPU-hours; 500 requests in a 50 s iteration, 2,000 so far
    row = cost_metrics(7200.0, 3600.0, SPOT, RESERVED, requests_total=2000, requests_in_iteration=500, iteration_s=50.0)
    assert row["cost/spot_usd"] == pytest.approx(2 * SPOT)
    assert row["cost/reserved_usd"] == pytest.approx(RESERVED)
    assert row["cost/usd"] == pytest.approx(2 * SPOT + RESERVED)
    assert row["cost/usd_per_1k_requests"] == pytest.approx((2 * SPOT + RESERVED) / 2.0)
    assert row["throughput/requests_per_s"] == pytest.approx(10.0)
    assert row["requests/completed"] == 500
    empty = cost_metrics(0.0, 10.0, SPOT, RESERVED, requests_total=0, requests_in_iteration=0, iteration_s=0.0)
    assert math.isnan(empty["cost/usd_per_1k_requests"]) and math.isnan(empty["throughput/requests_per_s"])


def test_simulated_rows_carry_the_same_cost_and_throughput_columns():
    """`spotlight simulate` bills the reserved node (trainers and colocated rollout) from t = 0
    and writes the coordinator's columns: the last row's cost per 1k requests is the run's."""
    import dataclasses

    from spotlight.sim.profile import load_profile
    from spotlight.sim.simulator import simulate

    profile = dataclasses.replace(
        load_profile(), prompts_per_iteration=8, num_control_prompts=2, group_size=8, train_time_s=600.0
    )
    r = simulate(profile, "spotlight", None, iterations=3)
    last = r.rows[-1]
    assert last["cost/reserved_usd"] == pytest.approx(
        profile.reserved_gpus * last["t_s"] / 3600 * profile.reserved_usd_per_gpu_hour
    )
    assert last["cost/usd"] == pytest.approx(last["cost/spot_usd"] + last["cost/reserved_usd"])
    assert sum(row["requests/completed"] for row in r.rows) == last["sim/requests_done"]
    assert last["cost/usd_per_1k_requests"] == pytest.approx(1000 * last["cost/usd"] / last["sim/requests_done"])
    for row in r.rows:
        assert row["throughput/requests_per_s"] == pytest.approx(row["requests/completed"] / row["time/iteration_s"])


def test_a_gpu_the_agent_gave_up_is_billed_but_no_rollout_capacity():
    """Was: a GPU whose workers failed every start stayed in the Planner's N_spot until its node
    left, so exploration was planned for capacity that served nothing."""
    im = InstanceManager(heartbeat_timeout_s=10.0)
    im.register("spot-a", "a", [0, 1], True, 0.0)
    assert im.num_spot_gpus() == 2
    im.heartbeat("spot-a", 5.0, workers_error="workers on GPUs [1] failed 5 starts", gpus_given_up=[1])
    assert im.num_spot_gpus() == 1 and im.nodes["spot-a"].gpus_given_up == [1]
    assert im.gpu_counts()["spot"] == 2  # still rented: still billed
    im.heartbeat("spot-a", 6.0, gpus=[0])  # the given-up GPU revoked: nothing left to discount
    assert im.num_spot_gpus() == 1
    im.heartbeat("spot-a", 7.0, gpus_given_up=[5])  # a GPU the node does not have counts for nothing
    assert im.nodes["spot-a"].gpus_given_up == [] and im.num_spot_gpus() == 1
