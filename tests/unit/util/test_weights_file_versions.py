"""A readable safetensors file that is no weight version of the run's transformer (another model
size, another LoRA rank, names of another model) is one line naming the file and why, from its
header alone (:func:`spotlight.util.weights_file.check_weight_version`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from spotlight.util.weights_file import (
    VersionLayout,
    WeightsFileError,
    check_loaded_version,
    check_weight_version,
    version_problem,
)

FULL = VersionLayout(
    shapes={"a.weight": (4, 2), "a.bias": (4,), "b.weight": (3, 4)},
    required=frozenset({"a.weight", "a.bias", "b.weight"}),
    what="T transformer",
    hint="the model section sets its shapes",
)
LORA = VersionLayout(
    shapes={"a.base_layer.weight": (4, 2), "a.lora_A.default.weight": (2, 2), "a.lora_B.default.weight": (4, 2)},
    required=frozenset({"a.lora_A.default.weight", "a.lora_B.default.weight"}),
    what="LoRA adapter (rank 2) of T",
)


def test_a_version_of_the_transformer_fits():
    assert version_problem(dict(FULL.shapes), FULL) is None
    assert version_problem({"a.lora_A.default.weight": (2, 2), "a.lora_B.default.weight": (4, 2)}, LORA) is None
    # load_version takes base weights along with the adapter too
    assert version_problem(dict(LORA.shapes), LORA) is None


@pytest.mark.parametrize(
    "found, layout, says",
    [
        ({}, FULL, "holds no tensors"),
        ({"x": (1,)}, FULL, "holds no weights of this run's T transformer: no tensor name in the file (e.g. 'x')"),
        ({"a.base_layer.weight": (4, 2)}, LORA, "holds no weights of this run's LoRA adapter (rank 2) of T"),
        (
            {**FULL.shapes, "a.weight": (8, 2)},
            FULL,
            "1 tensors of another shape, e.g. 'a.weight' is [8, 2] in the file",
        ),
        ({**FULL.shapes, "c.weight": (1,)}, FULL, "1 tensors the model does not have, e.g. 'c.weight'"),
        ({"a.weight": (4, 2)}, FULL, "lacks 2 of its 3 tensors, e.g. 'a.bias', 'b.weight'"),
        ({"a.lora_A.default.weight": (4, 2), "a.lora_B.default.weight": (4, 4)}, LORA, "2 tensors of another shape"),
    ],
    ids=["empty", "no-name-matches", "base-only-in-lora", "shape", "unknown", "missing", "lora-rank"],
)
def test_why_a_version_does_not_fit(found, layout, says):
    problem = version_problem(found, layout)
    assert problem is not None and says in problem, problem
    assert "\n" not in problem


def test_a_shape_mismatch_names_the_settings_that_set_the_shapes():
    assert "(the model section sets its shapes)" in version_problem({**FULL.shapes, "b.weight": (3, 5)}, FULL)


def test_the_file_check_reads_the_header_and_names_the_file(tmp_path):
    good, bad = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    save_file({n: torch.zeros(s) for n, s in FULL.shapes.items()}, str(good))
    save_file({n: torch.zeros(s) for n, s in {**FULL.shapes, "a.bias": (8,)}.items()}, str(bad))
    check_weight_version(good, FULL)
    with pytest.raises(WeightsFileError, match=r"^--weights .*v2\.safetensors: not a weight version of this run's T"):
        check_weight_version(bad, FULL, option="--weights")
    with pytest.raises(WeightsFileError, match="not a readable safetensors file"):
        (tmp_path / "v3.safetensors").write_bytes(b"garbage")
        check_weight_version(tmp_path / "v3.safetensors", FULL)
    with pytest.raises(WeightsFileError, match=r"v1\.safetensors: holds no weights"):
        check_loaded_version({"x": torch.zeros(1)}, FULL, good)
