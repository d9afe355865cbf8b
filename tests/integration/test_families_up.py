"""Every model family, end to end: `spotlight up --local --iterations 2` from a saved
random-weight checkpoint of the family's real classes (transformer, VAE, text encoder(s),
offline-built tokenizer(s)), loaded through exactly the path a user's checkpoint takes
(``model.pretrained_path``): one LoRA run per family, and full fine-tuning for Qwen-Image.

Real processes (coordinator, FSDP2 train worker, the reserved agent — plus one spot agent for
Qwen-Image LoRA — and their rollout workers) over ZeroMQ TCP on loopback. Sizes are tiny so
the 5 runs fit the suite's budget. Full fine-tuning of SD3.5 and FLUX (what a Train Worker
publishes and saves, and LoRA versions being smaller) is checked in the trainer by
tests/unit/workers/train/test_family_versions.py; the tiny family's full run is
tests/integration/test_up_local.py.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.accounting import assert_each_request_ended_once

REPO = pathlib.Path(__file__).resolve().parents[2]

# the tiny family's full fine-tuning run is tests/integration/test_up_local.py
CASES = [
    ("tiny", "lora"),
    ("qwen-image", "lora"),
    ("qwen-image", "full"),
    ("sd3", "lora"),
    ("flux", "lora"),
]


def _checkpoint(family: str, root: pathlib.Path) -> pathlib.Path:
    """The family's saved checkpoint, as a user would have it on disk."""
    path = root / f"ckpt-{family}"
    if family == "tiny":
        from spotlight.config import ModelConfig
        from spotlight.models.dit import build_transformer

        build_transformer(ModelConfig(init_seed=3)).save_pretrained(path)  # a transformer folder
    else:
        import importlib

        from spotlight.models.families import get_family  # noqa: F401  (registry import)

        mod = importlib.import_module(f"spotlight.models.families.{family.replace('-', '_')}")
        mod.make_random_checkpoint(path, seed=1)
    return path


def _config(family: str, mode: str, ckpt: pathlib.Path) -> dict:
    model = {"family": family, "pretrained_path": str(ckpt)}
    if family == "tiny":
        model["source"] = "pretrained"
    else:
        model.update(image_size=32, max_text_tokens=24 if family == "qwen-image" else 8)
    train = {"steps_per_iteration": 2, "learning_rate": 1e-3}
    if mode == "lora":
        train.update(lora_rank=4, kl_beta=0.01)
    changes = {
        "model": model,
        "sampler": {"num_steps": 4, "sde_window_size": 2, "sde_window_range": [0, 3], "noise_level": 1.2},
        # the default training set's 160 counting prompts (fewer to encode than all 3,400)
        "data": {
            "prompts_per_iteration": 3,
            "group_size": 2,
            "num_control_prompts": 1,
            "category_column": "tag",
            "categories": ["counting"],
        },
        "explore": {"planner": "fixed", "num_candidates": 4},
        "train": train,
        "cluster": {"worker_batch_size": 4},
        # held-out evaluation during training (docs/evaluation.md) on a 2-prompt panel
        "eval": {"every": 1, "prompts_path": "examples/default/prompts/evaluation_metadata.jsonl", "num_prompts": 2},
    }
    # every key written out (the built-in defaults: JPEG reward, GenEval-style training prompts, the tiny
    # architecture the checkpoint above was built with), so the embedded default's shapes
    # task never merges in
    from spotlight.config import SpotlightConfig, config_to_dict

    full = config_to_dict(SpotlightConfig())
    for section, values in changes.items():
        full[section].update(values)
    return full


@functools.lru_cache(maxsize=None)
def _run(family: str, mode: str, root: str) -> pathlib.Path:
    import tomli_w

    base = pathlib.Path(root)
    ckpt = base / f"ckpt-{family}"
    if not ckpt.exists():
        _checkpoint(family, base)
    rd = base / f"run-{family}-{mode}"
    conf = base / f"{family}-{mode}.toml"
    conf.write_text(tomli_w.dumps(_config(family, mode, ckpt)))
    # one spot agent for the headline family; the others run on the reserved agent alone
    # (exploration is then drained by it), which halves the processes each run starts
    agents = "1" if (family, mode) == ("qwen-image", "lora") else "0"
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "up",
        "--local",
        "--agents",
        agents,
        "--iterations",
        "2",
        "--config",
        str(conf),
        "--run-dir",
        str(rd),
        "--timeout-s",
        "900",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, (
        f"spotlight up ({family}, {mode}) failed:\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"
    )
    return rd


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("families"))


def _rows(rd: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]


def _transformer_cls(family: str):
    import diffusers

    from spotlight.config import ModelConfig
    from spotlight.models.families import get_family

    cfg = ModelConfig(family=family, pretrained_path="x") if family != "tiny" else ModelConfig()
    return getattr(diffusers, get_family(cfg).transformer_class)


