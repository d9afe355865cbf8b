"""The base model's pretraining records (spotlight/tasks/shapes/pretrain.py): what the model card
says about the stages behind a shipped checkpoint."""

import argparse
import json

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


def test_recipe_ships_from_the_checkpoint_its_first_stage_writes():
    first, last = pretrain.RECIPE[0], pretrain.RECIPE[-1]
    steps = int(first.split("--steps ")[1].split()[0])
    assert f"--init-from runs/pretrain-shapes/step_{steps:05d}" in last
    assert "--ship-dir spotlight/tasks/shapes/base_model" in last
    assert all("--caption-dropout" in cmd for cmd in pretrain.RECIPE)  # guidance needs the empty caption
