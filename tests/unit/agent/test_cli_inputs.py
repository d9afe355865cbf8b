"""What ``spotlight-agent`` accepts on its command line, control socket and revoked-GPUs file:
a GPU index the protocol refuses, a path that cannot be what the option names, a number of
seconds that is not finite, each refused before anything starts with one ``spotlight-agent:
error:`` line; and a ``join`` leaves no state directory behind that it created and that holds
nothing (a failed join left one ``<state dir>/<host>-<pid>`` per attempt).

Real processes, ZeroMQ sockets and files, or the pure functions.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading

import pytest
import zmq
from typer.testing import CliRunner

from agent.main import AgentDaemon, app, control_gpus_error, gpu_ids_error
from agent.preemption import revoke_notice, sigterm_notice
from agent.revocations import revocation_changes
from spotlight import protocol as P
from spotlight.net.security import add_client, init_keys, load_client_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MAX = 4095
"""The protocol's largest GPU index (``spotlight.protocol.MAX_GPU_INDEX``)."""
TOO_BIG = f"GPU ids are at most {MAX} (the largest the coordinator accepts), got"


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    init_keys(d)
    add_client(d, "agent", "spot-a")
    return d


def _agent(args: list[str], cwd, state, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=ROOT, **{"SPOTLIGHT_AGENT_STATE": str(state), **env})
    e.pop("SPOTLIGHT_KEYS", None)
    e.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-m", "agent.main", *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=120
    )


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("spotlight-agent: error: "), lines
    return lines[0][len("spotlight-agent: error: ") :]


def _leftovers(state) -> list[str]:
    return sorted(str(p.relative_to(state)) for p in state.rglob("*")) if state.exists() else []


# ---------------------------------------------------------------- 1. GPU indices the protocol refuses


def test_the_agents_gpu_bound_is_the_protocols():
    """Was: add-gpu --gpu 100000 was taken; every HEARTBEAT after it failed to decode at the
    coordinator ("Expected int <= 4095 - at $.workers[1].gpus[0]"), so the node timed out."""

    def heartbeat(g: int) -> P.Heartbeat:
        return P.Heartbeat(node_id="n", workers=[P.WorkerInfo(worker_id="n/gpu", gpus=[g])], gpus=[0, g])

    assert P.MAX_GPU_INDEX == MAX
    assert P.decode(P.encode(heartbeat(MAX)))[1].gpus == [0, MAX]
    with pytest.raises(P.ProtocolError, match=f"<= {MAX}"):
        P.decode(P.encode(heartbeat(MAX + 1)))
    assert gpu_ids_error([0, MAX]) is None
    err = gpu_ids_error([0, 100000])
    assert err is not None and f"at most {MAX}" in err and "[100000]" in err
    for cmd in ("add", "revoke"):
        assert f"at most {MAX}" in control_gpus_error(cmd, [100000], [0])


def test_a_control_request_past_the_cli_is_refused_too():
    """A raw request on the control socket (not through the CLI) with index 100000: nothing added."""

    class Sock:
        def __init__(self, req):
            self.req, self.sent = json.dumps(req).encode(), []

        def recv(self):
            return self.req

        def send(self, data):
            self.sent.append(json.loads(data))

    class Agent:
        def __init__(self, req):
            self.control, self.gpus, self.visible_devices, self.grace_s = Sock(req), [0], None, 10.0
            self.changed = []

        def add_gpus(self, gpus):
            self.changed.append(gpus)
            return [f"n/gpu{g}" for g in gpus]

        def on_notice(self, notice):
            self.changed.append(notice)

    for req in ({"cmd": "add", "gpus": [100000]}, {"cmd": "revoke", "gpus": [0], "grace_s": math.inf}):
        a = Agent(req)
        AgentDaemon.on_control(a)
        (reply,) = a.control.sent
        assert reply["ok"] is False and a.changed == [] and a.gpus == [0], reply


def test_the_revoked_gpus_file_refuses_an_index_no_node_can_hold():
    ch = revocation_changes(f"1 {MAX + 1}", held=[0, 1], revoked_by_file=set())
    assert ch.error and f"0 to {MAX}" in ch.error and ch.revoke == ()
    assert revocation_changes(f"1 {MAX}", held=[0, 1], revoked_by_file=set()).revoke == (1,)


