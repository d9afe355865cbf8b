"""The agent daemon and the CLI entry point must not pull in torch or diffusers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spotlight.config import REPO_ROOT

pytestmark = pytest.mark.procs  # each check imports in a fresh interpreter

MODULES = [
    "agent.main",
    "agent.node_scheduler",
    "agent.weight_cache",
    "spotlight.store.weight_sync",
    "spotlight.cli",
    "spotlight.protocol",
    "spotlight.config",
]
if (REPO_ROOT / "agent" / "preemption.py").is_file():
    MODULES.append("agent.preemption")


def test_light_modules_do_not_import_torch_or_diffusers():
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}:\n"
        "    importlib.import_module(m)\n"
        "heavy = sorted(k for k in ('torch', 'diffusers', 'transformers') if k in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_check_itself_detects_torch():
    """Guard against a vacuous check: importing a torch module is noticed."""
    code = "import spotlight.store.tensor_wire, sys; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode != 0
