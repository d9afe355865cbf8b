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
