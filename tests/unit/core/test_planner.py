"""Unit tests for the Planner (paper §4.3): pure logic, no timing."""

from __future__ import annotations

import json
import math
import random

import pytest

from spotlight.core.planner import (
    Action,
    ArmScore,
    Planner,
    PlannerConfig,
    PlannerObservation,
    StepOption,
    costs_full_rollout,
    feedback_ratio,
    selection_key,
)

FULL = StepOption(cache_threshold=0.0, effective_steps=20.0, accuracy=1.0)
CACHED = StepOption(cache_threshold=0.1, effective_steps=10.0, accuracy=0.9)
INACCURATE = StepOption(cache_threshold=0.3, effective_steps=5.0, accuracy=0.6)
TOO_FEW = StepOption(cache_threshold=0.5, effective_steps=0.5, accuracy=0.85)


def make_planner(options=(FULL, CACHED, INACCURATE, TOO_FEW), seed=0, **cfg) -> Planner:
    return Planner(PlannerConfig(**cfg), list(options), random.Random(seed))


def obs(budget_per_gpu: float = 40.0, gpus: int = 4) -> PlannerObservation:
    # C=2 prompts, t_step=0.5 s -> T_plan(d, s) = d * 2 * s * 0.5 = d * s
    return PlannerObservation(train_time_s=budget_per_gpu, num_spot_gpus=gpus, num_explored_prompts=2, step_time_s=0.5)


def A(d: int, s: float) -> Action:
    return Action(d, s, {20.0: 0.0, 10.0: 0.1}[s])


# --------------------------------------------------------------------- action space / eligibility


def test_grid_and_planned_cost():
    p = make_planner()
    assert [(a.num_sequences, a.effective_steps) for a in p.actions] == [
        (8, 10.0),
        (16, 10.0),
        (24, 10.0),
        (32, 10.0),
        (8, 20.0),
        (16, 20.0),
        (24, 20.0),
        (32, 20.0),
    ]
    o = PlannerObservation(train_time_s=1.0, num_spot_gpus=1, num_explored_prompts=3, step_time_s=0.25)
    assert p.planned_cost_s(A(16, 20.0), o) == pytest.approx(16 * 3 * 20 * 0.25)


def test_eligibility_matches_hand_computed_set():
    p = make_planner()
    plan = p.plan(obs(40.0, 4))  # W = 160; costs d*s: 80,160,240,320 | 160,320,480,640
    assert plan.budget_s == 160.0
    assert {(s.action.num_sequences, s.action.effective_steps) for s in plan.eligible} == {
        (8, 10.0),
        (16, 10.0),
        (8, 20.0),
    }
    assert [s.planned_cost_s for s in plan.eligible] == [80.0, 160.0, 160.0]  # boundary T_plan == W included
    assert plan.action == A(8, 10.0)


def test_budget_shrink_gives_fewer_eligible():
    p = make_planner()
    big = p.plan(obs(40.0, 4))
    small = p.plan(obs(40.0, 2))  # W = 80
    assert len(small.eligible) < len(big.eligible)
    assert [s.action for s in small.eligible] == [A(8, 10.0)]


def test_no_eligible_action_returns_none_with_reason():
    p = make_planner()
    plan = p.plan(obs(19.75, 4))  # W = 79 < cheapest 80
    assert plan.action is None
    assert plan.eligible == []
    assert plan.reason == "no action fits: cheapest T_plan=80.000s > W=79.000s"
    assert p.plan(obs(40.0, 0)).action is None  # no spot GPUs -> W = 0


def test_no_fit_message_says_what_it_means_and_what_happens():
    from spotlight.core.planner import no_fit_message

    log = make_planner().plan(obs(19.75, 4)).to_log()
    assert log["cheapest_s"] == 80.0
    assert no_fit_message(log, streams=True) == (
        "no exploration arm fits this iteration's training window (the cheapest needs 80.0 GPU-s, the spot GPUs "
        "have 79.0 GPU-s while training runs): spot GPUs stream the cheapest arm's candidates instead "
        "(nothing waits for them)"
    )
    assert no_fit_message(log, streams=False).endswith(
        ": the next batch is not explored (its rollouts use default seeds)"
    )
    assert "T_plan" not in no_fit_message(log, streams=False)
    assert "cheapest_s" not in make_planner().plan(obs(40.0, 4)).to_log()  # only when nothing fits


