"""The pure cores stay pure, and the shells leave the iteration core's state to the core.

``spotlight/core/`` decides; it takes observations and ``now`` and returns decisions, so it may
not import sockets, ZeroMQ, threads, processes, clocks or torch (docs/architecture.md §2). The
shells that drive the iteration core (the coordinator and the simulator) report events through
its methods and never assign one of its attributes.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from spotlight.config import REPO_ROOT

CORE = REPO_ROOT / "spotlight" / "core"
FORBIDDEN = {"socket", "zmq", "threading", "subprocess", "time", "torch", "multiprocessing", "asyncio"}
SHELLS = [REPO_ROOT / "spotlight" / "coordinator", REPO_ROOT / "spotlight" / "sim"]


def _imports(path: pathlib.Path) -> set[str]:
    """Top-level names of every module ``path`` imports (at any depth of the file)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_modules_import_no_io_clock_or_torch(path):
    assert not (_imports(path) & FORBIDDEN), f"{path.name} imports {sorted(_imports(path) & FORBIDDEN)}"


def test_the_scan_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import time\n    from torch import nn\n")
    assert _imports(bad) & FORBIDDEN == {"time", "torch"}


def _core_attribute_writes(path: pathlib.Path) -> list[str]:
    """``x.core.attr = ...`` / ``core.attr = ...`` / ``core.attr += ...`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for t in targets:
            if not isinstance(t, ast.Attribute):
                continue
            owner = t.value
            name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
            if name == "core":
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(t)}")
    return found


@pytest.mark.parametrize("path", sorted(p for d in SHELLS for p in d.rglob("*.py")), ids=lambda p: p.name)
def test_shells_never_assign_an_attribute_of_the_iteration_core(path):
    assert _core_attribute_writes(path) == []


def test_the_attribute_scan_sees_a_write(tmp_path):
    bad = tmp_path / "shell.py"
    bad.write_text("def f(self, core):\n    self.core.phase = 'finished'\n    core.done = True\n    self.core.x += 1\n")
    assert len(_core_attribute_writes(bad)) == 3
