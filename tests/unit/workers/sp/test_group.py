"""Elastic SP groups (spotlight.workers.sp.group) on CPU with gloo.

Every multi-process test spawns fresh interpreters (``spawn``) running the module-level
targets below; each process gets all of its group generations up front (fresh ports
chosen here), so the sequence is driven by the collectives themselves — no sleeps.
Results come back over a multiprocessing queue as plain numpy arrays.
"""

from __future__ import annotations

import os
import queue
import time
from multiprocessing.connection import wait

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from spotlight.config import ModelConfig, SamplerConfig
from spotlight.models.dit import build_transformer, make_velocity_fn, token_shape
from spotlight.rl.sampler import Conditioning, Sampler
from spotlight.workers.sp.group import GroupSpec, SPGroupMember, check_sp_degree
from tests.factories import cond_tensors, free_ports, make_lease_item, make_leases
from tests.unit.spawned import leave_now

TEXT_DIM = 384
TIMEOUT_S = 240  # stall detection only; a scenario takes ~10-20 s on 2 idle cores
SEEDS = [11, 12]


def _spec(members, port, gen) -> GroupSpec:
    return GroupSpec(members=tuple(members), master_addr="127.0.0.1", master_port=port, generation=gen)


def _inputs(text_tokens: int = 16):
    g = torch.Generator().manual_seed(1234)
    n_img, ch = token_shape(ModelConfig())
    latents = torch.randn(2, n_img, ch, generator=g)
    sigma = torch.tensor([0.9, 0.4])
    embeds = torch.randn(2, text_tokens, TEXT_DIM, generator=g)
    mask = torch.ones(2, text_tokens, dtype=torch.long)
    mask[1, text_tokens - 5 :] = 0  # a padded prompt
    return latents, sigma, Conditioning(embeds, mask)


def _velocity(member, text_tokens: int = 16) -> np.ndarray:
    latents, sigma, cond = _inputs(text_tokens)
    with torch.no_grad():
        return member.velocity_fn()(latents, sigma, cond).numpy()


def _reference(text_tokens: int = 16) -> np.ndarray:
    cfg = ModelConfig()
    latents, sigma, cond = _inputs(text_tokens)
    with torch.no_grad():
        return make_velocity_fn(build_transformer(cfg, TEXT_DIM), cfg)(latents, sigma, cond).numpy()


def _setup_child():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def _weights() -> dict:
    return build_transformer(ModelConfig(), TEXT_DIM).state_dict()


def _run(targets, timeout=TIMEOUT_S, *, dies: tuple[int, ...] = ()) -> dict:
    """Start one process per ``(target, args)``; collect ``(key, value)`` messages until all exit.

    ``dies``: indices of targets that are expected to exit abruptly (status 1, no ".done").
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=t, args=(q, *a), daemon=True) for t, a in targets]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    try:
        # Every target reports "<name>.done" (or "<name>.error") last; wait for all of them,
        # waking up on each message or process exit (no fixed sleeps).
        while sum(k.endswith(".done") for k in out) < len(procs) - len(dies):
            if time.monotonic() > deadline:
                pytest.fail(f"SP group processes stalled; got so far: {sorted(out)}")
            wait([q._reader] + [p.sentinel for p in procs], timeout=deadline - time.monotonic())
            while True:
                try:
                    key, value = q.get_nowait()
                except queue.Empty:
                    break
                out[key] = value
                if key.endswith(".error"):
                    pytest.fail(f"{key}: {value}")
            dead = [p for i, p in enumerate(procs) if i not in dies and p.exitcode not in (None, 0)]
            if dead and q.empty():
                pytest.fail(
                    f"a SP group process died (exit codes {[p.exitcode for p in procs]}); got so far: {sorted(out)}"
                )
        for p in procs:
            p.join(timeout)
        assert [p.exitcode for p in procs] == [1 if i in dies else 0 for i in range(len(procs))], out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return out


def _guard(q, name, fn):
    """Run ``fn`` in a spawned rank and report "<name>.done" (or "<name>.error") last.

    A rank that succeeded then exits with status 0 without the interpreter's teardown:
    gloo's and the TCP store's destructors at exit can abort a process whose peer is
    tearing down at the same moment ("terminate called without an active exception",
    SIGABRT after every result was in: seen in a full run), as in ``tests/unit/spawned``.
    The queue's feeder thread is drained first so no message is lost."""
    try:
        fn()
    except BaseException:  # report instead of dying silently
        import traceback

        q.put((f"{name}.error", traceback.format_exc()))
        raise
    q.put((f"{name}.done", True))
    q.close()
    q.join_thread()
    leave_now()


