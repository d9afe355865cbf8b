"""This host's GPUs from ``nvidia-smi`` output (spotlight/util/gpus.py); the machine has none."""

from __future__ import annotations

from spotlight.util.gpus import parse_nvidia_smi

OUT = "0, 81559\n1, 81559\n2, 40960\n3, 81559\n"


def test_parse_and_visible_devices():
    gpus = parse_nvidia_smi(OUT)
    assert gpus.indices == (0, 1, 2, 3) and gpus.smallest_bytes == 40960 << 20
    mine = parse_nvidia_smi(OUT, "3,1")
    assert mine.indices == (1, 3) and mine.smallest_bytes == 81559 << 20
    assert mine.describe() == "2 GPUs of 79.6 GiB (nvidia-smi)"
    assert parse_nvidia_smi(OUT, "GPU-8f1c,GPU-22ab").indices == (0, 1, 2, 3)  # UUIDs: keep every GPU
    assert parse_nvidia_smi(OUT, "") is None  # CUDA_VISIBLE_DEVICES="" hides them all
    assert parse_nvidia_smi(OUT, "7") is None
    assert parse_nvidia_smi("No devices were found\n") is None
    assert parse_nvidia_smi("0, [N/A]\n1, 1024\n").indices == (1,)
