"""The iteration core (spotlight/core/iteration.py): the coordinator's phase machine, driven here
directly with the real Request Scheduler and seed bank, as the coordinator and the
simulator drive it."""

from __future__ import annotations

import collections
import math
import random

import pytest

from spotlight.core.busy import BusyMeter
from spotlight.core.exploration import STRATEGIES
from spotlight.core.iteration import (
    PHASE_TRANSITIONS,
    CoreObservation,
    InvalidPhaseTransition,
    IterationCore,
    IterationDone,
    IterationSettings,
    Phase,
    RolloutParked,
    StartSaving,
    StartTraining,
    build_iteration_core,
    spot_nodes_missing,
)
from spotlight.core.planner import Action, Planner, PlannerConfig, StepOption
from spotlight.core.request_scheduler import RequestKind, RequestScheduler, RequestStatus
from spotlight.core.seed_bank import SeedBank, derive_seed

T = 10


def _core(*, mode="stale", iterations=3, stream=True, d=8, reuse=False, control=2, planner=None, min_spot=0):
    settings = IterationSettings(
        min_spot_nodes=min_spot,
        iterations=iterations,
        prompts_per_iteration=4,
        num_control_prompts=control,
        group_size=4,
        run_seed=7,
        num_steps=T,
        explore_mode=mode,
        stream_extra=stream,
        reuse_exploration=reuse,
    )
    sched = RequestScheduler(1e9)
    return IterationCore(settings, sched, SeedBank(7, 4), planner, Action(d, float(T), 0.0), list(range(12)))


def _finish(core, worker, *, is_spot, now, max_requests=100, reward=None):
    """Pull and complete everything ``worker`` may take now; returns the ids done."""
    done = []
    while True:
        leases = core.sched.pull(worker, is_spot=is_spot, max_requests=max_requests, now=now)
        if not leases:
            return done
        for lease in leases:
            assert core.sched.complete(lease.request_id, lease.lease_id, now, worker_id=worker)
            core.record_result(lease.request_id, now)
            req = core.sched.get(lease.request_id)
            core.record_reward(lease.request_id, reward(req) if reward else random.Random(req.seed).random())
            done.append(lease.request_id)


def _to_training(core, now=0.0):
    out = core.advance(now, CoreObservation())
    assert core.phase == "rollout" and out == []
    _finish(core, "r/0", is_spot=False, now=now + 1)
    out = core.advance(now + 2, CoreObservation(spot_slots=8))
    assert [type(d) for d in out] == [StartTraining]
    return out[0]


def test_extras_are_streamed_only_when_the_spot_queue_runs_low_and_continue_the_candidate_sequence():
    core = _core()
    _to_training(core)
    ex = core.sched.requests(iteration=1, kind=RequestKind.EXPLORE)
    assert len(ex) == 2 * 8  # 2 explored prompts x d=8 planned, nothing extra yet (16 queued >= 8 slots)
    leases = core.sched.pull("s/0", is_spot=True, max_requests=12, now=3.0)
    assert len(leases) == 12 and core.sched.num_ready(kind=RequestKind.EXPLORE) == 4
    core.advance(3.0, CoreObservation(spot_slots=8))
    extra = core.sched.requests(iteration=1, kind=RequestKind.EXPLORE)[16:]
    assert len(extra) == 12  # 4 queued < the 8 slots the spot workers hold: topped up to 2 x 8 queued
    per_slot = collections.Counter(core.request_meta[r.request_id][0] for r in extra)
    assert per_slot == {0: 6, 1: 6}  # round-robin over the explored prompts, never the control ones
    for r in extra:
        slot = core.request_meta[r.request_id][0]
        assert r.seed in {derive_seed(7, "candidate", 1, slot, j) for j in range(8, 14)}
        assert r.weight_version == 0 and r.params == core.sched.get(ex[0].request_id).params  # same batch key
    core.advance(3.5, CoreObservation(spot_slots=8))
    assert len(core.sched.requests(iteration=1, kind=RequestKind.EXPLORE)) == 28  # 16 queued >= 8: no more


def test_no_extras_when_streaming_is_off_or_outside_training():
    core = _core(stream=False)
    _to_training(core)
    core.sched.pull("s/0", is_spot=True, max_requests=16, now=3.0)
    core.advance(3.0, CoreObservation(spot_slots=8))
    assert len(core.sched.requests(iteration=1, kind=RequestKind.EXPLORE)) == 16