def test_accuracy_and_min_steps_filters():
    p = make_planner(min_effective_steps=1.0, min_exploration_accuracy=0.8)
    assert p.rejected_steps == [INACCURATE, TOO_FEW]
    assert {a.effective_steps for a in p.actions} == {10.0, 20.0}
    assert p.plan(obs()).rejected_steps == [INACCURATE, TOO_FEW]
    p2 = make_planner(min_effective_steps=15.0)
    assert {a.effective_steps for a in p2.actions} == {20.0}
    assert CACHED in p2.rejected_steps
    p3 = make_planner(min_exploration_accuracy=0.5)
    assert {a.effective_steps for a in p3.actions} == {5.0, 10.0, 20.0}


def test_a_cached_option_that_costs_as_much_as_the_full_rollout_is_no_arm():
    """What `spotlight profile` measured on the tiny model: threshold 0.3 computed 9.5 steps of
    10 but cost 11.04 full-step equivalents (every step still runs the first block's check),
    with a lower accuracy; it was an arm and marked eligible. It is dominated by the full
    rollout, so it is shadowed; a cheaper cached option stays."""
    full = StepOption(0.0, 10.0, 1.0, cost_steps=10.0)
    dear = StepOption(0.3, 9.5, 0.9, cost_steps=11.04)
    cheap = StepOption(0.1, 6.0, 0.95, cost_steps=7.0)
    p = make_planner(options=(full, dear, cheap))
    assert dear in p.shadowed_steps and dear not in p.step_options
    assert {a.cache_threshold for a in p.actions} == {0.0, 0.1}
    assert not costs_full_rollout(cheap, [full, dear, cheap]) and not costs_full_rollout(full, [full, dear, cheap])
    # without costs measured, effective steps are the cost: fewer steps never cost more
    assert not costs_full_rollout(CACHED, [FULL, CACHED])


def test_all_options_refused_raises():
    with pytest.raises(ValueError, match="all 2 step options refused"):
        make_planner(options=(INACCURATE, TOO_FEW))
    with pytest.raises(ValueError, match="refused"):
        make_planner(options=(FULL,), min_effective_steps=25.0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_sequences", 4),
        ("min_sequences", 0),
        ("sequence_step", 0),
        ("min_effective_steps", 0.0),
        ("min_exploration_accuracy", 1.5),
        ("beta", -0.1),
        ("window", 0),
    ],
)
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        PlannerConfig(**{field: value})


def test_sequence_grid_includes_max():
    assert PlannerConfig(min_sequences=8, max_sequences=20, sequence_step=8).sequence_grid() == [8, 16, 20]


# --------------------------------------------------------------------- selection order


def test_unseen_first_with_tie_break_order():
    p = make_planner()
    p.update(A(8, 10.0), 100.0)  # the cheapest arm is now seen with a huge mean, still below +inf
    plan = p.plan(obs(40.0, 4))
    # unseen: (16,10) cost 160 and (8,20) cost 160 tie on cost -> fewer steps first, despite more sequences
    assert [s.action for s in plan.eligible] == [A(16, 10.0), A(8, 20.0), A(8, 10.0)]
    assert plan.eligible[0].ucb == math.inf and plan.eligible[1].ucb == math.inf
    assert plan.action == A(16, 10.0)


def test_unseen_order_full_grid():
    p = make_planner()
    plan = p.plan(obs(1000.0, 4))
    order = [(s.action.num_sequences, s.action.effective_steps) for s in plan.eligible]
    # costs d*s; (16,10) and (8,20) tie at 160, (32,10) and (16,20) tie at 320
    assert order == [(8, 10.0), (16, 10.0), (8, 20.0), (24, 10.0), (32, 10.0), (16, 20.0), (24, 20.0), (32, 20.0)]


