"""Experiment tracking: what the coordinator feeds a tracker can be read back from the files."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
import pytest
from PIL import Image

from spotlight.config import ConfigError, load_config
from spotlight.coordinator.tracking import TrackingError, check_trackers, open_trackers


def _events(log_dir: pathlib.Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_holds_scalars_image_and_config(tmp_path):
    grid = tmp_path / "grid.png"
    Image.fromarray(np.full((20, 30, 3), 200, dtype=np.uint8)).save(grid)
    rows = [
        {
            "iteration": 0,
            "reward/mean": 0.25,
            "cost/usd": 0.5,
            "spot/busy_fraction": math.nan,
            "planner": {"arm": 3},
            "note": "x",
            "flag": True,
        },
        {"iteration": 1, "reward/mean": 0.75, "cost/usd": 1.0, "spot/busy_fraction": 0.5},
    ]
    t = open_trackers(["tensorboard"], tmp_path, config_text="[run]\niterations = 2\n")
    for row in rows:
        t.log_metrics(row["iteration"] + 1, row)
    t.log_image(2, "samples", grid)
    t.close()

    acc = _events(tmp_path / "tensorboard")
    tags = acc.Tags()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]  # 1-based steps
    assert [(e.step, e.value) for e in acc.Scalars("spot/busy_fraction")] == [(2, 0.5)]  # NaN left out
    assert "planner" not in tags["scalars"] and "note" not in tags["scalars"] and "flag" not in tags["scalars"]
    (img,) = acc.Images("samples")
    assert (img.step, img.width, img.height) == (2, 30, 20)
    texts = [t for t in tags["tensors"] if t.startswith("config")]
    assert texts, tags
    text = acc.Tensors(texts[0])[0].tensor_proto.string_val[0].decode()
    assert "iterations = 2" in text


def test_resumed_tracker_replaces_the_repeated_iteration(tmp_path):
    first = open_trackers(["tensorboard"], tmp_path)
    for step in (1, 2, 3):
        first.log_metrics(step, {"reward/mean": float(step)})
    first.close()
    # the run died in iteration 3 and resumes there: step 3 is logged again
    again = open_trackers(["tensorboard"], tmp_path, first_step=3)
    again.log_metrics(3, {"reward/mean": 30.0})
    again.close()
    assert [(e.step, e.value) for e in _events(tmp_path / "tensorboard").Scalars("reward/mean")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
    ]


def test_no_trackers_writes_nothing(tmp_path):
    t = open_trackers([], tmp_path, config_text="x")
    t.log_metrics(1, {"reward/mean": 1.0})
    t.close()
    assert not (tmp_path / "tensorboard").exists()


def test_unknown_or_missing_tracker_is_one_clear_line():
    with pytest.raises(TrackingError, match="unknown tracker 'mlflow'"):
        check_trackers(["mlflow"])
    with pytest.raises(ConfigError, match=r"run.trackers: unknown tracker\(s\) \['mlflow'\]"):
        load_config(overrides={"run.trackers": ["mlflow"]})
    assert load_config().run.trackers == ["tensorboard"]  # tracking is on by default
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(TrackingError, match="pip install wandb"):
            check_trackers(["tensorboard", "wandb"])


def test_wandb_offline_run_in_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = open_trackers(["wandb"], tmp_path, config_text="[run]\niterations = 2\n")
    t.log_metrics(1, {"reward/mean": 0.5})
    t.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