@pytest.mark.procs
def test_add_gpu_beyond_the_bound_never_reaches_the_live_agent(tmp_path):
    """A live agent's control socket (a REP that would say yes): `add-gpu --gpu 100000` is refused
    by the CLI with one line and exit 2, and the agent hears nothing."""
    state = tmp_path / "state"
    (state / "spot-0").mkdir(parents=True)
    rep = zmq.Context.instance().socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(f"ipc://{state / 'spot-0' / 'control.sock'}")
    heard: list[dict] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if rep.poll(50):
                heard.append(json.loads(rep.recv()))
                rep.send(json.dumps({"ok": True, "started": ["spot-0/gpu100000"], "gpus": [0, 100000]}).encode())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for cmd in ("add-gpu", "revoke"):
            proc = _agent([cmd, "--gpu", "100000", "--node-id", "spot-0", "--state-dir", str(state)], tmp_path, state)
            assert proc.returncode == 2, proc.stderr
            assert _one_error_line(proc) == f"--gpu: {TOO_BIG} [100000]"
        assert heard == []
        ok = _agent(["add-gpu", "--gpu", str(MAX), "--node-id", "spot-0", "--state-dir", str(state)], tmp_path, state)
        assert ok.returncode == 0 and heard == [{"cmd": "add", "gpus": [MAX]}], ok.stderr  # the bound itself passes
    finally:
        stop.set()
        t.join()
        rep.close(linger=0)


@pytest.mark.procs
def test_join_beyond_the_bound_fails_before_anything_starts(tmp_path, keys_dir):
    state = tmp_path / "state"
    args = ["join", "-c", "127.0.0.1:9", "--gpus", f"0,{MAX + 1}", "--keys", str(keys_dir), "--register-timeout-s", "1"]
    proc = _agent(args, tmp_path, state)
    assert proc.returncode == 2, proc.stderr
    assert _one_error_line(proc) == f"--gpus: {TOO_BIG} [{MAX + 1}]"
    assert not state.exists()


@pytest.mark.procs
def test_join_with_more_gpus_than_a_node_registers_fails_before_anything_starts(tmp_path, keys_dir):
    """Was: `--gpus 0,…,99` connected and was only then refused by the coordinator ("gpus must
    be 1-64 distinct indices")."""
    from spotlight.protocol import MAX_GPUS_PER_NODE

    state = tmp_path / "state"
    gpus = ",".join(str(g) for g in range(MAX_GPUS_PER_NODE + 1))
    args = ["join", "-c", "127.0.0.1:9", "--gpus", gpus, "--keys", str(keys_dir), "--register-timeout-s", "1"]
    proc = _agent(args, tmp_path, state)
    assert proc.returncode == 2, proc.stderr
    assert _one_error_line(proc) == (
        f"--gpus lists {MAX_GPUS_PER_NODE + 1} GPUs; one node registers at most {MAX_GPUS_PER_NODE}"
    )
    assert not state.exists()


@pytest.mark.procs
@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["--gpus", "0,,1"], "--gpus: '0,,1' has an empty element"),
        (["--gpus", "1,1"], "--gpus must list distinct non-negative indices, got '1,1'"),
        (["--cloud", "oracle"], "--cloud: unknown cloud 'oracle': expected one of aws, gcp, azure, none"),
    ],
    ids=["empty-element", "repeated", "unknown-cloud"],
)
def test_join_refuses_its_gpus_and_cloud_in_one_line_like_its_other_options(tmp_path, keys_dir, args, want):
    """Was: typer's usage lines and a boxed "Invalid value" before the reason, where every other
    refusal of join's input is one `spotlight-agent: error:` line."""
    state = tmp_path / "state"
    proc = _agent(["join", "-c", "127.0.0.1:9", "--keys", str(keys_dir), *args], tmp_path, state)
    assert proc.returncode == 2, proc.stderr
    assert _one_error_line(proc).startswith(want), proc.stderr
    assert "Usage" not in proc.stderr and not _leftovers(state)


@pytest.mark.parametrize("text", ["0,,1", "0,", ",1", ","])
def test_a_gpu_list_with_an_empty_element_is_refused(text):
    """Was: `join --gpus 0,,1` and `init --reserved-rollout-gpus 0,,1` dropped the empty element
    silently (a typo that loses a GPU); `init --reserved-rollout-gpus ""` still means none."""
    from agent.main import _parse_gpus
    from spotlight.cli import app as spotlight_app

    with pytest.raises(ValueError, match="has an empty element; give comma-separated indices"):
        _parse_gpus(text)
    res = CliRunner().invoke(spotlight_app, ["init", "--reserved-rollout-gpus", text])
    assert res.exit_code == 2 and "--reserved-rollout-gpus: " in res.stderr and "empty element" in res.stderr
    assert res.stdout == "", res.output
    assert _parse_gpus(" 0, 1 ") == [0, 1]


def test_init_refuses_a_reserved_rollout_gpu_beyond_the_bound():
    from spotlight.cli import app as spotlight_app

    res = CliRunner().invoke(spotlight_app, ["init", "--reserved-rollout-gpus", f"0,{MAX + 1}"])
    assert res.exit_code == 2 and f"at most {MAX}" in res.stderr and res.stdout == "", res.output
    assert CliRunner().invoke(spotlight_app, ["init", "--reserved-rollout-gpus", f"0,{MAX}"]).exit_code == 0