def test_training_end_abandons_extras_and_drain_waits_only_for_the_planned_candidates():
    core = _core()
    _to_training(core)
    planned = {r.request_id for r in core.sched.requests(iteration=1, kind=RequestKind.EXPLORE)}
    held = core.sched.pull("s/0", is_spot=True, max_requests=14, now=3.0)  # 2 planned stay queued
    core.advance(3.0, CoreObservation(spot_slots=4))
    extras = {r.request_id for r in core.sched.requests(iteration=1, kind=RequestKind.EXPLORE)} - planned
    assert len(extras) == 6  # topped up to 2 x 4 queued
    # a spot worker finishes 3 extras before training ends
    mine = core.sched.pull("s/1", is_spot=True, max_requests=5, now=4.0)
    finished_extra = [l for l in mine if l.request_id in extras][:3]
    for lease in finished_extra:
        core.sched.complete(lease.request_id, lease.lease_id, 4.5, worker_id="s/1")
        core.record_result(lease.request_id, 4.5)
        core.record_reward(lease.request_id, 0.5)
    out = core.advance(5.0, CoreObservation(spot_slots=8, train_done=True))
    assert core.phase == "drain" and out == []
    for rid in extras - {l.request_id for l in finished_extra}:
        st = core.sched.get(rid)
        assert st.status is RequestStatus.CANCELLED and "training ended" in st.history[-1][2]
    for rid in planned:
        assert core.sched.get(rid).status is not RequestStatus.CANCELLED
    # a late result for an abandoned extra is stale
    late = (
        next(l for l in mine if l.request_id in extras and l not in finished_extra)
        if any(l.request_id in extras and l not in finished_extra for l in mine)
        else None
    )
    if late is not None:
        assert not core.sched.complete(late.request_id, late.lease_id, 5.5, worker_id="s/1")
    # drain: the planned candidates still out (12 on s/0, 2 on s/1) must finish first
    out_planned = held + [l for l in mine if l.request_id in planned]
    for lease in out_planned[:-1]:
        core.sched.complete(lease.request_id, lease.lease_id, 6.0)
        core.record_result(lease.request_id, 6.0)
        core.record_reward(lease.request_id, 0.3)
    assert core.advance(6.0, CoreObservation()) == []  # one planned candidate is still running
    last = out_planned[-1]
    core.sched.complete(last.request_id, last.lease_id, 8.0)
    core.record_result(last.request_id, 8.0)
    core.record_reward(last.request_id, 0.3)
    out = core.advance(8.0, CoreObservation())
    assert [type(d) for d in out] == [IterationDone]
    m = out[0].metrics
    assert m["explore/num_requests"] == 16 + 3 and m["explore/num_extra_requests"] == 3
    assert m["time/explore_critical_path_s"] == pytest.approx(8.0 - 5.0)
    # the seed bank selected from planned + extra candidates alike
    seeds, explored = core.seed_bank.seeds_for(1, 0)
    assert explored and len(seeds) == 4


def test_checkpoint_boundary_nothing_queued_after_iteration_done():
    core = _core(iterations=2)
    _to_training(core)
    _finish(core, "s/0", is_spot=True, now=3.0)
    out = core.advance(4.0, CoreObservation(train_done=True))
    assert [type(d) for d in out] == [IterationDone]
    assert core.phase == "ended" and core.sched.num_ready() == 0  # the shell checkpoints here
    state = core.state_dict()
    assert state["iteration"] == 1
    out = core.advance(4.0, CoreObservation())
    assert core.phase == "rollout" and core.sched.num_ready(kind=RequestKind.ROLLOUT) == 16
    fresh = _core(iterations=2)
    fresh.load_state_dict(state)
    assert fresh.iteration == 1 and fresh.phase == "starting"


