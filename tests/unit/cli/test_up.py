"""`spotlight up`'s start-up checks: bad options and busy run directories are one-line errors
found before anything starts or is written (new-user trial findings)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from spotlight.cli import app

TOY = str(pathlib.Path(__file__).resolve().parents[3] / "examples" / "jpeg-toy" / "config.toml")


def _up(*args: str):
    return CliRunner().invoke(app, ["up", *args])


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--mock-cloud", "ibm", "--mock-cloud ibm: choose from aws, gcp, azure, none"),
        ("--reserved", "7400", "--reserved 7400: expected HOST:PORT"),
        ("--reserved", "127.0.0.1:99999", "--reserved 127.0.0.1:99999: expected HOST:PORT"),
        ("--trace-mode", "half", "--trace-mode half: choose from slice, full"),
        ("--timeout-s", "-5", "--timeout-s -5: must be > 0 seconds"),
        ("--timeout-s", "0", "--timeout-s 0: must be > 0 seconds"),
        ("--grace-s", "-1", "--grace-s -1: must be >= 0 seconds"),
        ("--grace-s", "nan", "--grace-s nan: must be >= 0 seconds"),
        ("--cycle-down-s", "-2", "--cycle-down-s -2: must be > 0 seconds"),
        ("--cycle-iteration-s", "0", "--cycle-iteration-s 0: must be > 0 seconds"),
        ("--reserved", "127.0.0.1:abc", "--reserved 127.0.0.1:abc: expected HOST:PORT"),
        ("--reserved", "garbage", "--reserved garbage: expected HOST:PORT"),
        ("--tracker", "mlflow", "--tracker mlflow: choose from tensorboard, wandb, none"),
    ],
)
def test_a_bad_option_is_one_line_before_anything_is_written(tmp_path, flag, value, expected):
    rd = tmp_path / "run"
    res = _up("--local", "--config", TOY, "--run-dir", str(rd), flag, value)
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [f"error: {expected}" + res.output.strip().split(expected, 1)[1]], (
        res.output
    )
    assert "Traceback" not in res.output and not rd.exists()


@pytest.mark.parametrize(("flag", "value"), [("--agents", "3"), ("--mock-cloud", "aws")])
def test_a_local_only_option_without_local_is_refused_not_ignored(tmp_path, flag, value):
    rd = tmp_path / "run"
    res = _up("--config", TOY, "--run-dir", str(rd), flag, value)
    assert res.exit_code == 2, res.output
    assert res.output.strip().startswith(f"error: {flag} needs --local"), res.output
    assert "Traceback" not in res.output and not rd.exists()


def test_a_run_whose_coordinator_still_runs_points_to_status_not_resume(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text())
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "spotlight"])
    try:
        (rd / "coordinator.json").write_text(json.dumps({"pid": proc.pid, "endpoint": "tcp://127.0.0.1:1"}))
        for args in (["--config", TOY, "--run-dir", str(rd)], ["--resume", str(rd)]):
            res = _up("--local", *args)
            assert res.exit_code == 2, res.output
            assert (
                f"still running (coordinator pid {proc.pid})" in res.output and f"spotlight status {rd}" in res.output
            ), res.output
            assert "--resume" not in res.output
    finally:
        proc.kill()
        proc.wait()


def _up_on_a_busy_port(*args: str):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        return port, _up("--config", TOY, "--reserved", f"127.0.0.1:{port}", *args)
    finally:
        busy.close()


def test_an_address_in_use_is_one_line_and_leaves_no_run_directory(tmp_path):
    """Was: a ZMQError traceback, exit 1, and a run directory with config.toml, keys/ and logs/."""
    rd = tmp_path / "run"
    port, res = _up_on_a_busy_port("--run-dir", str(rd))
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port}: address already in use", (
        res.output
    )
    assert "Traceback" not in res.output and not rd.exists()


def test_reserved_only_says_once_that_agents_is_ignored(tmp_path):
    _, res = _up_on_a_busy_port(
        "--local", "--mode", "reserved-only", "--agents", "3", "--run-dir", str(tmp_path / "run")
    )
    assert res.output.count("--agents 3 is ignored") == 1, res.output
    _, res = _up_on_a_busy_port("--local", "--mode", "reserved-only", "--run-dir", str(tmp_path / "run"))
    assert "ignored" not in res.output, res.output


def _write_final(rd: pathlib.Path) -> None:
    """What a finished run has beside its last checkpoint: the final model (a LoRA run's)."""
    (rd / "final").mkdir()
    _write_final_file(rd)


def _write_final_file(rd: pathlib.Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"lora_A": torch.zeros(2, 2)}, str(rd / "final" / "pytorch_lora_weights.safetensors"))


