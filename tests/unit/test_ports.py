"""Test listen ports (tests/factories.py): chosen where no outgoing connection can take them."""

from __future__ import annotations

import socket

from tests.factories import LISTEN_PORTS_LOW, _ephemeral_port_range, free_port, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    lo, _ = _ephemeral_port_range()
    ports = free_ports(8) + [free_port()]
    assert len(set(ports[:8])) == 8
    if lo - LISTEN_PORTS_LOW >= 1000:
        # an outgoing connection's local port comes from [lo, hi]: it can never take these
        assert all(LISTEN_PORTS_LOW <= p < lo for p in ports)
    for p in ports[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
