"""Convergence statistics (spotlight/studies/convergence.py): held-out curves from eval.jsonl
rows, moving averages, target, iterations to target with censoring, bootstrap intervals and
the goal check, on synthetic rows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spotlight.studies import convergence as cv


def _curve(scores, start=1, every=1, base=None) -> cv.Curve:
    return cv.Curve(tuple(range(start, start + every * len(scores), every)), tuple(float(s) for s in scores), base)


def _metrics(n, iteration_s=10.0, critical_s=0.0, usd_per_iteration=0.5):
    return [
        {
            "iteration": i,
            "time/iteration_s": iteration_s,
            "time/explore_critical_path_s": critical_s,
            "cost/usd": usd_per_iteration * (i + 1),
        }
        for i in range(n)
    ]


def test_heldout_curve_is_one_based_keeps_the_base_apart_and_the_last_row_of_an_iteration():
    rows = [
        {"iteration": -1, "version": 0, "eval/partial": 0.2, "eval/strict": 0.1},
        {"iteration": 1, "version": 2, "eval/partial": 0.4},
        {"iteration": 0, "version": 1, "eval/partial": 0.3},
        {"iteration": 1, "version": 2, "eval/partial": 0.5},  # a resumed run evaluated it again
    ]
    c = cv.heldout_curve(rows, "eval/partial")
    assert c.iterations == (1, 2)
    assert c.scores == (0.3, 0.5)
    assert c.base == 0.2


def test_heldout_curve_names_a_score_the_rows_lack():
    with pytest.raises(ValueError, match="eval/strict"):
        cv.heldout_curve([{"iteration": 0, "version": 1, "eval/score": 0.3}], "eval/strict")


def test_moving_average_windows_and_short_input():
    assert cv.moving_average([1, 2, 3, 4], 2).tolist() == [1.5, 2.5, 3.5]
    assert cv.moving_average([1, 2], 3).size == 0
    with pytest.raises(ValueError):
        cv.moving_average([1, 2, 3], 0)


def test_a_curve_reaching_the_target_at_iteration_5_gives_5():
    # windows of 3 end at 3, 4, 5, ...: means 0.2, 0.3, 0.4 (>= 0.4 first at iteration 5)
    c = _curve([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert cv.iterations_to_target(c, 0.4, 3) == 5
    assert cv.iterations_to_target(c, 0.45, 3) == 6
    assert cv.iterations_to_target(c, 0.6, 3) is None
    assert cv.iterations_to_target(c, 0.6, 1) == 6


def test_iterations_to_target_counts_training_iterations_when_evaluated_every_other():
    c = _curve([0.1, 0.5, 0.5], start=2, every=2)  # iterations 2, 4, 6
    assert cv.iterations_to_target(c, 0.5, 2) == 6
    assert cv.iterations_to_target(c, 0.3, 2) == 4


def test_target_is_the_lowest_saturated_seed_mean_score():
    fast = [_curve([0.2, 0.6, 0.6, 0.6]), _curve([0.2, 0.4, 0.4, 0.4])]  # mean 0.2, 0.5, 0.5, 0.5
    slow = [_curve([0.1, 0.2, 0.3, 0.4]), _curve([0.1, 0.2, 0.3, 0.4, 0.9])]  # common iterations 1-4
    target, sat = cv.target_score({"fast": fast, "slow": slow}, 2)
    assert sat == pytest.approx({"fast": 0.5, "slow": 0.35})
    assert target == pytest.approx(0.35)
    with pytest.raises(ValueError, match="at least 5"):
        cv.saturated_score(fast, 5)


def test_common_window_shrinks_only_to_the_shortest_run():
    assert cv.common_window([_curve([1] * 10), _curve([1] * 4)], 3) == 3
    assert cv.common_window([_curve([1] * 10), _curve([1] * 2)], 3) == 2
    with pytest.raises(ValueError, match="no evaluated iteration"):
        cv.common_window([_curve([])], 3)


def test_bootstrap_interval_of_identical_values_is_a_point():
    ci = cv.bootstrap_mean_ci([7, 7, 7, 7, 7])
    assert ci.mean == ci.low == ci.high == 7.0
    assert ci.n == 5
    assert ci.format("%.1f") == "7.0"


def test_bootstrap_interval_brackets_the_mean_widens_with_spread_and_is_reproducible():
    narrow = cv.bootstrap_mean_ci([9, 10, 11, 10, 10])
    wide = cv.bootstrap_mean_ci([4, 10, 16, 10, 10])
    assert narrow.low < narrow.mean == 10.0 < narrow.high
    assert wide.high - wide.low > 2 * (narrow.high - narrow.low)
    assert cv.bootstrap_mean_ci([4, 10, 16, 10, 10]) == wide  # fixed generator seed
    odd = [1.3, 2.7, 5.1, 9.9, 4.4]
    assert cv.bootstrap_mean_ci(odd, seed=1) != cv.bootstrap_mean_ci(odd, seed=2)
    # the percentile interval of a mean of 5 values in 4..16 lies inside the range of values
    assert 4 <= wide.low and wide.high <= 16


def test_bootstrap_of_nothing_is_nan_and_formats_as_a_dash():
    ci = cv.bootstrap_mean_ci([])
    assert ci.n == 0 and math.isnan(ci.mean)
    assert ci.format() == "—"
    assert ci.to_json()["mean"] is None


def test_ratio_interval_resamples_each_side():
    point = cv.bootstrap_ratio_ci([12, 12, 12], [6, 6, 6])
    assert point.mean == point.low == point.high == 2.0
    r = cv.bootstrap_ratio_ci([10, 12, 14], [5, 6, 7])
    assert r.mean == pytest.approx(2.0)
    assert r.low < 2.0 < r.high
    with pytest.raises(ValueError, match="> 0"):
        cv.bootstrap_ratio_ci([1, 2], [0, 1])


def test_run_outcome_of_a_run_that_reaches_the_target():
    o = cv.run_outcome(_metrics(6, iteration_s=10.0, critical_s=0.5), _curve([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), 0.4, 3)
    assert o.reached and o.iterations_to_target == o.iterations_censored == 5
    assert o.wall_s_to_target == o.wall_s_censored == 50.0
    assert o.cost_usd_to_target == pytest.approx(2.5)
    assert o.critical_path_share == pytest.approx(0.05)
    assert o.mean_iteration_s == 10.0


def test_a_run_that_never_reaches_the_target_is_censored_at_iterations_plus_one():
    o = cv.run_outcome(_metrics(6, iteration_s=10.0), _curve([0.1] * 6), 0.4, 3)
    assert not o.reached and o.iterations_to_target is None and o.wall_s_to_target is None
    assert o.iterations_censored == 7
    assert o.wall_s_censored == 70.0  # the whole run plus one mean iteration
    assert o.cost_usd_to_target is None


def test_mode_summary_counts_reached_and_uses_censored_values():
    hit = cv.run_outcome(_metrics(6), _curve([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), 0.4, 3)  # 5
    miss = cv.run_outcome(_metrics(6), _curve([0.1] * 6), 0.4, 3)  # censored at 7
    s = cv.mode_summary([hit, miss], {"heldout_strict": [0.3, None]})
    assert s["runs"] == 2 and s["reached"] == 1
    assert s["iterations_to_target"].mean == 6.0
    assert s["iterations_to_target"].low == 5.0 and s["iterations_to_target"].high == 7.0
    assert s["heldout_strict"].n == 1


def _outcomes(iterations, n_run=20, critical_s=0.0):
    out = []
    for n in iterations:
        scores = [0.0] * n_run if n is None else [0.0] * (n - 1) + [1.0] * (n_run - n + 1)
        out.append(cv.run_outcome(_metrics(n_run, critical_s=critical_s), _curve(scores), 1.0, 1))
    return out


def test_goal_is_met_only_with_the_ratio_separated_intervals_and_a_small_critical_path():
    base, ours = _outcomes([12, 13, 12, 14, 13]), _outcomes([6, 7, 6, 7, 6], critical_s=0.1)
    g = cv.goal_check(base, ours)
    assert g["ratio"].mean == pytest.approx(64 / 32)
    assert g["ratio_ok"] and g["ratio_low_ok"] and g["separated"] and g["critical_path_ok"]
    assert g["met"] and g["censored_runs"] == 0

    assert not cv.goal_check(base, _outcomes([6, 7, 6, 7, 6], critical_s=0.5))["met"]  # 5 % on the critical path
    close = cv.goal_check(_outcomes([9, 10, 9, 10, 9]), _outcomes([8, 9, 8, 9, 8]))
    assert not close["ratio_ok"] and not close["met"]
    # a 1.5x point ratio whose intervals overlap is not the goal either
    spread = cv.goal_check(_outcomes([4, 20, 6, 18, 12]), _outcomes([6, 8, 7, 7, 12]))
    assert spread["ratio_ok"] and not spread["separated"] and not spread["met"]


def test_goal_counts_censored_runs():
    g = cv.goal_check(_outcomes([None, 12, 12], n_run=15), _outcomes([6, 6, 6], n_run=15))
    assert g["censored_runs"] == 1
    assert g["ratio"].mean == pytest.approx(np.mean([16, 12, 12]) / 6)


def test_goal_is_not_met_while_a_spotlight_run_never_reached_the_target():
    # Spotlight's runs were shorter and never got there: censored at 9, a lower bound, against
    # rlboost's 15 — the 1.67x "ratio" is an upper bound and shows nothing
    g = cv.goal_check(_outcomes([15] * 5, n_run=20), _outcomes([None] * 5, n_run=8))
    assert g["ratio_ok"] and g["separated"] and g["critical_path_ok"]
    assert g["ours_censored"] == 5 and not g["met"]
    # one Spotlight run of five that never got there is enough to withhold the verdict
    g = cv.goal_check(_outcomes([19, 20, 20, 19, 20]), _outcomes([None, 6, 6, 6, 6]))
    assert g["ratio"].mean >= 1.5 and g["separated"] and g["ours_censored"] == 1 and not g["met"]
    # the baseline's censored runs only make the ratio conservative: the goal can still be met
    g = cv.goal_check(_outcomes([None, 20, 20, 19, 20]), _outcomes([6, 6, 7, 6, 6]))
    assert g["censored_runs"] == 1 and g["ours_censored"] == 0 and g["met"]


def test_goal_needs_more_than_one_run_per_mode_for_intervals_to_be_apart():
    # one run each: the "intervals" are points, so a 2x ratio shows nothing about the spread
    g = cv.goal_check(_outcomes([12]), _outcomes([6]))
    assert g["ratio_ok"] and g["too_few_runs"] and not g["separated"] and not g["met"]
    g = cv.goal_check(_outcomes([12, 13]), _outcomes([6, 6]))
    assert not g["too_few_runs"] and g["separated"] and g["met"]


def _flat(seed: int, base: float = 0.49, n: int = 10) -> cv.Curve:
    """A run whose panel score only wobbles around the base model's (no learning)."""
    rng = np.random.default_rng(seed)
    return cv.Curve(tuple(range(1, n + 1)), tuple(base + 0.02 * rng.standard_normal(n)), base)