# ---------------------------------------------------------------- child targets


def _t_match(q, rank, ports):
    """SP=2 forward twice (re-form with a fresh model object), plus an odd text length."""
    _setup_child()

    def body():
        m = SPGroupMember(ModelConfig(), f"w{rank}", torch.device("cpu"))
        m.form(_spec(["w0", "w1"], ports[0], 1), state_dict=_weights() if rank == 0 else None)
        q.put((f"r{rank}.source1", m.weights_source))
        q.put((f"r{rank}.v1", _velocity(m)))
        first_model = m.model
        m.form(_spec(["w0", "w1"], ports[1], 2), state_dict=None)  # enable_parallelism on a new object
        q.put((f"r{rank}.fresh_model", m.model is not first_model and m.model._parallel_config is not None))
        q.put((f"r{rank}.source2", m.weights_source))
        q.put((f"r{rank}.v2", _velocity(m)))
        q.put((f"r{rank}.v_odd_text", _velocity(m, text_tokens=15)))
        m.leave()

    _guard(q, f"r{rank}", body)


def _t_shrink(q, rank, ports):
    _setup_child()

    def body():
        m = SPGroupMember(ModelConfig(), f"w{rank}", torch.device("cpu"))
        m.form(_spec(["w0", "w1"], ports[0], 1), state_dict=_weights())
        q.put((f"r{rank}.v_sp2", _velocity(m)))
        if rank == 1:  # the revoked GPU: only this process exits
            m.leave()
            return
        m.form(_spec(["w0"], ports[1], 2))  # survivor re-forms alone from memory
        q.put(("r0.source", m.weights_source))
        q.put(("r0.degree", m.sp_degree))
        q.put(("r0.v_sp1", _velocity(m)))
        m.leave()

    _guard(q, f"r{rank}", body)


def _t_grow(q, who, ports):
    _setup_child()

    def body():
        if who == "old":
            m = SPGroupMember(ModelConfig(), "w0", torch.device("cpu"))
            m.form(_spec(["w0"], ports[0], 1), state_dict=_weights(), version=7)
            q.put(("old.v_sp1", _velocity(m)))
        else:
            m = SPGroupMember(ModelConfig(), "w1", torch.device("cpu"))
        m.form(_spec(["w0", "w1"], ports[1], 2))
        q.put((f"{who}.source", m.weights_source))
        q.put((f"{who}.version", m.weights_version))
        q.put((f"{who}.weights", {k: v.numpy().copy() for k, v in m.state_dict().items()}))
        q.put((f"{who}.v_sp2", _velocity(m)))
        m.leave()

    _guard(q, who, body)


def _trajectory_inputs():
    sampler = Sampler(SamplerConfig(), token_shape(ModelConfig()))
    _, _, cond = _inputs()
    return sampler, cond


