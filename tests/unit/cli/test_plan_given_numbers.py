"""``spotlight plan``, and ``spotlight up``'s refusal from the same plan, print a GPU size as it
was given (``--gpu-memory-gib 0.001`` or ``cluster.gpu_memory_gib = 0.001``): ``0.001``, not the
``0.000999999`` that the plan's ``int(x · 2³⁰)`` bytes read back at six digits
(docs/planning.md)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.core.memory_plan import GIB, Line, MemoryPlan, gib_as_given

GIVEN = [0.001, 0.01, 0.1, 0.3, 1e-05, 4, 8, 79.99, 80, 123.456, 1048576]


@pytest.mark.parametrize("x", GIVEN)
def test_a_size_reads_as_given_and_gives_the_same_bytes(x):
    limit = int(x * GIB)  # as plan_memory holds it
    shown = gib_as_given(limit, min_places=0)
    assert float(shown) == x and int(float(shown) * GIB) == limit, shown
    assert gib_as_given(limit) == (f"{x:.1f}" if x == int(x) else shown)  # a size: at least one decimal


def _plan(limit_gib: float) -> MemoryPlan:
    return MemoryPlan(
        trainer_gpu=(Line("parameters", 2 * GIB, "4·P/W"),),
        rollout_gpu=(Line("model copy", GIB // 2, "b·P"),),
        reserved_host=(),
        spot_host=(),
        disk=(),
        gpu_limit_bytes=int(limit_gib * GIB),
        tokens_per_micro_batch=1,
        rows_per_micro_batch=1,
        activation_checkpointing=False,
        version_bytes=0,
        train_checkpoint_bytes=0,
        final_bytes=0,
    )


def test_the_refusals_name_the_size_as_given():
    lines = _plan(0.001).problems()
    assert len(lines) == 2 and all("cluster.gpu_memory_gib = 0.001 (" in line for line in lines), lines
    assert _plan(1.5).problems() == [
        "a trainer GPU needs 2.0 GiB but cluster.gpu_memory_gib = 1.5 (parameters 2.0 GiB)"
    ]
    assert _plan(8).problems() == []


def test_plan_prints_the_gpu_size_it_was_given(tmp_path):
    res = CliRunner().invoke(app, ["plan", "--device", "cpu", "--gpu-memory-gib", "0.001"], env={"COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    refusals = res.stderr.strip().splitlines()
    assert len(refusals) == 2 and all("cluster.gpu_memory_gib = 0.001 (" in r for r in refusals), refusals
    assert "(over 0.001 GiB)" in res.stdout and "0.000999" not in res.output, res.output

    conf = tmp_path / "c.toml"
    conf.write_text("[cluster]\ngpu_memory_gib = 0.001\n")
    res = CliRunner().invoke(app, ["plan", str(conf), "--device", "cpu", "--json"])
    doc = json.loads(res.stdout)
    assert doc["problems"] and all("cluster.gpu_memory_gib = 0.001 (" in p for p in doc["problems"]), doc["problems"]

    res = CliRunner().invoke(app, ["plan", "--device", "cpu", "--gpu-memory-gib", "79.99"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "fits: every GPU within 79.99 GiB" in res.stdout, res.output