def _snapshot_files(rd: pathlib.Path) -> dict:
    return {
        str(p.relative_to(rd)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(rd.rglob("*")) if p.is_file()
    }


def test_resuming_a_finished_run_is_refused_and_leaves_it_untouched(tmp_path):
    """Was: "resumed … after iteration 20/20: continuing with iteration 21", then final/,
    status.json and the cost rewritten."""
    from spotlight.store.checkpoint import write_checkpoint

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text().replace("\niterations = 20\n", "\niterations = 2\n"))
    (rd / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    (rd / "status.json").write_text('{"finished": true}')
    _write_final(rd)
    write_checkpoint(rd, 1, {"iteration": 2}, keep=2)
    before = _snapshot_files(rd)
    res = _up("--local", "--resume", str(rd))
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert (
        line.startswith(f"error: {rd} is finished (2/2 iterations): model in {rd / 'final'}")
        and "--iterations N (N > 2)" in line
    ), line
    assert _snapshot_files(rd) == before


@pytest.mark.parametrize("left", [None, 0])
def test_resuming_a_run_whose_checkpoints_are_gone_is_refused_and_leaves_it_untouched(tmp_path, left):
    """Was: "no complete checkpoint; restarting the run at iteration 0", and metrics.jsonl and
    requests.jsonl emptied (or, with an older checkpoint left, silently cut back to it)."""
    from spotlight.store.checkpoint import write_checkpoint

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text())
    (rd / "metrics.jsonl").write_text("".join(f'{{"iteration": {i}}}\n' for i in range(4)))
    (rd / "requests.jsonl").write_text('{"request_id": 1}\n')
    if left is not None:
        write_checkpoint(rd, left, {"iteration": left + 1}, keep=2)
    before = _snapshot_files(rd)
    res = _up("--local", "--resume", str(rd))
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    back_to = "the checkpoint of iteration 1" if left is not None else "iteration 1 (no checkpoint is left)"
    assert text.startswith(
        f"error: --resume {rd}: metrics.jsonl records 4 iterations and the checkpoint of iteration 3"
    )
    assert f"resuming would go back to {back_to}" in text, text
    assert _snapshot_files(rd) == before


