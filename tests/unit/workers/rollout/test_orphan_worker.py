"""A Rollout Worker whose agent dies while the worker is still starting exits on its own.

The worker watches for its agent's death by comparing ``os.getppid()`` with the agent's pid.
Taking that pid from ``os.getppid()`` at construction time is wrong when the agent is killed
while the worker still imports torch and builds its model: the worker is then re-parented
already, takes the new parent for its agent and waits forever (seen as rollout workers left
behind, each holding its model, after an agent was SIGKILLed). The agent's pid comes from
:func:`spotlight.util.procs.spawn_logged` instead."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import psutil
import pytest

pytestmark = pytest.mark.procs

REPO = pathlib.Path(__file__).resolve().parents[4]

AGENT = """
import json, os, sys
from spotlight.util.procs import spawn_logged
conf = json.dumps({"model": {}, "sampler": {}, "worker_batch_size": 1, "torch_threads": 1})
cmd = [sys.executable, "-m", "spotlight.workers.rollout.worker", "--agent", sys.argv[1], "--worker-id", "w",
       "--gpus", "0", "--config-json", conf]
proc = spawn_logged(cmd, "worker-w", env=dict(os.environ))
print(proc.pid, flush=True)
os._exit(0)  # the agent dies at once, long before the worker has imported torch
"""


def test_a_worker_whose_agent_died_during_its_start_exits(tmp_path):
    endpoint = f"ipc://{tmp_path / 'agent.sock'}"  # nobody listens: the agent is gone
    env = dict(os.environ, SPOTLIGHT_LOG_DIR=str(tmp_path / "logs"))  # the worker's output goes to a file
    out = subprocess.run(
        [sys.executable, "-c", AGENT, endpoint],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    worker = psutil.Process(int(out.stdout.split()[0]))
    try:
        worker.wait(timeout=180)  # generous: the worker first imports torch and builds its model
    except psutil.TimeoutExpired:
        worker.kill()
        pytest.fail("the orphaned worker kept running (it took its new parent for its agent)")
