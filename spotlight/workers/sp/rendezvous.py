"""A torch.distributed rendezvous store that listens only where it was asked to.

``dist.init_process_group(init_method="tcp://127.0.0.1:PORT")`` (and a plain
``dist.TCPStore("127.0.0.1", PORT, is_master=True)``) makes rank 0's store server listen on
every interface (``::``, checked with torch 2.13: the host name is used only by clients), so the
unauthenticated store of an SP group or of the Train Workers would be reachable from the
network (DESIGN.md §9).  :func:`bound_store` binds the listening socket itself, to the asked
host only, and hands it to ``TCPStore`` through ``master_listen_fd``; pass the result as
``store=`` to ``dist.init_process_group``.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch.distributed as dist

PROBE_INTERVAL_S = 0.002


def wait_listening(host: str, port: int, timeout_s: float) -> bool:
    """Wait until something listens on ``host:port`` (probing every :data:`PROBE_INTERVAL_S`).

    torch's ``TCPStore`` client retries a refused connection with a growing back-off (up to
    about a second here): a member that reaches the rendezvous before rank 0 (a new worker
    joining a leader that is finishing its denoising step) would connect up to that long after
    rank 0 listens. Probing first lets it connect right away. Returns False after
    ``timeout_s`` (the store client then reports the failure itself).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.01, min(1.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(PROBE_INTERVAL_S)


def bound_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> "dist.TCPStore":
    """Rendezvous store for ``rank`` of ``world_size``; rank 0 serves it on ``host:port`` only.

    Args:
        host: address to listen on (rank 0) and to connect to (others), e.g. ``127.0.0.1``.
        port: TCP port (> 0; rank 0 binds it, so it must be free on ``host``).
        timeout: how long clients retry connecting and the server waits for all ranks.

    Raises:
        OSError: rank 0 cannot bind ``host:port`` (in use, or not a local address).
        RuntimeError / DistStoreError: the store could not be reached within ``timeout``.
        ValueError: ``port`` is not in 1..65535.
    """
    if not 0 < int(port) < 65536:
        raise ValueError(f"port must be 1..65535, got {port}")
    if rank != 0:
        wait_listening(host, port, timeout.total_seconds())
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family, stype, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(max(128, world_size))
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the listening socket from here on
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, master_listen_fd=fd, use_libuv=True)