def test_resuming_without_the_trainer_checkpoint_it_needs_is_refused_and_leaves_it_untouched(tmp_path):
    """Was: metrics.jsonl and requests.jsonl cut back, then the Train Worker failed on the
    missing checkpoints/train/vNNNNNN (a trainer checkpoint deleted, or pruned once the newest run
    checkpoint was deleted)."""
    from spotlight.cli.up_preflight import _trainer_checkpoint_gone
    from spotlight.store.checkpoint import train_checkpoint_dir, write_checkpoint

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text())
    (rd / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    write_checkpoint(rd, 1, {"iteration": 2, "version": 2}, keep=2)
    before = _snapshot_files(rd)
    res = _up("--local", "--resume", str(rd))
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert text.startswith(
        f"error: --resume {rd}: its last run checkpoint (after iteration 2) continues from weights v2"
    )
    assert _snapshot_files(rd) == before
    (train_checkpoint_dir(rd) / "v000002").mkdir(parents=True)
    (train_checkpoint_dir(rd) / "v000002" / ".metadata").write_bytes(b"dcp")
    assert _trainer_checkpoint_gone(rd) is None


def test_resuming_after_a_crash_before_the_first_checkpoint_is_not_refused(tmp_path):
    from spotlight.cli.up_preflight import _checkpoints_gone

    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    assert _checkpoints_gone(tmp_path, 1) is None
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    assert "checkpoint of iteration 1 was written" in _checkpoints_gone(tmp_path, 1)
    assert _checkpoints_gone(tmp_path, 2) is None  # iteration 2's checkpoint may not have been written
    assert _checkpoints_gone(tmp_path / "nowhere", 1) is None


def test_a_resumed_run_keeps_the_earlier_run_time_and_events(tmp_path):
    """Was: every resume restarted status.json's elapsed time and event log from zero."""
    from spotlight.coordinator.recorder import earlier_sessions
    from spotlight.core.events import EventLog

    earlier = [
        {"t_s": 1.0, "kind": "join", "node": "spot-0", "detail": "1 spot GPU"},
        {"t_s": 40.0, "kind": "finish", "node": "", "detail": "interrupted"},
    ]
    ckpt = {"elapsed_s": 30.0, "events": earlier[:1]}
    assert earlier_sessions(tmp_path, ckpt) == (30.0, earlier[:1])  # no status.json: the checkpoint's
    (tmp_path / "status.json").write_text(json.dumps({"elapsed_s": 42.5, "events": earlier}))
    assert earlier_sessions(tmp_path, ckpt) == (42.5, earlier)  # the later snapshot wins
    assert earlier_sessions(tmp_path, {}) == (42.5, earlier)  # a checkpoint of an older version
    log = EventLog(start_s=1000.0 - 42.5)  # this coordinator started at 1000 s on its clock
    log.extend(earlier)
    log.append(1000.0, "resume", "", "after iteration 1/2")
    assert [(e["t_s"], e["kind"]) for e in log.to_list()] == [(1.0, "join"), (40.0, "finish"), (42.5, "resume")]


def test_the_stop_hint_of_a_replay_says_the_replay_does_not_continue():
    """Was: after Ctrl-C of `--preemption-cycles 1 --mock-cloud aws` the hint dropped both flags silently."""
    from spotlight.cli.up import replay_note, resume_command

    layout = dict(
        local=True,
        agents=2,
        gpus_per_agent=1,
        mock_cloud="aws",
        grace_s=20.0,
        spot_nice=5,
        reserved="127.0.0.1:0",
        keys=None,
        verbose=False,
        log_level="WARNING",
        trackers=None,
    )
    cmd = resume_command("r", **layout)
    assert "--mock-cloud aws" in cmd
    note = replay_note("--preemption-cycles", cmd)
    assert note.startswith("note: the --preemption-cycles replay does not continue on resume") and "\n" not in note
    assert "add the --trace options again" in replay_note("--trace", resume_command("r", **layout, restart=True))
    assert replay_note(None, cmd) is None


def test_a_further_ctrl_c_during_the_clean_up_is_answered_not_ignored():
    """Was: SIG_IGN, so the ~17 s of clean-up after Ctrl-C looked like a hang."""
    import signal

    from spotlight.cli.up_local import patience_handler

    said: list[str] = []
    alive = iter([3, 1])
    handler = patience_handler(lambda: next(alive), said.append)
    handler(signal.SIGINT, None)
    handler(signal.SIGINT, None)
    assert said == [
        "still stopping agents, workers and trainers (3 processes), please wait",
        "still stopping agents, workers and trainers (1 process), please wait",
    ]


def test_the_local_cluster_stops_the_agents_before_the_coordinator_closes():
    """On exit the replay stops, agents and trainers are told why and waited for, the
    coordinator closes (its last status is then final), then the trace driver's agents and
    the mock metadata servers stop; a Ctrl-C meanwhile is answered."""
    import signal
    import types

    from spotlight.cli.up_local import LocalCluster

    events, said = [], []

    class Proc:
        def __init__(self, name):
            self.name = name

        def poll(self):
            return None

        def wait(self, timeout=None):
            events.append(f"wait {self.name}")

        def terminate(self):
            events.append(f"terminate {self.name}")

    coord = types.SimpleNamespace(
        trainers=types.SimpleNamespace(procs=[Proc("trainer")]),
        shutdown_agents=lambda reason: events.append(f"shutdown ({reason})"),
        close=lambda: events.append("coordinator close"),
    )
    driver = types.SimpleNamespace(
        stop_event=types.SimpleNamespace(set=lambda: events.append("replay stops")),
        close=lambda: events.append("driver close"),
        procs=[],
    )
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with LocalCluster(types.SimpleNamespace(), coord, say=said.append) as cluster:
            cluster.procs.append(Proc("agent"))
            cluster.driver = driver
            cluster.mocks.append(types.SimpleNamespace(stop=lambda: events.append("mock stop")))
            cluster.interrupt()
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    assert events == [
        "replay stops",
        "shutdown (interrupted)",
        "wait agent",
        "wait agent",
        "wait trainer",
        "coordinator close",
        "driver close",
        "mock stop",
    ]
    assert said == ["still stopping agents, workers and trainers (2 processes), please wait"]


def test_a_run_stopped_after_its_last_checkpoint_but_before_final_is_not_finished(tmp_path):
    """Stopped during the evaluation of the final weights or the final save: its checkpoints hold
    every iteration but final/ is missing (or empty), so --resume and --resume-existing go on to
    do what is left instead of calling it finished (was: "nothing to do", and no final/ ever)."""
    from spotlight.cli.up_preflight import _continue_hint, _finished
    from spotlight.store.checkpoint import write_checkpoint

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text().replace("\niterations = 20\n", "\niterations = 2\n"))
    write_checkpoint(rd, 1, {"iteration": 2, "pending_row": {"iteration": 1}}, keep=2)
    assert _finished(rd, 2) is None and "--iterations N" not in _continue_hint(rd)
    (rd / "final").mkdir()
    assert _finished(rd, 2) is None  # an empty final/: the save did not get far
    _write_final_file(rd)
    assert _finished(rd, 2).startswith(f"{rd} is finished (2/2 iterations)")