# ---------------------------------------------------------------- 2. paths that cannot be what the option names


@pytest.mark.procs
@pytest.mark.parametrize(
    ("args", "env", "want"),
    [
        (["--weights-dir", "afile"], {}, "--weights-dir afile: not a directory"),
        (["--weights-dir", "afile/sub"], {}, "--weights-dir afile/sub: {tmp}/afile is not a directory"),
        (["--log-file", "adir"], {}, "--log-file adir: a directory, not a file"),
        (["--log-file", "afile/agent.log"], {}, "--log-file afile/agent.log: {tmp}/afile is not a directory"),
        (["--revoked-gpus-file", "adir"], {}, "--revoked-gpus-file adir: a directory, not a file"),
        (["--log-level", "loud"], {}, "--log-level: unknown log level 'LOUD': expected DEBUG, INFO, WARNING or ERROR"),
        (
            [],
            {"SPOTLIGHT_AGENT_STATE": "afile"},
            "agent state directory afile ($SPOTLIGHT_AGENT_STATE): not a directory",
        ),
        (
            [],
            {"SPOTLIGHT_AGENT_STATE": "afile/state"},
            "agent state directory afile/state ($SPOTLIGHT_AGENT_STATE): {tmp}/afile is not a directory",
        ),
    ],
    ids=[
        "weights-file",
        "weights-under-file",
        "log-dir",
        "log-under-file",
        "revoked-dir",
        "log-level",
        "state-file",
        "state-under-file",
    ],
)
def test_a_path_that_cannot_serve_is_one_line_before_anything_starts(tmp_path, keys_dir, args, env, want):
    """Was: --weights-dir afile (a file) was a FileExistsError traceback, after the state directory
    had been made."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    state = tmp_path / "state"
    proc = _agent(
        [
            "join",
            "-c",
            "127.0.0.1:9",
            "--node-id",
            "spot-a",
            "--keys",
            str(keys_dir),
            "--register-timeout-s",
            "1",
            *args,
        ],
        tmp_path,
        state,
        **env,
    )
    assert proc.returncode == 2, proc.stderr
    assert _one_error_line(proc) == want.format(tmp=tmp_path)
    assert "registering" not in proc.stderr and not state.exists()
    assert (tmp_path / "afile").read_text() == "x" and list((tmp_path / "adir").iterdir()) == []


@pytest.mark.procs
def test_keys_that_are_a_file_say_so(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = _agent(["join", "-c", "127.0.0.1:9", "--keys", "afile"], tmp_path, tmp_path / "state")
    assert proc.returncode == 2 and _one_error_line(proc).startswith("--keys afile: not a directory"), proc.stderr


def test_make_dir_names_what_is_in_the_way_and_leaves_nothing(tmp_path):
    from agent.main import make_dir, remove_made_dirs

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="^not a directory$"):
        make_dir(tmp_path / "afile")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'afile'} is not a directory$"):
        make_dir(tmp_path / "afile" / "a" / "b")
    made = make_dir(tmp_path / "a" / "b" / "c")
    assert made == [tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    assert (tmp_path / "a" / "b" / "c").stat().st_mode & 0o777 == 0o700
    assert make_dir(tmp_path / "a" / "b") == []  # there already: not this caller's to remove
    (tmp_path / "a" / "b" / "handled-notices.json").write_text("{}")  # state worth keeping
    remove_made_dirs(made)
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["handled-notices.json"]
    (tmp_path / "a" / "b" / "handled-notices.json").unlink()
    remove_made_dirs(made)
    assert not (tmp_path / "a").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_make_dir_refuses_a_directory_it_cannot_write(tmp_path):
    from agent.main import make_dir

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        with pytest.raises(ValueError, match="^not writable$"):
            make_dir(ro)
        with pytest.raises(ValueError, match=f"^cannot create it: {ro} is not writable$"):
            make_dir(ro / "sub")
    finally:
        ro.chmod(0o700)


# ---------------------------------------------------------------- 3. what a join leaves behind


@pytest.mark.procs
def test_failed_joins_leave_no_state_directory_behind(tmp_path, keys_dir):
    """Was: every failed join (no coordinator; a bad --weights-dir) left <state>/<host>-<pid>."""
    state = tmp_path / "state"
    state.mkdir()  # the operator's: it stays
    (tmp_path / "afile").write_text("x")
    for extra in (["--register-timeout-s", "0.3"], ["--register-timeout-s", "0.3"], ["--weights-dir", "afile"]):
        proc = _agent(["join", "-c", "127.0.0.1:9", "--keys", str(keys_dir), *extra], tmp_path, state)
        assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    assert state.is_dir() and _leftovers(state) == []
    fresh = tmp_path / "fresh" / "state"  # created by the join: removed again
    proc = _agent(
        ["join", "-c", "127.0.0.1:9", "--keys", str(keys_dir), "--register-timeout-s", "0.3"], tmp_path, fresh
    )
    assert proc.returncode == 1 and not (tmp_path / "fresh").exists(), proc.stderr


@pytest.mark.procs
def test_a_join_keeps_a_state_directory_that_holds_something(tmp_path, keys_dir):
    """The node's state directory existed (e.g. holds the handled-notice ledger): untouched."""
    state = tmp_path / "state"
    (state / "spot-a").mkdir(parents=True)
    (state / "spot-a" / "handled-notices.json").write_text('{"version": 1, "keys": []}')
    proc = _agent(
        ["join", "-c", "127.0.0.1:9", "--node-id", "spot-a", "--keys", str(keys_dir), "--register-timeout-s", "0.3"],
        tmp_path,
        state,
    )
    assert proc.returncode == 1, proc.stderr
    assert _leftovers(state) == ["spot-a", "spot-a/handled-notices.json"]


