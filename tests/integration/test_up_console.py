"""What `spotlight up`'s console says, as a user runs it: which Planner profile the run uses and
why, and, when a Train Worker dies, its exception and the last lines of its log (the console
said only "error: train worker rank 0 exited with code 1" while the cause stayed in
``logs/trainer-0.log``).

A real `spotlight up` (subprocess) and a real Train Worker, made to fail as a full disk would:
its upload spool (``tensor_store/spool``) cannot be created, so publishing v0 raises.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TOY = REPO / "examples" / "jpeg-toy" / "config.toml"


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    from spotlight.config import load_config
    from spotlight.studies.profiling import config_key

    rd = tmp_path_factory.mktemp("run")
    profile = {
        "version": 1,
        "config_key": config_key(load_config(TOY)),
        "created_unix_s": 1.0e9,
        "t_step_s": {"cpu/sp1": 0.004},
        "steps": [{"cache_threshold": 0.0, "effective_steps": 10.0, "cost_steps": 10.0, "accuracy": 1.0}],
    }
    (rd / "profile.json").write_text(json.dumps(profile))
    (rd / "tensor_store").mkdir()
    (rd / "tensor_store" / "spool").write_text("a file where the trainer's spool directory goes\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="300")
    res = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "up", "--config", str(TOY), "--run-dir", str(rd)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=rd,
    )
    return rd, res


def test_the_console_names_the_profile_the_run_uses(failed_run):
    rd, res = failed_run
    line = next((x for x in res.stdout.splitlines() if x.startswith("planner profile ")), None)
    assert line is not None, res.stdout + res.stderr
    assert line.startswith(f"planner profile {rd / 'profile.json'} (from the run directory; measured "), line


def test_a_dead_trainers_exception_and_log_reach_the_console(failed_run):
    rd, res = failed_run
    assert res.returncode == 1, res.stdout + res.stderr
    assert not any(x.startswith("error: ") for x in res.stdout.splitlines()), res.stdout  # errors go to stderr
    out = res.stderr.splitlines()
    spool = rd / "tensor_store" / "spool"
    first = next(i for i, x in enumerate(out) if x.startswith("error: "))
    assert (
        out[first]
        == f"error: train worker rank 0 exited with code 1: FileExistsError: [Errno 17] File exists: '{spool}'"
    )
    assert out[first + 1] == f"  last lines of {rd / 'logs' / 'trainer-0.log'}:"
    tail = list(itertools.takewhile(lambda x: x.startswith("    "), out[first + 2 :]))
    assert tail[0] == "    Traceback (most recent call last):" and len(tail) <= 12, res.stderr
    assert tail[-1] == f"    FileExistsError: [Errno 17] File exists: '{spool}'", res.stderr
    saved = json.loads((rd / "status.json").read_text())
    assert saved["error"] == out[first][len("error: ") :]  # one line in the run's status