def test_best_of_n_reuse_generates_exactly_n_per_explored_prompt_and_no_rollout():
    core = _core(mode="critical_path", reuse=True, control=0, d=8, iterations=2)
    for it in range(2):
        core.advance(float(it), CoreObservation())
        assert core.phase == "explore_first"
        _finish(core, "r/0", is_spot=False, now=it + 0.1)
        out = core.advance(it + 0.2, CoreObservation())
        assert [type(d) for d in out] == [StartTraining]
        ids = out[0].request_ids
        per_prompt = collections.Counter(
            core.request_meta[r.request_id][0] for r in core.sched.requests(iteration=it, kind=RequestKind.EXPLORE)
        )
        assert per_prompt == {s: 8 for s in range(4)}  # N generations per prompt, not N + K
        # the candidates may become the rollout: full fidelity (log-probs, no First Block Cache)
        assert all(
            r.params.get("as_rollout") is True and "cache_threshold" not in r.params
            for r in core.sched.requests(iteration=it, kind=RequestKind.EXPLORE)
        )
        assert core.sched.requests(iteration=it, kind=RequestKind.ROLLOUT) == []
        assert len(ids) == 4 * 4 and all(core.sched.get(r).kind is RequestKind.EXPLORE for r in ids)
        by_slot = collections.defaultdict(list)
        for r in ids:
            by_slot[core.request_meta[r][0]].append(core.rewards[r])
        for slot, rewards in by_slot.items():  # the top-2 and bottom-2 of the 8 candidates
            allr = sorted(
                core.rewards[r.request_id]
                for r in core.sched.requests(iteration=it, kind=RequestKind.EXPLORE)
                if core.request_meta[r.request_id][0] == slot
            )
            assert sorted(rewards) == sorted(allr[:2] + allr[-2:])
        out = core.advance(it + 0.5, CoreObservation(train_done=True))
        assert isinstance(out[0], IterationDone)
    assert [type(d) for d in core.advance(3.0, CoreObservation())] == [StartSaving]


def test_reuse_needs_critical_path_and_no_control_prompts():
    with pytest.raises(ValueError, match="critical_path"):
        IterationSettings(
            iterations=1,
            prompts_per_iteration=4,
            num_control_prompts=0,
            group_size=4,
            run_seed=0,
            num_steps=T,
            explore_mode="stale",
            reuse_exploration=True,
        )


def test_planner_credits_the_chosen_arm_even_when_extras_streamed():
    """Crediting the grid arm matching the candidates scored left the chosen arm
    unseen (UCB = inf) so it was re-picked forever whatever beta (Fig. 17 benchmark)."""
    planner = Planner(
        PlannerConfig(max_sequences=24, min_sequences=8, sequence_step=8, beta=0.0),
        [StepOption(0.0, float(T), 1.0)],
        random.Random(0),
    )
    core = _core(planner=planner, iterations=3)
    core.advance(0.0, CoreObservation(num_spot_gpus=4, step_time_s=1e-3))
    _finish(core, "r/0", is_spot=False, now=1.0)
    core.advance(2.0, CoreObservation(num_spot_gpus=4, step_time_s=1e-3, spot_slots=40))
    action = core.explore_action[1]
    # spot workers take everything streamed while training runs: 2 slots x (d planned + extras)
    for _ in range(4):
        _finish(core, "s/0", is_spot=True, now=3.0)
        core.advance(3.0, CoreObservation(num_spot_gpus=4, step_time_s=1e-3, spot_slots=40))
    _finish(core, "s/0", is_spot=True, now=3.5)
    core.advance(4.0, CoreObservation(train_done=True))
    per_prompt = core._candidates_per_prompt[1]
    assert per_prompt > action.num_sequences
    # iteration 1's rollout then feeds back to the arm that was chosen
    core.advance(4.0, CoreObservation())
    _finish(core, "r/0", is_spot=False, now=5.0)
    core.advance(6.0, CoreObservation(num_spot_gpus=4, step_time_s=1e-3, spot_slots=8))
    counts = {a.num_sequences: planner.arm_stats(a)[0] for a in planner.actions}
    assert counts[action.num_sequences] == 1 and sum(counts.values()) == 1
    # the next plan no longer re-picks the same arm as unseen
    assert core.plan_logs[2]["action"] is not None
    assert (
        core.plan_logs[2]["action"]["num_sequences"] != action.num_sequences
        or "unseen" not in core.plan_logs[2]["reason"]
    )


def test_busy_meter_counts_lease_time_over_alive_time():
    m = BusyMeter()
    m.seen("a", True, 0.0)
    m.seen("b", True, 0.0)
    m.start("a", 0.0)
    m.end("a", 10.0)
    m.start("b", 5.0)  # still holding at the end of the window
    assert m.fraction(0.0, 10.0) == pytest.approx((10 + 5) / 20)
    m.gone("b", 10.0)
    m.seen("c", False, 0.0)
    assert m.fraction(0.0, 20.0) == pytest.approx(15 / (20 + 10))  # b alive only until 10
    assert math.isnan(m.fraction(0.0, 20.0, spot=False)) is False and m.fraction(0.0, 20.0, spot=False) == 0.0
    assert math.isnan(m.fraction(5.0, 5.0))


