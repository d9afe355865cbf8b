"""ZeroMQ ``ipc://`` endpoints for paths of any length. Torch-free.

A Unix socket's path must fit ``sockaddr_un.sun_path`` (107 bytes on Linux, 103 on macOS:
``zmq.IPC_PATH_MAX_LEN``); binding a longer one fails (``ZMQError: ipc path ... is longer than
107 characters``). The agent's sockets live under its state directory (a local run's: inside the
run directory) and ``$TMPDIR``, either of which can be deep. :func:`ipc_endpoint` keeps a path that
fits and maps a longer one, deterministically, to a short name in a private directory of this
user under ``/tmp``, so the process that binds and every client that connects (``spotlight-agent
revoke``, ``add-gpu``) compute the same endpoint from the same path.
"""

from __future__ import annotations

import hashlib
import os
import stat

import zmq

IPC_PATH_MAX_BYTES: int = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 103
"""The longest socket path this system's ZeroMQ can bind (``zmq.IPC_PATH_MAX_LEN``)."""

SHORT_ROOT = "/tmp"
"""Where the private directory of long paths' sockets goes (``spotlight-ipc-<uid>``)."""


class IpcPathError(OSError):
    """The private socket directory exists but is not this user's alone."""


def short_dir(*, create: bool = True) -> str:
    """``/tmp/spotlight-ipc-<uid>``: created mode 0700 unless ``create`` is False.

    Raises:
        IpcPathError: it is a symbolic link, not a directory, another user's, or open to others
            (another user could bind a socket there first).
    """
    d = os.path.join(SHORT_ROOT, f"spotlight-ipc-{os.getuid()}")
    if create:
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return d  # a client's look-up: nothing bound there yet
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise IpcPathError(
            f"{d}: the directory for long socket paths must be a directory of user {os.getuid()} with mode 0700 "
            f"(found mode {stat.filemode(st.st_mode)}, owner {st.st_uid}); remove it, or use a shorter "
            "$SPOTLIGHT_AGENT_STATE / $TMPDIR"
        )
    return d


def ipc_endpoint(path: str | os.PathLike, *, create: bool = True) -> str:
    """``ipc://<path>`` when ``path`` fits a Unix socket address, else ``ipc://`` of a name in
    :func:`short_dir` derived from the absolute path (the same for every process). ``create``:
    make the short directory if needed (the side that binds; a client passes False)."""
    p = os.path.abspath(os.fspath(path))
    if len(os.fsencode(p)) <= IPC_PATH_MAX_BYTES:
        return f"ipc://{p}"
    digest = hashlib.sha256(os.fsencode(p)).hexdigest()[:24]
    return f"ipc://{short_dir(create=create)}/{digest}.sock"


def ipc_path(endpoint: str) -> str:
    """The socket file of an ``ipc://`` endpoint."""
    if not endpoint.startswith("ipc://"):
        raise ValueError(f"not an ipc:// endpoint: {endpoint!r}")
    return endpoint[len("ipc://") :]
