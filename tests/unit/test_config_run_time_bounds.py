"""A config the product accepts never fails at run time: values that would overflow a C or OS
API (thread counts, timeouts, seeds), stall the run (a lease shorter than a heartbeat) or turn
every sample into NaN (guidance, shift) are refused at load, with one line naming the key."""

from __future__ import annotations

import pathlib

import pytest

from spotlight.config import (
    MAX_DURATION_S,
    MAX_GUIDANCE_SCALE,
    MAX_NOISE_LEVEL,
    MAX_SHIFT,
    MAX_SP_DEGREE,
    MAX_THREADS,
    MAX_WORKER_BATCH,
    MIN_SHIFT,
    REPO_ROOT,
    ConfigError,
    SpotlightConfig,
    load_config,
)


def _refused(overrides: dict, key: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    msg = str(info.value)
    assert key in msg, msg
    assert "\n" not in msg, msg
    assert info.value.field == key
    return msg


# -- 1: integers that reach a C or OS API --------------------------------------------------


@pytest.mark.parametrize(
    ("key", "bound"),
    [
        ("cluster.torch_threads", MAX_THREADS),
        ("reward.num_threads", MAX_THREADS),
        ("cluster.worker_batch_size", MAX_WORKER_BATCH),
        ("cluster.sp_degree", MAX_SP_DEGREE),
        ("cluster.reserved_sp_degree", MAX_SP_DEGREE),
    ],
)
def test_counts_that_reach_c_apis_are_bounded(key, bound):
    assert "must be <=" in _refused({key: 1_000_000_000_000}, key)
    _refused({key: bound + 1}, key)
    if "sp_degree" not in key:  # the tiny model cannot be split 4096 ways: the bound alone is checked
        load_config(overrides={key: bound})


@pytest.mark.parametrize("key", ["model.init_seed", "run.seed", "data.shuffle_seed", "cluster.max_message_bytes"])
def test_every_integer_fits_64_bits(key):
    assert "64-bit integer" in _refused({key: 1 << 64}, key)
    assert "64-bit integer" in _refused({key: -(1 << 63) - 1}, key)
    if key != "cluster.max_message_bytes":
        load_config(overrides={key: (1 << 63) - 1})


def test_a_huge_integer_in_a_toml_list_is_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[cluster]\nreserved_rollout_gpus = [100000000000000000000000]\n")
    with pytest.raises(ConfigError, match="cluster.reserved_rollout_gpus"):
        load_config(path)


def test_torch_threads_from_a_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[cluster]\ntorch_threads = 1000000000000\n")
    with pytest.raises(ConfigError, match=r"cluster\.torch_threads: must be <= 4096$"):
        load_config(path)


# -- 2: every duration has an upper bound ---------------------------------------------------


def _duration_fields() -> list[str]:
    cfg = SpotlightConfig()
    return [
        f"{section}.{name}"
        for section in cfg.__struct_fields__
        for name in getattr(cfg, section).__struct_fields__
        if name.endswith("_s")
    ]


def test_the_duration_fields_are_found():
    fields = _duration_fields()
    for key in ("reward.timeout_s", "reward.give_up_after_s", "cluster.lease_timeout_s", "eval.timeout_s"):
        assert key in fields


@pytest.mark.parametrize("key", _duration_fields())
def test_every_duration_has_an_upper_bound(key):
    if key == "cluster.heartbeat_interval_s":  # bounded by the timeouts it must stay below
        with pytest.raises(ConfigError, match="must"):
            load_config(overrides={key: 1e10, "cluster.heartbeat_timeout_s": 2e10, "cluster.lease_timeout_s": 2e10})
    else:
        assert "must be <=" in _refused({key: 1e10}, key)
    # just inside the bound still loads
    inside = {key: MAX_DURATION_S}
    if key == "cluster.heartbeat_interval_s":
        inside.update({"cluster.heartbeat_timeout_s": MAX_DURATION_S, "cluster.lease_timeout_s": MAX_DURATION_S})
        inside[key] = MAX_DURATION_S / 2
    load_config(overrides=inside)


def test_duration_lower_bounds_are_kept():
    _refused({"reward.timeout_s": 0}, "reward.timeout_s")
    _refused({"cluster.lease_timeout_s": -1}, "cluster.lease_timeout_s")


def _run_configs() -> list[pathlib.Path]:
    found = []
    for root in ("examples", "spotlight"):
        for path in sorted((REPO_ROOT / root).rglob("*.toml")):
            text = path.read_text()
            is_run = any(line.startswith(("[run]", "[cluster]")) for line in text.splitlines())
            is_profile = any(line.startswith(("[workload]", "[timing]")) for line in text.splitlines())
            if is_run and not is_profile:
                found.append(path)
    return found


def test_shipped_run_configs_still_load():
    paths = _run_configs()
    assert REPO_ROOT / "examples" / "default" / "config.toml" in paths
    for path in paths:
        load_config(path)


# -- 3: leases outlive a heartbeat ----------------------------------------------------------


def test_a_lease_shorter_than_a_heartbeat_is_refused():
    msg = _refused({"cluster.lease_timeout_s": 0.001}, "cluster.lease_timeout_s")
    assert "heartbeat_interval_s" in msg
    _refused({"cluster.lease_timeout_s": 1.0, "cluster.heartbeat_interval_s": 1.0}, "cluster.lease_timeout_s")
    load_config(overrides={"cluster.lease_timeout_s": 1.5, "cluster.heartbeat_interval_s": 1.0})


# -- 4: guidance and shift that make every sample NaN ---------------------------------------


def test_guidance_scale_is_bounded():
    assert "must be <=" in _refused({"model.guidance_scale": 1e300}, "model.guidance_scale")
    _refused({"model.guidance_scale": -1.0}, "model.guidance_scale")  # the lower bound stays
    load_config(overrides={"model.guidance_scale": MAX_GUIDANCE_SCALE})
    load_config(overrides={"model.guidance_scale": 0.0})


@pytest.mark.parametrize("shift", [1e300, 1e-300, MAX_SHIFT * 1.01, MIN_SHIFT / 2, 0.0, -1.0])
def test_shift_out_of_range_is_refused(shift):
    assert "must be between" in _refused({"sampler.shift": shift}, "sampler.shift")


@pytest.mark.parametrize("shift", [MIN_SHIFT, 1.0, 3.0, MAX_SHIFT])
def test_shift_in_range_loads(shift):
    assert load_config(overrides={"sampler.shift": shift}).sampler.shift == shift


@pytest.mark.parametrize("eta", [1e300, MAX_NOISE_LEVEL * 1.01, 0.0])
def test_noise_level_out_of_range_is_refused(eta):
    _refused({"sampler.noise_level": eta}, "sampler.noise_level")


def test_noise_level_in_range_loads():
    assert load_config(overrides={"sampler.noise_level": MAX_NOISE_LEVEL}).sampler.noise_level == MAX_NOISE_LEVEL


# -- 5: a key outside any section -----------------------------------------------------------


def test_a_top_level_key_is_not_called_a_section(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("foo = 1\n[run]\niterations = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "foo: a key outside any [section]" in msg, msg
    assert "unknown section" not in msg
    # a misspelt key outside any section points to the one meant
    path.write_text("iteratoins = 2\n")
    with pytest.raises(ConfigError, match=r"iteratoins: a key outside any \[section\]; did you mean run\.iterations\?"):
        load_config(path)
    # an unknown table is still an unknown section
    path.write_text("[foo]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"\[foo\]: unknown section"):
        load_config(path)


# -- values that loaded and then hung, crashed or trained on less than asked -----------------


def test_a_message_limit_below_a_worker_batch_result_is_refused():
    """Was: accepted, then ZeroMQ dropped every rollout result of 32 × 9 window latents (3.5 MiB)
    over the 1 MiB limit, the agent re-registered again and again, and the run never finished."""
    from spotlight.core.memory_plan import largest_worker_frame_bytes

    overrides = {"cluster.max_message_bytes": 1 << 20, "cluster.worker_batch_size": 32, "sampler.sde_window_size": 8}
    msg = _refused(overrides, "cluster.max_message_bytes")
    assert "RESULT frame of SDE window latents" in msg and "lower cluster.worker_batch_size" in msg, msg
    need, _ = largest_worker_frame_bytes(load_config(overrides={**overrides, "cluster.max_message_bytes": 1 << 30}))
    assert need == 32 * 9 * 3 * 32 * 32 * 4 + 64 * 1024  # the tiny model's 32 px latents are its pixels
    load_config(overrides={**overrides, "cluster.max_message_bytes": need})


def test_reserved_only_without_a_reserved_rollout_gpu_is_refused():
    """Was: accepted, and `up` waited in "phase starting" for ever: no GPU ran rollouts."""
    msg = _refused({"run.mode": "reserved-only", "cluster.reserved_rollout_gpus": []}, "cluster.reserved_rollout_gpus")
    assert "cluster.use_spot = false" in msg and "reserved-only" in msg, msg
    load_config(overrides={"cluster.reserved_rollout_gpus": []})  # spot GPUs run them


@pytest.mark.parametrize(
    ("mode", "bound", "least"),
    [("verl-omni-spot", "explore.num_candidates", 24), ("spotlight", "planner.max_sequences", 32)],
    ids=["best-of-n", "bandit"],
)
def test_a_candidate_cap_below_the_planned_candidates_is_refused(mode, bound, least):
    """Was: best-of-N with a cap of 2 trained on 2 samples a group (24 in all instead of 96),
    and the bandit's large arms were cut short while the Planner was credited for them."""
    msg = _refused(
        {"run.mode": mode, "explore.max_candidates_per_prompt": least - 1}, "explore.max_candidates_per_prompt"
    )
    assert f"must be >= {bound} = {least}" in msg, msg
    load_config(overrides={"run.mode": mode, "explore.max_candidates_per_prompt": least})
    load_config(overrides={"explore.max_candidates_per_prompt": 2, "explore.enabled": False})  # no exploration


def test_a_minimum_step_count_above_the_rollouts_is_refused():
    """Was: `ValueError: all 1 step options refused …` as a traceback when the coordinator started."""
    msg = _refused({"planner.min_effective_steps": 50.0}, "planner.min_effective_steps")
    assert "must be <= sampler.num_steps=" in msg, msg


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"planner.max_sequences": 10**12}, "planner.max_sequences"),
        ({"planner.max_sequences": 100_000, "planner.sequence_step": 1}, "planner.sequence_step"),
        ({"eval.num_seeds": 10**10}, "eval.num_seeds"),
    ],
    ids=["planner-d", "planner-grid", "eval-seeds"],
)
def test_sizes_built_as_lists_at_start_are_bounded(overrides, key):
    """Was: MemoryError at coordinator start (the Planner's d grid) or in `up`'s check of the
    held-out panel, both built in memory."""
    _refused(overrides, key)


