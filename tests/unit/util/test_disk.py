"""Free-space checks before large writes, and a child's "No space left on device" on the console."""

from __future__ import annotations

import shutil

import pytest

from spotlight.util.disk import DiskSpaceError, ensure_free_space, free_bytes, space_problem
from spotlight.util.procs import ChildExit, LogMark

GIB = 1 << 30


def test_space_problem_names_the_path_the_bytes_needed_and_free():
    assert space_problem("/data/run", 10 * GIB, 10 * GIB) is None  # exactly fits
    assert space_problem("/data/run", 0, 0) is None
    line = space_problem("/data/run/checkpoints/train", 245 * 10**9, 100 * GIB, "the trainer checkpoint of v3")
    assert line == (
        "disk full at /data/run/checkpoints/train: 245000000000 bytes (228.17 GiB) needed for the trainer "
        "checkpoint of v3, 107374182400 bytes (100.00 GiB) free"
    )


def test_ensure_free_space_raises_before_writing(tmp_path):
    target = tmp_path / "not" / "made" / "yet"  # the nearest existing parent's file system is asked
    assert free_bytes(target) > 0
    ensure_free_space(target, 1)
    with pytest.raises(DiskSpaceError, match=rf"^disk full at {target}: \d+ bytes .* needed for a test, \d+ bytes"):
        ensure_free_space(target, shutil.disk_usage(tmp_path).free + 10 * GIB, "a test")
    assert not (tmp_path / "not").exists()


def test_weight_version_spool_file_is_checked_before_it_is_written(tmp_path, monkeypatch):
    import torch

    from spotlight.store import tensor_wire
    from spotlight.util import disk

    monkeypatch.setattr(disk, "free_bytes", lambda path: 1000)
    with pytest.raises(DiskSpaceError, match="disk full at .*: 4[0-9]{3} bytes .* needed for weight version v1"):
        tensor_wire.save_version({"w": torch.zeros(1000)}, tmp_path / "v1.safetensors")
    assert not (tmp_path / "v1.safetensors").exists()


def test_a_child_out_of_disk_says_disk_full_at_the_path(tmp_path):
    log = tmp_path / "trainer-0.log"
    log.write_text(
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "OSError: [Errno 28] No space left on device: '/data/run/checkpoints/train/.tmp-v000004/__0_0.distcp'\n"
    )
    failed = ChildExit.of("train worker rank 0", 1, LogMark(str(log), 0), disk=tmp_path)
    assert failed.summary.startswith(
        "train worker rank 0 exited with code 1: disk full at /data/run/checkpoints/train/.tmp-v000004/__0_0.distcp: "
        "OSError: [Errno 28]"
    )
    # no path in the message: the directory the child writes to
    log.write_text("Traceback (most recent call last):\nRuntimeError: write failed: No space left on device\n")
    failed = ChildExit.of("train worker rank 0", 1, LogMark(str(log), 0), disk="/data/run")
    assert failed.summary == (
        "train worker rank 0 exited with code 1: disk full at /data/run: RuntimeError: write failed: "
        "No space left on device"
    )
    # our own refusal already says it once
    log.write_text("Traceback (most recent call last):\nspotlight.util.disk.DiskSpaceError: disk full at /x: 5 bytes\n")
    assert ChildExit.of("t", 1, LogMark(str(log), 0)).summary.count("disk full") == 1


def test_a_directory_that_takes_no_file_is_unwritable_whatever_its_permissions_say(tmp_path):
    """Was: ``profile --out /proc/p.json`` (as root, ``os.access`` says /proc is writable)
    measured for minutes and then failed to write its result."""
    import pathlib

    from spotlight.cli.profile import profile_path
    from spotlight.util.disk import unwritable_dir

    assert unwritable_dir(tmp_path) == "" and list(tmp_path.iterdir()) == []  # the probe is removed
    if pathlib.Path("/proc/self").is_dir():  # Linux: a virtual file system that takes no new file
        assert unwritable_dir("/proc").startswith("not writable"), unwritable_dir("/proc")
        with pytest.raises(ValueError, match="/proc"):
            profile_path(pathlib.Path("/proc/p.json"), None)