def test_a_finished_run_whose_final_is_damaged_is_not_finished(tmp_path):
    """A final/ file truncated after the save (a full disk, a hand edit): was "is finished",
    so --resume refused and the run could never save its model again while `spotlight eval`
    refused the folder. Now a resume saves it again, and says why."""
    from spotlight.cli.up_preflight import _finished
    from spotlight.coordinator.resume import damaged_final
    from spotlight.store.checkpoint import write_checkpoint

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text().replace("\niterations = 20\n", "\niterations = 2\n"))
    write_checkpoint(rd, 1, {"iteration": 2}, keep=2)
    assert damaged_final(rd) is None  # no final/ yet
    _write_final(rd)
    assert _finished(rd, 2) is not None and damaged_final(rd) is None
    weights = rd / "final" / "pytorch_lora_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    assert _finished(rd, 2) is None
    why = damaged_final(rd)
    assert why.startswith("final/ is damaged (") and str(weights) in why, why
    weights.unlink()
    (rd / "final" / "README.md").write_text("a model card, the weights gone")
    assert _finished(rd, 2) is None and damaged_final(rd).startswith("final/ is damaged (")


def test_a_finished_run_whose_final_bytes_changed_is_not_finished(tmp_path):
    """A final/ file of the right size whose bytes changed after the save (a flipped bit): its
    SHA256SUMS says so, and a resume saves it again (was: "is finished", and eval scored it)."""
    from spotlight.cli.up_preflight import _finished
    from spotlight.coordinator.resume import damaged_final
    from spotlight.store.checkpoint import write_checkpoint
    from spotlight.util.weights_file import write_digests

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text().replace("\niterations = 20\n", "\niterations = 2\n"))
    write_checkpoint(rd, 1, {"iteration": 2}, keep=2)
    _write_final(rd)
    write_digests(rd / "final")
    assert _finished(rd, 2) is not None and damaged_final(rd) is None
    weights = rd / "final" / "pytorch_lora_weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    assert _finished(rd, 2) is None
    assert damaged_final(rd).startswith(
        f"final/ is damaged ({rd / 'final'}: pytorch_lora_weights.safetensors holds other bytes"
    )


def test_resume_existing_of_a_finished_run_is_nothing_to_do_even_with_config(tmp_path):
    """The systemd unit passes --config and --resume-existing: a finished run must neither be
    re-run nor fail (Restart=on-failure would loop), and --config must not be refused."""
    from spotlight.store.checkpoint import write_checkpoint

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text().replace("\niterations = 20\n", "\niterations = 2\n"))
    (rd / "coordinator.json").write_text(json.dumps({"pid": 999999999, "endpoint": "tcp://127.0.0.1:1"}))
    _write_final(rd)
    write_checkpoint(rd, 1, {"iteration": 2}, keep=2)
    before = _snapshot_files(rd)
    res = _up("--config", TOY, "--run-dir", str(rd), "--resume-existing")
    assert res.exit_code == 0, res.output
    assert (
        res.output.strip()
        == f"{rd} is finished (2/2 iterations): model in {rd / 'final'}, metrics in {rd / 'metrics.jsonl'}: "
        "nothing to do"
    ), res.output
    assert _snapshot_files(rd) == before


