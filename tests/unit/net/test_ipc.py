"""Unix-socket endpoints for deep paths (spotlight/net/ipc.py), with real ZeroMQ sockets.

Was: an agent whose state directory (a local run's: ``<run_dir>/agents``) or ``$TMPDIR`` was deep
died at its first bind with ``ZMQError: ipc path ... is longer than 107 characters``, and the run
waited for agents that never came."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import tempfile

import pytest
import zmq

from spotlight.net import ipc
from spotlight.net.agent_paths import control_endpoint
from tests.factories import deep_dir


@pytest.fixture
def short_root(monkeypatch):
    """Long paths' sockets in a folder of this test's (short, as /tmp is), removed after it."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))
    monkeypatch.setattr(ipc, "SHORT_ROOT", str(root))
    yield root
    shutil.rmtree(root)


def _round_trip(endpoint: str) -> bytes:
    ctx = zmq.Context.instance()
    server, client = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    try:
        server.bind(endpoint)
        client.connect(endpoint)
        client.send(b"ping")
        assert server.poll(10_000)
        server.send(server.recv() + b" pong")
        assert client.poll(10_000)
        return client.recv()
    finally:
        client.close(linger=0)
        server.close(linger=0)


def test_a_short_path_is_kept(tmp_path, short_root):
    path = tmp_path / "x.sock"
    assert ipc.ipc_endpoint(path) == f"ipc://{path}"
    assert ipc.ipc_path(ipc.ipc_endpoint(path)) == str(path)
    assert not any(short_root.iterdir())


def test_a_long_path_binds_under_a_private_short_name(tmp_path, short_root):
    path = deep_dir(tmp_path) / "control.sock"
    assert len(str(path)) > ipc.IPC_PATH_MAX_BYTES
    with pytest.raises(zmq.ZMQError):  # what the agent did before
        zmq.Context.instance().socket(zmq.REP).bind(f"ipc://{path}")
    endpoint = ipc.ipc_endpoint(path)
    assert len(ipc.ipc_path(endpoint)) <= ipc.IPC_PATH_MAX_BYTES
    # a client computes the same endpoint without creating anything
    assert ipc.ipc_endpoint(path, create=False) == endpoint
    assert ipc.ipc_endpoint(deep_dir(tmp_path / "other") / "control.sock") != endpoint
    assert _round_trip(endpoint) == b"ping pong"
    private = short_root / f"spotlight-ipc-{os.getuid()}"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


def test_a_private_directory_open_to_others_is_refused(tmp_path, short_root):
    private = short_root / f"spotlight-ipc-{os.getuid()}"
    private.mkdir(mode=0o777)
    private.chmod(0o777)
    with pytest.raises(ipc.IpcPathError, match="mode 0700"):
        ipc.ipc_endpoint(deep_dir(tmp_path / "one") / "control.sock")
    private.rmdir()
    (short_root / "elsewhere").mkdir()
    private.symlink_to(short_root / "elsewhere")
    with pytest.raises(ipc.IpcPathError, match="mode 0700"):
        ipc.ipc_endpoint(deep_dir(tmp_path / "two") / "control.sock")


def test_an_agent_control_socket_in_a_deep_state_directory(tmp_path, short_root, monkeypatch):
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(deep_dir(tmp_path)))
    endpoint = control_endpoint("spot-0")
    assert endpoint == control_endpoint("spot-0", create=False)
    assert _round_trip(endpoint) == b"ping pong"
