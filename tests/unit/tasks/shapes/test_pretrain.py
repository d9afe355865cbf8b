"""The base model's pretraining records (spotlight/tasks/shapes/pretrain.py): what the model card
says about the stages behind a shipped checkpoint."""

import argparse
import json

import pytest

from spotlight.tasks.shapes import pretrain


def _log(path, steps, elapsed_per_step_s=1.0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"step": s, "loss": 1.0 / s, "grad_norm": 0.1, "elapsed_s": s * elapsed_per_step_s}) + "\n"
            for s in range(1, steps + 1)
        )
    )


def test_history_stops_the_stage_before_at_the_checkpoint_it_was_continued_from(tmp_path):
    # stage 1 ran on to step 12 but stage 2 started from its step 8: the card counts 8 steps
    _log(tmp_path / "stage1" / "train_log.jsonl", 12)
    (tmp_path / "stage1" / "step_00008").mkdir()
    _log(tmp_path / "stage2" / "train_log.jsonl", 6, elapsed_per_step_s=2.0)
    args = argparse.Namespace(
        init_from=str(tmp_path / "stage1" / "step_00008"),
        caption_dropout=0.1,
        lr=3e-4,
        warmup=2,
        lr_schedule="linear",
        seed=1,
    )
    history = pretrain._training_history(tmp_path / "stage2" / "step_00004", tmp_path / "stage2", args)
    assert [r["step"] for r in history.stage1] == list(range(1, 9))
    assert history.step == 4 and len(history.rows) == 4
    text = pretrain._stages_text(history, args)
    assert "The stage before: 8 steps, 0.1 min" in text
    assert "4 steps, lr 0.0003" in text and "10% of the captions dropped" in text
    # the loss curve draws the stages' rows, the stage before first
    pretrain.loss_curve(tmp_path / "stage2" / "train_log.jsonl", tmp_path / "loss.png", before=history.stage1)
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_one_stage_history_has_no_stage_before(tmp_path):
    _log(tmp_path / "run" / "train_log.jsonl", 5)
    args = argparse.Namespace(init_from="", caption_dropout=0.0, lr=1e-3, warmup=2, lr_schedule="constant", seed=0)
    history = pretrain._training_history(tmp_path / "run" / "step_00005", tmp_path / "run", args)
    assert history.stage1 == [] and history.stage1_log is None
    assert pretrain._stages_text(history, args).startswith("- One stage from random weights: 5 steps")


def test_each_stage_of_the_recipe_starts_from_the_last_checkpoint_of_the_one_before():
    def flag(cmd, name):
        return cmd.split(f"--{name} ")[1].split()[0] if f"--{name} " in cmd else None

    for before, cmd in zip(pretrain.RECIPE, pretrain.RECIPE[1:]):
        assert flag(cmd, "init-from") == f"{flag(before, 'out')}/step_{int(flag(before, 'steps')):05d}", cmd
    assert [cmd for cmd in pretrain.RECIPE if "--ship-dir" in cmd] == [pretrain.RECIPE[-1]]
    assert flag(pretrain.RECIPE[-1], "ship-dir") == "spotlight/tasks/shapes/base_model"
    assert all("--caption-dropout" in cmd for cmd in pretrain.RECIPE)  # guidance needs the empty caption
    for cmd in pretrain.RECIPE:  # every stage's command line is one the CLI accepts
        args = pretrain.build_parser().parse_args(cmd.split()[3:])
        fresh = {"init_from": "", "out": "/nonexistent/pretrain-out"}  # this machine may hold the runs already
        assert pretrain._check_args(argparse.Namespace(**{**vars(args), **fresh})) is None


