"""No import cycle between the single-GPU and the sequence-parallel Rollout Worker modules.

Both import their shared classes from ``spotlight.workers.common``; neither imports the
other at module level (``rollout_worker.main`` picks ``group_worker`` lazily for SP > 1).
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from spotlight.config import REPO_ROOT

GROUP, ROLLOUT = "spotlight.workers.group_worker", "spotlight.workers.rollout_worker"


@pytest.mark.parametrize("first,other", [(GROUP, ROLLOUT), (ROLLOUT, GROUP)])
def test_each_worker_module_imports_first_in_a_fresh_interpreter(first, other):
    code = (
        "import importlib, sys\n"
        f"m = importlib.import_module({first!r})\n"
        f"assert {other!r} not in sys.modules, 'imported ' + {other!r}\n"
        "assert 'spotlight.workers.common' in sys.modules\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def _module_level_imports(path) -> set[str]:
    """Modules named by import statements outside any function or class body."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_neither_module_imports_the_other_at_module_level():
    workers = REPO_ROOT / "spotlight" / "workers"
    group = _module_level_imports(workers / "group_worker.py")
    rollout = _module_level_imports(workers / "rollout_worker.py")
    assert ROLLOUT not in group and GROUP not in rollout
    assert "spotlight.workers.common" in group and "spotlight.workers.common" in rollout
    # common imports neither
    common = _module_level_imports(workers / "common.py")
    assert ROLLOUT not in common and GROUP not in common
    # the re-exports keep existing importers working
    from spotlight.workers import common, group_worker, rollout_worker

    assert rollout_worker.RolloutExecutor is common.RolloutExecutor
    assert issubclass(group_worker.GroupExecutor, common.RolloutExecutor)
    assert issubclass(group_worker.GroupWorkerProcess, common.WorkerProcess)
