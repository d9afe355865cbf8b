"""A ``final/`` or ``best/`` folder carries the SHA-256 of each of its files (``SHA256SUMS``, in
``sha256sum``'s format), and :func:`check_weights_dir` finds bytes changed after the save: a
safetensors file whose tensor bytes were flipped still has a valid header and the right size, so
safetensors itself loads it (was: ``spotlight eval`` scored, and ``up --resume`` kept, whatever
the disk returned)."""

from __future__ import annotations

import hashlib
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from spotlight.util.weights_file import (
    DIGEST_FILE,
    LORA_FILE,
    WeightsFileError,
    check_weights_dir,
    digest_problem,
    write_digests,
)


def _saved(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "final"
    folder.mkdir()
    save_file(
        {"transformer.a.lora_A.weight": torch.arange(32, dtype=torch.float32).reshape(4, 8)}, str(folder / LORA_FILE)
    )
    write_digests(folder)
    return folder


def _flip_last_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_found_and_named(tmp_path):
    folder = _saved(tmp_path)
    check_weights_dir(folder)
    weights = folder / LORA_FILE
    _flip_last_byte(weights)
    load_file(str(weights))  # safetensors itself cannot tell
    with pytest.raises(WeightsFileError) as info:
        check_weights_dir(folder, option="--weights")
    text = str(info.value)
    assert text.startswith(f"--weights {folder}: {LORA_FILE} holds other bytes than were saved"), text
    assert "\n" not in text


def test_the_listing_is_sha256sum_format(tmp_path):
    """``<hex>  <name>``, one line a file: what ``sha256sum -c SHA256SUMS`` checks in the folder."""
    folder = _saved(tmp_path)
    (line,) = (folder / DIGEST_FILE).read_text().splitlines()
    assert line == f"{hashlib.sha256((folder / LORA_FILE).read_bytes()).hexdigest()}  {LORA_FILE}"


def test_a_listed_file_that_is_gone_is_named(tmp_path):
    folder = _saved(tmp_path)
    (folder / "config.json").write_text("{}")
    write_digests(folder)
    (folder / "config.json").unlink()
    assert digest_problem(folder) == f"config.json is missing (listed in {DIGEST_FILE})"


@pytest.mark.parametrize(
    "listing, needle",
    [
        pytest.param("", "lists no file", id="empty"),
        pytest.param("not a digest\n", "line 1 is not '<sha256>  <file name>'", id="garbage"),
        pytest.param(f"{'0' * 64}  ../outside\n", "line 1 is not", id="a-path-out-of-the-folder"),
        pytest.param(f"{'0' * 64}  ..\n", "line 1 is not", id="the-parent"),
        pytest.param(f"{'0' * 64}  sub/file\n", "line 1 is not", id="a-path-in-a-subfolder"),
    ],
)
def test_a_bad_listing_is_refused_and_no_file_outside_is_read(tmp_path, listing, needle):
    folder = _saved(tmp_path)
    (folder / DIGEST_FILE).write_text(listing)
    with pytest.raises(WeightsFileError, match=None) as info:
        check_weights_dir(folder)
    assert needle in str(info.value), info.value


def test_a_folder_without_a_listing_is_loaded_as_before(tmp_path):
    """Folders saved before runs wrote SHA256SUMS, or assembled by hand, are still checked only
    for readable safetensors files."""
    folder = _saved(tmp_path)
    (folder / DIGEST_FILE).unlink()
    check_weights_dir(folder)
    assert digest_problem(folder) is None


def test_hidden_and_linked_files_are_not_listed(tmp_path):
    folder = _saved(tmp_path)
    (folder / ".lock").write_text("")
    (folder / "link.safetensors").symlink_to(folder / LORA_FILE)
    write_digests(folder)
    names = [line.split("  ", 1)[1] for line in (folder / DIGEST_FILE).read_text().splitlines()]
    assert names == [LORA_FILE]