def test_third_tie_break_fewer_sequences():
    # equal UCB, equal cost, equal steps -> fewer sequences first (unreachable with d*C*s*t costs, so by key)
    a = ArmScore(Action(16, 10.0, 0.1), planned_cost_s=5.0, ucb=1.0, mean=0.5, n=1)
    b = ArmScore(Action(8, 10.0, 0.1), planned_cost_s=5.0, ucb=1.0, mean=0.5, n=1)
    c = ArmScore(Action(8, 12.0, 0.1), planned_cost_s=5.0, ucb=1.0, mean=0.5, n=1)
    d = ArmScore(Action(8, 12.0, 0.1), planned_cost_s=4.0, ucb=1.0, mean=0.5, n=1)
    e = ArmScore(Action(32, 30.0, 0.0), planned_cost_s=99.0, ucb=2.0, mean=1.0, n=1)
    assert sorted([a, b, c, d, e], key=selection_key) == [e, d, b, a, c]


def test_ucb_ordering_hand_computed():
    p = make_planner(beta=0.5)
    for r in (1.0, 1.2):
        p.update(A(8, 10.0), r)
    p.update(A(16, 10.0), 1.5)
    for _ in range(3):
        p.update(A(8, 20.0), 0.9)
    p.update(A(32, 20.0), 5.0)  # ineligible at W=160, but still counts toward N
    plan = p.plan(obs(40.0, 4))
    n_total = 7
    ln = math.log(n_total + 1)
    expected = {
        A(16, 10.0): 1.5 + 0.5 * math.sqrt(ln / 1),
        A(8, 10.0): 1.1 + 0.5 * math.sqrt(ln / 2),
        A(8, 20.0): 0.9 + 0.5 * math.sqrt(ln / 3),
    }
    assert [s.action for s in plan.eligible] == [A(16, 10.0), A(8, 10.0), A(8, 20.0)]
    for s in plan.eligible:
        assert s.ucb == pytest.approx(expected[s.action])
    assert plan.eligible[0].ucb == pytest.approx(2.2210134, abs=1e-6)  # 1.5 + 0.5*sqrt(ln 8)
    assert plan.eligible[1].mean == pytest.approx(1.1) and plan.eligible[1].n == 2
    assert plan.action == A(16, 10.0)


def test_sliding_window():
    p = make_planner(window=10, beta=0.5)
    for r in range(1, 13):
        p.update(A(8, 10.0), float(r))
    for _ in range(3):
        p.update(A(16, 20.0), 0.0)
    count, window = p.arm_stats(A(8, 10.0))
    assert count == 12 and window == [float(x) for x in range(3, 13)]
    assert p.total_updates == 15
    score = {s.action: s for s in p.plan(obs(1000.0, 4)).eligible}[A(8, 10.0)]
    assert score.n == 10
    assert score.mean == pytest.approx(7.5)
    assert score.ucb == pytest.approx(7.5 + 0.5 * math.sqrt(math.log(16) / 10))


# --------------------------------------------------------------------- feedback


def test_feedback_ratio_hand_numbers():
    # sigma_all = (0.4+0.6+0.1+0.3)/4 = 0.35, sigma_unc = 0.2
    assert feedback_ratio([0.4, 0.6], [0.1, 0.3]) == pytest.approx(1.75)
    assert feedback_ratio([], [0.2, 0.2]) == pytest.approx(1.0)
    assert math.isnan(feedback_ratio([0.4, 0.6], []))
    # zero control std: floored at 0.02 -> 0.25 / 0.02 = 12.5, capped at 5
    assert feedback_ratio([0.4, 0.6], [0.0, 0.0]) == 5.0
    assert feedback_ratio([0.4, 0.6], [0.0, 0.0], std_floor=0.1, max_feedback=100) == pytest.approx(2.5)
    # no bounds: the paper's ratio, nan for a zero baseline
    assert math.isnan(feedback_ratio([0.4, 0.6], [0.0, 0.0], std_floor=0.0, max_feedback=1e300))
    # every group constant: no evidence either way
    assert math.isnan(feedback_ratio([0.0, 0.0], [0.0, 0.0]))
    with pytest.raises(ValueError, match="max_feedback"):
        feedback_ratio([0.4], [0.2], max_feedback=0.5)
    with pytest.raises(ValueError, match="feedback_std_floor"):
        feedback_ratio([0.4], [0.2], std_floor=-1.0)