def test_a_mode_whose_runs_only_wobble_did_not_learn():
    """The 5-seed shapes benchmark: every mode's best 3-point window sat within noise of the base
    model's panel score, and the iterations-to-target counts were noise."""
    curves = {"a": [_flat(s) for s in range(5)], "b": [_flat(s) for s in range(5, 10)]}
    target, _ = cv.target_score(curves, 3)
    check = cv.learning_check(curves, target, 3)
    assert not check["modes"]["a"]["learned"] and not check["modes"]["b"]["learned"]
    assert check["target_ok"] is False


def test_a_mode_that_climbs_learned_and_its_target_is_beyond_noise():
    rising = [
        cv.Curve(c.iterations, tuple(x + 0.01 * i for i, x in zip(c.iterations, c.scores)), c.base)
        for c in (_flat(s) for s in range(5))
    ]  # the same wobble, plus 0.01 per iteration
    check = cv.learning_check({"a": rising}, cv.target_score({"a": rising}, 3)[0], 3)
    assert check["modes"]["a"]["learned"] is True and check["target_ok"] is True
    assert check["modes"]["a"]["gain"] == pytest.approx(0.09, abs=0.03)


def test_learning_is_unknown_with_one_run_or_without_a_base_evaluation():
    c = cv.Curve((1, 2, 3), (0.4, 0.5, 0.6), None)
    assert cv.mode_learning([c, c], 3)["learned"] is None  # no base score
    assert cv.mode_learning([cv.Curve((1, 2, 3), (0.4, 0.5, 0.6), 0.3)], 3)["learned"] is None  # one run
    assert cv.learning_check({"a": [c, c]}, 0.5, 3)["target_ok"] is None


def test_heldout_curve_names_a_row_that_is_not_an_object_or_a_score_that_is_not_a_number():
    with pytest.raises(ValueError, match="without 'iteration'"):
        cv.heldout_curve([[1, 2]])
    with pytest.raises(ValueError, match="eval/partial is None, not a number"):
        cv.heldout_curve([{"iteration": 0, "eval/partial": None}])