def _t_trajectory(q, role, ports):
    """Leader denoises 3 steps at SP=2, 3 at SP=1 (follower revoked), the rest at SP=2 (new joiner)."""
    _setup_child()
    from spotlight.workers.sp.group import release_followers, run_group_batch, serve_until_released

    def body():
        cfg = ModelConfig()
        if role == "leader":
            sampler, cond = _trajectory_inputs()
            m = SPGroupMember(cfg, "w0", torch.device("cpu"))
            m.form(_spec(["w0", "w1"], ports[0], 1), state_dict=_weights())
            state = sampler.initial_state(SEEDS)
            run_group_batch(m, sampler, state, cond, stop_at=3)
            release_followers(m)
            q.put(("leader.step_sp2", state.step))
            m.form(_spec(["w0"], ports[1], 2))  # shrink: rank 1 is gone
            q.put(("leader.source_sp1", m.weights_source))
            run_group_batch(m, sampler, state, cond, stop_at=6)
            q.put(("leader.step_sp1", state.step))
            m.form(_spec(["w0", "w2"], ports[2], 3))  # grow: w2 joins and receives weights
            run_group_batch(m, sampler, state, cond)
            release_followers(m)
            q.put(("leader.final", state.latents.numpy()))
            q.put(("leader.step", state.step))
            q.put(("leader.n_log_probs", len(state.log_probs)))
            m.leave()
        elif role == "follower":
            m = SPGroupMember(cfg, "w1", torch.device("cpu"))
            m.form(_spec(["w0", "w1"], ports[0], 1))
            q.put(("follower.source", m.weights_source))
            q.put(("follower.batches", serve_until_released(m)))
            m.leave()  # revoked: exits
        else:
            m = SPGroupMember(cfg, "w2", torch.device("cpu"))
            m.form(_spec(["w0", "w2"], ports[2], 3))  # waits in rendezvous until the leader re-forms
            q.put(("joiner.source", m.weights_source))
            q.put(("joiner.batches", serve_until_released(m)))
            m.leave()

    _guard(q, role, body)


def _t_hard_revoke(q, role, ports):
    """The follower's process dies abruptly inside a batch (GPU revoked without notice)."""
    _setup_child()
    from spotlight.workers.sp.group import SPGroupError, run_group_batch, serve_batch

    def body():
        cfg = ModelConfig()
        if role == "leader":
            sampler, cond = _trajectory_inputs()
            m = SPGroupMember(cfg, "w0", torch.device("cpu"), timeout_s=60)
            m.form(_spec(["w0", "w1"], ports[0], 1), state_dict=_weights())
            state = sampler.initial_state(SEEDS)
            with pytest.raises(SPGroupError, match="broke at step 2"):
                run_group_batch(m, sampler, state, cond)
            # rolled back to the last completed step: nothing half-applied
            q.put(
                (
                    "leader.broken_at",
                    (state.step, len(state.window_latents), len(state.log_probs), state.computed_steps.tolist()),
                )
            )
            m.form(_spec(["w0"], ports[1], 2))
            q.put(("leader.source", m.weights_source))
            run_group_batch(m, sampler, state, cond)
            q.put(("leader.final", state.latents.numpy()))
            q.put(("leader.step", state.step))
            m.leave()
        else:
            m = SPGroupMember(cfg, "w1", torch.device("cpu"), timeout_s=60)
            m.form(_spec(["w0", "w1"], ports[0], 1))
            inner = m.velocity_fn()
            calls = []

            def dying_velocity(*args):
                calls.append(1)
                if len(calls) == 3:  # inputs of step 2 received, forward not joined
                    os._exit(1)
                return inner(*args)

            m.velocity_fn = lambda: dying_velocity
            serve_batch(m)

    _guard(q, role, body)


EXPLORE_SAMPLER = SamplerConfig(num_steps=10, sde_window_start=0, sde_window_size=2, noise_level=1.0)
# (kind, cache threshold): with the random-init tiny model a single worker computes 5 of 10
# steps at 0.5 and only the first at 100; a rollout never caches, whatever its params say
CACHE_CASES = [("explore", 0.5), ("explore", 100.0), ("rollout", 100.0), ("explore", 0.0)]


def _cache_tensors() -> dict:
    return cond_tensors(_inputs()[2])


