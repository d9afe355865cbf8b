"""``spotlight eval`` on a run whose ``final/`` weights are no readable safetensors files: one
``error:`` line naming the file and the library's reason (exit 2), before any model is sampled,
as ``spotlight profile --weights`` says it -- for the shapes task and for any other task's panel,
a LoRA adapter and a transformer folder alike. The files are real (a saved tiny transformer, a
corrupted copy); the command's own loaders read them."""

from __future__ import annotations

import pathlib

import pytest
from typer.testing import CliRunner

from spotlight.cli import app

runner = CliRunner()

CORRUPT = [
    pytest.param(lambda b: b"", "header too small", id="empty"),
    pytest.param(lambda b: b"not a safetensors file" * 8, "header too large", id="garbage"),
    pytest.param(lambda b: b[:-64], "incomplete metadata", id="truncated"),
]


@pytest.fixture
def no_sampling(monkeypatch):
    """Sampling with any model fails the test: the weights must be refused first."""
    from spotlight.tasks.shapes import evaluate as ev
    from spotlight.workers.eval import eval_worker as ew

    def fail(*args, **kwargs):
        pytest.fail("eval sampled before it checked the weights files")

    monkeypatch.setattr(ev, "evaluate", fail)
    monkeypatch.setattr(ew, "sample_panel", fail)


def _run_dir(tmp_path: pathlib.Path, reward: str) -> pathlib.Path:
    """A finished run of the tiny family (8x8, 3 steps) with ``reward`` and held-out prompts;
    its ``final/`` is empty (the test fills it)."""
    (tmp_path / "prompts.txt").write_text("a photo of a cat\na photo of a dog\n")
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.toml").write_text(
        "[model]\nimage_size = 8\nmax_text_tokens = 8\n\n[sampler]\nnum_steps = 3\nsde_window_size = 1\n\n"
        f'[reward]\nkind = "{reward}"\n\n[eval]\nprompts_path = "{tmp_path / "prompts.txt"}"\nnum_prompts = 2\n'
    )
    return run


def _lora_bytes() -> bytes:
    """A real safetensors file (one tensor) to corrupt."""
    import torch
    from safetensors.torch import save

    return save({"transformer.a.lora_A.weight": torch.zeros(4, 8)})


def _refused(res, *needles: str) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    text = res.stderr.strip()
    assert text.startswith("error: cannot load final weights: ") and "\n" not in text, text
    assert "Traceback" not in res.output and "SafetensorError" not in res.output
    for needle in needles:
        assert needle in text, (needle, text)
    return text


