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

import torch.distributed as dist


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