def _cache_outcomes(executor) -> dict:
    """(computed steps, images) per CACHE_CASES entry, run one after the other on ``executor``."""
    out = {}
    for kind, thr in CACHE_CASES:
        msg, frames = executor.run(
            "w0", make_leases(kind, [51, 52], params={"cache_threshold": thr}), _cache_tensors()
        ).result
        from spotlight import protocol as P
        from spotlight.store.tensor_wire import unpack_tensors

        _, body, payload = P.decode(P.encode(msg, frames))
        out[(kind, thr)] = (
            [it.computed_steps for it in body.items],
            unpack_tensors(body.tensors, payload)["images"].numpy(),
        )
        out[("num_gpus", kind, thr)] = body.num_gpus
    return out


def _t_group_cache(q, role, ports):
    """An SP=2 group (GroupExecutor leader + group_worker.serve follower) runs CACHE_CASES."""
    _setup_child()
    from spotlight.workers.sp.group import release_followers
    from spotlight.workers.sp.group_worker import GroupExecutor, serve

    def body():
        rank = 0 if role == "leader" else 1
        m = SPGroupMember(ModelConfig(), f"w{rank}", torch.device("cpu"))
        weights = _weights() if rank == 0 else None
        m.form(_spec(["w0", "w1"], ports[0], 1), state_dict=weights, version=3 if rank == 0 else None)
        if role == "leader":
            ex = GroupExecutor(m, EXPLORE_SAMPLER, reform=lambda form: True)
            ex.add_version(3, weights)
            q.put(("leader.outcomes", _cache_outcomes(ex)))
            q.put(("leader.degree", m.sp_degree))
            release_followers(m)
        else:
            serve(m)
        m.leave()

    _guard(q, role, body)


# ---------------------------------------------------------------- tests


@pytest.mark.procs
def test_sp_group_exploration_honours_first_block_cache_like_a_single_worker():
    """Exploration on an SP group ran every step whatever its cache
    threshold (GroupExecutor ignored it). Now the group caches with a group-wide decision
    and reports the same computed steps as a single worker for the same request; rollouts
    stay at full fidelity."""
    from spotlight.workers.rollout.worker import RolloutExecutor

    ports = free_ports(1)
    out = _run([(_t_group_cache, ("leader", ports)), (_t_group_cache, ("follower", ports))])
    group = out["leader.outcomes"]
    assert out["leader.degree"] == 2
    single_ex = RolloutExecutor(ModelConfig(), EXPLORE_SAMPLER, text_dim=TEXT_DIM)
    single_ex.add_version(3, _weights())
    single = _cache_outcomes(single_ex)
    T = EXPLORE_SAMPLER.num_steps
    for case in CACHE_CASES:
        steps, images = group[case]
        assert steps == single[case][0], (case, steps, single[case][0])
        assert np.abs(images.astype(int) - single[case][1].astype(int)).max() <= 1, case
    assert group[("explore", 0.5)][0] == [5, 5]  # fewer computed steps than T, as profiled
    assert group[("explore", 100.0)][0] == [1, 1]
    assert group[("rollout", 100.0)][0] == [T, T]  # never cached
    assert group[("explore", 0.0)][0] == [T, T]
    # the Result says how many GPUs the batch occupied (the Planner's t_step is in GPU-seconds)
    assert all(group[("num_gpus", *case)] == 2.0 for case in CACHE_CASES)
    assert all(single[("num_gpus", *case)] == 1.0 for case in CACHE_CASES)


@pytest.mark.procs
def test_sp2_matches_sp1_and_reform_builds_a_fresh_model():
    ports = free_ports(2)
    out = _run([(_t_match, (r, ports)) for r in range(2)])
    ref = _reference()
    assert out["r0.source1"] == "given" and out["r1.source1"] == "broadcast"
    assert out["r0.source2"] == out["r1.source2"] == "memory"
    for r in range(2):
        np.testing.assert_allclose(out[f"r{r}.v1"], ref, atol=1e-5, rtol=0)
        np.testing.assert_allclose(out[f"r{r}.v2"], ref, atol=1e-5, rtol=0)
        assert out[f"r{r}.fresh_model"] is True
        # 15 text tokens: padded with masked tokens to 16 at SP=2, same result as SP=1 unpadded
        np.testing.assert_allclose(out[f"r{r}.v_odd_text"], _reference(text_tokens=15), atol=1e-5, rtol=0)


