"""An agent whose state directory and ``$TMPDIR`` are deep binds its sockets (was: ``ZMQError: ipc
path ... is longer than 107 characters`` at start-up; a local run's agents keep their state in
``<run_dir>/agents``, so a run directory a few levels down was enough). Real ZeroMQ sockets; the
agent's control requests answered in process."""

from __future__ import annotations

import json
import shutil
import tempfile

import zmq

from agent.main import AgentDaemon
from spotlight.net import ipc
from spotlight.net.agent_paths import control_endpoint
from spotlight.net.security import add_client, init_keys, load_client_keys
from tests.factories import deep_dir


def test_agent_sockets_in_deep_directories(tmp_path, monkeypatch):
    short = tempfile.mkdtemp(prefix="ipc-", dir="/tmp")
    monkeypatch.setattr(ipc, "SHORT_ROOT", short)
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(deep_dir(tmp_path / "state")))
    monkeypatch.setattr(tempfile, "tempdir", str(deep_dir(tmp_path / "tmp")))
    init_keys(tmp_path / "keys")
    add_client(tmp_path / "keys", "agent", "spot-a")
    d = AgentDaemon(
        "127.0.0.1:9", [0], keys=load_client_keys(tmp_path / "keys", role="agent"), node_id="n", warm_spare=False
    )
    try:
        assert len(ipc.ipc_path(d.worker_endpoint)) <= ipc.IPC_PATH_MAX_BYTES
        d._take_node_state()  # binds the control socket, as after registration
        client = zmq.Context.instance().socket(zmq.REQ)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(control_endpoint("n", create=False))  # what `spotlight-agent revoke` connects to
        client.send(json.dumps({"op": "status"}).encode())
        assert d.control.poll(10_000)
        assert d.control.recv_multipart()[-1] == b'{"op": "status"}'
        client.close()
    finally:
        for s in (d.coord, d.workers_sock, d.control):
            s.close(linger=0)
        d._remove_control_socket()
        shutil.rmtree(short)
