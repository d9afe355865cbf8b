"""A state file written by ``write_text_atomic`` holds the old text or the new, never a part."""

from __future__ import annotations

import pytest

from spotlight.util.atomic_file import replace_dir_atomic, write_text_atomic


def test_it_writes_and_replaces(tmp_path):
    path = tmp_path / "coordinator.json"
    write_text_atomic(path, '{"pid": 1}')
    write_text_atomic(path, '{"pid": 2}')
    assert path.read_text() == '{"pid": 2}'
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator.json"]


def test_a_failed_write_keeps_the_old_text_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "status.json"
    path.write_text('{"iteration": 3}')
    with pytest.raises(UnicodeEncodeError):  # fails after the file was opened, as a full disk would
        write_text_atomic(path, '{"iteration": 4, "note": "\ud800"}')
    assert path.read_text() == '{"iteration": 3}'
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_plain_write_that_fails_the_same_way_empties_the_file(tmp_path):
    """Why the atomic write exists: the same failure through ``write_text`` loses the old text."""
    path = tmp_path / "status.json"
    path.write_text('{"iteration": 3}')
    with pytest.raises(UnicodeEncodeError):
        path.write_text('{"iteration": 4, "note": "\ud800"}', encoding="utf-8")
    assert path.read_text() != '{"iteration": 3}'


def test_the_coordinator_files_are_written_atomically(tmp_path, monkeypatch):
    import spotlight.coordinator.recorder as recorder

    calls = []
    monkeypatch.setattr(recorder, "write_text_atomic", lambda path, text: calls.append(path.name))
    recorder.write_coordinator_json(tmp_path, "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", None)
    recorder.write_status(tmp_path, {"iteration": 1})
    assert calls == ["coordinator.json", "status.json"]


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    final = tmp_path / "final"
    with replace_dir_atomic(final) as tmp:
        assert tmp.parent == tmp_path and not final.exists()  # nothing at final/ while it is written
        (tmp / "a.safetensors").write_bytes(b"1")
    assert sorted(p.name for p in final.iterdir()) == ["a.safetensors"]
    with pytest.raises(OSError):
        with replace_dir_atomic(final) as tmp:
            (tmp / "b.safetensors").write_bytes(b"2")
            raise OSError(28, "No space left on device")
    assert sorted(p.name for p in final.iterdir()) == ["a.safetensors"]  # the earlier folder, untouched
    with replace_dir_atomic(final) as tmp:
        (tmp / "c.safetensors").write_bytes(b"3")
    assert sorted(p.name for p in final.iterdir()) == ["c.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_a_temporary_folder_an_earlier_crash_left_is_not_carried_over(tmp_path):
    (tmp_path / "final.tmp").mkdir()
    (tmp_path / "final.tmp" / "half.safetensors").write_bytes(b"x")
    with replace_dir_atomic(tmp_path / "final") as tmp:
        (tmp / "whole.safetensors").write_bytes(b"y")
    assert [p.name for p in (tmp_path / "final").iterdir()] == ["whole.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_a_run_config_write_that_fails_keeps_the_earlier_config(tmp_path, monkeypatch):
    """A run's config.toml is what ``--resume`` and ``spotlight eval --run-dir`` read; before, it
    was written in place, so a full disk while saving it left an empty or cut file. The report
    files (eval.json, simulate.json, profile and bench results) go the same way now."""
    import errno
    import os

    import spotlight.util.atomic_file as atomic_file
    from spotlight.config import dump_config, load_config

    path = tmp_path / "config.toml"
    dump_config(load_config(), path)
    before = path.read_text()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic_file.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        dump_config(load_config(overrides={"run.iterations": 3}), path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]
