"""Every module of ``spotlight/`` and ``agent/`` imports, in the test process (the fast lane's
only contact with modules no other fast test imports, e.g. worker entry points)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import agent
import spotlight


def _modules() -> list[str]:
    names = []
    for pkg in (spotlight, agent):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.rsplit(".", 1)[-1] != "__main__":  # runs the CLI when imported
                names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_the_walk_finds_the_packages_and_their_entry_points():
    assert {
        "agent.main",
        "spotlight.cli.up",
        "spotlight.coordinator.coordinator",
        "spotlight.workers.rollout.worker",
        "spotlight.workers.sp.group_worker",
        "spotlight.workers.train.train_worker",
        "spotlight.models.families.qwen_image",
    } <= set(MODULES)
    assert not [m for m in MODULES if m.endswith("__main__")]


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)
