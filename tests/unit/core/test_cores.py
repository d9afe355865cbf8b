"""Pure cores: seed bank, tensor store, instance manager, node scheduler."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from agent.node_scheduler import NodeScheduler, WorkerStatus
from spotlight.config import REPO_ROOT
from spotlight.core.instance_manager import InstanceManager, NodeStatus
from spotlight.core.seed_bank import SeedBank, candidate_seeds, default_seeds, derive_seed, select_top_bottom
from spotlight.protocol import TensorMeta
from spotlight.store.tensor_store import TensorStore

# ---------------------------------------------------------------- seed bank


def test_derive_seed_is_stable():
    # pinned values: a change would silently change every run's seeds
    assert derive_seed(0, "default", 0, 0, 0) == 7650549
    assert derive_seed(1, "candidate", 2, 3, 4) == 669191386
    # the documented construction: blake2b-64 of "|"-joined parts, low 31 bits
    h = hashlib.blake2b(b"5|x|9", digest_size=8).digest()
    assert derive_seed(5, "x", 9) == int.from_bytes(h, "little") & 0x7FFFFFFF
    assert 0 <= derive_seed("anything") < 2**31
    # stable across processes (no PYTHONHASHSEED dependence)
    code = "from spotlight.core.seed_bank import derive_seed; print(derive_seed(1, 'candidate', 2, 3, 4))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, env={"PYTHONHASHSEED": "123"}
    )
    assert out.stdout.strip() == "669191386", out.stderr


def test_default_and_candidate_seeds_are_distinct_and_deterministic():
    d = default_seeds(0, 3, 1, 8)
    c = candidate_seeds(0, 3, 1, 24)
    assert len(d) == 8 and len(c) == 24
    assert len(set(d) | set(c)) == 32
    assert d == default_seeds(0, 3, 1, 8)
    assert default_seeds(0, 3, 2, 8) != d and default_seeds(0, 4, 1, 8) != d and default_seeds(1, 3, 1, 8) != d
    assert candidate_seeds(0, 3, 1, 4) == c[:4]


def test_select_top_bottom_picks_extremes():
    seeds = [100, 101, 102, 103, 104, 105, 106, 107]
    rewards = [0.5, 0.9, 0.1, 0.7, 0.3, 0.8, 0.0, 0.6]
    # top 2: 0.9 (101), 0.8 (105); bottom 2 in descending order: 0.1 (102), 0.0 (106)
    assert select_top_bottom(seeds, rewards, 4) == [101, 105, 102, 106]


def test_select_top_bottom_breaks_ties_by_order():
    seeds = [10, 11, 12, 13, 14, 15, 16]
    rewards = [1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
    # ranking by (-reward, index): 10, 11, 12, 13, 14, 15, 16 -> top 10, 11; bottom 15, 16
    assert select_top_bottom(seeds, rewards, 4) == [10, 11, 15, 16]
    assert select_top_bottom(seeds, [0.0] * 7, 2) == [10, 16]


def test_select_top_bottom_ignores_non_finite():
    seeds = [1, 2, 3, 4, 5, 6]
    rewards = [float("nan"), 5.0, float("inf"), 1.0, -float("inf"), 3.0]
    # only 3 finite candidates (<= K): all returned, best first
    assert select_top_bottom(seeds, rewards, 4) == [2, 6, 4]
    assert select_top_bottom(seeds, [float("nan")] * 6, 4) == []
    rewards = [float("nan"), 5.0, 4.0, 1.0, 2.0, 3.0]
    assert select_top_bottom(seeds, rewards, 2) == [2, 4]


def test_select_top_bottom_equals_a_full_sort_by_reward_then_order():
    """It picks the K/2 best and K/2 worst without sorting every candidate; the picks are
    those of sorting all finite candidates by (-reward, index) (its earlier code)."""
    import math
    import random

    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randrange(0, 40)
        rewards = [rng.choice([rng.random(), 0.0, -0.0, 0.5, 1.0, math.nan, math.inf, -math.inf]) for _ in range(n)]
        seeds = [rng.randrange(2**31) for _ in range(n)]
        k = rng.choice([0, 2, 4, 8, 16])
        ranked = sorted(((r, i) for i, r in enumerate(rewards) if math.isfinite(r)), key=lambda x: (-x[0], x[1]))
        want = ranked if len(ranked) <= k else ranked[: k // 2] + ranked[-(k // 2) :]
        assert select_top_bottom(seeds, rewards, k) == [seeds[i] for _, i in want]


def test_seed_prefix_and_seed_from_text_are_derive_seed():
    from spotlight.core.seed_bank import seed_from_text, seed_prefix

    for parts, more in [((0, "candidate", 3), (1, 7)), ((7,), ("x", 2.5)), ((), (1,)), ((True, "default"), (0, 0, 0))]:
        assert seed_from_text(seed_prefix(*parts) + "|".join(map(str, more))) == derive_seed(*parts, *more)


def test_select_top_bottom_errors():
    with pytest.raises(ValueError):
        select_top_bottom([1, 2], [1.0], 2)
    with pytest.raises(ValueError):
        select_top_bottom([1, 2, 3], [1.0, 2.0, 3.0], 3)


def test_seed_bank_fills_defaults():
    bank = SeedBank(run_seed=0, group_size=4)
    seeds, explored = bank.seeds_for(2, 1)
    assert seeds == default_seeds(0, 2, 1, 4) and explored is False

    cands = candidate_seeds(0, 2, 1, 6)
    picked = bank.record_exploration(2, 1, cands, [0.1, 0.9, 0.5, 0.3, 0.8, 0.2])
    assert picked == [cands[1], cands[4], cands[5], cands[0]]  # 0.9, 0.8 | 0.2, 0.1
    seeds, explored = bank.seeds_for(2, 1)
    assert seeds == picked and explored is True
    # other slots / iterations are unaffected
    assert bank.seeds_for(2, 0) == (default_seeds(0, 2, 0, 4), False)

    # exploration with too few finite rewards: picked ones first, defaults fill up; one
    # finite candidate selects nothing, so the slot does not count as explored
    bank.record_exploration(3, 0, [7, 8, 9], [float("nan"), 1.0, float("nan")])
    seeds, explored = bank.seeds_for(3, 0)
    assert explored is False and len(seeds) == 4
    assert seeds == [8] + default_seeds(0, 3, 0, 4)[:3]

    # a default seed that was also picked is not duplicated
    dflt = default_seeds(0, 4, 0, 4)
    bank.record_exploration(4, 0, [dflt[2]], [1.0])
    seeds, _ = bank.seeds_for(4, 0)
    assert seeds == [dflt[2], dflt[0], dflt[1], dflt[3]] and len(set(seeds)) == 4

    bank.forget(before_iteration=4)
    assert bank.seeds_for(2, 1) == (default_seeds(0, 2, 1, 4), False)
    assert bank.seeds_for(4, 0)[0][0] == dflt[2]  # kept (its explored flag: see test_seed_bank_explored_needs_d_scored)
    assert bank.explored_slots(2) == set() and bank.explored_slots(3) == set()


def test_seed_bank_explored_needs_d_scored():
    """Explored means >= d finite-reward candidates were scored for the slot: a cancelled or
    partial exploration still supplies its picks, but its group is neither the action's result
    nor the control baseline."""
    bank = SeedBank(run_seed=0, group_size=4)
    d = 8
    cands = candidate_seeds(0, 5, 0, d)
    full = [0.1 * i for i in range(d)]
    bank.record_exploration(5, 0, cands, full, required=d)
    # 6 of 8 finished (2 cancelled): picks are made, slot is not explored
    bank.record_exploration(5, 1, cands[:6], full[:6], required=d)
    # all 8 finished but one reward is NaN: 7 finite < 8
    bank.record_exploration(5, 2, cands, full[:7] + [float("nan")], required=d)
    assert bank.seeds_for(5, 0)[1] is True
    assert bank.seeds_for(5, 1) == (select_top_bottom(cands[:6], full[:6], 4), False)
    assert bank.seeds_for(5, 2)[1] is False and len(bank.seeds_for(5, 2)[0]) == 4
    assert bank.explored_slots(5) == {0}
    # without required (old callers): explored iff more than K finite candidates (a real selection)
    bank.record_exploration(6, 0, cands[:5], full[:5])
    bank.record_exploration(6, 1, cands[:4], full[:4])
    assert bank.explored_slots(6) == {0}
    with pytest.raises(ValueError, match="required"):
        bank.record_exploration(6, 2, cands, full, required=0)


# ---------------------------------------------------------------- tensor store


def test_tensor_store_weights_memory_and_disk(tmp_path):
    store = TensorStore(tmp_path, keep_versions=2).open()
    blobs = {v: bytes([v]) * (10 + v) for v in range(1, 5)}
    for v, b in blobs.items():
        store.put_weights(v, b)
    assert store.latest_version == 4
    assert store.stats()["weights_in_memory"] == [3, 4]
    for v, b in blobs.items():
        assert store.get_weights(v) == b  # 1, 2 from disk, 3, 4 from memory
    assert (tmp_path / "weights" / "v1.safetensors").read_bytes() == blobs[1]
    assert store.get_weights(99) is None
    # a new store on the same root still serves every version from disk
    fresh = TensorStore(tmp_path, keep_versions=2).open()
    assert fresh.get_weights(2) == blobs[2]
    store.prune_weights(keep_from=3)
    assert store.get_weights(1) is None and store.get_weights(2) is None
    assert store.get_weights(3) == blobs[3]
    assert not list((tmp_path / "weights").glob("*.tmp"))
    # republishing an old version does not lower latest_version
    store.put_weights(2, b"again")
    assert store.latest_version == 4 and store.get_weights(2) == b"again"


def test_tensor_store_state_put_get_delete(tmp_path):
    store = TensorStore(tmp_path).open()
    metas = [TensorMeta("latents", "float32", [2, 3]), TensorMeta("log_probs.0", "float32", [])]
    frames = [b"\x01" * 24, memoryview(b"\x02" * 4)]
    size = store.put_state("r1.L7", metas, frames)
    assert size == 28
    got = store.get_state("r1.L7")
    assert got == (metas, [b"\x01" * 24, b"\x02" * 4])
    assert store.stats()["committed_states"] == 1 and store.stats()["state_bytes"] == 28
    # disk mirror: a fresh store (e.g. after a coordinator restart) reads it back
    fresh = TensorStore(tmp_path).open()
    assert fresh.get_state("r1.L7") == got
    assert store.get_state("missing") is None
    store.delete_state("r1.L7")
    assert store.get_state("r1.L7") is None
    assert fresh.get_state("r1.L7") is None  # gone from disk too

    assert not (tmp_path / "state" / "r1.L7").exists()
    store.delete_state("r1.L7")  # idempotent


def test_tensor_store_state_write_is_whole_or_nothing(tmp_path):
    """A committed state is written to a hidden folder and renamed: one a crash cut short is
    dropped when the store opens, a second commit under the same key replaces the first whole,
    and a write that fails leaves nothing behind."""
    store = TensorStore(tmp_path).open()
    cut = tmp_path / "state" / ".r2.L1.tmp"
    cut.mkdir()
    (cut / "0.bin").write_bytes(b"\x00" * 3)
    assert TensorStore(tmp_path).open().get_state("r2.L1") is None and not cut.exists()
    store.put_state("r2.L1", [TensorMeta("a", "uint8", [2]), TensorMeta("b", "uint8", [1])], [b"ab", b"c"])
    store.put_state("r2.L1", [TensorMeta("a", "uint8", [1])], [b"z"])
    assert store.get_state("r2.L1") == ([TensorMeta("a", "uint8", [1])], [b"z"])
    assert sorted(p.name for p in (tmp_path / "state" / "r2.L1").iterdir()) == ["0.bin", "meta.json"]
    with pytest.raises(ValueError, match="1 tensor metas but 2 frames"):
        store.put_state("r2.L2", [TensorMeta("a", "uint8", [1])], [b"z", b"y"])
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["r2.L1"]
    (tmp_path / "state" / "r2.L1" / "meta.json").write_text("{not json")
    assert store.get_state("r2.L1") is None


# ---------------------------------------------------------------- instance manager


def test_instance_manager_lifecycle_and_gpu_seconds():
    im = InstanceManager(heartbeat_timeout_s=10.0)
    assert im.register("spot-a", "s1", [0, 1], True, now=0.0) == []
    assert im.register("res", "s2", [0], False, now=0.0) == []
    im.heartbeat("res", 2.0, workers={"res/gpu0": [0]})
    im.heartbeat("spot-a", 5.0, workers={"spot-a/gpu0": [0], "spot-a/gpu1": [1]})
    assert im.num_spot_gpus() == 2
    assert im.session_ok("spot-a", "s1") and not im.session_ok("spot-a", "other")

    im.integrate(10.0)
    assert im.gpu_seconds(spot=True) == 20.0 and im.gpu_seconds(spot=False) == 10.0

    # reap at t=13: "res" silent for 11 s > 10 -> dead; "spot-a" silent 8 s -> alive
    dead = im.reap(13.0)
    assert dead == {"res": ["res/gpu0"]}
    assert im.nodes["res"].status == NodeStatus.DEAD and im.nodes["spot-a"].status == NodeStatus.ALIVE
    assert im.gpu_seconds(spot=True) == 26.0 and im.gpu_seconds(spot=False) == 13.0
    assert im.reap(13.5) == {}  # already dead: not reported again

    # a GPU-scoped or hint notice does not drain the node
    im.notice("spot-a", {"scope": "gpu", "source": "x"}, 14.0)
    im.notice("spot-a", {"scope": "node", "is_hint": True, "source": "x"}, 14.0)
    assert im.nodes["spot-a"].status == NodeStatus.ALIVE
    im.notice("spot-a", {"scope": "node", "source": "gce"}, 15.0)
    assert im.nodes["spot-a"].status == NodeStatus.DRAINING
    assert im.num_spot_gpus() == 0 and im.live() == []
    assert len(im.nodes["spot-a"].notices) == 3

    # a draining node still costs money until it leaves
    assert sorted(im.goodbye("spot-a", 20.0, "preempted")) == ["spot-a/gpu0", "spot-a/gpu1"]
    assert im.gpu_seconds(spot=True) == 26.0 + 2 * 7.0
    assert im.goodbye("spot-a", 21.0, "again") == []
    assert not im.session_ok("spot-a", "s1")
    im.integrate(100.0)
    assert im.gpu_seconds(spot=True) == 40.0 and im.gpu_seconds(spot=False) == 13.0
    assert im.cost_usd(3.6, 7.2) == pytest.approx((40.0 * 3.6 + 13.0 * 7.2) / 3600.0)
    statuses = [h[0] for h in im.nodes["spot-a"].history]
    assert statuses == [NodeStatus.ALIVE, NodeStatus.DRAINING, NodeStatus.DEAD]


def test_instance_manager_reregistration_returns_stale_workers():
    im = InstanceManager(heartbeat_timeout_s=5.0)
    im.register("n", "s1", [0], True, now=0.0)
    im.heartbeat("n", 1.0, workers={"n/gpu0": [0]})
    assert im.register("n", "s2", [0, 1], True, now=2.0) == ["n/gpu0"]
    assert im.session_ok("n", "s2") and not im.session_ok("n", "s1")
    assert im.num_spot_gpus() == 2
    # after death, a re-registration has no live predecessor
    im.reap(10.0)
    assert im.register("n", "s3", [0], True, now=11.0) == []


def test_instance_manager_invalid_transitions():
    im = InstanceManager(heartbeat_timeout_s=5.0)
    im.register("n", "s", [0], True, now=0.0)
    rec = im.nodes["n"]
    with pytest.raises(ValueError):
        im._set(rec, NodeStatus.ALIVE, 1.0, "alive -> alive")
    im.notice("n", {"scope": "node", "source": "x"}, 1.0)
    with pytest.raises(ValueError):
        im._set(rec, NodeStatus.ALIVE, 2.0, "draining -> alive")
    im.goodbye("n", 3.0, "bye")
    for status in NodeStatus:
        with pytest.raises(ValueError):
            im._set(rec, status, 4.0, "dead is final")
    # public API on a dead node is a no-op, not a crash
    im.notice("n", {"scope": "node", "source": "x"}, 5.0)
    assert rec.status == NodeStatus.DEAD


def test_gpu_seconds_only_count_live_time():
    im = InstanceManager(heartbeat_timeout_s=5.0)
    im.integrate(0.0)
    im.register("n", "s", [0, 1, 2], True, now=10.0)  # nothing counted before it existed
    im.integrate(12.0)
    assert im.gpu_seconds(spot=True) == pytest.approx(3 * 2.0)
    im.integrate(12.0)  # same instant: no double count
    assert im.gpu_seconds(spot=True) == pytest.approx(6.0)


# ---------------------------------------------------------------- node scheduler


def test_plan_workers_groups():
    ns = NodeScheduler("spot-0")
    assert ns.plan_workers([3, 1, 0, 2, 4], 2) == [[0, 1], [2, 3], [4]]
    assert ns.plan_workers([1, 0], 1) == [[0], [1]]
    assert ns.plan_workers([0, 1, 2, 3], 4) == [[0, 1, 2, 3]]
    assert ns.plan_workers([], 2) == []
    assert NodeScheduler.worker_id_for("spot-0", [2, 3]) == "spot-0/gpu2+3"


def test_node_scheduler_bookkeeping():
    ns = NodeScheduler("spot-0")
    a = ns.add_worker([0])
    b = ns.add_worker([1, 2])
    assert a.worker_id == "spot-0/gpu0" and b.worker_id == "spot-0/gpu1+2"
    assert a.status == WorkerStatus.STARTING and len(ns.live_workers()) == 2
    ns.hello(a.worker_id, pid=111)
    ns.hello("unknown", pid=1)  # ignored
    assert a.status == WorkerStatus.READY and a.pid == 111

    ns.leased(a.worker_id, [("r1", 1), ("r2", 2)], now=5.0)
    ns.leased(b.worker_id, [("r3", 3)], now=6.0)
    assert a.busy_since == 5.0 and sorted(ns.in_flight()) == ["r1", "r2", "r3"]
    ns.leased(b.worker_id, [], now=9.0)
    assert b.busy_since == 6.0

    ns.finished(a.worker_id, ["r1"])
    assert a.in_flight == {"r2": 2} and a.busy_since == 5.0
    ns.finished(a.worker_id, ["r2", "never-leased"])
    assert a.in_flight == {} and a.busy_since is None
    ns.finished("unknown", ["r3"])  # ignored
    assert ns.in_flight() == ["r3"]

    assert ns.exited(b.worker_id) == [("r3", 3)]
    assert b.status == WorkerStatus.EXITED and b.in_flight == {} and b.busy_since is None
    assert ns.in_flight() == [] and [w.worker_id for w in ns.live_workers()] == [a.worker_id]
    assert ns.exited(b.worker_id) == []
    assert ns.exited("unknown") == []

    # restart in the same slot counts restarts and starts clean
    b2 = ns.add_worker([1, 2])
    # a new process never reuses an id: a late exit/message of the old one cannot hit it
    assert b2.worker_id == b.worker_id + ".r1" and b2.restarts == 1 and b2.status == WorkerStatus.STARTING
    assert ns.add_worker([1, 2]).restarts == 2
    assert ns.workers[b.worker_id].in_flight == {}
