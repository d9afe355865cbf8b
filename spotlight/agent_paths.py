"""Where a node agent keeps its local state; shared by the agent daemon and the reserved
side (local mode, trace replay), so neither imports the other's entry point. Torch-free."""

from __future__ import annotations

import os
import pathlib


def state_dir(node_id: str) -> pathlib.Path:
    """Per-node state (notice ledger, control socket): ``$SPOTLIGHT_AGENT_STATE/<node>`` or
    ``~/.local/state/spotlight-agent/<node>`` (created, mode 0700)."""
    base = os.environ.get("SPOTLIGHT_AGENT_STATE") or os.path.join(os.path.expanduser("~"), ".local", "state", "spotlight-agent")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node_id)
    d = pathlib.Path(base) / safe
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def control_endpoint(node_id: str) -> str:
    """The agent's local control socket (``spotlight-agent revoke`` / ``add-gpu`` talk to it)."""
    return f"ipc://{state_dir(node_id) / 'control.sock'}"