def test_a_run_dir_or_keys_that_is_a_file_is_one_line_before_anything_is_printed(tmp_path):
    """Was: the run header and the prompts, then `error: keys: [Errno 20] Not a directory`."""
    f = tmp_path / "README.md"
    f.write_text("not a run\n")
    for args, flag in (
        (["--run-dir", str(f)], "--run-dir"),
        (["--run-dir", str(tmp_path / "run"), "--keys", str(f)], "--keys"),
    ):
        res = _up("--local", "--config", TOY, *args)
        assert res.exit_code == 2, res.output
        assert res.output.strip().splitlines() == [f"error: {flag} {f}: not a directory"], res.output
        assert f.read_text() == "not a run\n" and not (tmp_path / "run").exists()


def test_a_tcp_reserved_address_is_accepted_as_the_agents_form_is():
    from spotlight.cli.up_preflight import check_options

    assert check_options(mock_cloud="none", reserved="tcp://127.0.0.1:5555", trace_mode="slice") == []


def test_a_plain_start_on_a_finished_run_suggests_a_command_that_extends_it(tmp_path):
    """Was: "continue it with spotlight up --resume RUN", which a finished run refuses."""
    from spotlight.store.checkpoint import write_checkpoint

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text().replace("\niterations = 20\n", "\niterations = 2\n"))
    (rd / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    write_checkpoint(rd, 1, {"iteration": 2}, keep=2)
    _write_final(rd)
    res = _up("--local", "--config", TOY, "--run-dir", str(rd))
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert f"spotlight up --resume {rd} --iterations N (N > 2)" in line, line
    assert "continue it with" not in line
    # an unfinished run still gets the plain --resume
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text().replace("\niterations = 20\n", "\niterations = 5\n"))
    res = _up("--local", "--config", TOY, "--run-dir", str(rd))
    assert f"continue it with spotlight up --resume {rd} or" in res.output, res.output


# ---------------------------------------------------------------- --external-trainers


@pytest.mark.parametrize("flag", [("--trainer-port", "7401"), ("--trainer-timeout-s", "60")])
def test_trainer_options_without_external_trainers_are_refused(tmp_path, flag):
    rd = tmp_path / "run"
    res = _up("--config", TOY, "--run-dir", str(rd), *flag)
    assert res.exit_code == 2 and res.output.strip() == f"error: {flag[0]} needs --external-trainers", res.output
    assert not rd.exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--reserved", "127.0.0.1:7400", "--trainer-port", "7400"), "--trainer-port 7400 is the --reserved port"),
        (("--reserved", "127.0.0.1:65535"), "--reserved port 65535 leaves no port for the trainers"),
        (("--trainer-timeout-s", "0"), "--trainer-timeout-s 0: must be > 0 seconds"),
    ],
)
def test_bad_trainer_addresses_are_one_line(tmp_path, args, expected):
    rd = tmp_path / "run"
    res = _up("--config", TOY, "--run-dir", str(rd), "--external-trainers", *args)
    assert res.exit_code == 2 and res.output.strip().startswith(f"error: {expected}"), res.output
    assert not rd.exists()


def test_external_trainers_need_a_trainer_key_on_the_allow_list(tmp_path):
    from spotlight.net.security import add_client
    from tests.factories import make_keys

    keys = make_keys(tmp_path / "keys", agents=["pool"])
    rd = tmp_path / "run"
    res = _up("--config", TOY, "--run-dir", str(rd), "--keys", str(keys), "--external-trainers")
    assert res.exit_code == 2, res.output
    assert f"error: --external-trainers: the allow-list of {keys} holds no trainer key" in " ".join(res.output.split())
    assert f"spotlight keys add {keys} trainer NAME" in " ".join(res.output.split()) and not rd.exists()
    add_client(keys, "trainer", "pool")
    port, res = _up_on_a_busy_port("--run-dir", str(rd), "--keys", str(keys), "--external-trainers")
    assert res.exit_code == 2 and "trainer key" not in res.output  # the key check passed: it got to binding
    assert f"error: cannot listen on 127.0.0.1:{port} (or the trainer port 127.0.0.1:{port + 1})" in res.output