def test_non_finite_feedback_is_a_play_without_value():
    p = make_planner()
    p.update(A(8, 10.0), 1.0)
    p.update(A(8, 10.0), math.nan)
    p.update(A(8, 10.0), math.inf)
    p.update(A(16, 10.0), -math.inf)
    p.update(A(16, 10.0), None)
    assert p.num_ignored_feedback == 4
    assert p.total_updates == 5
    assert p.arm_stats(A(8, 10.0)) == (3, [1.0, None, None])
    assert p.arm_stats(A(16, 10.0)) == (2, [None, None])
    scores = {s.action: s for s in p.plan(obs(1000.0, 4)).eligible}
    ln = math.log(5 + 1)
    # the mean is over values only; an arm with none scores the neutral ratio 1.0
    assert scores[A(8, 10.0)].mean == 1.0 and scores[A(8, 10.0)].n == 3
    assert scores[A(8, 10.0)].ucb == pytest.approx(1.0 + 0.5 * math.sqrt(ln / 3))
    assert scores[A(16, 10.0)].mean == 1.0 and scores[A(16, 10.0)].n == 2
    assert scores[A(16, 10.0)].ucb == pytest.approx(1.0 + 0.5 * math.sqrt(ln / 2))
    with pytest.raises(ValueError, match="unknown action"):
        p.update(Action(8, 7.0, 0.2), 1.0)


# --------------------------------------------------------------------- persistence / logging


def test_state_dict_round_trip_same_next_plan():
    p1 = make_planner(seed=1)
    sim = random.Random(7)
    for _ in range(12):
        plan = p1.plan(obs(1000.0, 4))
        p1.update(plan.action, 1.0 + sim.random())
    p1.update(plan.action, math.nan)
    state = json.loads(json.dumps(p1.state_dict(), allow_nan=False))
    p2 = make_planner(seed=999)
    assert p2.plan(obs(1000.0, 4)).to_log() != p1.plan(obs(1000.0, 4)).to_log()
    p2.load_state_dict(state)
    assert p2.num_ignored_feedback == 1 and p2.total_updates == 13  # the nan play counts
    assert any(None in a["window"] for a in state["arms"])  # the play without feedback survives JSON
    for _ in range(5):
        l1, l2 = p1.plan(obs(1000.0, 4)), p2.plan(obs(1000.0, 4))
        assert l1.to_log() == l2.to_log()
        r = 1.0 + sim.random()
        p1.update(l1.action, r)
        p2.update(l2.action, r)
    assert p1.state_dict() == p2.state_dict()


def test_to_log_is_json():
    p = make_planner()
    p.update(A(8, 10.0), 1.25)
    log = p.plan(obs(40.0, 4)).to_log()
    text = json.dumps(log, allow_nan=False)
    back = json.loads(text)
    assert back["action"] == {"num_sequences": 16, "effective_steps": 10.0, "cache_threshold": 0.1, "cost_steps": None}
    assert back["budget_s"] == 160.0
    assert [e["ucb"] for e in back["eligible"]][:2] == ["inf", "inf"]
    assert isinstance(back["eligible"][2]["ucb"], float) and back["eligible"][2]["n"] == 1
    assert len(back["rejected_steps"]) == 2
    none_log = p.plan(obs(1.0, 1)).to_log()
    assert none_log["action"] is None and none_log["reason"].startswith("no action fits")
    json.dumps(none_log, allow_nan=False)


