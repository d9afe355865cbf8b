"""``run.checkpoint_every = 2``: a local run checkpoints (coordinator and Train Workers) only after
iterations 2 and 3 (the last) of 3; with the last checkpoint gone (a crash before it was
written) ``--resume`` continues from the one before it, and the Train Worker loads the DCP
checkpoint of that iteration's weights. ``run.keep_train_checkpoints = 2`` keeps the trainer
checkpoint the simulated crash resumes from (with the default 1, the one before the last is
deleted once the last run checkpoint names the last; a real crash comes before that)."""

from __future__ import annotations

import shutil
import subprocess

from spotlight.store.checkpoint import complete_checkpoints, train_checkpoint_dir, train_versions
from tests.integration.runs import REPO, read_jsonl, toy_config, up_command, up_env


def _up(*args: str) -> subprocess.CompletedProcess:
    cmd = up_command("--local", "--agents", "1", "--timeout-s", "900", "--log-level", "INFO", *args)
    return subprocess.run(cmd, cwd=REPO, env=up_env(), capture_output=True, text=True, timeout=1000)


def test_checkpoint_every_two_then_resume_from_the_last_written(tmp_path):
    cfg = toy_config(
        tmp_path / "config.toml", **{"run.iterations": 3, "run.checkpoint_every": 2, "run.keep_train_checkpoints": 2}
    )
    rd = tmp_path / "run"
    res = _up("--config", str(cfg), "--run-dir", str(rd))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert [n for n, _ in complete_checkpoints(rd)] == [1, 2]  # iterations 2 and 3, not 1
    assert train_versions(train_checkpoint_dir(rd)) == [2, 3]  # weights after iterations 2 and 3
    trainer_log = (rd / "logs" / "trainer-0.log").read_text()
    assert trainer_log.count("saved trainer checkpoint") == 2, trainer_log[-3000:]

    # a crash after iteration 3 but before its checkpoints: the last written is iteration 2's
    shutil.rmtree(rd / "checkpoints" / "iter_000002")
    (rd / "checkpoints" / "LATEST").unlink()
    shutil.rmtree(train_checkpoint_dir(rd) / "v000003")
    shutil.rmtree(rd / "final")
    res = _up("--resume", str(rd))
    logs = res.stdout[-3000:] + res.stderr[-5000:]
    assert res.returncode == 0, logs
    assert "continuing with iteration 3 (weights v2)" in res.stdout, logs
    assert [m["iteration"] for m in read_jsonl(rd / "metrics.jsonl")] == [0, 1, 2]
    assert "loaded trainer checkpoint" in (rd / "logs" / "trainer-0.log").read_text()
    assert "v000002" in (rd / "logs" / "trainer-0.log").read_text().split("loaded trainer checkpoint")[-1][:200]
    assert (rd / "final").is_dir()
    assert train_versions(train_checkpoint_dir(rd)) == [2, 3]  # run.keep_train_checkpoints = 2