def test_more_optimizer_steps_than_samples_are_refused():
    """Was: 10**12 steps accepted; the trainer built a list of that many minibatches and looped
    through empty ones for ever."""
    msg = _refused({"train.steps_per_iteration": 97}, "train.steps_per_iteration")
    assert "must be <= 96" in msg, msg
    load_config(overrides={"train.steps_per_iteration": 96})


def test_text_tokens_below_what_the_tokenizer_needs_are_refused():
    """Was: `max_text_tokens = 1` loaded; `up` then failed to encode the prompts with the
    tokenizer's advice ("activate truncation and/or padding") and `eval` with a traceback."""
    msg = _refused({"model.max_text_tokens": 1}, "model.max_text_tokens")
    assert "must be >= 2" in msg and "[CLS] and [SEP]" in msg, msg
    load_config(overrides={"model.max_text_tokens": 2})


def test_uncapped_exploration_takes_any_planner_grid_the_config_accepts():
    """Was: `planner.max_sequences = 1048576` loaded, and `up --uncapped-exploration` (a cap of
    1 000 000) then refused it, blaming the flag."""
    from spotlight.cli.up_preflight import UNCAPPED_CANDIDATES
    from spotlight.config import MAX_PLANNER_SEQUENCES

    assert UNCAPPED_CANDIDATES >= MAX_PLANNER_SEQUENCES
    biggest = {"planner.max_sequences": MAX_PLANNER_SEQUENCES, "planner.sequence_step": 1024}
    load_config(overrides={**biggest, "explore.max_candidates_per_prompt": UNCAPPED_CANDIDATES})
    _refused({**biggest, "planner.max_sequences": MAX_PLANNER_SEQUENCES + 1}, "planner.max_sequences")