def test_when_no_arm_fits_spot_gpus_still_stream_candidates_but_nothing_is_planned_or_awaited():
    planner = Planner(
        PlannerConfig(max_sequences=24, min_sequences=8, sequence_step=8, beta=0.0),
        [StepOption(0.0, float(T), 1.0)],
        random.Random(0),
    )
    core = _core(planner=planner, iterations=3)
    core.advance(0.0, CoreObservation())
    _finish(core, "r/0", is_spot=False, now=1.0)
    # a 1 s window on 1 spot GPU at 1 GPU-s per step: even d=8 x 2 prompts x 10 steps overruns it
    core.advance(1.0, CoreObservation(num_spot_gpus=1, step_time_s=1.0, spot_slots=4))
    assert core.plan_logs[1]["action"] is None and 1 not in core.explore_action
    queued = core.sched.requests(iteration=1, kind=RequestKind.EXPLORE)
    assert len(queued) == 8 and core.explorations[1].planned == set()  # 2 x 4 slots streamed, none planned
    done = _finish(core, "s/0", is_spot=True, now=1.5, max_requests=3)
    assert done
    out = core.advance(2.0, CoreObservation(train_done=True))
    assert [type(d) for d in out] == [IterationDone]  # nothing planned: DRAIN waits for nothing
    assert out[0].metrics["time/explore_critical_path_s"] == 0.0
    assert all(
        r.status in (RequestStatus.DONE, RequestStatus.CANCELLED)
        for r in core.sched.requests(iteration=1, kind=RequestKind.EXPLORE)
    )
    core.advance(2.0, CoreObservation())
    _finish(core, "r/0", is_spot=False, now=3.0)
    core.advance(3.0, CoreObservation(num_spot_gpus=1, step_time_s=1.0))
    assert planner.total_updates == 0  # no arm was chosen, so none is credited


# ---------------------------------------------------------------- the phase table
def test_every_phase_has_its_edges_written_down_and_finished_is_terminal():
    assert set(PHASE_TRANSITIONS) == set(Phase)
    assert PHASE_TRANSITIONS[Phase.FINISHED] == frozenset()
    reachable, todo = {Phase.STARTING}, [Phase.STARTING]
    while todo:
        for nxt in PHASE_TRANSITIONS[todo.pop()]:
            if nxt not in reachable:
                reachable.add(nxt)
                todo.append(nxt)
    assert reachable == set(Phase)  # every phase is reachable from the start, FINISHED included


def test_a_move_the_table_does_not_allow_is_refused():
    core = _core()
    assert core.phase is Phase.STARTING
    with pytest.raises(InvalidPhaseTransition):
        core._set_phase(Phase.TRAIN)  # STARTING -> TRAIN skips the rollout
    assert core.phase is Phase.STARTING  # unchanged


def test_the_core_owns_saving_to_finished():
    """The coordinator's and the simulator's saving tails were two copies that differed: the
    core now ends the run once the shell observes the final model saved."""
    core = _core(iterations=0)
    assert core.advance(0.0, CoreObservation()) == [StartSaving()]
    assert core.phase is Phase.SAVING and not core.done
    assert core.advance(1.0, CoreObservation()) == [] and not core.done  # not saved yet
    core.advance(2.0, CoreObservation(final_saved=True))
    assert core.phase is Phase.FINISHED and core.done
    assert core.advance(3.0, CoreObservation(final_saved=True)) == [] and core.phase is Phase.FINISHED


def test_phase_is_its_string_in_messages_and_snapshots():
    assert f"{Phase.TRAIN}" == str(Phase.TRAIN) == "train" and Phase.TRAIN == "train"


def test_each_mode_names_its_strategy():
    for mode, strategy in STRATEGIES.items():
        assert _core(mode=mode, reuse=mode == "critical_path").strategy is strategy
    assert STRATEGIES["stale"].credits_planner and not STRATEGIES["critical_path"].credits_planner


def test_the_factory_builds_a_planner_only_where_the_run_explores():
    sched, bank = RequestScheduler(1e9), SeedBank(7, 4)
    settings = lambda mode: IterationSettings(  # noqa: E731
        iterations=2,
        prompts_per_iteration=4,
        num_control_prompts=1,
        group_size=4,
        run_seed=7,
        num_steps=T,
        explore_mode=mode,
    )
    pc = PlannerConfig(max_sequences=16, min_sequences=8, sequence_step=4, group_size=4)
    options = [StepOption(0.0, float(T), 1.0)]
    fixed = Action(8, float(T), 0.0)
    stale = build_iteration_core(
        settings("stale"), sched, bank, [0, 1, 2, 3], planner_config=pc, step_options=options, fixed_action=fixed
    )
    assert stale.planner is not None and stale.fixed_action is None
    off = build_iteration_core(
        settings("off"), sched, bank, [0, 1, 2, 3], planner_config=pc, step_options=options, fixed_action=fixed
    )
    assert off.planner is None and off.fixed_action is None
    best_of_n = build_iteration_core(
        settings("critical_path"),
        sched,
        bank,
        [0, 1, 2, 3],
        planner_config=None,
        step_options=options,
        fixed_action=fixed,
    )
    assert best_of_n.planner is None and best_of_n.fixed_action == fixed


