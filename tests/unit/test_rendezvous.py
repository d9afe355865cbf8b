"""The rendezvous store of SP groups and Train Workers listens only on the asked host
(spotlight/workers/rendezvous.py)."""

from __future__ import annotations

import datetime
import socket
import threading

import psutil
import torch
import torch.distributed as dist

from spotlight.config import ModelConfig
from spotlight.models.dit import build_transformer
from spotlight.workers.rendezvous import bound_store
from spotlight.workers.sp_group import GroupSpec, SPGroupMember

TIMEOUT = datetime.timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_plain_tcpstore_listens_on_every_interface():
    """Why bound_store exists: torch binds the wildcard address whatever host_name says."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=TIMEOUT)
    try:
        assert _listening(port) & {"::", "0.0.0.0"}, _listening(port)
    finally:
        del store


def test_bound_store_listens_on_loopback_only_and_serves_other_ranks():
    port = _free_port()
    box = {}
    th = threading.Thread(target=lambda: box.update(master=bound_store("127.0.0.1", port, 0, 2, TIMEOUT)))
    th.start()  # rank 0 waits for rank 1 to connect
    client = bound_store("127.0.0.1", port, 1, 2, TIMEOUT)
    th.join(60)
    master = box["master"]
    assert _listening(port) == {"127.0.0.1"}
    client.set("k", "v")
    assert master.get("k") == b"v"
    del client, master


def test_sp_group_rendezvous_listens_on_loopback_only():
    port = _free_port()
    m = SPGroupMember(ModelConfig(), "w0", torch.device("cpu"), timeout_s=60)
    seen = {}
    real = dist.init_process_group

    def spy(*a, **kw):  # inspect the sockets while the group is being formed
        out = real(*a, **kw)
        seen["ips"] = _listening(port)
        return out

    dist.init_process_group = spy
    try:
        m.form(GroupSpec(members=("w0",), master_addr="127.0.0.1", master_port=port, generation=1),
               state_dict=build_transformer(ModelConfig(), 384).state_dict(), version=0)
    finally:
        dist.init_process_group = real
        m.leave()
    assert seen["ips"] == {"127.0.0.1"}