def test_an_agents_exit_removes_its_control_socket_but_not_a_successors(tmp_path, monkeypatch, keys_dir):
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "state"))
    sock = tmp_path / "state" / "n" / "control.sock"
    for successor in (False, True):
        d = AgentDaemon("127.0.0.1:9", [0], keys=load_client_keys(keys_dir, role="agent"), node_id="n")
        d._take_node_state()
        assert sock.exists()
        if successor:  # this node id was taken while it ran: the new holder bound its own socket there
            d.control.close(linger=0)
            sock.unlink()
            other = zmq.Context.instance().socket(zmq.REP)
            other.bind(f"ipc://{sock}")
        d.shutdown()
        assert sock.exists() is successor
        if successor:
            other.close(linger=0)


# ---------------------------------------------------------------- 4. seconds that are not finite


@pytest.fixture
def no_agent_env(tmp_path, monkeypatch):
    """In-process CLI runs: no keys from the environment (a join that got past its options would
    stop at once for want of keys), state under ``tmp_path`` (it must stay absent)."""
    monkeypatch.delenv("SPOTLIGHT_KEYS", raising=False)
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.mark.parametrize(
    ("cmd", "flag"),
    [
        (["revoke", "--gpu", "0", "--node-id", "x"], "--grace-s"),
        (["join", "-c", "127.0.0.1:9"], "--grace-s"),
        (["join", "-c", "127.0.0.1:9"], "--poll-interval-s"),
        (["join", "-c", "127.0.0.1:9"], "--register-timeout-s"),
        (["join", "-c", "127.0.0.1:9"], "--coordinator-timeout-s"),
    ],
)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_seconds_name_the_option(no_agent_env, cmd, flag, value):
    """Was: revoke --grace-s nan said "Input should be greater than or equal to 0"; inf was taken."""
    res = CliRunner().invoke(app, [*cmd, flag, value])
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{flag}': {value} is not a finite number of seconds (expected " in res.output, res.output
    assert not no_agent_env.exists()


@pytest.mark.parametrize("args", [["--grace-s", "-1"], ["--poll-interval-s", "0.01"], ["--poll-interval-s", "1e300"]])
def test_finite_seconds_keep_their_range(no_agent_env, args):
    """A poll interval of 1e300 s overflowed the detector thread's timer (it stopped polling)."""
    res = CliRunner().invoke(app, ["join", "-c", "127.0.0.1:9", *args])
    assert res.exit_code == 2 and f"Invalid value for '{args[0]}': {args[1]} is out of range" in res.output, res.output


def test_notices_refuse_a_grace_that_is_not_finite():
    for grace in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            sigterm_notice(grace, 0.0)
        with pytest.raises(ValueError, match="finite"):
            revoke_notice([0], grace, 0.0)
    assert revoke_notice([0], 0.0, 5.0).deadline_unix_s == 5.0


def test_a_coordinator_host_that_does_not_resolve_is_named(monkeypatch):
    """Was: `join -c no.such.host.invalid:7400` gave up with "no answer from coordinator … within
    5s", as for a coordinator that is down."""
    import socket

    from agent.main import unresolved_host_hint

    def lookup(host, port, *a, **k):
        if host == "no.such.host.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    hint = unresolved_host_hint("tcp://no.such.host.invalid:7400")
    assert hint == " (no.such.host.invalid does not resolve: Name or service not known)"
    assert unresolved_host_hint("tcp://127.0.0.1:7400") == "" and unresolved_host_hint("tcp://[::1]:7400") == ""
