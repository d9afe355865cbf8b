"""Where a node agent keeps its local state; shared by the agent daemon and the reserved
side (local mode, trace replay), so neither imports the other's entry point. Torch-free."""

from __future__ import annotations

import os
import pathlib


def state_root() -> pathlib.Path:
    """The directory of every node's state: ``$SPOTLIGHT_AGENT_STATE`` or
    ``~/.local/state/spotlight-agent``."""
    return pathlib.Path(
        os.environ.get("SPOTLIGHT_AGENT_STATE")
        or os.path.join(os.path.expanduser("~"), ".local", "state", "spotlight-agent")
    )


def state_dir(node_id: str, *, create: bool = True) -> pathlib.Path:
    """Per-node state (notice ledger, control socket): ``<state_root>/<node>`` (created, mode
    0700, unless ``create`` is False: a client only looks)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node_id)
    d = state_root() / safe
    if create:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def control_endpoint(node_id: str, *, create: bool = True) -> str:
    """The agent's local control socket (``spotlight-agent revoke`` / ``add-gpu`` talk to it;
    they pass ``create=False``: a client must not create a missing state directory):
    ``<state_dir>/control.sock``, or, where that path is too long for a Unix socket, the short
    name :func:`~spotlight.net.ipc.ipc_endpoint` maps it to."""
    from spotlight.net.ipc import ipc_endpoint

    return ipc_endpoint(state_dir(node_id, create=create) / "control.sock", create=create)
