"""No import cycle between the single-GPU and the sequence-parallel Rollout Worker modules.

The sequence-parallel group worker imports the shared classes from
``spotlight.workers.rollout.worker``; the rollout worker never imports the group worker at module
level (``make_worker`` picks it lazily for SP > 1).
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from spotlight.config import REPO_ROOT

GROUP, ROLLOUT = "spotlight.workers.sp.group_worker", "spotlight.workers.rollout.worker"


@pytest.mark.procs
def test_the_rollout_worker_imports_without_the_group_worker():
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({ROLLOUT!r})\n"
        f"assert {GROUP!r} not in sys.modules, 'imported ' + {GROUP!r}\n"
        f"importlib.import_module({GROUP!r})\n"
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
    group = _module_level_imports(workers / "sp" / "group_worker.py")
    rollout = _module_level_imports(workers / "rollout" / "worker.py")
    assert GROUP not in rollout
    assert ROLLOUT in group
    from spotlight.workers.rollout import worker
    from spotlight.workers.sp import group_worker

    assert issubclass(group_worker.GroupExecutor, worker.RolloutExecutor)
    assert issubclass(group_worker.GroupWorkerProcess, worker.WorkerProcess)
