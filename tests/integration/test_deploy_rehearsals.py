"""The deployment recipes rehearsed on this machine (deploy/<recipe>/rehearse.sh, deploy/rehearse.py):
each recipe's own commands start the coordinator and the agents on localhost and run 2 iterations
of the embedded default (Kubernetes: 1).

Slurm: the batch scripts as they are (``srun`` a shim that runs one process per task, so the
reserved job's Train Workers are two ranks of the multi-node entry point on two localhost "nodes").
SkyPilot, with ``--preempt``: a mock AWS spot notice to one spot node's metadata server while the
run's Train Workers are held; that agent drains and exits, joining again on the same "VM" exits 75
and the job waits for the VM to go; the rehearsal takes it away and launches the replacement job,
which joins with a new node id. No request is lost (each ends exactly once, and the preempted node's
in-flight work was committed or re-run), the coordinator, the other agents and the Train Workers
kept running, and the run ends with both iterations.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

from tests.integration.accounting import assert_each_request_ended_once
from tests.integration.runs import read_jsonl

REPO = pathlib.Path(__file__).resolve().parents[2]


def _rehearse(recipe: str, work: pathlib.Path, *args: str) -> dict:
    proc = subprocess.run(
        [str(REPO / "deploy" / recipe / "rehearse.sh"), "--work-dir", str(work), *args],
        capture_output=True,
        text=True,
        timeout=1100,  # inside the per-test limit (pyproject: 1200 s)
    )
    facts = json.loads((work / "rehearsal.json").read_text())
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(work.glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    return facts


def _check_run(facts: dict, iterations: int = 2) -> list[dict]:
    rd = pathlib.Path(facts["run_dir"])
    assert facts["coordinator_exit"] == 0 and facts["iterations_done"] == iterations
    assert [m["iteration"] for m in read_jsonl(rd / "metrics.jsonl")] == list(range(iterations))
    reqs = read_jsonl(rd / "requests.jsonl")
    assert reqs
    assert_each_request_ended_once(reqs)
    return reqs


def test_slurm_rehearsal(tmp_path):
    """The reserved job spans two "nodes": its trainer is two srun tasks of the multi-node entry
    point (ranks from Slurm's task variables, a 2-D HSDP mesh), connected with the trainer key."""
    facts = _rehearse("slurm", tmp_path)
    _check_run(facts)
    assert facts["nodes"] == ["spot-1000-0-r0", "spot-1000-1-r0"]
    assert facts["trainer_ranks"] == 2
    log = (tmp_path / "reserved.log").read_text(errors="replace")
    for rank in (0, 1):
        assert f"rank {rank} of 2 (node {rank} of 2, local rank 0, cpu, srun) connecting to" in log
    assert log.count("HSDP mesh: 2 nodes × 1 ranks per node") == 2 and "as trainer.reserved" in log
    assert "all 2 train worker ranks connected (2 × 1 ranks" in log


def test_skypilot_rehearsal_with_a_preempted_spot_node(tmp_path):
    facts = _rehearse("skypilot", tmp_path, "--preempt")
    reqs = _check_run(facts)
    pre = facts["preempted"]
    assert pre["node"] == "spot-vm0" and pre["replacement"] == "spot-vm0r1"
    assert pre["exit"] != 0  # the job was waiting for its VM to go (exit 75, then sleep), and the VM went
    assert facts["kept_running"]["all_alive"], facts["kept_running"]
    status = json.loads((pathlib.Path(facts["run_dir"]) / "status.json").read_text())
    events = [(e["kind"], e["node"]) for e in status.get("events", [])]
    assert ("notice", "spot-vm0") in events, events
    assert ("join", "spot-vm0r1") in events, events
    # the replacement took work: some request of the run was leased to it
    assert any("leased to spot-vm0r1/" in json.dumps(r["history"]) for r in reqs)


def test_kubernetes_rehearsal(tmp_path):
    """The StatefulSet's containers (coordinator with --resume-existing on its volume, reserved
    agent) and the agent Deployment's pods (node id $(POD_NAME)) as the manifests give their
    arguments; one iteration is enough to show the cluster forms and trains (the other two
    rehearsals run two)."""
    facts = _rehearse("kubernetes", tmp_path, "--iterations", "1")
    _check_run(facts, iterations=1)
    assert facts["nodes"] == ["spotlight-agent-0x0", "spotlight-agent-1x0"]
    assert pathlib.Path(facts["run_dir"]) == tmp_path / "run"  # the PersistentVolume's mount, here
