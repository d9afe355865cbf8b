"""examples/deploy/two-node-trainer-local.sh: a 2-iteration run whose two Train Worker ranks are
launched by torchrun as two "nodes" of one rank each on localhost (``spotlight up
--external-trainers``, ``python -m spotlight.workers.train.launch``), with the coordinator and its
local agents. The ranks connect with a trainer key over CurveZMQ, train on a 2-D HSDP mesh
(2 nodes × 1 rank), are billed per host, and every process exits cleanly."""

from __future__ import annotations

import json
import pathlib
import subprocess

from tests.integration.accounting import assert_each_request_ended_once
from tests.integration.runs import read_jsonl

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_two_node_trainer_example(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.run(
        [str(REPO / "examples" / "deploy" / "two-node-trainer-local.sh"), str(work)],
        capture_output=True,
        text=True,
        timeout=1100,  # inside the per-test limit (pyproject: 1200 s)
    )
    logs = {p.name: p.read_text(errors="replace") for p in sorted(work.glob("*.log"))}
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n" + "\n".join(
        f"== {name}\n{text[-2000:]}" for name, text in logs.items()
    )
    rd = work / "run"
    assert [m["iteration"] for m in read_jsonl(rd / "metrics.jsonl")] == [0, 1]
    assert_each_request_ended_once(read_jsonl(rd / "requests.jsonl"))
    assert (rd / "final" / "config.json").is_file()

    assert "all 2 train worker ranks connected (2 × 1 ranks" in logs["up.log"]
    for node in (0, 1):
        log = logs[f"trainer-node{node}.log"]
        assert f"rank {node} of 2 (node {node} of 2, local rank 0, cpu, torchrun)" in log
        assert "as trainer.two-node" in log  # the allow-listed trainer key
        assert "HSDP mesh: 2 nodes × 1 ranks per node ('replicate', 'shard')" in log
        assert "shutdown: run finished" in log
    status = json.loads((rd / "status.json").read_text())
    assert status["gpus"]["train"] == 2  # both ranks' GPUs billed (one host here: "GPU" 0 and 1)
    assert status["cost"]["reserved_gpu_hours"] > 0
