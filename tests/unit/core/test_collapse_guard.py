"""The collapse guard (``spotlight/core/collapse_guard.py``, docs/collapse-guard.md)."""

from __future__ import annotations

import numpy as np
import pytest

from spotlight.config import ConfigError, GuardConfig
from spotlight.core.collapse_guard import GuardSettings, check, cleared, image_stats

S = GuardSettings(baseline_iterations=2, patience=2)


def _rows(**series) -> list[dict]:
    n = len(next(iter(series.values())))
    return [{"iteration": i} | {k.replace("__", "/"): v[i] for k, v in series.items()} for i in range(n)]


def _run(rows, settings=S):
    """Feed rows one by one as the coordinator does; every alert raised, with its row index."""
    live, got = [], []
    for i in range(1, len(rows) + 1):
        for a in cleared(rows[:i], live, settings):
            live.remove(a)
        new = check(rows[:i], settings, already=live)
        live += new
        got += new
    return got


def test_flat_rows_raise_nothing():
    rows = _rows(
        image__speckle=[0.02] * 8,
        image__hf_energy=[0.01] * 8,
        image__saturation=[0.3] * 8,
        train__approx_kl=[0.01] * 8,
        train__clipfrac=[0.1] * 8,
        reward__mean=[0.1 * i for i in range(8)],
    )
    assert _run(rows) == []


def test_rising_speckle_fires_once_after_patience():
    speckle = [0.02, 0.03, 0.05, 0.20, 0.25, 0.30, 0.35]
    got = _run(_rows(image__speckle=speckle))
    assert [(a.kind, a.metric, a.iteration) for a in got] == [("image_drift", "image/speckle", 4)]
    assert got[0].value == pytest.approx(0.25) and got[0].bound == pytest.approx(0.025 + 0.10)


def test_one_spike_is_not_sustained():
    assert _run(_rows(image__speckle=[0.02, 0.02, 0.5, 0.02, 0.5, 0.02])) == []


def test_alert_rearms_after_its_condition_clears():
    got = _run(_rows(image__hf_energy=[0.01, 0.01, 0.05, 0.05, 0.01, 0.05, 0.05]))
    assert [a.iteration for a in got] == [3, 6]


def test_saturation_collapse_either_way():
    up = _run(_rows(image__saturation=[0.2, 0.2, 0.5, 0.5]))
    down = _run(_rows(image__saturation=[0.2, 0.2, 0.05, 0.05]))
    assert [a.kind for a in up] == ["image_drift"] and [a.kind for a in down] == ["image_drift"]


@pytest.mark.parametrize("direction", [+1, -1])
def test_colour_entropy_drift_either_way(direction):
    """Noise adds colours (entropy up), collapse removes them (down): both alert once sustained."""
    drift = [2.0, 2.0, 2.0 + direction * 0.5, 2.0 + direction * 1.5, 2.0 + direction * 1.6]
    got = _run(_rows(image__color_entropy=drift))
    assert [(a.kind, a.metric, a.iteration) for a in got] == [("image_drift", "image/color_entropy", 4)]
    assert got[0].bound == pytest.approx(2.0 + direction * S.color_entropy_change)
    assert _run(_rows(image__color_entropy=[2.0, 2.0, 2.5, 2.6, 1.5])) == []  # within a bit of the baseline


def test_heldout_drop_while_reward_rises_is_reward_hacking():
    rows = _rows(eval__score=[0.5, 0.6, 0.55, 0.45], reward__mean=[0.1, 0.2, 0.3, 0.4])
    got = _run(rows)
    assert [(a.kind, a.iteration) for a in got] == [("heldout_drop", 3)]
    assert "reward hacking" in got[0].message


def test_heldout_drop_with_falling_reward_is_not_hacking():
    rows = _rows(eval__score=[0.5, 0.6, 0.55, 0.45], reward__mean=[0.1, 0.4, 0.3, 0.2])
    assert _run(rows) == []


def test_kl_and_clipfrac_runaway():
    rows = _rows(train__approx_kl=[0.01, 0.9, 1.2, 2.0], train__clipfrac=[0.1, 0.1, 0.6, 0.7])
    got = _run(rows)
    assert sorted((a.kind, a.iteration) for a in got) == [("clipfrac_runaway", 3), ("kl_runaway", 2)]


def test_missing_and_non_finite_values_are_ignored():
    rows = _rows(image__speckle=[0.02, float("nan"), None, float("inf"), 0.03])
    assert _run(rows) == []