def test_the_trainer_port_is_the_reserved_port_plus_one_unless_given():
    from spotlight.cli.up import UpOptions, resume_command
    from spotlight.cli.up_preflight import UpRun

    def bind(reserved, port=None):
        opts = UpOptions.__new__(UpOptions)
        object.__setattr__(opts, "trainer_port", port)
        run = UpRun(opts=opts, cfg=None, prompt_set=None, run_dir=pathlib.Path("r"), fresh=True, resuming=False,
                    reserved=reserved, agents=0)  # fmt: skip
        return run.trainer_bind

    assert bind("0.0.0.0:7400") == "0.0.0.0:7401"
    assert bind("127.0.0.1:0") == "127.0.0.1:0"
    assert bind("0.0.0.0:7400", 9000) == "0.0.0.0:9000"
    layout = dict(local=False, agents=0, gpus_per_agent=1, mock_cloud="none", grace_s=20.0, spot_nice=5,
                  reserved="0.0.0.0:7400", keys=None, verbose=False, log_level="WARNING", trackers=None)  # fmt: skip
    cmd = resume_command("r", **layout, external_trainers=True, trainer_port=9000)
    assert cmd == "spotlight up --resume r --reserved 0.0.0.0:7400 --external-trainers --trainer-port 9000"


def test_an_sp_degree_the_checkpoint_cannot_split_is_one_line_before_anything_starts(tmp_path):
    """Qwen-Image's tiny checkpoint has 2 attention heads: SP 4 cannot work and is refused, naming
    the field, the reason and the checkpoint; SP 2 passes (its 7 text tokens are padded)."""
    from spotlight.cli.up_preflight import Stop, _check_model, _sp_degree_problem
    from spotlight.config import config_from_dict
    from spotlight.models.families import get_family
    from spotlight.models.families.qwen_image import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path / "qwen")
    model = {"family": "qwen-image", "pretrained_path": str(ckpt), "image_size": 32, "max_text_tokens": 7}
    bad = config_from_dict({"model": model, "cluster": {"sp_degree": 4}})
    with pytest.raises(Stop) as stop:
        _check_model(bad)
    assert "cluster.sp_degree = 4" in stop.value.line and "2 attention heads" in stop.value.line
    assert str(ckpt) in stop.value.line
    good = config_from_dict({"model": model, "cluster": {"sp_degree": 2, "reserved_sp_degree": 2}})
    assert _sp_degree_problem(good, get_family(good.model)) is None


def test_a_run_dir_that_cannot_be_created_is_one_line_before_anything_is_printed(tmp_path):
    """Was accepted, then failed when the run first wrote there."""
    f = tmp_path / "README.md"
    f.write_text("not a run\n")
    res = _up("--local", "--config", TOY, "--run-dir", str(f / "run"))
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        f"error: --run-dir {f / 'run'}: cannot be created ({f} is not a directory)"
    ], res.output


def _local_listing(rd: pathlib.Path, pid: int = 999999999) -> None:
    agents = {"reserved-0": {"pid": pid, "spot": False, "gpus": [0]}}
    agents |= {f"spot-{i}": {"pid": pid, "spot": True, "gpus": [0]} for i in range(3)}
    (rd / "local_agents.json").write_text(json.dumps({"coordinator": "tcp://127.0.0.1:1", "agents": agents}))