def _write_checkpoint(folder, num_layers=6):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"num_layers": num_layers}))
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (["--task-weights", "colour=1"], "--task-weights colour=1: unknown task kind 'colour'"),
        (["--task-weights", "color_attr=0"], "the weights sum to 0"),
        (["--task-weights", "color_attr=-2,position=1"], "expected KIND=WEIGHT with a number >= 0"),
        (["--num-layers", "-1"], "--num-layers must be an integer >= 1"),
        (["--caption-dropout", "1.5"], "--caption-dropout must be a number in [0, 1)"),
        (["--init-from", "{tmp}/missing/step_00400"], "--init-from {tmp}/missing/step_00400: not a checkpoint folder"),
        (["--init-from", "{tmp}/four/step_00400"], "has 4 blocks, this run builds 6; pass --num-layers 4"),
        (["--ship-only", "{tmp}/missing", "--ship-dir", "{tmp}/ship"], "--ship-only {tmp}/missing: not a checkpoint"),
        (["--ship-only", "{tmp}/run/step_00400", "--ship-dir", "{tmp}/ship"], "no {tmp}/out/train_log.jsonl"),
    ],
)
def test_bad_command_lines_stop_with_one_line_before_anything_is_written(tmp_path, capsys, argv, message):
    _write_checkpoint(tmp_path / "four" / "step_00400", num_layers=4)
    _write_checkpoint(tmp_path / "run" / "step_00400")
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        pretrain.main(["--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ship").exists()  # nothing trained, nothing shipped


def test_task_weights_draw_only_the_named_kinds_in_proportion():
    import numpy as np

    from spotlight.tasks.shapes import world

    # no weights: the same draw as before the option existed (the recipe's stages reproduce)
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    assert list(pretrain.draw_task_kinds(a, {}, 64)) == list(b.choice(world.TASKS, size=64))
    weights = pretrain.parse_task_weights("color_attr=3,position=1")
    tags = list(pretrain.draw_task_kinds(np.random.default_rng(0), weights, 4000))
    assert set(tags) == {"color_attr", "position"}
    assert 0.72 < tags.count("color_attr") / len(tags) < 0.78
    assert pretrain.task_mix_text("color_attr=3,position=1") == "task kinds color_attr 75%, position 25%"
    assert pretrain.task_mix_text("") == "task kind uniform"


def test_each_checkpoint_records_the_text_encoder_it_was_trained_on(tmp_path):
    from spotlight.models.families.tiny import read_text_conditioning

    argv = ["--steps", "2", "--batch-size", "2", "--num-layers", "1", "--threads", "1", "--save-every", "1"]
    assert pretrain.main(["--out", str(tmp_path), *argv, "--text-encoder", "minilm-bigram"]) == 0
    assert [read_text_conditioning(tmp_path / f"step_{s:05d}") for s in (1, 2)] == ["minilm-bigram"] * 2


def test_an_out_folder_that_holds_a_run_is_not_overwritten(tmp_path, capsys):
    _log(tmp_path / "train_log.jsonl", 3)
    before = (tmp_path / "train_log.jsonl").read_text()
    with pytest.raises(SystemExit):
        pretrain.main(["--out", str(tmp_path), "--steps", "1"])
    assert f"--out {tmp_path} already holds a pretraining run" in capsys.readouterr().err
    assert (tmp_path / "train_log.jsonl").read_text() == before


def test_a_stage_that_changes_the_text_encoder_says_so(tmp_path):
    """Continuing a bigram checkpoint without ``--text-encoder minilm-bigram`` is named, with the
    flag that keeps it; the same encoder, or no ``--init-from``, says nothing."""
    from spotlight.models.families.tiny import write_text_conditioning

    write_text_conditioning(tmp_path, "minilm-bigram")
    note = pretrain.encoder_switch_note(str(tmp_path), "minilm")
    assert note is not None and "'minilm-bigram'" in note and "--text-encoder minilm-bigram" in note
    assert pretrain.encoder_switch_note(str(tmp_path), "minilm-bigram") is None
    assert pretrain.encoder_switch_note(None, "minilm") is None
    # a checkpoint without the file was trained on plain MiniLM embeddings
    assert "'minilm'" in pretrain.encoder_switch_note(str(tmp_path / "missing"), "minilm-bigram")