@pytest.mark.procs
def test_shrink_2_to_1_reuses_weights_in_memory():
    ports = free_ports(2)
    out = _run([(_t_shrink, (r, ports)) for r in range(2)])
    ref = _reference()
    np.testing.assert_allclose(out["r0.v_sp2"], ref, atol=1e-5, rtol=0)
    assert out["r0.source"] == "memory"
    assert out["r0.degree"] == 1
    np.testing.assert_allclose(out["r0.v_sp1"], ref, atol=1e-5, rtol=0)
    assert "r1.done" in out


@pytest.mark.procs
def test_grow_1_to_2_broadcasts_weights_from_peer():
    ports = free_ports(2)
    out = _run([(_t_grow, ("old", ports)), (_t_grow, ("new", ports))])
    ref = _reference()
    assert out["old.source"] == "memory"
    assert out["new.source"] == "broadcast"
    assert out["new.version"] == out["old.version"] == 7
    src, got = out["old.weights"], out["new.weights"]
    assert sorted(src) == sorted(got)
    for k in src:
        assert src[k].dtype == got[k].dtype and np.array_equal(src[k], got[k]), k
    np.testing.assert_allclose(out["old.v_sp1"], ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out["old.v_sp2"], ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out["new.v_sp2"], ref, atol=1e-5, rtol=0)


@pytest.mark.procs
def test_trajectory_survives_sp_2_1_2():
    ports = free_ports(3)
    out = _run([(_t_trajectory, (role, ports)) for role in ("leader", "follower", "joiner")])
    sampler, cond = _trajectory_inputs()
    cfg = ModelConfig()
    ref_state = sampler.initial_state(SEEDS)
    with torch.no_grad():
        sampler.run(ref_state, make_velocity_fn(build_transformer(cfg, TEXT_DIM), cfg), cond)
    assert out["leader.step_sp2"] == 3 and out["leader.step_sp1"] == 6
    assert out["leader.step"] == sampler.cfg.num_steps
    assert out["leader.n_log_probs"] == sampler.cfg.sde_window_size
    assert out["leader.source_sp1"] == "memory"
    assert out["follower.source"] == out["joiner.source"] == "broadcast"
    assert out["follower.batches"] == 1 and out["joiner.batches"] == 1
    np.testing.assert_allclose(out["leader.final"], ref_state.latents.numpy(), atol=1e-4, rtol=0)


def test_bad_sp_degree_raises_before_any_collective():
    cfg = ModelConfig()  # 2 heads, 256 image tokens
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_sp_degree(cfg, 3)
    m = SPGroupMember(cfg, "w0", torch.device("cpu"))
    with pytest.raises(ValueError, match="SP degree 3"):
        m.form(_spec(["w0", "w1", "w2"], 1, 1), state_dict={})  # no rendezvous is attempted
    with pytest.raises(ValueError, match="not a member"):
        m.form(_spec(["w1"], 1, 1))
    with pytest.raises(ValueError, match="image tokens"):
        check_sp_degree(ModelConfig(image_size=34, patch_size=2, num_attention_heads=2), 2)  # 17² tokens
    check_sp_degree(cfg, 2)
    assert m.sp_degree == 0 and m.model is None