def test_a_finished_local_run_s_commands_to_go_on_start_its_agents_again(tmp_path):
    """Was: "resume with --iterations N", and `spotlight up --resume RUN --iterations 3` (no
    --local) then waited forever for the local agents, which had ended with the run."""
    from spotlight.store.checkpoint import write_checkpoint

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "config.toml").write_text(pathlib.Path(TOY).read_text().replace("\niterations = 20\n", "\niterations = 2\n"))
    (rd / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    write_checkpoint(rd, 1, {"iteration": 2}, keep=2)
    _write_final(rd)
    _local_listing(rd)
    res = _up("--local", "--resume", str(rd))
    assert res.exit_code == 2, res.output
    assert f"spotlight up --resume {rd} --local --agents 3 --iterations N (N > 2)" in res.output, res.output
    res = _up("--local", "--run-dir", str(rd))  # a plain start in it: the same command line
    assert res.exit_code == 2, res.output
    assert f"spotlight up --resume {rd} --local --agents 3 --iterations N (N > 2)" in " ".join(res.output.split())


def test_resuming_a_local_run_without_local_says_its_agents_are_gone(tmp_path):
    """The waiting line of a resumed run: a local run's agents ended with it, so it names the
    command with --local instead of promising that agents reconnect; a crashed coordinator's
    agents that still run do reconnect."""
    import os
    import types

    from spotlight.cli.up import _waiting_line

    rd = tmp_path / "run"
    rd.mkdir()
    run = types.SimpleNamespace(resuming=True, run_dir=rd, keys_dir=rd / "keys")
    coord = types.SimpleNamespace(endpoint="tcp://0.0.0.0:5555")
    assert "reconnect by themselves" in _waiting_line(run, coord)  # not a local run
    _local_listing(rd)
    line = _waiting_line(run, coord)
    assert "its local agents stopped with it" in line and f"spotlight up --resume {rd} --local --agents 3" in line
    assert "reconnect" not in line
    _local_listing(rd, pid=os.getpid())  # "alive", but not an agent: still gone
    assert "stopped with it" in _waiting_line(run, coord)


@pytest.mark.procs  # a process that looks like a local agent
def test_resuming_a_local_run_whose_agents_survived_waits_for_them(tmp_path):
    import types

    from spotlight.cli.up import _waiting_line

    rd = tmp_path / "run"
    rd.mkdir()
    run = types.SimpleNamespace(resuming=True, run_dir=rd, keys_dir=rd / "keys")
    coord = types.SimpleNamespace(endpoint="tcp://0.0.0.0:5555")
    survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "spotlight.agent.main"])
    try:
        _local_listing(rd, pid=survivor.pid)  # an agent that outlived a crashed coordinator
        assert "reconnect by themselves" in _waiting_line(run, coord)
    finally:
        survivor.kill()
        survivor.wait()


def test_ranks_over_several_nodes_need_external_trainers(tmp_path):
    """The coordinator spawns its own Train Workers on this host only: train.num_train_nodes = 2
    without --external-trainers would start both ranks here and plan each GPU's share as half a
    replica where each would hold a whole one."""
    conf = tmp_path / "two-nodes.toml"
    conf.write_text(pathlib.Path(TOY).read_text() + "\n")
    from spotlight.config import dump_config, load_config

    dump_config(load_config(conf, overrides={"train.num_train_workers": 2, "train.num_train_nodes": 2}), conf)
    rd = tmp_path / "run"
    res = _up("--local", "--config", str(conf), "--run-dir", str(rd))
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    assert "train.num_train_nodes = 2" in line and "--external-trainers" in line, line
    assert "Traceback" not in res.output and not (rd / "metrics.jsonl").exists()


def test_more_gpus_per_local_agent_than_a_node_registers_is_refused_before_the_run(tmp_path):
    """Was: `up --local --gpus-per-agent 65` created the run, both agents exited with "--gpus
    lists 65 GPUs; one node registers at most 64", and the run finished without spot GPUs, exit 0."""
    rd = tmp_path / "run"
    res = _up("--local", "--gpus-per-agent", "65", "--run-dir", str(rd))
    assert res.exit_code == 2 and "--gpus-per-agent" in res.output and "less than or equal to" in res.output, res.output
    assert not rd.exists()


def test_the_launch_line_for_external_trainers_says_the_configs_layout(tmp_path):
    """Was: "torchrun --nnodes NODES --nproc-per-node GPUS …" although the config says 2 × 1."""
    import types

    from spotlight.cli.up import _waiting_trainers_line
    from spotlight.config import load_config

    cfg = load_config(None, {"train.num_train_workers": 2, "train.num_train_nodes": 2})
    run = types.SimpleNamespace(cfg=cfg, opts=types.SimpleNamespace(trainer_timeout_s=900.0), keys_dir=tmp_path)
    coord = types.SimpleNamespace(trainers=types.SimpleNamespace(advertised_endpoint=lambda: "head:7401"))
    line = _waiting_trainers_line(run, coord)
    assert "torchrun --nnodes 2 --nproc-per-node 1 --node-rank N" in line and "--coordinator head:7401" in line, line
