"""The rendezvous store of SP groups and Train Workers listens only on the asked host
(spotlight/workers/sp/rendezvous.py)."""

from __future__ import annotations

import datetime
import threading

import psutil
import torch
import torch.distributed as dist

from spotlight.config import ModelConfig
from spotlight.models.dit import build_transformer
from spotlight.workers.sp.group import GroupSpec, SPGroupMember
from spotlight.workers.sp.rendezvous import bound_store
from tests.factories import free_port

TIMEOUT = datetime.timedelta(seconds=60)


def _listening(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_plain_tcpstore_listens_on_every_interface():
    """Why bound_store exists: torch binds the wildcard address whatever host_name says."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=TIMEOUT)
    try:
        assert _listening(port) & {"::", "0.0.0.0"}, _listening(port)
    finally:
        del store


def test_bound_store_listens_on_loopback_only_and_serves_other_ranks():
    port = free_port()
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


def test_sp_group_rendezvous_listens_on_loopback_only(monkeypatch):
    import pytest

    import spotlight.workers.sp.rendezvous as R

    port = free_port()
    seen = {}

    class Seen(Exception):
        pass

    real = R.bound_store

    def spy(*a, **kw):  # inspect the sockets once rank 0's store is up, then stop the form
        seen["store"] = real(*a, **kw)
        seen["ips"] = _listening(port)
        raise Seen

    monkeypatch.setattr(R, "bound_store", spy)
    peer = threading.Thread(target=lambda: seen.update(client=real("127.0.0.1", port, 1, 2, TIMEOUT)))
    peer.start()  # rank 1's store client (rank 0's store waits for it)
    m = SPGroupMember(ModelConfig(), "w0", torch.device("cpu"), timeout_s=60)
    try:
        with pytest.raises(Seen):
            m.form(
                GroupSpec(members=("w0", "w1"), master_addr="127.0.0.1", master_port=port, generation=1),
                state_dict=build_transformer(ModelConfig(), 384).state_dict(),
                version=0,
            )
    finally:
        peer.join(60)
        m.leave()
    assert seen["ips"] == {"127.0.0.1"}


def test_group_of_one_opens_no_rendezvous():
    port = free_port()
    m = SPGroupMember(ModelConfig(), "w0", torch.device("cpu"), timeout_s=60)
    try:
        m.form(
            GroupSpec(members=("w0",), master_addr="127.0.0.1", master_port=port, generation=1),
            state_dict=build_transformer(ModelConfig(), 384).state_dict(),
            version=0,
        )
        assert _listening(port) == set() and not dist.is_initialized()
    finally:
        m.leave()
