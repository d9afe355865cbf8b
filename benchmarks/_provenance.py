"""Provenance of a benchmark result: commit, machine, command, date.

Every figure script under ``benchmarks/`` prints :func:`provenance_line` and stores
:func:`provenance` next to its numbers, so a result can be traced to the code and the
machine that produced it.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        )
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return commit + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        acc = f"torch {torch.__version__}" + (
            f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
        )
    except ImportError:
        acc = "no torch"
    return f"{os.cpu_count()} CPU cores ({cpu}), {acc}, Python {platform.python_version()}"


def provenance() -> dict[str, str]:
    """``{"commit", "machine", "command", "date"}`` of this process (date in UTC, ISO 8601)."""
    return {
        "commit": _commit(),
        "machine": _machine(),
        "command": " ".join(
            shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else "python"] + sys.argv[1:]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def provenance_line() -> str:
    p = provenance()
    return f"commit {p['commit']} · {p['date']} · {p['machine']} · python {p['command']}"


def save_result(fig, out, data: dict, *, indent: int = 1) -> pathlib.Path:
    """Write a figure script's picture (``out``, PNG at 110 dpi) and its numbers beside it
    (``out`` with ``.json``: ``data`` plus :func:`provenance` under ``"provenance"``).

    Returns:
        The PNG path.
    """
    import json

    import matplotlib.pyplot as plt

    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    out.with_suffix(".json").write_text(
        json.dumps({**data, "provenance": data.get("provenance", provenance())}, indent=indent, default=str)
    )
    return out
