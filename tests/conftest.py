"""Shared test setup: keep torch to one thread per process on the 2-core CI machine, and give
every test the environment it started with (an in-process ``spotlight up`` sets
``$SPOTLIGHT_LOG_DIR`` and friends for its children; leaked into later tests, it sent their
subprocesses' output to a dead run's log files)."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
