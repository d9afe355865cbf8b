"""``spotlight plan`` and the memory refusal of ``spotlight up`` (cluster.gpu_memory_gib), in-process."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from spotlight.cli import app


def _toml(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_plan_prints_the_table_and_fits(tmp_path):
    res = CliRunner().invoke(app, ["plan", "--device", "cpu", "--gpu-memory-gib", "4"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for item in ("trainer GPU", "Adam state", "activations", "rollout GPU", "disk", "fits: every GPU within 4.0 GiB"):
        assert item in res.output, res.output


def test_plan_of_a_preset_that_does_not_fit(tmp_path):
    conf = _toml(tmp_path, "[train]\nlora_rank = 0\nnum_train_workers = 4\n[cluster]\ngpu_memory_gib = 80\n")
    res = CliRunner().invoke(app, ["plan", conf, "--preset", "qwen-image-20b", "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)  # the JSON alone: the refusal is on stderr
    assert res.stderr.startswith("does not fit: a trainer GPU needs"), res.stderr
    # full fine-tuning of 20.4 B parameters on 4 GPUs: 16 bytes per parameter / 4 for weights, grads, Adam
    trainer = doc["trainer_gpu"]
    assert abs(trainer["parameters"] + trainer["gradients"] + trainer["Adam state"] - 16 * doc["params"] / 4) < 16
    assert doc["problems"] and "a trainer GPU needs" in doc["problems"][0]
    assert doc["fits"] is False and isinstance(doc["notes"], list)
    res = CliRunner().invoke(app, ["plan", "--json", "--device", "cuda"])  # no GPU size: fits unknown, said
    doc = json.loads(res.stdout)
    assert doc["fits"] is None and any("no GPU size" in n or "gpu_memory_gib" in n for n in doc["notes"]), doc


def test_up_refuses_a_config_that_cannot_fit_before_anything_starts(tmp_path):
    conf = _toml(tmp_path, "[cluster]\ngpu_memory_gib = 0.01\n")
    rd = tmp_path / "run"
    res = CliRunner().invoke(app, ["up", "--local", "--config", conf, "--run-dir", str(rd)], env={"COLUMNS": "400"})
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    assert "does not fit its GPUs: a trainer GPU needs" in errors[0]
    assert "cluster.gpu_memory_gib = 0.01" in errors[0] and "Adam state" in errors[0]
    assert not rd.exists()


def _fake_nvidia_smi(tmp_path, mib: int) -> dict:
    """An ``nvidia-smi`` on PATH that reports two GPUs of ``mib`` MiB (this machine has none)."""
    import os
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho '0, {mib}'\necho '1, {mib}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "400"}


@pytest.mark.procs  # runs the fake nvidia-smi
def test_up_checks_against_this_hosts_gpu_size_when_no_limit_is_configured(tmp_path, monkeypatch):
    env = _fake_nvidia_smi(tmp_path, 8)  # 8 MiB GPUs: nothing fits
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rd = tmp_path / "run"
    res = CliRunner().invoke(app, ["up", "--local", "--run-dir", str(rd)], env=env)
    assert res.exit_code == 2, res.output
    (error,) = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert "a trainer GPU needs" in error and "this host's GPU size (2 GPUs of 0.0 GiB (nvidia-smi))" in error
    assert "set cluster.gpu_memory_gib to check against another size" in error
    assert not rd.exists()


def test_memory_check_and_summary_on_a_cpu_host_and_with_a_limit(tmp_path, monkeypatch):
    from spotlight.cli.plan import plan_summary
    from spotlight.cli.up_preflight import _check_memory
    from spotlight.config import load_config

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: a CPU host
    check = _check_memory(load_config(None))
    assert check.device == "cpu" and check.limit_source is None and check.plan.gpu_limit_bytes is None
    lines = plan_summary(check.plan, device="cpu", limit_source=None, disk_free_bytes=10 << 30)
    assert len(lines) == 3 and lines[1].startswith("  trainer rank (CPU, fp32, host memory) ")
    assert "Adam state" in lines[1] and "10.0 GiB free" in lines[2] and "trainer checkpoints" in lines[2]
    # a configured limit: bf16 on CUDA, checked against cluster.gpu_memory_gib
    big = _check_memory(load_config(None, {"cluster.gpu_memory_gib": 80.0}))
    assert big.device == "cuda" and big.limit_source == "cluster.gpu_memory_gib"
    (line,) = [x for x in plan_summary(big.plan, device="cuda", limit_source=big.limit_source) if "trainer GPU" in x]
    # the tiny model's terms are MiB: in GiB all but the fixed CUDA reserve would read 0.0
    assert "of 81920.0 MiB (cluster.gpu_memory_gib)" in line and "CUDA reserve 1024.0" in line


def test_a_cpu_run_one_process_of_which_needs_more_than_the_host_has_is_refused(tmp_path, monkeypatch):
    """Was: on a CPU host nothing was checked: ``model.max_text_tokens = 10**12`` planned a
    trainer rank of a billion GiB, started, and aborted with "memory allocation … failed"."""
    import spotlight.cli.up_preflight as pre
    from spotlight.cli.up_preflight import Stop
    from spotlight.config import load_config

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: a CPU host
    monkeypatch.setattr(pre, "_host_memory_bytes", lambda: 16 << 30)
    assert pre._check_memory(load_config(None)).plan is not None  # the default fits 16 GiB
    monkeypatch.setattr(pre, "_host_memory_bytes", lambda: 1 << 20)
    with pytest.raises(Stop) as exc:
        pre._check_memory(load_config(None))
    assert "does not fit this host: a trainer rank needs " in str(exc.value), exc.value
    assert "this host has 1.0 MiB" in str(exc.value)
    # many trainer ranks (was: train.num_train_workers = 1000 started ranks until the host ran out)
    monkeypatch.setattr(pre, "_host_memory_bytes", lambda: 16 << 30)
    many = load_config(None, {"train.num_train_workers": 1000})
    with pytest.raises(Stop) as exc:
        pre._check_memory(many, trainer_ranks=1000, rollout_workers=3)
    assert "its 1000 trainer rank(s) (train.num_train_workers), 3 Rollout Worker(s) and the coordinator on this " in (
        " ".join(str(exc.value).split())
    )
    assert pre._check_memory(many, trainer_ranks=0, rollout_workers=3).plan is not None  # --external-trainers
    # each process's own memory counts too (was: 2 agents × 64 GPUs planned as 128 × 30 MiB, where
    # each Rollout Worker process is 300-470 MB resident with torch imported)
    with pytest.raises(Stop) as exc:
        pre._check_memory(load_config(None), trainer_ranks=1, rollout_workers=128)
    assert "1 trainer rank(s) (train.num_train_workers), 128 Rollout Worker(s)" in " ".join(str(exc.value).split())
    monkeypatch.setattr(pre, "_host_memory_bytes", lambda: None)  # unknown: not checked
    plan = pre._check_memory(load_config(None)).plan
    assert pre.host_memory_problem(plan, plan.trainer_gpu_bytes - 1).startswith("a trainer rank needs ")
    assert pre.host_memory_problem(plan, None) is None


@pytest.mark.procs  # runs the fake nvidia-smi
@pytest.mark.parametrize("gpus", [False, True])
def test_a_rollout_the_coordinator_cannot_hold_is_refused(tmp_path, monkeypatch, gpus):
    """Was: data.prompts_per_iteration = 1000000 started (a warning that prompts repeat) and
    would have gathered 8 million samples' images and SDE windows on the coordinator, about a
    TiB; the plan did not count them. Refused on a CPU host and on a GPU host alike."""
    import spotlight.cli.up_preflight as pre
    from spotlight.cli.up_preflight import Stop
    from spotlight.config import load_config

    if gpus:  # two 80 GiB GPUs: the models fit them, the samples not the host
        monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, 81920)["PATH"])
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: a CPU host
    monkeypatch.setattr(pre, "_host_memory_bytes", lambda: 16 << 30)
    assert pre._check_memory(load_config(None)).plan is not None
    with pytest.raises(Stop) as exc:
        pre._check_memory(load_config(None, {"data.prompts_per_iteration": 1_000_000}))
    line = " ".join(str(exc.value).split())
    assert "does not fit this host: the reserved host needs " in line and "coordinator: rollout samples" in line, line
    assert "8000000 samples" in line and "this host has 16.0 GiB" in line


def test_plan_of_the_tiny_model_speaks_mib_and_counts_its_parameters():
    res = CliRunner().invoke(app, ["plan"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    title = res.output.splitlines()[0]
    assert title.startswith("tiny: 3.7 M parameters, LoRA r=32 885 k, 1 trainer GPU,"), title
    assert " MiB " in res.output.splitlines()[2] and "1024.00" in res.output  # the CUDA reserve
    assert "note: no GPU size to check against: give --gpu-memory-gib" in res.output
    res = CliRunner().invoke(app, ["plan", "--preset", "qwen-image-20b"], env={"COLUMNS": "200"})
    assert "note: --preset is planned at this config's 32 px" in res.output, res.output


@pytest.mark.parametrize(
    "n, text",
    [(20_430_000_000, "20.4 B"), (212_000_000, "212 M"), (3_700_000, "3.7 M"), (885_000, "885 k"), (12, "12")],
)
def test_count_text(n, text):
    from spotlight.cli.plan import count_text

    assert count_text(n) == text


def test_a_directory_given_as_the_config_is_named_as_one(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("")
    (tmp_path / "empty").mkdir()
    for command in (["plan"], ["up", "--config"]):
        res = CliRunner().invoke(app, [*command, str(tmp_path / "run")])
        assert res.exit_code == 2 and "run is a directory; did you mean " in res.output, res.output
        res = CliRunner().invoke(app, [*command, str(tmp_path / "empty")])
        assert res.exit_code == 2 and "is a directory, not a config file" in res.output, res.output


def test_a_config_that_is_not_utf8_is_one_line_naming_the_file(tmp_path):
    """Was: a traceback ending in UnicodeDecodeError from plan and up, and from eval a line
    that did not name the file."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("[run]\nseed = 1\n# caf\u00e9\n".encode("latin-1"))
    for command in (["plan", str(bad)], ["up", "--local", "--config", str(bad)], ["eval", "--config", str(bad)]):
        res = CliRunner().invoke(app, command)
        assert res.exit_code == 2, res.output
        assert "Traceback" not in res.output and f"{bad}:3: not UTF-8 text" in " ".join(res.output.split()), res.output
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[run]\nseed = 1\n")  # a byte-order mark, as some editors write: fine
    res = CliRunner().invoke(app, ["plan", str(bom)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output


def test_a_cuda_plan_on_a_host_without_a_gpu_says_so():
    """A fresh-clone user on a CPU host read bf16 sizes for a run that is fp32 there."""
    from spotlight.cli.plan import make_plan, plan_notes
    from spotlight.config import load_config

    cfg = load_config(None)
    plan, _ = make_plan(cfg)
    cpu_host = plan_notes(cfg, None, plan, device="cuda", has_cuda=False)
    assert any("this host has no GPU" in n and "--device cpu" in n for n in cpu_host)
    assert not any("no GPU" in n and "host" in n for n in plan_notes(cfg, None, plan, device="cuda", has_cuda=True))
    assert not any("this host" in n for n in plan_notes(cfg, None, plan, device="cpu", has_cuda=False))


def _family_config(tmp_path, family: str, checkpoint) -> str:
    out = tmp_path / f"{family}.toml"
    out.unlink(missing_ok=True)
    args = ["init", "--family", family, "--pretrained-path", str(checkpoint), "--out", str(out)]
    assert CliRunner().invoke(app, args).exit_code == 0
    return str(out)


def test_a_checkpoint_of_another_family_is_refused_not_counted_as_this_familys_class(tmp_path):
    """Was: an sd3 config on a Qwen-Image checkpoint built an SD3 transformer from Qwen's config
    (diffusers ignored the unknown keys) and printed made-up sizes with exit 0."""
    qwen = tmp_path / "qwen"
    (qwen / "transformer").mkdir(parents=True)
    (qwen / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    (qwen / "transformer" / "config.json").write_text(json.dumps({"_class_name": "QwenImageTransformer2DModel"}))
    res = CliRunner().invoke(app, ["plan", _family_config(tmp_path, "sd3", qwen), "--device", "cpu"])
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert "is a QwenImagePipeline checkpoint (model_index.json), not sd3" in " ".join(res.stderr.split())
    (qwen / "model_index.json").unlink()  # no index: the transformer's own class says it
    res = CliRunner().invoke(app, ["plan", _family_config(tmp_path, "sd3", qwen), "--device", "cpu"])
    assert res.exit_code == 2, res.output
    assert "holds a QwenImageTransformer2DModel, not a SD3Transformer2DModel" in " ".join(res.stderr.split())


def test_a_preset_of_another_family_than_the_configs_is_refused_and_a_missing_checkpoint_names_the_preset(tmp_path):
    flux = _family_config(tmp_path, "flux", tmp_path / "nonexistent")
    res = CliRunner().invoke(app, ["plan", flux, "--preset", "qwen-image-20b", "--device", "cpu"])
    assert res.exit_code == 2, res.output
    err = " ".join(res.stderr.split())
    assert "--preset qwen-image-20b is a qwen-image architecture and this config's model.family is flux" in err
    assert "use --preset flux-12b" in err, err
    res = CliRunner().invoke(app, ["plan", flux, "--device", "cpu"])
    assert res.exit_code == 2, res.output
    assert "plan a published size with --preset flux-12b" in " ".join(res.stderr.split()), res.stderr
    assert CliRunner().invoke(app, ["plan", flux, "--preset", "flux-12b", "--device", "cpu"]).exit_code == 0
    # a tiny-model config with any preset stays allowed (docs/planning.md: planned at its resolution)
    assert CliRunner().invoke(app, ["plan", "--preset", "sd3.5-large", "--device", "cpu"]).exit_code == 0
    # the tiny family has no published sizes: no hint that ends in "--preset " and nothing (was so)
    tiny = _family_config(tmp_path, "tiny", tmp_path / "nonexistent")
    res = CliRunner().invoke(app, ["plan", tiny, "--device", "cpu"])
    err = " ".join(res.stderr.split())
    assert res.exit_code == 2 and "checkpoint directory not found" in err and "--preset" not in err, res.output


def test_plan_says_what_up_would_refuse_that_the_plan_does_not_depend_on(tmp_path):
    """Was: `num_attention_heads = 3` (the checkpoint has 4) and a missing data.prompts_path were
    planned without a word ("fits", exit 0), while `spotlight up` refused both at once."""
    conf = tmp_path / "c.toml"
    conf.write_text(f'[model]\nnum_attention_heads = 3\n[data]\nprompts_path = "{tmp_path / "none.jsonl"}"\n')
    res = CliRunner().invoke(app, ["plan", str(conf), "--device", "cpu", "--gpu-memory-gib", "4"])
    assert res.exit_code == 0, res.output
    notes = [line for line in res.output.splitlines() if line.startswith("note: spotlight up refuses this config: ")]
    assert len(notes) == 2, res.output
    assert "the checkpoint has num_attention_heads = 4 but the config implies 3 (model.num_attention_heads)" in notes[0]
    assert notes[1].endswith(f"data.prompts_path: file not found: {tmp_path / 'none.jsonl'}")
    res = CliRunner().invoke(app, ["plan", "--device", "cpu", "--gpu-memory-gib", "4"])
    assert "refuses" not in res.output
