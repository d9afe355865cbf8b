"""Listen ports (spotlight/net/ports.py, tests/factories.py): chosen where no outgoing connection can take them."""

from __future__ import annotations

import socket

from spotlight.net.ports import LISTEN_PORTS_LOW, ephemeral_port_range
from tests.factories import free_port, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    lo, _ = ephemeral_port_range()
    ports = free_ports(8) + [free_port()]
    assert len(set(ports[:8])) == 8
    if lo - LISTEN_PORTS_LOW >= 1000:
        # an outgoing connection's local port comes from [lo, hi]: it can never take these
        assert all(LISTEN_PORTS_LOW <= p < lo for p in ports)
    for p in ports[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
