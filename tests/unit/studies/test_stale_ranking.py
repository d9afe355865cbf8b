"""Stale-weight ranking study (paper §3.2.1 Insight 1, Fig. 5): ranks, heat maps, the
generation loop on two tiny weight versions, and ``spotlight bench stale-ranking``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from spotlight.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    RunConfig,
    SamplerConfig,
    SpotlightConfig,
    dump_config,
)
from spotlight.studies.profiling import spearman
from spotlight.studies.stale_ranking import (
    group_spearman,
    plot_heatmap,
    rank_heatmap,
    rank_within_groups,
    run_stale_ranking,
)

TEXT_DIM = 16
# 8x8 pixels, 3 steps: every transformer call is cheap on 2 cores.
SMALL_MODEL = ModelConfig(image_size=8, max_text_tokens=8)
SMALL_SAMPLER = SamplerConfig(num_steps=3, sde_window_start=0, sde_window_size=1)


def _cfg() -> SpotlightConfig:
    return SpotlightConfig(
        model=SMALL_MODEL,
        sampler=SMALL_SAMPLER,
        cluster=ClusterConfig(worker_batch_size=4),
        data=DataConfig(group_size=4, num_control_prompts=0, prompts_per_iteration=2),
        run=RunConfig(iterations=2),
    )


# ------------------------------------------------------------------ pure functions


def test_rank_within_groups_zero_is_best_and_ties_by_index():
    r = np.array([[0.1, 0.9, 0.5], [2.0, 2.0, -1.0]])
    assert rank_within_groups(r).tolist() == [[2, 0, 1], [0, 1, 2]]
    # NaN ranks last
    assert rank_within_groups([[float("nan"), 1.0, 0.0]]).tolist() == [[2, 0, 1]]
    with pytest.raises(ValueError):
        rank_within_groups([1.0, 2.0])


def test_perfect_agreement_is_diagonal_with_rho_one():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 6))
    b = 3.0 * a + 1.0  # monotone: same ranking
    heat = rank_heatmap(rank_within_groups(a), rank_within_groups(b), 6)
    assert heat.sum() == 30
    assert np.array_equal(heat, np.diag(np.full(6, 5)))
    rhos = group_spearman(a, b)
    assert np.allclose(rhos, 1.0)
    assert spearman(list(a[0]), list(b[0])) == pytest.approx(1.0)


def test_reversed_ranking_is_anti_diagonal_with_rho_minus_one():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, 5))
    b = -a
    heat = rank_heatmap(rank_within_groups(a), rank_within_groups(b), 5)
    assert np.array_equal(heat, np.fliplr(np.diag(np.full(5, 4))))
    assert np.allclose(group_spearman(a, b), -1.0)


def test_rank_heatmap_rejects_bad_input():
    with pytest.raises(ValueError):
        rank_heatmap([[0, 1]], [[0, 1, 2]], 3)
    with pytest.raises(ValueError):
        rank_heatmap([[0, 3]], [[0, 1]], 3)


def test_plot_heatmap_writes_png(tmp_path):
    path = tmp_path / "h.png"
    plot_heatmap(np.diag(np.arange(1, 5)), path, "diag")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ generation


def _two_versions():
    from spotlight.models.dit import build_transformer

    a = build_transformer(SMALL_MODEL, TEXT_DIM, seed=3).state_dict()
    g = torch.Generator().manual_seed(7)
    b = {
        k: (
            v + 0.01 * v.std().nan_to_num() * torch.randn(v.shape, generator=g)
            if v.is_floating_point() and v.numel() > 1
            else v.clone()
        )
        for k, v in a.items()
    }
    return a, b


def test_run_stale_ranking_on_two_tiny_versions():
    cfg = _cfg()
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(3, 4, TEXT_DIM, generator=g)
    mask = torch.ones(3, 4, dtype=torch.int64)
    a, b = _two_versions()
    lines: list[str] = []
    from spotlight.rl.sampler import Conditioning

    res = run_stale_ranking(cfg, Conditioning(embeds, mask), [a, b], [0, 2], 6, progress=lines.append, versions=[4, 5])
    assert len(res["pairs"]) == 1
    pair = res["pairs"][0]
    assert (pair["stale_version"], pair["updated_version"]) == (4, 5)
    assert math.isfinite(pair["rho_mean"]) and -1.0 <= pair["rho_mean"] <= 1.0
    assert math.isfinite(res["overall"]["rho_mean"]) and -1.0 <= res["overall"]["rho_mean"] <= 1.0
    heat = np.array(res["heatmap"])
    assert heat.shape == (6, 6) and heat.sum() == 2 * 6
    assert np.array_equal(np.array(pair["heatmap"]), heat)
    assert (heat.sum(axis=0) == 2).all() and (heat.sum(axis=1) == 2).all()  # each rank once per prompt
    assert 0.0 <= pair["selection_overlap"] <= 1.0  # 6 seeds > group size 4
    assert any(line.startswith("v4:") for line in lines) and any("v4 -> v5" in line for line in lines)
    json.dumps(res)  # JSON-able


# ------------------------------------------------------------------ CLI


def test_choose_pairs():
    from spotlight.cli.bench import choose_pairs

    assert choose_pairs([0, 1, 2, 3, 4], 3, None) == ([1, 2, 3, 4], [(0, 1), (1, 2), (2, 3)])
    assert choose_pairs([0, 1, 3, 4], 5, None) == ([0, 1, 3, 4], [(0, 1), (2, 3)])
    assert choose_pairs([0, 1, 2, 3], 1, "0,2") == ([0, 2], [(0, 1)])
    for args in (([0], 3, None), ([0, 2], 3, None), ([0, 1], 3, "0,5"), ([0, 1], 3, "1")):
        with pytest.raises(ValueError):
            choose_pairs(*args)


def test_cli_on_fake_run_dir(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from spotlight.cli import app
    from spotlight.models.dit import build_transformer
    from spotlight.models.text_encoder import TEXT_DIM as MINILM_DIM

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\na photo of a cat\ntwo blue balls\n")
    run = tmp_path / "run"
    (run / "tensor_store" / "weights").mkdir(parents=True)
    cfg = _cfg()
    cfg = SpotlightConfig(
        **{f: getattr(cfg, f) for f in cfg.__struct_fields__ if f != "data"},
        data=DataConfig(prompts_path=str(prompts), group_size=4, num_control_prompts=0, prompts_per_iteration=2),
    )
    dump_config(cfg, run / "config.toml")

    runner = CliRunner()
    (tmp_path / "afile").write_text("")
    res = runner.invoke(app, ["bench", "stale-ranking", "--run-dir", str(tmp_path / "afile")])
    assert res.exit_code == 2 and "afile is a file, not a run directory" in res.output, res.output  # was "not found"
    # fewer than two versions: a clear error, not a traceback
    save_file(
        {k: v.contiguous() for k, v in build_transformer(SMALL_MODEL, MINILM_DIM, seed=1).state_dict().items()},
        run / "tensor_store" / "weights" / "v0.safetensors",
    )
    res = runner.invoke(app, ["bench", "stale-ranking", "--run-dir", str(run)])
    assert res.exit_code == 2 and "need at least 2" in res.output

    save_file(
        {k: v.contiguous() for k, v in build_transformer(SMALL_MODEL, MINILM_DIM, seed=2).state_dict().items()},
        run / "tensor_store" / "weights" / "v1.safetensors",
    )
    res = runner.invoke(
        app, ["bench", "stale-ranking", "--run-dir", str(run), "--num-prompts", "2", "--num-seeds", "5"]
    )
    assert res.exit_code == 0, res.output
    assert "overall Spearman" in res.output
    data = json.loads((run / "bench" / "stale_ranking.json").read_text())
    assert [(p["stale_version"], p["updated_version"]) for p in data["pairs"]] == [(0, 1)]
    assert np.array(data["heatmap"]).sum() == 2 * 5
    rho = data["overall"]["rho_mean"]
    assert math.isnan(rho) or -1.0 <= rho <= 1.0
    assert (run / "bench" / "stale_ranking_heatmap.png").read_bytes()[:4] == b"\x89PNG"


class _TiedReward:
    """A reward that scores every image 0.5: every prompt group's rewards tie, so no Spearman ρ."""

    def __init__(self, cfg):
        pass

    def __call__(self, images, prompts):
        return [0.5] * len(images)


