"""Flow-GRPO SDE sampler: step maths, seeded noise, resumable state, executor.

Maths reference: docs/flow-grpo.md §1.2 (the "sde" step of Flow-GRPO).
The transformer is the tiny pixel-space Qwen-Image DiT with seeded random weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from spotlight import protocol as P
from spotlight.config import ModelConfig, SamplerConfig
from spotlight.models.dit import build_transformer, make_velocity_fn, token_shape
from spotlight.rl.sampler import (
    DenoiseState,
    Sampler,
    make_sigmas,
    sde_step,
    seeded_noise,
    window_steps,
)
from spotlight.store.tensor_wire import pack_tensors, unpack_tensors
from spotlight.workers.rollout.worker import RolloutExecutor
from tests.factories import cond_tensors, make_conditioning, make_leases

TEXT_DIM = 16  # the width of tests.factories.make_conditioning's embeddings (5 tokens)
# 8x8 pixels -> 16 tokens x 12 channels: keeps every transformer call cheap on 2 cores.
SMALL_MODEL = ModelConfig(image_size=8)
# 5 steps, SDE on steps 1..2 (steps 0, 3, 4 are Euler): exercises both step kinds.
SAMPLER_CFG = SamplerConfig(num_steps=5, sde_window_start=1, sde_window_size=2, noise_level=0.8)
SEEDS = [101, 7, 123456789, 2**40 + 3]


@pytest.fixture(scope="module")
def velocity_fn():
    model = build_transformer(SMALL_MODEL, TEXT_DIM)
    return make_velocity_fn(model, SMALL_MODEL)


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    return Sampler(SAMPLER_CFG, token_shape(SMALL_MODEL))


def _run(sampler: Sampler, velocity_fn, seeds, cond, **kw) -> DenoiseState:
    with torch.no_grad():
        return sampler.run(sampler.initial_state(seeds), velocity_fn, cond, **kw)


# ---------------------------------------------------------------- sde_step maths


def _reference_mean_std(x, v, sigma, sigma_next, sigma1, eta):
    """docs/flow-grpo.md §1.2, written out independently of the product code."""
    dt = sigma_next - sigma
    s_tilde = sigma1 if sigma == 1.0 else sigma
    std_dev_t = eta * math.sqrt(sigma / (1.0 - s_tilde))
    mean = x * (1 + std_dev_t**2 * dt / (2 * sigma)) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t * math.sqrt(-dt)


@pytest.mark.parametrize("j", [0, 1, 3, 5])
@pytest.mark.parametrize("eta", [0.7, 1.2])
def test_sde_step_log_prob_is_the_gaussian_density(j, eta):
    sigmas = make_sigmas(8, 3.0)
    sigma, sigma_next, sigma1 = float(sigmas[j]), float(sigmas[j + 1]), float(sigmas[1])
    assert (sigma == 1.0) == (j == 0)
    g = torch.Generator().manual_seed(j)
    x = torch.randn(3, 6, 4, generator=g)
    v = torch.randn(3, 6, 4, generator=g)
    eps = torch.randn(3, 6, 4, generator=g)

    res = sde_step(v, x, sigma, sigma_next, sigma1, eta, noise=eps)
    mean, std = _reference_mean_std(x, v, sigma, sigma_next, sigma1, eta)
    assert res.std == pytest.approx(std, rel=1e-12)
    if j == 0:
        # closed form at sigma = 1: the per-step noise std is exactly eta
        assert res.std == pytest.approx(eta, rel=1e-6)
    torch.testing.assert_close(res.mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(res.prev_sample, mean + std * eps, rtol=1e-6, atol=1e-6)
    assert res.log_prob.dtype == torch.float32 and res.log_prob.shape == (3,)
    ref = torch.distributions.Normal(res.mean, res.std).log_prob(res.prev_sample).mean(dim=(1, 2))
    torch.testing.assert_close(res.log_prob, ref, rtol=1e-6, atol=1e-6)

    # given prev_sample (training): same density, evaluated at the stored sample
    stored = torch.randn(3, 6, 4, generator=g)
    res2 = sde_step(v, x, sigma, sigma_next, sigma1, eta, prev_sample=stored)
    assert torch.equal(res2.prev_sample, stored)
    ref2 = torch.distributions.Normal(res2.mean, res2.std).log_prob(stored).mean(dim=(1, 2))
    torch.testing.assert_close(res2.log_prob, ref2, rtol=1e-6, atol=1e-6)
    # and evaluating the step's own sample reproduces the sampled log-prob exactly
    res3 = sde_step(v, x, sigma, sigma_next, sigma1, eta, prev_sample=res.prev_sample)
    assert torch.equal(res3.log_prob, res.log_prob)


def test_sde_step_computes_in_float32_from_bf16_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, generator=g)
    v = torch.randn(2, 4, 3, generator=g)
    eps = torch.randn(2, 4, 3, generator=g)
    res = sde_step(v.bfloat16(), x.bfloat16(), 0.8, 0.6, 0.9, 1.0, noise=eps)
    assert res.mean.dtype == res.prev_sample.dtype == res.log_prob.dtype == torch.float32


def test_sde_step_needs_noise_or_prev_sample():
    x = torch.zeros(1, 2, 2)
    with pytest.raises(ValueError):
        sde_step(x, x, 0.5, 0.25, 0.9, 1.0)


def test_eta_zero_is_exactly_euler():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 3, generator=g)
    v = torch.randn(2, 5, 3, generator=g)
    sigma, sigma_next = 0.75, 0.5
    res = sde_step(v, x, sigma, sigma_next, 0.9, 0.0)
    assert torch.equal(res.prev_sample, x + v * (sigma_next - sigma))
    assert torch.equal(res.mean, res.prev_sample)
    assert res.log_prob is None and res.std == 0.0


def test_advance_outside_window_records_nothing_and_full_run_fills_window(sampler, velocity_fn):
    cond = make_conditioning(2)
    state = sampler.initial_state(SEEDS[:2])
    window = window_steps(SAMPLER_CFG)
    assert list(window) == [1, 2]
    with torch.no_grad():
        sampler.advance(state, velocity_fn, cond)  # step 0: Euler, before the window
        assert state.step == 1 and state.log_probs == [] and state.window_latents == []
        entering = state.latents.clone()
        sampler.advance(state, velocity_fn, cond)  # step 1: first SDE step
        assert len(state.log_probs) == 1 and len(state.window_latents) == 2
        assert torch.equal(state.window_latents[0], entering)
        assert torch.equal(state.window_latents[1], state.latents)
        sampler.advance(state, velocity_fn, cond)  # step 2: last SDE step
        sampler.advance(state, velocity_fn, cond)  # step 3: Euler after the window
        assert len(state.log_probs) == 2 and len(state.window_latents) == 3
        sampler.run(state, velocity_fn, cond)
    assert state.step == SAMPLER_CFG.num_steps
    assert len(state.log_probs) == SAMPLER_CFG.sde_window_size
    assert len(state.window_latents) == SAMPLER_CFG.sde_window_size + 1
    assert all(lp.shape == (2,) and torch.isfinite(lp).all() for lp in state.log_probs)
    assert torch.equal(state.computed_steps, torch.full((2,), SAMPLER_CFG.num_steps))
    with pytest.raises(ValueError):
        sampler.advance(state, velocity_fn, cond)


def test_eta_is_zero_outside_the_window(sampler):
    etas = [sampler.eta(j) for j in range(SAMPLER_CFG.num_steps)]
    assert etas == [0.0, 0.8, 0.8, 0.0, 0.0]


# ---------------------------------------------------------------- seeded noise


@pytest.mark.parametrize("step", [-1, 0, 3])
def test_seeded_noise_row_is_independent_of_batch(step):
    shape = (16, 12)
    batch = seeded_noise(SEEDS, step, shape)
    reordered = seeded_noise(list(reversed(SEEDS)), step, shape)
    assert batch.shape == (len(SEEDS), *shape) and batch.dtype == torch.float32
    for i, s in enumerate(SEEDS):
        alone = seeded_noise([s], step, shape)[0]
        assert torch.equal(alone, batch[i])
        assert torch.equal(alone, reordered[len(SEEDS) - 1 - i])
    # a batch with other company still gives the same row
    mixed = seeded_noise([999, SEEDS[2], 5], step, shape)
    assert torch.equal(mixed[1], batch[2])


def test_seeded_noise_differs_across_seed_and_step():
    shape = (16, 12)
    draws = {(s, k): seeded_noise([s], k, shape)[0] for s in (1, 2, 3) for k in (-1, 0, 1, 2)}
    keys = list(draws)
    for a in range(len(keys)):
        for b in range(a + 1, len(keys)):
            assert not torch.equal(draws[keys[a]], draws[keys[b]]), (keys[a], keys[b])
    # repeated draws are identical (no hidden global RNG)
    torch.manual_seed(123)
    again = seeded_noise([2], 1, shape)[0]
    assert torch.equal(again, draws[(2, 1)])


# ---------------------------------------------------------------- trajectories


def test_trajectory_alone_matches_its_row_in_a_batch(sampler, velocity_fn):
    cond = make_conditioning(len(SEEDS))
    batched = _run(sampler, velocity_fn, SEEDS, cond)
    diffs = []
    for i, s in enumerate(SEEDS):
        alone = _run(sampler, velocity_fn, [s], cond.index([i]))
        diffs.append(float((alone.latents[0] - batched.latents[i]).abs().max()))
        # The transformer is not bit batch-invariant on CPU (observed ~5e-7); the seeded
        # noise itself is (see above), so the trajectories agree to float32 round-off.
        torch.testing.assert_close(alone.latents[0], batched.latents[i], rtol=0, atol=1e-5)
        for w_alone, w_batch in zip(alone.window_latents, batched.window_latents):
            torch.testing.assert_close(w_alone[0], w_batch[i], rtol=0, atol=1e-5)
        for lp_alone, lp_batch in zip(alone.log_probs, batched.log_probs):
            torch.testing.assert_close(lp_alone[0], lp_batch[i], rtol=0, atol=1e-4)
    print(f"alone-vs-batched max |diff| per seed: {diffs}")


def test_denoise_state_select_concat_tensors_round_trip(sampler, velocity_fn):
    cond = make_conditioning(3)
    steps = iter(range(100))
    state = _run(sampler, velocity_fn, SEEDS[:3], cond, should_stop=lambda st: next(steps) >= 3)
    assert state.step == 3 and len(state.log_probs) == 2

    a, b = state.select([0, 2]), state.select([1])
    assert a.seeds == [SEEDS[0], SEEDS[2]] and b.seeds == [SEEDS[1]]
    joined = DenoiseState.concat([a, b])
    order = [0, 2, 1]
    assert joined.seeds == [SEEDS[i] for i in order] and joined.step == 3
    assert torch.equal(joined.latents, state.latents[order])
    for w_j, w in zip(joined.window_latents, state.window_latents):
        assert torch.equal(w_j, w[order])
    for lp_j, lp in zip(joined.log_probs, state.log_probs):
        assert torch.equal(lp_j, lp[order])
    assert torch.equal(joined.computed_steps, state.computed_steps[order])

    # select copies: mutating the sub-state leaves the parent untouched
    a.latents += 1.0
    assert not torch.equal(a.latents[0], state.latents[0])

    tensors = state.tensors()
    assert set(tensors) == {
        "latents",
        "computed_steps",
        "window_latents.0",
        "window_latents.1",
        "window_latents.2",
        "log_probs.0",
        "log_probs.1",
    }
    back = DenoiseState.from_tensors(state.seeds, state.step, tensors)
    assert back.seeds == state.seeds and back.step == state.step
    assert torch.equal(back.latents, state.latents)
    assert len(back.window_latents) == 3 and len(back.log_probs) == 2
    assert all(torch.equal(x, y) for x, y in zip(back.window_latents, state.window_latents))
    assert all(torch.equal(x, y) for x, y in zip(back.log_probs, state.log_probs))
    assert torch.equal(back.computed_steps, state.computed_steps)

    # and through the wire format
    metas, frames = pack_tensors(tensors)
    wired = DenoiseState.from_tensors(state.seeds, state.step, unpack_tensors(metas, frames))
    assert torch.equal(wired.latents, state.latents)
    assert all(torch.equal(x, y) for x, y in zip(wired.log_probs, state.log_probs))

    with pytest.raises(ValueError):
        DenoiseState.concat([state, sampler.initial_state([1])])
    with pytest.raises(KeyError):
        DenoiseState.from_tensors([1], 0, {})


@pytest.mark.parametrize("stop_at", [1, 2, 4])
def test_resume_from_committed_state_is_bit_identical(sampler, velocity_fn, stop_at):
    seeds = SEEDS[:3]
    cond = make_conditioning(3)
    full = _run(sampler, velocity_fn, seeds, cond)

    calls = iter(range(100))
    part = _run(sampler, velocity_fn, seeds, cond, should_stop=lambda st: next(calls) >= stop_at)
    assert part.step == stop_at
    # commit each row separately through the wire format, then rebuild the same batch
    rows = []
    for i in range(3):
        sub = part.select([i])
        metas, frames = pack_tensors(sub.tensors())
        rows.append(DenoiseState.from_tensors(sub.seeds, sub.step, unpack_tensors(metas, frames)))
    resumed = DenoiseState.concat(rows)
    with torch.no_grad():
        sampler.run(resumed, velocity_fn, cond)

    assert resumed.step == full.step
    assert torch.equal(resumed.latents, full.latents)
    assert len(resumed.log_probs) == len(full.log_probs) == SAMPLER_CFG.sde_window_size
    assert all(torch.equal(x, y) for x, y in zip(resumed.log_probs, full.log_probs))
    assert all(torch.equal(x, y) for x, y in zip(resumed.window_latents, full.window_latents))
    assert torch.equal(resumed.computed_steps, full.computed_steps)


def test_resume_single_row_matches_single_row_run(sampler, velocity_fn):
    cond = make_conditioning(1)
    full = _run(sampler, velocity_fn, [SEEDS[3]], cond)
    calls = iter(range(100))
    part = _run(sampler, velocity_fn, [SEEDS[3]], cond, should_stop=lambda st: next(calls) >= 2)
    resumed = DenoiseState.from_tensors(part.seeds, part.step, part.select([0]).tensors())
    with torch.no_grad():
        sampler.run(resumed, velocity_fn, cond)
    assert torch.equal(resumed.latents, full.latents)


def test_window_log_probs_reproduce_sampled_log_probs(sampler, velocity_fn):
    seeds = SEEDS[:3]
    cond = make_conditioning(3)
    state = _run(sampler, velocity_fn, seeds, cond)
    window = torch.stack(state.window_latents, dim=1)
    old = torch.stack(state.log_probs, dim=1)
    assert window.shape == (3, SAMPLER_CFG.sde_window_size + 1, *token_shape(SMALL_MODEL))
    with torch.no_grad():
        new, results = sampler.window_log_probs(velocity_fn, window, cond)
    assert new.shape == old.shape == (3, SAMPLER_CFG.sde_window_size)
    assert torch.equal(new, old)
    assert torch.equal(torch.exp(new - old), torch.ones_like(old))
    assert len(results) == SAMPLER_CFG.sde_window_size and all(r.std > 0 for r in results)
    with torch.no_grad():
        sub, _ = sampler.window_log_probs(velocity_fn, window, cond, step_indices=[1])
    assert torch.equal(sub[:, 0], old[:, 1])
    # a different trajectory under the same weights has a different density
    with torch.no_grad():
        shuffled, _ = sampler.window_log_probs(velocity_fn, window.flip(1), cond)
    assert not torch.equal(shuffled, old)


# ---------------------------------------------------------------- RolloutExecutor

EXEC_MODEL = ModelConfig()  # 32x32 images, 256 tokens
EXEC_SAMPLER = SamplerConfig(num_steps=4, sde_window_start=0, sde_window_size=2, noise_level=1.0)


@pytest.fixture(scope="module")
def executor() -> RolloutExecutor:
    ex = RolloutExecutor(EXEC_MODEL, EXEC_SAMPLER, text_dim=TEXT_DIM)
    ex.add_version(3, build_transformer(EXEC_MODEL, TEXT_DIM).state_dict())
    return ex


def _lease_tensors(batch: int) -> dict[str, torch.Tensor]:
    return cond_tensors(make_conditioning(batch, seed=5))


def _through_wire(msg, frames):
    """encode → decode → unpack, as the agent/coordinator would see it."""
    mtype, body, payload = P.decode(P.encode(msg, frames))
    return mtype, body, unpack_tensors(body.tensors, payload)


def test_executor_rollout_result_and_commit_resume(executor):
    seeds = [41, 42]
    L, C = token_shape(EXEC_MODEL)
    W = EXEC_SAMPLER.sde_window_size

    out = executor.run("w0", make_leases("rollout", seeds), _lease_tensors(2))
    assert out.commit is None and out.result is not None
    mtype, res, t = _through_wire(*out.result)
    assert mtype == P.MsgType.RESULT
    assert [it.request_id for it in res.items] == ["r0", "r1"]
    assert [it.lease_id for it in res.items] == [10, 11]
    assert all(it.computed_steps == EXEC_SAMPLER.num_steps for it in res.items)
    assert t["images"].shape == (2, 3, 32, 32) and t["images"].dtype == torch.uint8
    assert t["window_latents"].shape == (2, W + 1, L, C) and t["window_latents"].dtype == torch.float32
    assert t["log_probs"].shape == (2, W) and torch.isfinite(t["log_probs"]).all()

    # preemption: should_stop turns True on its 4th call (after 3 steps ran)
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) > 3

    out2 = executor.run("w0", make_leases("rollout", seeds), _lease_tensors(2), should_stop=should_stop)
    assert out2.result is None and out2.commit is not None
    mtype, commit, state_t = _through_wire(*out2.commit)
    assert mtype == P.MsgType.COMMIT
    assert [(c.request_id, c.lease_id, c.step, c.seed, c.weight_version) for c in commit.items] == [
        ("r0", 10, 3, 41, 3),
        ("r1", 11, 3, 42, 3),
    ]
    assert all(k.startswith("state.0.") or k.startswith("state.1.") for k in state_t)

    # resume (the coordinator relays the committed tensors unchanged) on the same batch
    resume = make_leases("rollout", seeds, resume_step=3)
    out3 = executor.run("w0", resume, {**_lease_tensors(2), **state_t})
    assert out3.result is not None
    _, res3, t3 = _through_wire(*out3.result)
    assert torch.equal(t3["images"], t["images"])
    assert torch.equal(t3["window_latents"], t["window_latents"])
    assert torch.equal(t3["log_probs"], t["log_probs"])
    assert [it.computed_steps for it in res3.items] == [EXEC_SAMPLER.num_steps] * 2


def test_executor_explore_with_cache_reports_computed_steps(executor):
    out = executor.run("w0", make_leases("explore", [51, 52], params={"cache_threshold": 0.5}), _lease_tensors(2))
    assert out.result is not None
    _, res, t = _through_wire(*out.result)
    assert t["images"].shape == (2, 3, 32, 32) and t["images"].dtype == torch.uint8
    assert "log_probs" not in t and "window_latents" not in t  # exploration feeds no gradient
    for it in res.items:
        assert 1 <= it.computed_steps <= EXEC_SAMPLER.num_steps
    # a threshold no step can beat: only the first forward runs its tail blocks
    out_hi = executor.run("w0", make_leases("explore", [51, 52], params={"cache_threshold": 100.0}), _lease_tensors(2))
    _, res_hi, _ = _through_wire(*out_hi.result)
    assert all(1 <= it.computed_steps < EXEC_SAMPLER.num_steps for it in res_hi.items)
    # back to a rollout (cache disabled): full fidelity again
    out2 = executor.run("w0", make_leases("rollout", [51]), _lease_tensors(1))
    _, res2, _ = _through_wire(*out2.result)
    assert res2.items[0].computed_steps == EXEC_SAMPLER.num_steps


def test_executor_explore_as_rollout_is_a_full_rollout(executor):
    """verl-omni-spot: a candidate that may become the rollout is run uncached, with the SDE
    window's latents and log-probs, bit-identical to a rollout of the same seed."""
    _, _, ref = _through_wire(*executor.run("w0", make_leases("rollout", [61, 62]), _lease_tensors(2)).result)
    out = executor.run(
        "w0", make_leases("explore", [61, 62], params={"as_rollout": True, "cache_threshold": 100.0}), _lease_tensors(2)
    )
    _, res, t = _through_wire(*out.result)
    assert all(it.computed_steps == EXEC_SAMPLER.num_steps for it in res.items)
    for name in ("images", "window_latents", "log_probs"):
        assert torch.equal(t[name], ref[name]), name