# --------------------------------------------------------------------- simulated run


def test_simulated_run_converges_to_best_arm():
    p = make_planner(seed=3, beta=0.5, window=10)
    best = A(24, 10.0)
    env = random.Random(11)
    picks: dict[Action, int] = {}
    for it in range(200):
        plan = p.plan(obs(1000.0, 4))
        a = plan.action
        if it < len(p.actions):
            assert plan.eligible[0].ucb == math.inf  # every arm is tried once first
        else:
            picks[a] = picks.get(a, 0) + 1
        mean = 1.6 if a == best else 1.0
        p.update(a, mean + env.gauss(0.0, 0.1))
    assert max(picks, key=picks.get) == best
    assert picks[best] > 0.5 * sum(picks.values())


def test_measured_cost_steps_drive_the_budget():
    """A cached step is not free (the head block still runs): cost uses cost_steps when profiled."""
    opts = [StepOption(0.0, 10.0, 1.0), StepOption(1.0, 2.0, 0.9, cost_steps=5.0)]
    p = Planner(PlannerConfig(min_sequences=8, max_sequences=8, sequence_step=8), opts, random.Random(0))
    cheap = next(a for a in p.actions if a.effective_steps == 2.0)
    o = PlannerObservation(train_time_s=1.0, num_spot_gpus=1, num_explored_prompts=1, step_time_s=0.01)
    assert p.planned_cost_s(cheap, o) == pytest.approx(8 * 1 * 5.0 * 0.01)
    # budget 0.3 s: 8 seqs x 5 cost-steps x 0.01 = 0.4 s does not fit although s=2 alone would (0.16 s)
    plan = p.plan(PlannerObservation(train_time_s=0.3, num_spot_gpus=1, num_explored_prompts=1, step_time_s=0.01))
    assert plan.action is None


# --------------------------------------------------------------------- planner faults
# Each test below fails on the code before the fix (see the commit message).


def test_sp_group_step_time_in_gpu_seconds_keeps_every_eligible_arm_within_the_window():
    """Fault 1: t_step measured per worker, W counted in GPUs -> plans overran by the SP degree."""
    from spotlight.core.planner import step_time_gpu_s

    # one spot node = one SP group of 2 GPUs; a batch of 4 sequences x 20 computed steps took 8 s
    wall_per_seq_step = 8.0 / 80
    t_train, gpus = 40.0, 2
    p = Planner(PlannerConfig(min_sequences=8, max_sequences=32, sequence_step=8), [FULL], random.Random(0))

    def eligible(t_step):
        o = PlannerObservation(train_time_s=t_train, num_spot_gpus=gpus, num_explored_prompts=2, step_time_s=t_step)
        return [s.action for s in p.plan(o).eligible]

    def wall_s(a):  # what the group really needs for the arm
        return a.num_sequences * 2 * a.effective_steps * wall_per_seq_step

    t_step = step_time_gpu_s(8.0, 80, 2)
    assert t_step == pytest.approx(0.2)
    ok = eligible(t_step)
    assert ok and all(wall_s(a) <= t_train for a in ok)
    # the per-worker wall time (the old coordinator formula elapsed / steps) admits arms that overrun
    assert any(wall_s(a) > t_train for a in eligible(8.0 / 80))
    # single-GPU workers: unchanged
    assert step_time_gpu_s(8.0, 80, 1) == pytest.approx(0.1)


def test_step_time_gpu_s_unusable_observations():
    from spotlight.core.planner import step_time_gpu_s

    assert step_time_gpu_s(1.0, 0, 2) is None  # nothing computed
    assert step_time_gpu_s(0.0, 10, 2) is None
    assert step_time_gpu_s(-1.0, 10, 2) is None
    assert step_time_gpu_s(math.nan, 10, 2) is None
    assert step_time_gpu_s(2e6, 10, 2) is None  # clock glitch
    with pytest.raises(ValueError, match="num_gpus"):
        step_time_gpu_s(1.0, 10, 0)
    with pytest.raises(ValueError, match="num_gpus"):
        step_time_gpu_s(1.0, 10, math.nan)
    # a group that re-formed 2 -> 1 halfway reports 1.5 GPUs on average
    assert step_time_gpu_s(3.0, 10, 1.5) == pytest.approx(0.45)