@pytest.mark.procs
def test_hard_revoke_mid_batch_rolls_back_and_continues_alone():
    ports = free_ports(2)
    out = _run([(_t_hard_revoke, ("leader", ports)), (_t_hard_revoke, ("follower", ports))], dies=(1,))
    sampler, cond = _trajectory_inputs()
    cfg = ModelConfig()
    ref_state = sampler.initial_state(SEEDS)
    with torch.no_grad():
        sampler.run(ref_state, make_velocity_fn(build_transformer(cfg, TEXT_DIM), cfg), cond)
    # steps 0 and 1 done; step 2's window latent entry and computed count were undone
    assert out["leader.broken_at"] == (2, 3, 2, [2, 2])
    assert out["leader.source"] == "memory"
    assert out["leader.step"] == sampler.cfg.num_steps
    np.testing.assert_allclose(out["leader.final"], ref_state.latents.numpy(), atol=1e-4, rtol=0)


def test_version_switch_keeps_the_older_version_and_sp1_needs_no_process_group():
    """A leader switching v0 → v1 → v0 (exploration keeps v_n while rollouts use v_n+1) must
    not overwrite the v0 tensors it keeps (the model used to be loaded in place over them).
    A group of one forms without a process group and reuses its plain model object."""
    import torch.distributed as dist

    from spotlight.workers.sp.group_worker import broadcast_weights

    _setup_child()
    cfg = ModelConfig()
    a = build_transformer(cfg, TEXT_DIM, seed=1).state_dict()
    b = build_transformer(cfg, TEXT_DIM, seed=2).state_dict()
    a_copy = {k: v.clone() for k, v in a.items()}
    m = SPGroupMember(cfg, "w0", torch.device("cpu"))
    m.form(_spec(["w0"], 1, 1), state_dict=a, version=0)  # port 1: never bound at SP 1
    assert not dist.is_initialized() and m.form_timings_s["rendezvous"] < 1.0
    v0 = m.state_dict()
    ref_a = _velocity(m)
    plain = m.model
    broadcast_weights(m, b, 1)
    assert m.weights_version == 1 and m.model is plain
    ref_b = _velocity(m)
    assert not np.allclose(ref_a, ref_b)
    for k in a:
        assert torch.equal(a[k], a_copy[k]) and torch.equal(v0[k], a_copy[k]), k
    broadcast_weights(m, v0, 0)  # back to v0: its views are adopted, not copied
    np.testing.assert_array_equal(_velocity(m), ref_a)
    assert all(m.state_dict()[k].data_ptr() == v0[k].data_ptr() for k in v0)
    m.form(_spec(["w0"], 1, 2))
    assert m.model is plain and m.weights_source == "memory"
    np.testing.assert_array_equal(_velocity(m), ref_a)
    m.leave()


def test_prewarmed_spare_member_is_reassigned_and_receives_into_its_buffers():
    """A warm spare's member: layout and pre-faulted receive buffers before it has an id."""
    from spotlight.workers.sp.group import _layout

    cfg = ModelConfig()
    m = SPGroupMember(cfg, "spare", torch.device("cpu"))
    m.prewarm()
    entries = m._skeleton_entries()
    want = sorted(build_transformer(cfg, TEXT_DIM).state_dict())
    assert [n for n, _, _ in entries] == want
    assert {dt: t.numel() for dt, t in m._recv_flat.items()} == {dt: n for dt, n, _ in _layout(entries)}
    m.reassign("node/gpu1.r1", "cpu")
    assert m.worker_id == "node/gpu1.r1" and m._recv_flat is not None
    m.form(_spec(["node/gpu1.r1"], 1, 1), state_dict=_weights(), version=3)
    with pytest.raises(RuntimeError, match="in use"):
        m.reassign("other", "cpu")
    m.leave()


