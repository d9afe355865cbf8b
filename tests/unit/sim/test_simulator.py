"""`spotlight simulate`: the discrete-event simulator drives the real pure cores (iteration
core, Request Scheduler, Planner, Instance Manager, seed bank) with simulated workers."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

from spotlight.sim.profile import DEFAULT_PROFILE, ProfileError, load_profile
from spotlight.sim.simulator import POLICIES, Simulator, simulate
from spotlight.traces.formats import ReplayAction, TraceEvent, load_bamboo_trace, pingpong_trace

REPO = pathlib.Path(__file__).resolve().parents[3]
TRACE = REPO / "examples" / "traces" / "bamboo" / "p3-trace.csv"


@pytest.fixture(scope="module")
def profile():
    # the shipped profile at a smaller workload so each run takes well under a second
    return dataclasses.replace(
        load_profile(), prompts_per_iteration=8, num_control_prompts=2, group_size=8, train_time_s=1200.0
    )


def _churn(t_end: float, period: float = 300.0) -> list[ReplayAction]:
    """Two spot nodes of 2 GPUs; node 1 loses one GPU and gets it back every ``period`` s."""
    acts = [ReplayAction(0.0, "start_node", a, 0, f"n{a}0") for a in range(2)] + [
        ReplayAction(0.0, "add_gpu", a, 1, f"n{a}1") for a in range(2)
    ]
    t = period
    while t < t_end:
        acts.append(ReplayAction(t, "revoke_gpu", 1, 1, "n11"))
        acts.append(ReplayAction(t + period / 2, "add_gpu", 1, 1, "n11"))
        t += period
    return acts


def test_every_policy_finishes_and_the_cost_is_every_gpu_second_times_its_price(profile):
    for name in POLICIES:
        r = simulate(profile, name, _churn(1e6), iterations=3)
        assert r.finished and r.iterations == 3, name
        reserved_gpus = profile.reserved_gpus if POLICIES[name].use_spot else profile.reserved_only_gpus
        assert r.reserved_gpu_hours == pytest.approx(
            r.wall_s * reserved_gpus / 3600
        )  # held the whole run, trainers included
        assert r.cost_usd == pytest.approx(
            r.spot_gpu_hours * profile.spot_usd_per_gpu_hour + r.reserved_gpu_hours * profile.reserved_usd_per_gpu_hour
        )
        assert r.cost_usd == pytest.approx(r.spot_cost_usd + r.reserved_cost_usd)
        if not POLICIES[name].use_spot:
            assert r.spot_gpu_hours == 0
        rollouts = 3 * profile.prompts_per_iteration * profile.group_size
        if name != "verl-omni-spot":
            assert r.requests_done >= rollouts


def test_spotlight_keeps_spot_gpus_busy_while_training_and_off_the_critical_path(profile):
    r = simulate(profile, "spotlight", None, iterations=4)
    assert r.spot_busy_training >= 0.99
    assert r.critical_path_share <= 0.02
    base = simulate(profile, "rlboost", None, iterations=4)
    assert base.spot_busy_training == 0.0  # RLBoost's spot GPUs idle through every training phase


def test_elastic_sp_and_live_migration_lose_less_than_restarts(profile):
    acts = _churn(1e6, period=200.0)
    spot = simulate(profile, "spotlight", acts, iterations=3)
    rlb = simulate(profile, "rlboost+explore", acts, iterations=3)
    assert spot.preemptions > 5 and rlb.preemptions > 5
    assert spot.work_lost_steps <= rlb.work_lost_steps
    assert spot.spot_utilisation > rlb.spot_utilisation
    # without live migration, revoked in-flight work is lost
    nolm = simulate(
        profile,
        dataclasses.replace(POLICIES["spotlight"], name="spotlight-no-migration", live_migration=False),
        acts,
        iterations=3,
    )
    assert nolm.work_lost_steps > spot.work_lost_steps


def test_resuming_committed_work_pays_the_restore_time(profile):
    """Live migration is not free: resuming a committed request fetches its latents back
    (profile commit_s); with paper-like cycles (8 -> 4 -> 8 spot GPUs) a slow restore costs time."""
    from spotlight.traces.synthetic import preemption_cycles

    acts = preemption_cycles(2, 2, cycles_per_iteration=4, iteration_s=1500.0, iterations=6, revoke_gpus=2)
    fast = simulate(dataclasses.replace(profile, commit_s=0.0), "spotlight", acts, iterations=3)
    slow = simulate(dataclasses.replace(profile, commit_s=200.0), "spotlight", acts, iterations=3)
    assert fast.preemptions > 0 and slow.preemptions > 0
    assert slow.wall_s > fast.wall_s


def test_a_candidate_cap_below_d_still_explores(profile):
    """--max-candidates below the planned d: the prompts explored up to the cap count
    as explored (the cap, not d, is what can be scored)."""
    sim = Simulator(profile, POLICIES["spotlight"], None, iterations=3, max_candidates_per_prompt=12)
    r = sim.run()
    explored = [row["planner/explored_groups"] for row in r.rows[1:]]
    assert explored and all(n == profile.prompts_per_iteration - profile.num_control_prompts for n in explored)


def test_deterministic_for_a_seed(profile):
    a = simulate(profile, "spotlight", _churn(1e6), iterations=2, seed=3)
    b = simulate(profile, "spotlight", _churn(1e6), iterations=2, seed=3)
    timing = {"sim_elapsed_s": 0, "speedup_vs_real_time": 0}
    assert a.summary() | timing == b.summary() | timing
    assert a.rows == b.rows


def test_best_of_n_baseline_runs_n_generations_per_prompt_on_the_critical_path(profile):
    sim = Simulator(profile, POLICIES["verl-omni-spot"], None, iterations=2)
    r = sim.run()
    n = profile.best_of_n
    assert r.requests_done == 2 * profile.prompts_per_iteration * n  # N per prompt, no second rollout
    assert r.critical_path_share > 0.2


def test_pingpong_trace_is_continuous_at_every_turn():
    ev = [
        TraceEvent(0.0, "add", "a"),
        TraceEvent(0.0, "add", "b"),
        TraceEvent(10.0, "remove", "a"),
        TraceEvent(20.0, "add", "c"),
    ]
    out = pingpong_trace(ev, 200.0, period_s=30.0)
    alive, counts = set(), []
    for e in out:  # replaying must never add an alive node or remove a dead one
        if e.action == "add":
            assert e.node not in alive
            alive.add(e.node)
        else:
            assert e.node in alive
            alive.remove(e.node)
        counts.append(len(alive))
    assert all(b.t_s >= a.t_s for a, b in zip(out, out[1:])) and out[-1].t_s < 200.0
    # backward pass: c leaves at 30 + 10, a returns at 30 + 20; forward again from 60
    assert (40.0, "remove", "c") in [(e.t_s, e.action, e.node) for e in out]
    assert (50.0, "add", "a") in [(e.t_s, e.action, e.node) for e in out]
    assert (70.0, "remove", "a") in [(e.t_s, e.action, e.node) for e in out]
    real = pingpong_trace(load_bamboo_trace(TRACE), 3 * 86400.0)
    assert real[-1].t_s > 2 * 86400.0


def test_profile_errors_name_the_field(tmp_path):
    bad = tmp_path / "p.toml"
    bad.write_text(DEFAULT_PROFILE.read_text().replace("step_gpu_s = 2.0", "step_gpu_s = -1"))
    with pytest.raises(ProfileError, match=r"\[timing\] step_gpu_s must be > 0"):
        load_profile(bad)
    bad.write_text(DEFAULT_PROFILE.read_text().replace("num_steps = 20 ", "num_steps = 'x' "))
    with pytest.raises(ProfileError, match=r"\[workload\] num_steps must be an integer"):
        load_profile(bad)
    bad.write_text("[workload]\nprompts_per_iteration = 4\n")
    with pytest.raises(ProfileError, match="sp_efficiency|missing"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.toml")
    for old, new, match in (
        ("best_of_n = 32", "best_of_n = 8", "best_of_n must be > group_size"),
        ("spot_sp = 2", "spot_sp = 4", "needs at least 4 GPUs per spot node"),
        ("effective_steps = 16.0", "effective_steps = 200.0", "cannot exceed"),
        ("min_effective_steps = 12.0", "min_effective_steps = 50.0", "no step option"),
        ("reserved-only = 64", "reserved-onyl = 64", "unknown policy 'reserved-onyl'"),
    ):
        bad.write_text(DEFAULT_PROFILE.read_text().replace(old, new, 1))
        with pytest.raises(ProfileError, match=match):
            load_profile(bad)
    bad.write_text("timing = 5\n" + DEFAULT_PROFILE.read_text().replace("[timing]", "[timingx]"))
    with pytest.raises(ProfileError, match=r"\[timing\] must be a table"):
        load_profile(bad)


@pytest.mark.parametrize(
    "old, new, match",
    [
        # a misspelled key next to the real one used to be ignored: the run used the real one
        (
            "batch_size = 4 ",
            "batch_size = 4\nnum_step = 30 ",
            r"\[workload\] unknown key 'num_step'; did you mean num_steps\?",
        ),
        ("[timing]\n", "[timing]\nnotice_s = 5\n", r"\[timing\] unknown key 'notice_s'; it belongs in \[cluster\]"),
        ("[prices]\n", "[prices]\nzzz = 1\n", r"\[prices\] unknown key 'zzz' \(the keys are spot_usd_per_gpu_hour"),
        ("name = ", "nmae = 'x'\nname = ", r"unknown top-level key 'nmae'"),
        ("name = ", "spot_nodes = 8\nname = ", r"unknown top-level key 'spot_nodes'; it belongs in \[cluster\]"),
        # appended at the end of the file, TOML puts the key in [iterations_to_target]
        ("reserved-only = 64", "reserved-only = 64\nspot_nodes = 8", r"has 'spot_nodes', which belongs in \[cluster\]"),
        ("reserved-only = 64", "reserved-only = 64\nname = 'x'", r"has 'name', which belongs in the top of the file"),
        # a key of one step option is as read as any other
        (
            "accuracy = 1.00",
            "accuracy = 1.00, acuracy = 0.3",
            r"step_options entry 1: unknown key 'acuracy'; did you mean accuracy\?",
        ),
        # "02" and 2 are one SP degree: one of the two values was dropped silently
        ("2 = 0.87,", '2 = 0.87, "02" = 0.5,', r"sp_efficiency gives SP degree 2 twice"),
    ],
)
def test_a_key_the_simulator_does_not_read_is_refused_with_the_key_it_was_meant_to_be(tmp_path, old, new, match):
    text = DEFAULT_PROFILE.read_text()
    assert old in text
    bad = tmp_path / "p.toml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(ProfileError, match=match):
        load_profile(bad)


def test_the_shipped_profiles_set_every_key_the_simulator_reads():
    import tomllib

    from spotlight.sim.profile import PROFILE_KEYS

    for path in DEFAULT_PROFILE.parent.glob("*.toml"):
        d = tomllib.loads(path.read_text())
        assert {s: sorted(d[s]) for s in PROFILE_KEYS} == {s: sorted(k) for s, k in PROFILE_KEYS.items()}, path
        load_profile(path)


def test_a_run_config_given_as_profile_is_named_as_not_a_profile(tmp_path):
    from spotlight.config import DEFAULT_CONFIG_PATH

    with pytest.raises(
        ProfileError,
        match=r"not a simulation profile: unknown section\(s\) \[model\]"
        r".*missing section\(s\) \[workload\], \[timing\].*a run config\?",
    ):
        load_profile(DEFAULT_CONFIG_PATH)
    bad = tmp_path / "p.toml"
    bad.write_text(DEFAULT_PROFILE.read_text().replace("[prices]", "[pricez]"))
    with pytest.raises(
        ProfileError,
        match=r"not a simulation profile: unknown section\(s\) \[pricez\]; missing section\(s\) \[prices\]$",
    ):
        load_profile(bad)


def test_cli_prints_the_cost_to_target_table(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "simulate",
        "--trace",
        str(TRACE),
        "--iterations",
        "2",
        "--out",
        str(tmp_path),
        "--json",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload = json.loads(proc.stdout)  # progress off a terminal goes to stderr, as lines
    assert "simulating spotlight …" in proc.stderr and "wrote " in proc.stderr, proc.stderr[-2000:]
    assert [r["policy"] for r in payload["results"]] == ["spotlight", "rlboost", "verl-omni-spot", "reserved-only"]
    assert (tmp_path / "simulate.png").stat().st_size > 10_000
    bad = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "simulate", "--policy", "nope", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown policy 'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_synthetic_reward_many_equals_one_at_a_time():
    """The simulator computes rewards ahead in bulk (numpy SplitMix64, ``math`` log/cos/sin):
    bit for bit the rewards of one call per request."""
    import random

    from spotlight.sim.simulator import SyntheticReward

    rng = random.Random(3)
    for seed in (0, 1, 2**40):
        bulk, single = SyntheticReward(seed), SyntheticReward(seed)
        for n in (0, 1, 7, 3000):
            prompts = [rng.randrange(-2, 200) for _ in range(n)]
            seeds = [rng.choice([rng.randrange(2**31), rng.randrange(2**64), 0, 2**64 - 1]) for _ in range(n)]
            stale = [rng.random() < 0.4 for _ in range(n)]
            assert bulk.many(prompts, seeds, stale) == [single(p, s, stale=t) for p, s, t in zip(prompts, seeds, stale)]
        # a seed outside [0, 2**64) takes the one-at-a-time path
        assert bulk.many([1, 2], [5, -1], [False, True]) == [single(1, 5, stale=False), single(2, -1, stale=True)]


def test_a_run_leaves_the_garbage_collector_as_it_found_it(profile):
    import gc

    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            simulate(profile, "spotlight", None, iterations=2)
            assert gc.isenabled() is state
    finally:
        (gc.enable if was else gc.disable)()


def test_an_unfinished_run_says_why_and_is_not_compared_as_a_cost_to_target(profile):
    """Was: with a training step past the 30-day limit every policy showed "0 (unfinished)", but
    its wall time, cost and "vs spotlight" ratio were printed as results, and the warning did not
    say what stopped it."""
    from spotlight.cli.simulate import _cells
    from spotlight.sim.report import comparison_rows

    slow = dataclasses.replace(profile, train_time_s=1e8)
    stuck = [simulate(slow, name, _churn(1e5), iterations=2) for name in ("spotlight", "rlboost")]
    for r in stuck:
        assert not r.finished and r.iterations == 0
        assert "lies past the simulated time limit of 30 days" in r.stopped_because, r.stopped_because
    rows = comparison_rows(stuck)
    assert all(row["cost_vs_baseline"] != row["cost_vs_baseline"] for row in rows)  # NaN: no ratio
    cells = _cells(rows[1] | {"cost_vs_baseline": None})  # as simulate.json holds it
    assert cells[1] == "0 (unfinished)" and cells[2].endswith("h (stopped)") and cells[3].endswith(" (stopped)")
    assert cells[4] == "—"
    done = [simulate(profile, name, _churn(1e6), iterations=2) for name in ("spotlight", "rlboost")]
    assert all(r.finished and r.stopped_because == "" for r in done)
    assert comparison_rows(done)[1]["cost_vs_baseline"] > 0
    # a finished run beside an unfinished baseline: no ratio either
    assert (
        comparison_rows([stuck[0], done[1]])[1]["cost_vs_baseline"]
        != comparison_rows([stuck[0], done[1]])[1]["cost_vs_baseline"]
    )