def test_degenerate_control_iteration_does_not_pin_its_arm():
    """Fault 3: one iteration with ~constant control groups gave r ~ 10^5-10^6, and its arm
    was then chosen for the whole window W_b whatever the other arms returned."""
    p = make_planner()  # window 10, beta 0.5, 8 arms
    o = obs(1000.0, 4)
    n_arms = len(p.actions)
    spiked, picks = None, []
    for it in range(n_arms + 1 + p.config.window):
        a = p.plan(o).action
        if it == n_arms:  # every arm tried once; this iteration's 4 control groups are ~constant
            spiked = a
            r = r_spike = feedback_ratio([0.5] * 8, [1e-6] * 4)
        else:
            r = 1.0 if a == spiked else 1.5  # the spiked arm is really the worst one
        p.update(a, r)
        if it > n_arms:
            picks.append(a == spiked)
    assert len(picks) == p.config.window
    assert sum(picks) <= p.config.window // 2, picks  # unbounded (r = 3.3e5): all 10; cap 5: 3
    assert r_spike == 5.0  # sigma_all / max(1e-6, 0.02) = 0.333 / 0.02 = 16.7, capped at max_feedback = 5


def test_nan_feedback_does_not_repick_the_same_arm_forever():
    """Fault 4: non-finite feedback (no control groups) left the arm unseen (UCB = +inf), so the
    planner chose it again on every iteration."""
    p = make_planner()
    o = obs(1000.0, 4)
    picks = []
    for _ in range(3 * len(p.actions)):
        a = p.plan(o).action
        picks.append(a)
        p.update(a, math.nan)
    assert set(picks) == set(p.actions)  # every arm gets played
    assert max(picks.count(a) for a in p.actions) <= 4
    assert p.total_updates == len(picks) and p.num_ignored_feedback == len(picks)
    # round trip keeps the plays without feedback (same next plan)
    q = make_planner()
    q.load_state_dict(json.loads(json.dumps(p.state_dict(), allow_nan=False)))
    assert q.plan(o).to_log() == p.plan(o).to_log()
    # and a real value later is what the arm's mean is made of
    p.update(picks[0], 2.0)
    score = {s.action: s for s in p.plan(o).eligible}[picks[0]]
    assert score.mean == 2.0 and score.n == picks.count(picks[0]) + 1


def test_version_1_state_still_loads():
    p = make_planner()
    p.update(A(8, 10.0), 1.25)
    st = json.loads(json.dumps(p.state_dict()))
    st["version"] = 1
    q = make_planner()
    q.load_state_dict(st)
    assert q.arm_stats(A(8, 10.0)) == (1, [1.25]) and q.total_updates == 1
    with pytest.raises(ValueError, match="version"):
        q.load_state_dict({**st, "version": 99})


def test_d_grid_starts_above_group_size():
    """Fault 5: with d == K the top-K/2 + bottom-K/2 selection keeps every candidate."""
    from spotlight.core.planner import min_selective_sequences

    with pytest.raises(ValueError, match="must be > group_size K=8"):
        PlannerConfig(min_sequences=8, group_size=8)
    with pytest.raises(ValueError, match="must be > group_size K=8"):
        PlannerConfig(min_sequences=4, max_sequences=32, group_size=8)
    assert min_selective_sequences(8, 8, 32) == 16
    assert min_selective_sequences(8, 8, 12) == 12  # capped at max_sequences
    assert min_selective_sequences(4, 2, 32) == 6
    with pytest.raises(ValueError, match="max_sequences=8 must be > group_size K=8"):
        min_selective_sequences(8, 8, 8)
    cfg = PlannerConfig(
        min_sequences=min_selective_sequences(8, 8, 32), max_sequences=32, sequence_step=8, group_size=8
    )
    assert cfg.sequence_grid() == [16, 24, 32]
    p = Planner(cfg, [FULL, CACHED], random.Random(0))
    assert min(a.num_sequences for a in p.actions) == 16