def test_leader_alone_abandons_its_step_for_a_join_and_the_result_is_unchanged(monkeypatch):
    """A GROUP_FORM arriving mid-step at SP 1 (a GPU granted): the leader stops between two
    transformer blocks, the step restarts from its beginning in the new generation, and the
    request's result is the uninterrupted one."""
    from spotlight import protocol as P
    from spotlight.workers.rollout.worker import RolloutExecutor
    from spotlight.workers.sp import group_worker as GW

    _setup_child()
    cfg, scfg = ModelConfig(), SamplerConfig()
    weights = _weights()
    m = SPGroupMember(cfg, "w0", torch.device("cpu"))
    m.form(_spec(["w0"], 1, 1), state_dict=weights, version=0)
    abandoned = []
    monkeypatch.setattr(GW._JoinPending, "__init__", lambda self, *a: abandoned.append(m.model is not None))

    def reform(form):
        m.form(_spec(form.members, 1, form.generation))
        return True

    ex = GW.GroupExecutor(m, scfg, reform)
    ex.versions[0] = m.state_dict()
    calls = []

    def should_stop():
        calls.append(1)
        if len(calls) == 5:  # step boundary, 2 blocks, boundary, then the first block of step 1
            ex.pending_form = P.GroupForm(members=["w0"], master_addr="127.0.0.1", master_port=1, generation=2)
        return False

    _, _, cond = _inputs()
    tensors = cond_tensors(cond, slice(0, 1))
    item = make_lease_item("r", lease_id=1, seed=SEEDS[0])
    got = ex.run("w0", P.Leases(worker_id="w0", items=[item]), dict(tensors), should_stop=should_stop).result
    ref_ex = RolloutExecutor(cfg, scfg)
    ref_ex.add_version(0, weights)
    ref = ref_ex.run("ref", P.Leases(worker_id="ref", items=[item]), dict(tensors)).result
    assert abandoned == [True] and m.spec.generation == 2
    from spotlight.store.tensor_wire import unpack_tensors

    a, b = unpack_tensors(got[0].tensors, got[1]), unpack_tensors(ref[0].tensors, ref[1])
    torch.testing.assert_close(a["window_latents"], b["window_latents"], atol=1e-5, rtol=0)
    torch.testing.assert_close(a["log_probs"], b["log_probs"], atol=1e-4, rtol=1e-6)
    m.leave()


def test_a_broken_nccl_group_is_aborted_not_waited_on(monkeypatch):
    """On a peer's death an NCCL survivor must abort its communicator (``ncclCommAbort``) before
    anything waits on it: ``destroy_process_group`` on a communicator whose peer died blocks until
    the timeout and lets the watchdog kill the survivor with its batch. Gloo notices a dead peer by
    itself and is destroyed as before. (No NCCL here: torch.distributed is stood in for.)"""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    calls, state = [], {"init": True}

    def abort(group=None):
        calls.append("abort")
        state["init"] = False  # torch clears its process-group table on an abort of the world

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: state["init"])
    monkeypatch.setattr(c10d, "_abort_process_group", abort)

    def destroy(group=None):
        calls.append("destroy")
        state["init"] = False

    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    m = SPGroupMember(ModelConfig(), "w0", torch.device("cpu"))
    m.backend = "nccl"
    m.mark_broken()
    m.leave()
    assert calls == ["abort"] and not m._broken
    calls.clear()
    state["init"] = True
    m.leave()  # a healthy group (released by its leader) is destroyed normally
    assert calls == ["destroy"]
    calls.clear()
    state["init"] = True
    m._peer_died(12345)  # the PeerWatch callback aborts at once, from its thread
    assert calls == ["abort"] and m._broken
    m.backend, state["init"] = "gloo", True
    calls.clear()
    m.leave()
    assert calls == ["destroy"]


@pytest.mark.procs
def test_peer_watch_reports_a_dead_peer_even_before_its_parent_reaps_it():
    import subprocess
    import sys
    import threading

    from spotlight.workers.sp.group import PeerWatch

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    seen, fired = [], threading.Event()
    watch = PeerWatch([peer.pid], lambda pid: (seen.append(pid), fired.set()), interval_s=0.02)
    try:
        assert not fired.wait(0.2)  # alive: nothing happens
        peer.kill()  # not reaped yet: a zombie counts as dead
        assert fired.wait(30), "the watch did not notice the dead peer"
        assert seen == [peer.pid]
    finally:
        watch.stop()
        peer.wait()
