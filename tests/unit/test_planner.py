"""Unit tests for the Planner (paper §4.3): pure logic, no timing."""

from __future__ import annotations

import json
import math
import random

import pytest

from spotlight.planner import (
    Action,
    ArmScore,
    Planner,
    PlannerConfig,
    PlannerObservation,
    StepOption,
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
        (8, 10.0), (16, 10.0), (24, 10.0), (32, 10.0), (8, 20.0), (16, 20.0), (24, 20.0), (32, 20.0)
    ]
    o = PlannerObservation(train_time_s=1.0, num_spot_gpus=1, num_explored_prompts=3, step_time_s=0.25)
    assert p.planned_cost_s(A(16, 20.0), o) == pytest.approx(16 * 3 * 20 * 0.25)


def test_eligibility_matches_hand_computed_set():
    p = make_planner()
    plan = p.plan(obs(40.0, 4))  # W = 160; costs d*s: 80,160,240,320 | 160,320,480,640
    assert plan.budget_s == 160.0
    assert {(s.action.num_sequences, s.action.effective_steps) for s in plan.eligible} == {
        (8, 10.0), (16, 10.0), (8, 20.0)
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


def test_all_options_refused_raises():
    with pytest.raises(ValueError, match="all 2 step options refused"):
        make_planner(options=(INACCURATE, TOO_FEW))
    with pytest.raises(ValueError, match="refused"):
        make_planner(options=(FULL,), min_effective_steps=25.0)


@pytest.mark.parametrize(
    "field,value",
    [("max_sequences", 4), ("min_sequences", 0), ("sequence_step", 0), ("min_effective_steps", 0.0),
     ("min_exploration_accuracy", 1.5), ("beta", -0.1), ("window", 0)],
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
    assert math.isnan(feedback_ratio([0.4, 0.6], [0.0, 0.0]))


def test_non_finite_feedback_ignored():
    p = make_planner()
    p.update(A(8, 10.0), 1.0)
    before = p.state_dict()
    p.update(A(8, 10.0), math.nan)
    p.update(A(8, 10.0), math.inf)
    p.update(A(16, 10.0), -math.inf)
    assert p.num_ignored_feedback == 3
    assert p.total_updates == 1
    after = p.state_dict()
    assert after["arms"] == before["arms"] and after["total_updates"] == before["total_updates"]
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
    assert p2.num_ignored_feedback == 1 and p2.total_updates == 12
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