@pytest.mark.parametrize("family,mode", CASES)
def test_family_runs_two_iterations(root, family, mode):
    rd = _run(family, mode, root)
    rows = _rows(rd)
    assert [r["iteration"] for r in rows] == [0, 1]
    # on-policy check: the first minibatch of each iteration recomputes the rollout exactly
    assert rows[0]["train/ratio_max_dev"] == 0.0
    assert all(r["train/optimizer_steps"] == 2 and r["train/skipped_steps"] == 0 for r in rows)
    assert all(r["train/nonfinite_samples"] == 0 for r in rows)
    reqs = [json.loads(line) for line in (rd / "requests.jsonl").read_text().splitlines()]
    assert_each_request_ended_once(reqs)
    assert {r["kind"] for r in reqs} == {"rollout", "explore"}

    versions = sorted((rd / "tensor_store" / "weights").glob("v*.safetensors"))
    assert len(versions) == 3  # v0, v1, v2
    v0, v2 = load_file(versions[0]), load_file(versions[-1])
    final = rd / "final"
    if mode == "lora":
        # a published version is the adapter alone
        assert all("lora_" in k for k in v0) and len(v0) > 0
        assert any(not torch.equal(v0[k], v2[k]) for k in v0 if "lora_B" in k)
        assert (final / "pytorch_lora_weights.safetensors").is_file()
        # the adapter loads the diffusers way onto the base transformer, and equals the last version
        ckpt = pathlib.Path(root) / f"ckpt-{family}"
        cls = _transformer_cls(family)
        base = cls.from_pretrained(ckpt if family == "tiny" else ckpt / "transformer")
        base.load_lora_adapter(str(final), prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
        strip = lambda k: re.sub(r"\.lora_(A|B)\.[^.]+\.", r".lora_\1.", k)  # drop the adapter name
        loaded = {strip(k): v for k, v in base.state_dict().items() if "lora_" in k}
        assert set(loaded) == {strip(k) for k in v2}
        for k, v in v2.items():
            assert torch.equal(loaded[strip(k)], v), k
    else:
        assert not any("lora_" in k for k in v0)
        model = _transformer_cls(family).from_pretrained(final)
        final_sd = model.state_dict()
        assert set(final_sd) == set(v0)
        assert sum(not torch.equal(final_sd[k], v0[k]) for k in v0) > len(v0) // 2


@pytest.mark.parametrize("family,mode", CASES)
def test_held_out_evaluation_during_training_for_every_family(root, family, mode):
    rd = _run(family, mode, root)
    evals = sorted(
        (json.loads(line) for line in (rd / "eval.jsonl").read_text().splitlines()), key=lambda e: e["iteration"]
    )
    assert [(e["iteration"], e["version"]) for e in evals] == [(-1, 0), (0, 1), (1, 2)]
    assert all(e["eval/num_images"] == 4 and e["eval/score"] < 0 for e in evals)  # JPEG reward: -kB
    assert all((rd / "eval" / f"iter_{i:04d}.png").is_file() for i in range(3))
    last_row = _rows(rd)[-1]  # the final weights' evaluation is joined before the last row
    assert last_row["eval/iteration"] == 2 and last_row["eval/score"] == evals[-1]["eval/score"]
    layout = "pytorch_lora_weights.safetensors" if mode == "lora" else "config.json"
    assert (rd / "best" / layout).is_file()


@pytest.mark.parametrize("family,mode", [("qwen-image", "lora"), ("sd3", "lora"), ("flux", "lora")])
def test_spotlight_eval_scores_any_family(root, family, mode):
    rd = _run(family, mode, root)
    proc = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "eval", "--run-dir", str(rd), "--num-seeds", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((rd / "eval.json").read_text())
    assert report["num_prompts"] == 2 and {"base", "final"} <= set(report)
    assert (rd / "eval_base.png").is_file() and (rd / "eval_final.png").is_file()
    assert "held-out score" in proc.stdout


@pytest.mark.parametrize("family", ["qwen-image"])  # SD3.5, FLUX: unit/workers/train/test_family_versions.py
def test_lora_versions_are_smaller_than_full_versions(root, family):
    lora = _rows(_run(family, "lora", root))[0]["weights/version_bytes"]
    full = _rows(_run(family, "full", root))[0]["weights/version_bytes"]
    assert 0 < lora < full


def test_fig09_reads_any_familys_held_out_evaluation(root, tmp_path):
    """benchmarks/fig09_heldout_score.py plots a Qwen-Image run from its eval.jsonl (nothing
    recomputed), and scores its published versions post hoc with the Eval Worker's code."""
    rd = _run("qwen-image", "lora", root)
    script = [sys.executable, str(REPO / "benchmarks" / "fig09_heldout_score.py"), "--run-dir", str(rd)]
    proc = subprocess.run([*script, "--out", str(tmp_path / "a.png")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "a.json").read_text())
    evals = {
        json.loads(line)["version"]: json.loads(line)["eval/score"]
        for line in (rd / "eval.jsonl").read_text().splitlines()
    }
    (rows,) = data["results"].values()
    assert {r["version"]: r["score"] for r in rows} == evals and "eval.jsonl" in next(iter(data["sources"].values()))
    post_hoc = ["--source", "versions", "--every", "2", "--eval-prompts", "2", "--eval-seeds", "2"]
    post_hoc += ["--cache", str(tmp_path / "cache.json"), "--out", str(tmp_path / "b.png")]
    proc = subprocess.run([*script, *post_hoc], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (rows,) = json.loads((tmp_path / "b.json").read_text())["results"].values()
    assert [r["version"] for r in rows] == [0, 2]
    assert rows[0]["score"] == pytest.approx(evals[0], rel=1e-4)  # the same panel, seeds and code as during training
