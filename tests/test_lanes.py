"""The test lanes themselves (tests/conftest.py): ``e2e`` on everything under tests/integration/,
the ``procs`` registry names tests that exist, and the guard that keeps the fast lane
(``not e2e and not procs``) in-process notices each way of starting a process."""

from __future__ import annotations

import ast
import multiprocessing.process
import pathlib
import sys
import textwrap

import pytest

import tests.conftest as lanes

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent


def test_everything_under_integration_is_e2e(request):
    items = [i for i in request.session.items if pathlib.Path(str(i.path)).is_relative_to(TESTS / "integration")]
    assert all(i.get_closest_marker("e2e") for i in items), [i.nodeid for i in items if not i.get_closest_marker("e2e")]
    outside = [i for i in request.session.items if i not in items and i.get_closest_marker("e2e")]
    assert not outside, [i.nodeid for i in outside]


def _test_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_procs_registry_names_existing_tests():
    """A renamed or moved test must take its entry along (else it would fail the guard)."""
    for rel in lanes.PROCS_MODULES:
        assert (TESTS / rel).is_file(), rel
    for entry in lanes.PROCS_TESTS:
        rel, name = entry.split("::")
        assert (TESTS / rel).is_file(), entry
        assert name in _test_names(TESTS / rel), entry


def test_the_fast_lane_is_the_documented_expression():
    assert '-m "not e2e and not procs"' in (REPO / "scripts" / "test").read_text()
    assert "--durations=20" in (REPO / "scripts" / "test").read_text()


def test_the_guard_hooks_are_installed():
    import torch.distributed as dist

    assert multiprocessing.process.BaseProcess.start is lanes._recorded_process_start
    lanes._wrap_init_process_group()
    assert getattr(dist.init_process_group, "_spotlight_recorded", False)


def test_the_guard_records_a_subprocess_audit_event_without_starting_one():
    """This test runs with the guard armed (it is in the fast lane): an audit event for a
    process start is recorded; the record is taken back so the test itself passes."""
    assert lanes._started is not None, "the guard is not armed for a fast test"
    before = list(lanes._started)
    sys.audit("subprocess.Popen", "/bin/true", ["/bin/true"], None, None)
    sys.audit("os.fork")
    got = lanes._started[len(before) :]
    del lanes._started[len(before) :]
    assert [g.split(" ")[0] for g in got] == ["subprocess.Popen", "os.fork"], got


GUARDED = """
import multiprocessing
import os
import subprocess
import sys

import pytest


def test_plain():
    pass


def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _nothing():
    pass


def test_multiprocessing():
    p = multiprocessing.get_context("spawn").Process(target=_nothing)
    p.start()
    p.join()


def test_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1)
    dist.destroy_process_group()


@pytest.mark.procs
def test_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.gpu
def test_needs_cuda():
    import torch

    assert torch.cuda.is_available()
"""


@pytest.mark.procs
def test_the_guard_fails_unmarked_tests_that_start_processes(tmp_path):
    """A small suite under this conftest in a fresh pytest: each unmarked way of starting a
    process or process group fails its test, naming it; the marked and the plain tests pass;
    the `gpu` test is skipped where CUDA is not available."""
    import subprocess

    import torch

    suite = tmp_path / "tests"
    (suite / "unit").mkdir(parents=True)
    (suite / "__init__.py").write_text("")
    (suite / "unit" / "__init__.py").write_text("")
    (suite / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (suite / "unit" / "test_guarded.py").write_text(textwrap.dedent(GUARDED))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    e2e\n    procs\n    gpu\naddopts = --strict-markers\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(suite)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    failed = {line.split("::")[1].split(" ")[0] for line in out.splitlines() if line.startswith("FAILED ")}
    assert failed == {"test_subprocess", "test_multiprocessing", "test_fork", "test_process_group"}, out[-4000:]
    assert ("3 passed" if torch.cuda.is_available() else "2 passed, 1 skipped") in out, out[-4000:]
    for what in ("subprocess.Popen", "multiprocessing start", "os.fork", "init_process_group"):
        assert what in out, (what, out[-4000:])
