"""Run checkpoints (spotlight.store.checkpoint): atomic write, LATEST pointer, retention, fallback."""

from __future__ import annotations

import json
import os

import pytest

from spotlight.errors import SpotlightError
from spotlight.store.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    checkpoint_dir,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    missing_checkpoint,
    next_epoch,
    write_checkpoint,
)


def test_write_then_load_round_trip(tmp_path):
    state = {"iteration": 3, "sched": {"a": [1, 2.5, None, "x"]}, "nested": {"k": True}}
    path = write_checkpoint(tmp_path, 3, state, {"seed_bank.json": b"{}", "sub/blob.bin": b"\x00\xff"})
    assert path == checkpoint_dir(tmp_path) / "iter_000003"
    assert load_checkpoint(path) == state
    assert (path / "seed_bank.json").read_bytes() == b"{}"
    assert (path / "sub" / "blob.bin").read_bytes() == b"\x00\xff"
    assert (checkpoint_dir(tmp_path) / "LATEST").read_text().strip() == "iter_000003"
    assert latest_checkpoint(tmp_path) == (3, path)
    # nothing but the checkpoint and the pointer is left behind
    assert sorted(p.name for p in checkpoint_dir(tmp_path).iterdir()) == ["LATEST", "iter_000003"]


def test_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    checkpoint_dir(tmp_path).mkdir()
    assert latest_checkpoint(tmp_path) is None


def test_crash_mid_write_leaves_previous_checkpoint(tmp_path):
    """A crash before the rename leaves only a temp dir: ignored and cleaned up."""
    good = write_checkpoint(tmp_path, 1, {"n": 1})
    root = checkpoint_dir(tmp_path)
    crashed = root / ".tmp-iter_000002-deadbeef"
    crashed.mkdir()
    (crashed / "state.json").write_text('{"format": 1, "iteration": 2, "st')  # truncated
    assert latest_checkpoint(tmp_path, cleanup=False) == (1, good)
    assert crashed.exists()
    assert latest_checkpoint(tmp_path) == (1, good)
    assert not crashed.exists()
    # the next write of iteration 2 succeeds
    p2 = write_checkpoint(tmp_path, 2, {"n": 2})
    assert latest_checkpoint(tmp_path) == (2, p2)


def test_incomplete_final_dir_is_skipped(tmp_path):
    """An ``iter_`` dir whose state.json is truncated or missing is not complete."""
    good = write_checkpoint(tmp_path, 4, {"n": 4})
    root = checkpoint_dir(tmp_path)
    (root / "iter_000005").mkdir()
    (root / "iter_000005" / "state.json").write_text('{"format": 1, "itera')
    (root / "iter_000006").mkdir()
    (root / "LATEST").write_text("iter_000006\n")  # names an incomplete dir
    assert latest_checkpoint(tmp_path) == (4, good)
    assert [i for i, _ in complete_checkpoints(tmp_path)] == [4]
    # rewriting an iteration whose final dir is incomplete replaces it
    p5 = write_checkpoint(tmp_path, 5, {"n": 5})
    assert load_checkpoint(p5) == {"n": 5}


def test_latest_pointing_to_missing_dir_falls_back_to_newest(tmp_path):
    write_checkpoint(tmp_path, 1, {"n": 1})
    p2 = write_checkpoint(tmp_path, 2, {"n": 2})
    root = checkpoint_dir(tmp_path)
    (root / "LATEST").write_text("iter_000009\n")
    assert latest_checkpoint(tmp_path) == (2, p2)
    (root / "LATEST").write_text("garbage")
    assert latest_checkpoint(tmp_path) == (2, p2)
    (root / "LATEST").unlink()
    assert latest_checkpoint(tmp_path) == (2, p2)


def test_latest_pointer_is_trusted_over_newer_dirs(tmp_path):
    """LATEST names the checkpoint to resume from even if a newer complete dir exists."""
    p1 = write_checkpoint(tmp_path, 1, {"n": 1})
    write_checkpoint(tmp_path, 2, {"n": 2})
    (checkpoint_dir(tmp_path) / "LATEST").write_text("iter_000001\n")
    assert latest_checkpoint(tmp_path) == (1, p1)


def test_retention_keeps_newest_and_latest(tmp_path):
    for i in range(5):
        write_checkpoint(tmp_path, i, {"n": i}, keep=2)
    assert [i for i, _ in complete_checkpoints(tmp_path)] == [3, 4]
    write_checkpoint(tmp_path, 7, {"n": 7}, keep=1)
    assert [i for i, _ in complete_checkpoints(tmp_path)] == [7]
    with pytest.raises(ValueError):
        write_checkpoint(tmp_path, 8, {}, keep=0)