@pytest.mark.parametrize(
    "field,value",
    [
        ("feedback_std_floor", -0.01),
        ("feedback_std_floor", math.inf),
        ("max_feedback", 0.5),
        ("max_feedback", math.inf),
        ("group_size", 0),
    ],
)
def test_new_config_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        PlannerConfig(**{field: value})


def test_feedback_from_groups_counts_only_fully_explored_and_control_groups():
    """Fault 6: every non-control group counted as explored, even when its exploration was
    cancelled or partial (it then ran with default or few-candidate seeds)."""
    from spotlight.core.planner import feedback_from_groups

    rewards = {
        0: [0.0, 1.0, 0.0, 1.0],  # explored, std 0.5
        1: [0.2, 0.4, 0.2, 0.4],  # explored, std 0.1
        2: [0.5, 0.5, 0.5, 0.5],  # partly explored: excluded (std 0 would pull sigma_all down)
        3: [0.1, 0.3, 0.1, 0.3],  # control, std 0.1
        4: [0.0, 0.4, float("nan"), 0.0, 0.4],  # control, NaN dropped: std 0.2
    }
    r = feedback_from_groups(rewards, explored_slots={0, 1}, control_slots={3, 4})
    # sigma_all = (0.5 + 0.1 + 0.1 + 0.2) / 4 = 0.225, sigma_unc = 0.15
    assert r == pytest.approx(1.5)
    # counting slot 2 as explored (the old rule) gives another number
    assert feedback_from_groups(rewards, {0, 1, 2}, {3, 4}) == pytest.approx(0.18 / 0.15)
    # no fully explored group, or no control group: no evidence (a play without feedback)
    assert math.isnan(feedback_from_groups(rewards, set(), {3, 4}))
    assert math.isnan(feedback_from_groups(rewards, {0, 1}, set()))
    # bounds are the ratio's
    assert feedback_from_groups({0: [0.0, 1.0], 1: [0.3, 0.3]}, {0}, {1}) == 5.0
    assert feedback_from_groups(
        {0: [0.0, 1.0], 1: [0.3, 0.3]}, {0}, {1}, std_floor=0.1, max_feedback=100
    ) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="both explored and control"):
        feedback_from_groups(rewards, {0, 3}, {3})
    # the Planner method uses its config's bounds
    p = make_planner(feedback_std_floor=0.1, max_feedback=100.0)
    assert p.feedback({0: [0.0, 1.0], 1: [0.3, 0.3]}, {0}, {1}) == pytest.approx(2.5)


def test_the_config_section_and_the_planner_config_agree():
    """One set of defaults: the ``[planner]`` section and the Planner's own config used to be two
    types with different defaults, copied field by field."""
    import dataclasses

    from spotlight.config import PlannerSection, SpotlightConfig, load_config

    section, core = PlannerSection(), PlannerConfig()
    shared = {f.name for f in dataclasses.fields(PlannerConfig)} & set(PlannerSection.__struct_fields__)
    assert shared >= {"max_sequences", "sequence_step", "beta", "window", "feedback_std_floor", "max_feedback"}
    for name in shared - {"min_sequences"}:  # 0 in the section: the first grid value above K
        assert getattr(section, name) == getattr(core, name), name
    cfg = load_config(overrides={"planner.beta": 0.25, "planner.window": 7})
    pc = cfg.planner_config()
    assert (pc.beta, pc.window, pc.group_size) == (0.25, 7, cfg.data.group_size)
    assert pc.min_sequences == cfg.planner_min_sequences > cfg.data.group_size
    assert isinstance(cfg, SpotlightConfig)
