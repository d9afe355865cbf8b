"""The Eval Worker (``spotlight/workers/eval/eval_worker.py``): a published version on the fixed
held-out panel, the same images as ``spotlight eval``'s ODE sampler, scores and a grid written
atomically, ``best/`` replaced only by a better version."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from spotlight.config import ConfigError, dump_config, load_config
from spotlight.models.families import get_family
from spotlight.util.weights_file import check_weights_dir
from spotlight.workers.eval import eval_worker as ew


def _run_dir(tmp_path, **overrides):
    # full fine-tuning: v0 below is the whole transformer (a LoRA run's versions are adapters)
    base = {"eval.every": 1, "eval.num_prompts": 6, "eval.num_seeds": 2, "train.lora_rank": 0}
    cfg = load_config(overrides=base | overrides)
    rd = tmp_path / "run"
    (rd / "tensor_store" / "weights").mkdir(parents=True)
    dump_config(cfg, rd / "config.toml")
    model = get_family(cfg.model).build_transformer()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, rd / "tensor_store/weights/v0.safetensors")
    return cfg, rd, model


def test_base_model_evaluation_matches_spotlight_eval_and_keeps_best(tmp_path):
    cfg, rd, model = _run_dir(tmp_path)
    r = ew.evaluate_version(rd, 0, -1, cache_dir=tmp_path / "cache")
    assert (rd / "eval" / "iter_0000.json").is_file() and (rd / "eval" / "iter_0000.png").is_file()
    assert json.loads((rd / "eval" / "iter_0000.json").read_text()) == r
    assert 0.0 <= r["eval/score"] <= 1.0 and 0.0 <= r["eval/strict"] <= 1.0
    assert r["eval/num_images"] == 12 and r["version"] == 0 and r["iteration"] == -1
    kinds = [k for k in r if k.startswith("eval/strict/")]
    assert kinds and r["eval/strict"] == pytest.approx(np.mean([r[k] for k in kinds]))

    # the same images `spotlight eval` samples for these prompts and seeds
    from spotlight.tasks.shapes import evaluate as ev

    panel = ew.build_panel(cfg)
    want = ev.sample_ode(model.eval(), cfg.model, cfg.sampler, panel.prompts, panel.seeds)
    fam, policy = ew.load_policy(cfg, model.state_dict(), torch.device("cpu"))
    got, nonfinite = ew.sample_panel(
        fam, policy, cfg, fam.encode_prompts(panel.unique_prompts), panel, torch.device("cpu")
    )
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1 and nonfinite == 0

    assert r["eval/is_best"] == 1.0 and (rd / "best" / "config.json").is_file()
    # every file of best/ (best.json too) is in its SHA256SUMS, and they match
    listed = {line.split("  ", 1)[1] for line in (rd / "best" / "SHA256SUMS").read_text().splitlines()}
    assert listed == {p.name for p in (rd / "best").iterdir()} - {"SHA256SUMS"} and "best.json" in listed
    check_weights_dir(rd / "best")
    assert json.loads((rd / "best" / "best.json").read_text())["version"] == 0
    again = ew.evaluate_version(rd, 0, 0, cache_dir=tmp_path / "cache")
    assert again["eval/score"] == r["eval/score"]  # fixed panel, deterministic sampling
    assert again["eval/is_best"] == 0.0  # not better: best/ stays
    assert json.loads((rd / "best" / "best.json").read_text())["iteration"] == -1
    assert (rd / "eval" / "iter_0001.png").is_file()


def test_lora_version_is_the_adapter_and_best_is_a_lora_folder(tmp_path):
    cfg, rd, model = _run_dir(tmp_path, **{"train.lora_rank": 4})
    from spotlight.models.lora import add_lora, lora_spec

    fam = get_family(cfg.model)
    lora_model = fam.build_transformer()
    add_lora(lora_model, lora_spec(cfg.train), fam.default_lora_targets, seed=cfg.model.init_seed)
    adapter = {k: v.contiguous() for k, v in lora_model.state_dict().items() if "lora_" in k}
    save_file(adapter, rd / "tensor_store/weights/v1.safetensors")
    r = ew.evaluate_version(rd, 1, 0, cache_dir=tmp_path / "cache")
    assert (rd / "best" / "pytorch_lora_weights.safetensors").is_file()
    assert "pytorch_lora_weights.safetensors" in (rd / "best" / "SHA256SUMS").read_text()
    check_weights_dir(rd / "best")
    assert r["version"] == 1


def test_eval_prompts_are_required_outside_the_shapes_task():
    with pytest.raises(ConfigError, match="eval.prompts_path"):
        load_config(overrides={"eval.every": 2, "reward.kind": "jpeg_compressibility"})
    load_config(overrides={"eval.every": 2})  # the shapes task has its test set


def test_preflight_refuses_an_unreadable_or_unscorable_panel(tmp_path):
    from spotlight.cli.up_preflight import Stop, _check_eval

    with pytest.raises(Stop, match="eval.prompts_path"):
        _check_eval(load_config(overrides={"eval.every": 1, "eval.prompts_path": str(tmp_path / "missing.txt")}))
    bad = tmp_path / "bad.txt"
    bad.write_text("a photo of a cat\n")  # not a shapes-world caption: the shapes reward cannot score it
    with pytest.raises(Stop, match="eval.prompts_path"):
        _check_eval(load_config(overrides={"eval.every": 1, "eval.prompts_path": str(bad)}))
    _check_eval(load_config(overrides={"eval.every": 1}))


def test_non_finite_samples_are_counted_and_said_not_scored_in_silence(tmp_path, caplog):
    """Was: weights (or a guidance scale) that made every latent NaN gave black images, a score of
    0.000 per task kind and exit 0, with nothing saying the samples were not finite."""
    import logging

    cfg, rd, model = _run_dir(tmp_path)
    broken = {
        k: torch.full_like(v, float("nan")) if k.endswith("proj_out.weight") else v.contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(broken, rd / "tensor_store/weights/v1.safetensors")
    with caplog.at_level(logging.WARNING, logger="spotlight.eval"):
        r = ew.evaluate_version(rd, 1, 0, cache_dir=tmp_path / "cache")
    assert r["eval/nonfinite_samples"] == r["eval/num_images"] == 12
    assert "12 of 12 panel samples are not finite (NaN/inf latents)" in caplog.text
    ok = ew.evaluate_version(rd, 0, -1, cache_dir=tmp_path / "cache")
    assert ok["eval/nonfinite_samples"] == 0.0
    assert ew.nonfinite_note(0, 12) is None


def test_without_best_an_evaluation_must_beat_every_result_kept(tmp_path):
    """``best/`` removed by a resume (its weights were trained again): a version scoring below a
    result still on disk does not take ``best/`` (was: any version did, as if it were the run's
    first evaluation)."""
    cfg, rd, model = _run_dir(tmp_path)
    (rd / "eval").mkdir()
    (rd / "eval" / "iter_0001.json").write_text(json.dumps({"iteration": 0, "version": 1, "eval/score": 2.0}))
    r = ew.evaluate_version(rd, 0, -1, cache_dir=tmp_path / "cache")
    assert r["eval/is_best"] == 0.0 and not (rd / "best").exists()
    (rd / "eval" / "iter_0001.json").unlink()
    r = ew.evaluate_version(rd, 0, -1, cache_dir=tmp_path / "cache")
    assert r["eval/is_best"] == 1.0 and json.loads((rd / "best" / "best.json").read_text())["version"] == 0