def test_retention_never_deletes_the_latest(tmp_path):
    write_checkpoint(tmp_path, 10, {"n": 10})
    # an older iteration written after a newer one (e.g. a resumed run re-saving) becomes LATEST
    p = write_checkpoint(tmp_path, 3, {"n": 3}, keep=1)
    assert p.is_dir()
    assert latest_checkpoint(tmp_path) == (3, p)


def test_corrupt_and_unknown_format_raise_checkpoint_error(tmp_path):
    p = write_checkpoint(tmp_path, 0, {"n": 0})
    doc = json.loads((p / "state.json").read_text())
    assert doc["format"] == CHECKPOINT_FORMAT and doc["iteration"] == 0
    (p / "state.json").write_text(json.dumps({**doc, "format": CHECKPOINT_FORMAT + 1}))
    with pytest.raises(CheckpointError, match="unknown checkpoint format"):
        load_checkpoint(p)
    (p / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(p)
    (p / "state.json").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(p)
    assert issubclass(CheckpointError, SpotlightError)
    assert latest_checkpoint(tmp_path) is None


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="strict JSON"):
        write_checkpoint(tmp_path, 0, {"x": float("nan")})
    with pytest.raises(ValueError, match="strict JSON"):
        write_checkpoint(tmp_path, 0, {"x": object()})
    for bad in ("../escape", "/abs", "state.json", ".tmp-x", ""):
        with pytest.raises(ValueError, match="invalid checkpoint file name"):
            write_checkpoint(tmp_path, 0, {}, {bad: b""})
    with pytest.raises(ValueError):
        write_checkpoint(tmp_path, -1, {})
    # failed writes leave nothing behind
    root = checkpoint_dir(tmp_path)
    assert not root.exists() or not any(root.iterdir())
    write_checkpoint(tmp_path, 0, {})
    with pytest.raises(CheckpointError, match="already exists"):
        write_checkpoint(tmp_path, 0, {})


def test_failed_write_keeps_previous(tmp_path, monkeypatch):
    """An OSError during the rename leaves the previous checkpoint and no temp dir."""
    p1 = write_checkpoint(tmp_path, 1, {"n": 1})

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "rename", boom)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path, 2, {"n": 2})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path, cleanup=False) == (1, p1)
    assert sorted(p.name for p in checkpoint_dir(tmp_path).iterdir()) == ["LATEST", "iter_000001"]


def test_next_epoch_counts_starts_durably(tmp_path):
    assert [next_epoch(tmp_path) for _ in range(3)] == [0, 1, 2]
    assert (checkpoint_dir(tmp_path) / "EPOCH").read_text().strip() == "2"
    # epochs and checkpoints live side by side; neither disturbs the other
    p = write_checkpoint(tmp_path, 0, {})
    assert next_epoch(tmp_path) == 3 and latest_checkpoint(tmp_path) == (0, p)
    (checkpoint_dir(tmp_path) / "EPOCH").write_text("x")
    with pytest.raises(CheckpointError, match="not a non-negative integer"):
        next_epoch(tmp_path)


def test_checkpoint_cadence_is_every_nth_iteration_and_the_last():
    from spotlight.store.checkpoint import is_checkpoint_iteration

    assert [n for n in range(7) if is_checkpoint_iteration(n, 2, 7)] == [1, 3, 5, 6]
    assert [n for n in range(4) if is_checkpoint_iteration(n, 1, 4)] == [0, 1, 2, 3]
    assert [n for n in range(5) if is_checkpoint_iteration(n, 10, 5)] == [4]


@pytest.mark.parametrize(
    ("recorded", "checkpointed", "every", "missing"),
    [
        (0, 0, 1, None),  # a fresh run
        (1, 0, 1, None),  # killed between iteration 1's metrics row and its checkpoint
        (5, 4, 1, None),  # the same later in the run
        (5, 5, 1, None),  # killed during iteration 6
        (3, 0, 1, 1),  # rows 2 and 3 prove the checkpoints of iterations 1 and 2 were written: gone
        (20, 0, 1, 18),
        (12, 5, 5, 9),  # checkpoint_every 5: iteration 10's checkpoint was written before row 11
        (10, 5, 5, None),  # row 10 without its checkpoint: a crash between the two writes
        (4, 0, 5, None),  # no checkpoint iteration finished yet
        (12, 10, 5, None),
    ],
)
def test_a_checkpoint_the_metrics_prove_was_written_is_missing(recorded, checkpointed, every, missing):
    assert missing_checkpoint(recorded, checkpointed, every) == missing