def test_image_stats_see_speckle_and_high_frequency_noise():
    rng = np.random.default_rng(0)
    clean = np.full((3, 64, 64), 240, np.uint8)
    clean[:, 20:40, 20:40] = 40  # a dark square on a light background
    speckled = clean.copy()
    mask = rng.random((64, 64)) < 0.3
    speckled[0][mask & (clean[0] == 240)] = 255
    speckled[2][mask & (clean[0] == 240)] = 200  # near-white pixels with visible colour
    a, b = image_stats([clean]), image_stats([speckled])
    assert a["image/speckle"] == 0.0 and b["image/speckle"] > 0.2
    assert b["image/hf_energy"] > 1.4 * a["image/hf_energy"]
    assert set(a) == {"image/speckle", "image/hf_energy", "image/saturation", "image/color_entropy"}
    hwc = image_stats([speckled.transpose(1, 2, 0)])
    assert hwc == pytest.approx(b)
    assert image_stats([]) == {}


@pytest.mark.parametrize(
    "field,value", [("patience", 0), ("baseline_iterations", 0), ("kl_max", 0.0), ("hf_energy_ratio", 1.0)]
)
def test_config_refuses_bounds_that_cannot_work(field, value):
    with pytest.raises(ConfigError, match=f"guard.{field}"):
        GuardConfig(**{field: value})


def test_config_fields_are_the_core_settings():
    import dataclasses

    cfg = GuardConfig()
    for f in dataclasses.fields(GuardSettings):
        assert getattr(cfg, f.name) == f.default


# measured: `python benchmarks/collapse_guard.py --iterations 12 --eval-every 2` (benchmarks/RESULTS.md)
SPECKLE_LR3E4_NO_KL = [0.016, 0.358, 0.623, 0.73, 0.787, 0.83, 0.854, 0.87, 0.88, 0.89, 0.894, 0.901]
SPECKLE_FULL_FT = [0.016, 0.032, 0.094, 0.177, 0.238, 0.279, 0.305, 0.319, 0.341, 0.34, 0.357, 0.365]


def test_the_measured_collapse_fires_by_iteration_3_with_the_base_model_as_baseline():
    got = _run(_rows(image__speckle=SPECKLE_LR3E4_NO_KL), GuardSettings())
    assert [(a.kind, a.iteration + 1) for a in got] == [("image_drift", 3)]
    # the previous default (full fine-tuning, lr 1e-4, KL 0.04, window 0-7) degraded too, more
    # slowly: the guard says so two iterations later
    got = _run(_rows(image__speckle=SPECKLE_FULL_FT), GuardSettings())
    assert [(a.kind, a.iteration + 1) for a in got] == [("image_drift", 5)]


# measured: `./scripts/run-local` on the embedded default (LoRA r32, CFG 5, window 0-3), 2026-12-05
DEFAULT_RUN = dict(
    image__speckle=[
        0.021,
        0.018,
        0.019,
        0.016,
        0.032,
        0.026,
        0.019,
        0.023,
        0.025,
        0.029,
        0.03,
        0.038,
        0.023,
        0.025,
        0.031,
        0.032,
        0.031,
        0.05,
        0.03,
        0.045,
    ],
    image__hf_energy=[
        0.0166,
        0.0153,
        0.014,
        0.0135,
        0.0187,
        0.02,
        0.0151,
        0.0158,
        0.0195,
        0.0174,
        0.0218,
        0.0225,
        0.0175,
        0.0177,
        0.021,
        0.0164,
        0.0196,
        0.0227,
        0.017,
        0.0229,
    ],
    image__saturation=[
        0.112,
        0.126,
        0.113,
        0.126,
        0.172,
        0.162,
        0.134,
        0.129,
        0.157,
        0.152,
        0.18,
        0.18,
        0.141,
        0.165,
        0.177,
        0.156,
        0.178,
        0.185,
        0.153,
        0.194,
    ],
    image__color_entropy=[
        0.8,
        0.81,
        0.78,
        0.84,
        1.06,
        1.05,
        0.93,
        0.88,
        1.0,
        0.89,
        1.15,
        1.12,
        0.9,
        1.05,
        1.12,
        0.93,
        1.06,
        1.13,
        0.96,
        1.22,
    ],
    train__approx_kl=[0.0] * 20,
    train__clipfrac=[0.0] * 20,
)


def test_the_default_recipe_s_measured_run_raises_nothing():
    assert _run(_rows(**DEFAULT_RUN), GuardSettings()) == []
