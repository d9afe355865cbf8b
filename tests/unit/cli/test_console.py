"""What `spotlight up` prints and where its processes' logs go."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys

from spotlight.cli.up import next_command, resume_command
from spotlight.coordinator.recorder import format_progress
from spotlight.store.checkpoint import write_checkpoint
from spotlight.util.procs import LOG_DIR_ENV, LOG_ECHO_ENV, log_file_name, spawn_logged

ROW = {
    "iteration": 0,
    "reward/mean": 0.2279,
    "reward/std": 0.3437,
    "time/rollout_s": 7.04,
    "time/train_s": 15.3,
    "time/explore_s": 15.2,
    "time/explore_critical_path_s": 2.0,
    "time/critical_path_share": 0.08,
    "spot/busy_fraction": 0.993,
    "cost/usd": 0.6049,
}


def _progress(row: dict, iterations: int) -> str:
    return format_progress(row, iterations)


def test_progress_line_tells_the_iteration_story_in_100_columns():
    line = _progress(ROW, 20)
    assert (
        line == "iter  1/20 reward +0.228  rollout 7.0s train 15s explore 15s  spot busy 99% critical 8% $0.60"
    )  # 1-based, as everywhere
    big = dict(
        ROW,
        iteration=998,
        **{
            "reward/mean": -0.5,
            "time/rollout_s": 998.0,
            "time/train_s": 999.0,
            "time/explore_s": 997.0,
            "spot/busy_fraction": 1.0,
            "time/critical_path_share": 0.05,
            "cost/usd": 999.99,
        },
    )
    assert len(_progress(big, 999)) <= 100, _progress(big, 999)
    hours = _progress(dict(big, **{"time/train_s": 3 * 3600.0, "time/rollout_s": 1500.0}), 999)
    assert "rollout 25m train 3.0h" in hours and len(hours) <= 100
    last = _progress(dict(ROW, **{"spot/busy_fraction": math.nan}), 20)  # no next batch to explore
    assert "spot busy - critical" in last and "-%" not in last and "nan" not in last  # "-", as the README says


def test_resume_command_repeats_the_local_layout():
    rd = "/tmp/my run"
    cmd = resume_command(
        rd,
        local=True,
        agents=1,
        gpus_per_agent=2,
        mock_cloud="gcp",
        grace_s=20.0,
        spot_nice=5,
        reserved="127.0.0.1:0",
        keys=None,
        verbose=True,
        log_level="warning",
        trackers=None,
    )
    assert cmd == "spotlight up --resume '/tmp/my run' --local --agents 1 --gpus-per-agent 2 --mock-cloud gcp --verbose"
    remote = resume_command(
        "r",
        local=False,
        agents=2,
        gpus_per_agent=1,
        mock_cloud="none",
        grace_s=20.0,
        spot_nice=5,
        reserved="0.0.0.0:7400",
        keys="/k",
        verbose=False,
        log_level="INFO",
        trackers=["none"],
    )
    assert remote == "spotlight up --resume r --reserved 0.0.0.0:7400 --keys /k --tracker none --log-level INFO"


LAYOUT = dict(
    local=True,
    agents=2,
    gpus_per_agent=2,
    mock_cloud="aws",
    grace_s=10.0,
    spot_nice=5,
    reserved="127.0.0.1:0",
    keys=None,
    verbose=False,
    log_level="WARNING",
    trackers=None,
)


def test_resume_command_of_a_reserved_only_run_has_no_spot_agent_flags():
    """--mode reserved-only starts no spot agent: `--agents 2 --gpus-per-agent 2 --mock-cloud aws
    --grace-s 10` in the hint described agents the resumed run would not start either."""
    assert resume_command("r", **LAYOUT, spot=False) == "spotlight up --resume r --local"
    assert (
        resume_command("r", **LAYOUT)
        == "spotlight up --resume r --local --agents 2 --gpus-per-agent 2 --mock-cloud aws --grace-s 10"
    )


def test_after_a_stop_the_hint_continues_from_the_checkpoint_or_starts_again(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "metrics.jsonl").write_text("")
    sentence, cmd = next_command(rd, iterations=5, **LAYOUT, spot=False)  # stopped before iteration 1 ended
    assert "no checkpoint" in sentence and "Start the run again" in sentence and "Continue" not in sentence
    assert cmd == f"spotlight up --config {rd}/config.toml --run-dir {rd} --local"
    (rd / "metrics.jsonl").write_text(
        '{"iteration": 0}\n'
    )  # stopped between the row and its checkpoint: a plain start would refuse the directory
    sentence, cmd = next_command(rd, iterations=5, **LAYOUT)
    assert (
        sentence.startswith("Iteration 1 was stopped before its checkpoint was written")
        and "No iteration finished" not in sentence
    )
    assert cmd.startswith(f"spotlight up --resume {rd} --local --agents 2")
    write_checkpoint(rd, 2, {"x": 1}, keep=2)  # after iteration 3
    sentence, cmd = next_command(rd, iterations=5, **LAYOUT)
    assert sentence == "Continue the run from its last complete iteration (3/5) with:"
    assert cmd == resume_command(rd, **LAYOUT)


CHILD = (
    "import logging, sys\n"
    "from spotlight.util.procs import configure_logging\n"
    "configure_logging('worker[n/gpu0]', 'worker-n/gpu0')\n"
    "logging.getLogger('x').info('hello from the child')\n"
    "print('printed', flush=True)\n"
)


def _run_child(tmp_path, echo: bool) -> tuple[str, str]:
    env = dict(
        os.environ,
        **{LOG_DIR_ENV: str(tmp_path / "logs"), LOG_ECHO_ENV: "1" if echo else "0", "PYTHONPATH": os.getcwd()},
    )
    env.pop("SPOTLIGHT_LOG_LEVEL", None)
    r, w = os.pipe()
    proc = spawn_logged(
        [sys.executable, "-c", CHILD],
        "worker-n/gpu0",
        env=env,
        **({"stdout": w, "stderr": subprocess.STDOUT} if echo else {}),
    )
    os.close(w)
    with os.fdopen(r) as f:
        terminal = f.read() if echo else ""
    assert proc.wait(timeout=60) == 0
    return terminal, (tmp_path / "logs" / "worker-n-gpu0.log").read_text()


def test_child_logs_go_to_its_file_not_the_console(tmp_path):
    assert log_file_name("spot-0/gpu0+1.r2") == "spot-0-gpu0+1.r2.log"
    code = (
        "import sys; from spotlight.util.procs import configure_logging; configure_logging('t', 'worker-n/gpu0'); "
        "import logging; logging.getLogger().info('hello from the child'); print('printed')"
    )
    env = dict(os.environ, **{LOG_DIR_ENV: str(tmp_path / "logs"), LOG_ECHO_ENV: "0", "PYTHONPATH": os.getcwd()})
    env.pop("SPOTLIGHT_LOG_LEVEL", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == ""  # nothing on the console
    text = (tmp_path / "logs" / "worker-n-gpu0.log").read_text()
    assert "t INFO hello from the child" in text and "printed" in text


def test_verbose_echoes_child_logs_and_keeps_the_file(tmp_path):
    terminal, text = _run_child(tmp_path, echo=True)
    assert "worker[n/gpu0] INFO hello from the child" in terminal
    assert "worker[n/gpu0] INFO hello from the child" in text


def test_children_ignore_ctrl_c_the_parent_stops_them(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    code = "import sys, time; print('up', flush=True); sys.stdin.readline(); print('still here', flush=True)"
    proc = spawn_logged(
        [sys.executable, "-c", code], "child", env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "up\n"
    proc.send_signal(signal.SIGINT)  # what a Ctrl-C in the terminal sends the whole process group
    out, _ = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0 and out == "still here\n"