def test_a_parked_rollout_request_stops_the_iteration_once_and_nothing_trains():
    """docs/architecture.md §4: the update needs every rollout sample, so a rollout request
    parked after cluster.max_request_failures is a RolloutParked decision, not a smaller batch."""
    core = _core()
    core.sched.max_failures = 2
    core.advance(0.0, CoreObservation())
    bad = core.sched.requests(iteration=0, kind=RequestKind.ROLLOUT)[3].request_id
    for w in ("r/0", "r/1"):
        for lease in core.sched.pull(w, is_spot=False, max_requests=100, now=1.0):
            if lease.request_id == bad:
                core.sched.fail(bad, lease.lease_id, reason="RuntimeError: boom", now=1.0)
            else:
                core.sched.complete(lease.request_id, lease.lease_id, 1.0)
                core.record_result(lease.request_id, 1.0)
                core.record_reward(lease.request_id, 0.5)
    assert core.sched.get(bad).status is RequestStatus.PARKED
    out = core.advance(2.0, CoreObservation())
    assert out == [RolloutParked(0, [bad])] and core.phase == "rollout"
    assert core.advance(3.0, CoreObservation()) == [] and core.phase == "rollout"


def test_a_parked_exploration_request_is_dropped_and_the_iteration_ends():
    core = _core(iterations=2)
    core.sched.max_failures = 1
    _to_training(core)
    leases = core.sched.pull("s/0", is_spot=True, max_requests=100, now=3.0)
    bad = leases[0]
    assert core.sched.fail(bad.request_id, bad.lease_id, reason="AttributeError: no enable_cache", now=3.0)
    for lease in leases[1:]:
        core.sched.complete(lease.request_id, lease.lease_id, 3.0)
        core.record_result(lease.request_id, 3.0)
        core.record_reward(lease.request_id, 0.1)
    out = core.advance(4.0, CoreObservation(train_done=True))
    _finish(core, "s/0", is_spot=True, now=5.0)
    out += core.advance(6.0, CoreObservation())
    assert core.sched.get(bad.request_id).status is RequestStatus.PARKED
    assert [type(d) for d in out] == [IterationDone]


def test_iteration_1_waits_for_min_spot_nodes_and_later_iterations_do_not():
    """cluster.min_spot_nodes: iteration 1 starts once that many spot nodes are alive; nodes that
    leave afterwards do not hold up later iterations, nor a resumed run past iteration 1."""
    assert spot_nodes_missing(0, 1, 3) == 2 and spot_nodes_missing(0, 3, 3) == 0 and spot_nodes_missing(0, 5, 0) == 0
    assert spot_nodes_missing(1, 0, 3) == 0  # after iteration 1: go on with whatever is alive
    core = _core(iterations=2, min_spot=2)
    assert core.advance(0.0, CoreObservation(num_spot_nodes=0)) == [] and core.phase == "starting"
    assert core.advance(1.0, CoreObservation(num_spot_nodes=1)) == [] and core.phase == "starting"
    core.advance(2.0, CoreObservation(num_spot_nodes=2))
    assert core.phase == "rollout"
    _finish(core, "r/0", is_spot=False, now=3.0)
    assert [type(d) for d in core.advance(4.0, CoreObservation(num_spot_nodes=0))] == [StartTraining]
    core.advance(5.0, CoreObservation(train_done=True, num_spot_nodes=0))
    _finish(core, "r/0", is_spot=False, now=5.5)  # the spot nodes left: the reserved side drains
    out = core.advance(6.0, CoreObservation(num_spot_nodes=0))
    assert [type(d) for d in out] == [IterationDone]  # and iteration 1 still ends
    core.advance(7.0, CoreObservation(num_spot_nodes=0))
    assert core.phase == "rollout" and core.iteration == 1  # and iteration 2 begins without them
    resumed = _core(iterations=2, min_spot=2)
    resumed.load_state_dict(core.state_dict())
    resumed.advance(8.0, CoreObservation(num_spot_nodes=0))
    assert resumed.phase == "rollout"  # a run resumed past iteration 1 does not wait either
    with pytest.raises(ValueError, match="min_spot_nodes"):
        _core(min_spot=-1)
