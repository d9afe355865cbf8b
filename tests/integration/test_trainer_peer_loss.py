"""A Train Worker rank killed during an update (``kill -9``): the surviving rank's collective fails,
it reports the lost peer and exits (status 4, no hang until a timeout), and the coordinator stops
the run naming the rank that was killed, not the survivor (CPU, gloo; the NCCL abort of the same
path is tests/unit/workers/train/test_peer_watch.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from tests.integration.runs import REPO, WAIT_S, Up, freeze, toy_config, train_workers, up_env
from tests.integration.waiting import wait_until


def _phase(rd) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "status", "--json", str(rd)],
        cwd=REPO,
        env=up_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        return json.loads(out.stdout).get("phase", "")
    except ValueError:
        return ""


def test_a_rank_killed_mid_update_stops_its_peer_and_the_run(tmp_path):
    conf = toy_config(tmp_path / "config.toml", **{"train.num_train_workers": 2, "eval.every": 0})
    rd = tmp_path / "run"
    up = Up(rd, ["--local", "--agents", "1", "--config", str(conf)])
    try:
        v0 = rd / "tensor_store" / "weights" / "v0.safetensors"
        wait_until(v0.is_file, "weights v0", timeout_s=WAIT_S, alive=up.alive, logs=up.logs)
        ranks = sorted(train_workers(up.proc.pid), key=lambda p: "--rank 1" in " ".join(p.cmdline()))
        assert len(ranks) == 2
        (rank1,) = freeze(ranks[1:])  # rank 0 enters the update and waits for rank 1 in a collective
        wait_until(lambda: _phase(rd) == "train", "the update to start", timeout_s=WAIT_S, alive=up.alive)
        rank1.send_signal(signal.SIGKILL)
        rc = up.finish()
        assert rc == 1, up.logs()
        err = (rd.parent / f"{rd.name}.stdout").read_text() + up.err_path.read_text()
        assert "train worker rank 1 was killed by SIGKILL" in " ".join(err.split()), up.logs()
        log0 = (rd / "logs" / "trainer-0.log").read_text()
        assert "rank 0 stops: another rank of the trainer group is gone" in log0, log0[-3000:]
        assert "Traceback" not in log0
    finally:
        up.close()