@pytest.mark.parametrize("reward", ["geneval_shapes", "jpeg_compressibility"], ids=["shapes-task", "panel"])
@pytest.mark.parametrize("corrupt, reason", CORRUPT)
def test_a_corrupt_lora_file_in_final_is_one_line_before_any_sampling(tmp_path, no_sampling, reward, corrupt, reason):
    """Was: `SafetensorError: Error while deserializing header: header too small` as a Rich
    traceback (the panel path: after the base model had sampled the whole panel)."""
    run = _run_dir(tmp_path, reward)
    lora = run / "final" / "pytorch_lora_weights.safetensors"
    lora.write_bytes(corrupt(_lora_bytes()))
    res = runner.invoke(app, ["eval", "--run-dir", str(run), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    _refused(res, str(lora), "not a readable safetensors file", reason)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("reward", ["geneval_shapes", "jpeg_compressibility"], ids=["shapes-task", "panel"])
def test_a_corrupt_transformer_folder_is_one_line_naming_its_file(tmp_path, no_sampling, reward):
    """A full fine-tune's final/ (config.json and diffusion_pytorch_model.safetensors, as
    save_pretrained writes it) with its weights file cut short."""
    from spotlight.config import load_config
    from spotlight.models.families import get_family

    run = _run_dir(tmp_path, reward)
    get_family(load_config(run / "config.toml").model).build_transformer().save_pretrained(run / "final")
    (weights,) = (run / "final").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-64])
    res = runner.invoke(app, ["eval", "--run-dir", str(run), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    _refused(res, str(weights), "not a readable safetensors file", "incomplete metadata")


def test_weights_option_is_checked_the_same_way(tmp_path, no_sampling):
    """``--weights FOLDER`` with ``--config``: the same check, the same line."""
    run = _run_dir(tmp_path, "geneval_shapes")
    lora = run / "final" / "pytorch_lora_weights.safetensors"
    lora.write_bytes(b"")
    res = runner.invoke(
        app,
        ["eval", "--config", str(run / "config.toml"), "--weights", str(run / "final"), "--num-seeds", "1",
         "--out", str(tmp_path / "out")],
    )  # fmt: skip
    _refused(res, str(lora), "header too small")


def test_a_lora_file_without_tensors_is_refused(tmp_path, no_sampling):
    from safetensors.torch import save_file

    run = _run_dir(tmp_path, "geneval_shapes")
    lora = run / "final" / "pytorch_lora_weights.safetensors"
    save_file({}, str(lora))
    res = runner.invoke(app, ["eval", "--run-dir", str(run), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    _refused(res, str(lora), "without tensors")


@pytest.mark.parametrize("reward", ["geneval_shapes", "jpeg_compressibility"], ids=["shapes-task", "panel"])
def test_a_lora_file_whose_keys_match_nothing_is_refused_not_scored_as_the_base(tmp_path, no_sampling, reward):
    """Was: diffusers warned "No LoRA keys associated …", loaded nothing, and eval reported the
    base model's scores as the final model's (exit 0). The panel path refuses it before the
    base model samples (``no_sampling``)."""
    import torch
    from safetensors.torch import save_file

    run = _run_dir(tmp_path, reward)
    lora = run / "final" / "pytorch_lora_weights.safetensors"
    save_file({"foo": torch.zeros(2)}, str(lora))
    res = runner.invoke(app, ["eval", "--run-dir", str(run), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    _refused(res, str(lora), "holds no LoRA weights of this transformer")


@pytest.mark.parametrize("reward", ["geneval_shapes", "jpeg_compressibility"], ids=["shapes-task", "panel"])
def test_a_lora_file_of_another_shape_is_one_line(tmp_path, no_sampling, reward):
    """A readable adapter for another transformer size: one line, not a size-mismatch traceback."""
    import torch
    from safetensors.torch import save_file

    run = _run_dir(tmp_path, reward)
    lora = run / "final" / "pytorch_lora_weights.safetensors"
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 3),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(5, 4),
        },
        str(lora),
    )
    res = runner.invoke(app, ["eval", "--run-dir", str(run), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    _refused(res, str(lora), "not a LoRA adapter of this transformer")


@pytest.mark.parametrize("reward", ["geneval_shapes", "jpeg_compressibility"], ids=["shapes-task", "panel"])
def test_a_transformer_folder_with_a_flipped_byte_is_refused_by_its_digest(tmp_path, no_sampling, reward, monkeypatch):
    """A full fine-tune's final/ as the run saves it (with SHA256SUMS), one byte of its weights
    flipped afterwards: the file is still readable safetensors of the right shapes, so it was
    scored as the run's model. Now one line naming the file, before any sampling; a large
    folder (here: every folder) says that it is being checked first."""
    import spotlight.cli.eval as cli_eval

    monkeypatch.setattr(cli_eval, "LARGE_WEIGHTS_BYTES", 1)
    from spotlight.config import load_config
    from spotlight.models.families import get_family
    from spotlight.util.weights_file import write_digests

    run = _run_dir(tmp_path, reward)
    get_family(load_config(run / "config.toml").model).build_transformer().save_pretrained(run / "final")
    write_digests(run / "final")
    (weights,) = (run / "final").glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40
    weights.write_bytes(bytes(data))
    res = runner.invoke(app, ["eval", "--run-dir", str(run), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    _refused(res, f"{weights.name} holds other bytes than were saved")
    assert " ".join(res.stdout.split()).startswith(f"checking {run / 'final'} (0.0 GiB) against its SHA256SUMS…")