def test_executor_mixed_fresh_and_resumed_items(executor):
    """One resumed item and one fresh item in the same lease batch keep their order."""
    seeds = [61, 62]
    full = executor.run("w0", make_leases("rollout", seeds), _lease_tensors(2))
    _, _, t_full = _through_wire(*full.result)

    calls = []
    out = executor.run(
        "w0",
        make_leases("rollout", seeds),
        _lease_tensors(2),
        should_stop=lambda: bool(calls.append(1)) or len(calls) > 2,
    )
    _, commit, state_t = _through_wire(*out.commit)
    assert [c.step for c in commit.items] == [2, 2]

    leases = make_leases("rollout", seeds)
    leases.items[1].resume_step = 2  # item 0 starts over, item 1 resumes
    only_row1 = {k: v for k, v in state_t.items() if k.startswith("state.1.")}
    res = executor.run("w0", leases, {**_lease_tensors(2), **only_row1})
    _, body, t = _through_wire(*res.result)
    assert [it.request_id for it in body.items] == ["r0", "r1"]
    # rows ran in different sub-batches than in `full`: equal up to float32 round-off
    torch.testing.assert_close(t["window_latents"], t_full["window_latents"], rtol=0, atol=1e-5)
    torch.testing.assert_close(t["log_probs"], t_full["log_probs"], rtol=0, atol=1e-4)
    assert (t["images"].int() - t_full["images"].int()).abs().max() <= 1
