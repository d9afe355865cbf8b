"""Listen ports chosen now and bound a moment later (a rendezvous, a master port).

A port taken from ``bind(0)`` comes from the kernel's ephemeral range, the range an outgoing
connection's local port is drawn from. Between choosing it and binding it, any connection
the node opens (a store or gloo client, a ZeroMQ peer, an HTTP request) can take it, and the
bind then fails with "Address already in use". :func:`listen_ports` chooses below that range
instead, where only a listener can be.
"""

from __future__ import annotations

import os
import pathlib
import random
import socket
import time

EPHEMERAL_RANGE_FILE = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_LOW = 20000
"""Ports are chosen from ``[LISTEN_PORTS_LOW, start of the ephemeral range)``."""


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; else its default)."""
    try:
        lo, hi = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def listen_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports on ``host`` that were free a moment ago (all held while choosing),
    below the ephemeral range; ``bind(0)`` ports where the range leaves under 1 000 below it.

    Raises:
        OSError: not ``n`` free ports found in 100·n tries.
    """
    lo, _ = ephemeral_port_range()
    socks: list[socket.socket] = []
    try:
        if lo - LISTEN_PORTS_LOW < 1000:
            for _ in range(n):
                s = socket.socket()
                s.bind((host, 0))
                socks.append(s)
            return [s.getsockname()[1] for s in socks]
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        ports: list[int] = []
        for _ in range(100 * n):
            if len(ports) == n:
                break
            port = rng.randrange(LISTEN_PORTS_LOW, lo)
            if port in ports:
                continue
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        if len(ports) < n:
            raise OSError(f"found only {len(ports)} of {n} free ports on {host} in {LISTEN_PORTS_LOW}..{lo - 1}")
        return ports
    finally:
        for s in socks:
            s.close()


def listen_port(host: str = "127.0.0.1") -> int:
    """One port of :func:`listen_ports`."""
    return listen_ports(1, host)[0]
