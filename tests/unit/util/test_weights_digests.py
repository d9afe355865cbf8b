"""A ``final/`` or ``best/`` folder carries the SHA-256 of each of its files (``SHA256SUMS``, in
``sha256sum``'s format), and :func:`check_weights_dir` finds bytes changed after the save: a
safetensors file whose tensor bytes were flipped still has a valid header and the right size, so
safetensors itself loads it (was: ``spotlight eval`` scored, and ``up --resume`` kept, whatever
the disk returned)."""

from __future__ import annotations

import hashlib
import pathlib
import re

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
        pytest.param("\n\n", "lists no file", id="blank"),
        pytest.param("not a digest\n", "line 1 is not '<sha256>  <file name>': 'not a digest'", id="garbage"),
        pytest.param("x" * 200, "line 1 is not '<sha256>  <file name>': '" + "x" * 80 + "…'", id="long"),
        pytest.param(f"{'0' * 64}  ../outside\n", "line 1 names '../outside', not a file of this folder", id="parent"),
        pytest.param(f"{'0' * 64}  ..\n", "line 1 names '..', not a file of this folder", id="the-parent"),
        pytest.param(f"{'0' * 64}  /etc/passwd\n", "names '/etc/passwd', not a file of this folder", id="absolute"),
        pytest.param(f"{'0' * 64}  sub/file\n", "line 1 names 'sub/file', not a file of this folder", id="subfolder"),
    ],
)
def test_a_bad_listing_is_refused_and_no_file_outside_is_read(tmp_path, listing, needle):
    folder = _saved(tmp_path)
    (folder / DIGEST_FILE).write_text(listing)
    with pytest.raises(WeightsFileError) as info:
        check_weights_dir(folder)
    assert needle in str(info.value), info.value


def test_what_sha256sum_reads_is_read(tmp_path):
    """Uppercase hex, ``./name``, blank lines and the binary marker, as ``sha256sum -c`` takes
    them (was: refused as "not '<sha256>  <file name>'")."""
    folder = _saved(tmp_path)
    digest = hashlib.sha256((folder / LORA_FILE).read_bytes()).hexdigest()
    for listing in (f"{digest.upper()}  {LORA_FILE}\n", f"\n{digest}  ./{LORA_FILE}\n\n", f"{digest} *{LORA_FILE}\r\n"):
        (folder / DIGEST_FILE).write_text(listing)
        check_weights_dir(folder)


def test_a_listing_that_leaves_out_the_weights_does_not_vouch_for_them(tmp_path):
    """Was: a SHA256SUMS listing only a note beside the weights passed, and flipped bytes in the
    adapter were scored. The files a loader reads must be listed; another file need not be."""
    folder = _saved(tmp_path)
    (folder / "notes.txt").write_text("a note")
    (folder / DIGEST_FILE).write_text(f"{hashlib.sha256(b'a note').hexdigest()}  notes.txt\n")
    with pytest.raises(WeightsFileError, match=f"{LORA_FILE} is not listed in {DIGEST_FILE}, so its bytes cannot"):
        check_weights_dir(folder)
    write_digests(folder)
    (folder / "stray.txt").write_text("added later")
    check_weights_dir(folder)


def test_a_transformer_folder_must_list_its_config_and_every_weights_file(tmp_path):
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"a": torch.zeros(2)}, str(folder / "diffusion_pytorch_model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(2)}, str(folder / "diffusion_pytorch_model-00002-of-00002.safetensors"))
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text("{}")
    write_digests(folder)
    check_weights_dir(folder)
    lines = (folder / DIGEST_FILE).read_text().splitlines()
    for left_out in lines:
        (folder / DIGEST_FILE).write_text("".join(f"{line}\n" for line in lines if line != left_out))
        name = left_out.split("  ", 1)[1]
        with pytest.raises(WeightsFileError, match=f"{re.escape(name)} is not listed"):
            check_weights_dir(folder)


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