def test_progress_says_rho_is_undefined_in_words_when_every_group_ties(monkeypatch):
    """Was: `v4 -> v5: Spearman rho nan ± nan over 0 prompts` before bench explained the tie."""
    from spotlight.rewards import reward_fn
    from spotlight.rl.sampler import Conditioning

    monkeypatch.setattr(reward_fn, "RewardFn", _TiedReward)
    g = torch.Generator().manual_seed(0)
    cond = Conditioning(torch.randn(2, 4, TEXT_DIM, generator=g), torch.ones(2, 4, dtype=torch.int64))
    a, b = _two_versions()
    lines: list[str] = []
    res = run_stale_ranking(_cfg(), cond, [a, b], [0, 1], 3, progress=lines.append, versions=[4, 5])
    assert res["pairs"][0]["num_valid_prompts"] == 0
    pair_line = next(line for line in lines if line.startswith("v4 -> v5"))
    assert "nan" not in pair_line.lower(), pair_line
    assert "undefined" in pair_line and "rewards tied within each of the 2 prompt groups" in pair_line, pair_line


def test_rho_text_says_how_many_groups_the_rho_averages():
    from spotlight.studies.stale_ranking import rho_text

    assert rho_text(0.5, 0.1, 2, 2) == "0.500 ± 0.100 (2 of 2 prompt groups)"
    assert rho_text(0.5, 0.0, 1, 3) == "0.500 ± 0.000 (1 of 3 prompt groups, 2 left out: rewards tied)"
    assert "nan" not in rho_text(float("nan"), float("nan"), 0, 3)


def test_run_stale_ranking_refuses_weights_of_another_model_before_sampling():
    """The study itself (not only ``spotlight bench``): one WeightVersionError naming the version,
    before any model is built, instead of torch's size-mismatch RuntimeError mid-study."""
    from spotlight.models.dit import build_transformer
    from spotlight.models.lora import WeightVersionError
    from spotlight.rl.sampler import Conditioning

    a, _ = _two_versions()
    other = build_transformer(
        ModelConfig(image_size=8, max_text_tokens=8, num_attention_heads=4), TEXT_DIM
    ).state_dict()
    cond = Conditioning(torch.randn(2, 4, TEXT_DIM), torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(WeightVersionError, match="weight version v5: not a weight version .* another shape"):
        run_stale_ranking(_cfg(), cond, [a, other], [0, 1], 3, progress=lambda line: None, versions=[4, 5])
    with pytest.raises(WeightVersionError, match="weight version v4: holds no weights"):
        run_stale_ranking(_cfg(), cond, [{"x": torch.zeros(1)}, a], [0, 1], 3, versions=[4, 5])
