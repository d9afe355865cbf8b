"""Shared test setup.

* Torch to one thread per process on the 2-core CI machine, and every test gets the
  environment it started with (an in-process ``spotlight up`` sets ``$SPOTLIGHT_LOG_DIR`` and
  friends for its children; leaked into later tests, it sent their subprocesses' output to a
  dead run's log files).
* The lanes (``./scripts/test --fast`` runs ``not e2e and not procs``), markers registered in
  pyproject.toml:

  - ``e2e``: everything under ``tests/integration/``, applied here;
  - ``procs``: a test that starts processes or a process group (``subprocess``, ``mp.spawn``,
    agent or worker processes, gloo ``init_process_group``). Marked in the test module
    (``pytestmark``/decorator) or, for the tests in :data:`PROCS_MODULES`/:data:`PROCS_TESTS`, here. The
    guard below fails any test outside ``procs``/``e2e`` that starts a process or a
    process group, so the fast lane stays in-process;
  - ``gpu``: needs CUDA; skipped where ``torch.cuda.is_available()`` is false.
"""

from __future__ import annotations

import multiprocessing.process
import os
import pathlib
import sys

import psutil
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TESTS = pathlib.Path(__file__).resolve().parent

# Modules whose every test is ``procs``, marked here rather than in the module: their owners
# edit them in parallel (move the mark into the module's ``pytestmark`` when convenient).
PROCS_MODULES = {
    "unit/agent/test_restart.py",
    "unit/workers/train/test_train_checkpoint.py",
    "unit/workers/train/test_train_worker.py",
}
# Single tests of modules edited in parallel (parameters left out; the rest of the module stays fast).
PROCS_TESTS = (
    {
        "unit/agent/test_faults.py::" + name
        for name in (
            "test_agent_restarted_on_preempted_vm_exits_75_and_does_not_drain_twice",
            "test_spawned_worker_environment_has_no_secrets",
            "test_shutdown_kills_sigterm_ignoring_workers_within_one_deadline",
            "test_shutdown_terminates_cooperative_workers_without_kill",
            "test_join_without_keys_is_one_line_before_connecting",
            "test_join_to_nothing_shows_progress_and_obeys_sigterm",
            "test_first_registration_timeout_is_an_option",
            "test_join_with_a_bad_coordinator_address_is_one_line_before_connecting",
            "test_join_help_fits_80_columns",
        )
    }
    | {
        "unit/agent/test_warm_spare.py::" + name
        for name in (
            "test_grant_hands_the_ready_spare_over_and_the_next_spare_follows",
            "test_spare_of_an_old_configuration_is_not_used",
            "test_spare_that_dies_unused_is_restarted_then_given_up",
            "test_spare_that_initialised_cuda_falls_back_to_a_cold_worker",
            "test_revoked_follower_is_killed_once_the_survivor_serves_and_a_leader_after_its_commit",
        )
    }
    | {
        "unit/cli/test_console.py::" + name
        for name in (
            "test_child_logs_go_to_its_file_not_the_console",
            "test_verbose_echoes_child_logs_and_keeps_the_file",
            "test_children_ignore_ctrl_c_the_parent_stops_them",
        )
    }
    | {
        "unit/cli/test_help.py::test_help_fits_80_columns",
        "unit/cli/test_up.py::test_a_run_whose_coordinator_still_runs_points_to_status_not_resume",
        "unit/coordinator/test_status_events.py::test_status_cli_shows_a_finished_run_from_its_directory",
        "unit/core/test_cores.py::test_derive_seed_is_stable",
        "unit/sim/test_simulator.py::test_cli_prints_the_cost_to_target_table",
    }
)


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir(tmp_path_factory):
    """The temporary files the code under test makes (an agent's worker-socket folder, a
    child's scratch files) go under this session's pytest folder, which pytest prunes (it keeps
    the newest 3), not the system's /tmp, where a test that never closes what it made left them
    for good (11 ``spotlight-agent-*`` folders per fast lane). Set before the first test, so
    :func:`_restore_environment` keeps it, and for child processes too (``$TMPDIR``)."""
    import tempfile

    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # recomputed from $TMPDIR on next use
    yield


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


def pytest_sessionstart(session):
    """Build matplotlib's font cache before any test runs: on a machine or user without one
    (``~/.cache/matplotlib``, or a fresh ``$MPLCONFIGDIR``), the first plot runs ``fc-list``,
    and the ``procs`` guard below would fail whichever in-process test happened to plot first."""
    import matplotlib.font_manager  # noqa: F401  (its import loads or builds the cache)


def pytest_collection_modifyitems(config, items):
    integration = TESTS / "integration"
    gpu_items = []
    for item in items:
        path = pathlib.Path(str(item.path))
        rel = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else ""
        if path.is_relative_to(integration):
            item.add_marker(pytest.mark.e2e)
        if rel in PROCS_MODULES or f"{rel}::{item.name.split('[')[0]}" in PROCS_TESTS:
            item.add_marker(pytest.mark.procs)
        if item.get_closest_marker("gpu"):
            gpu_items.append(item)
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
            for item in gpu_items:
                item.add_marker(skip)


# ---------------------------------------------------------------- the `procs` guard
#
# While a test outside ``procs``/``e2e`` runs (set-up, call and tear-down), every process it
# starts is recorded: Python's audit events for subprocess/fork/spawn/exec/system, every
# ``multiprocessing`` process start (torch ``mp.spawn`` included; a ``spawn`` child is
# exec'ed without an audit event), every torch.distributed process group, and, as a last
# net, a child process of this one that was not there when the test began.

_SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "pty.spawn"}
)
_started: list[str] | None = None  # None: the running test may start processes (or none runs)


def _record(what: str) -> None:
    if _started is not None:
        _started.append(what[:300])


def _process_group_up() -> bool:
    dist = sys.modules.get("torch.distributed")
    is_initialized = getattr(dist, "is_initialized", None)  # None: not loaded, or still loading
    return bool(is_initialized is not None and dist.is_available() and is_initialized())


_dist_wrapped = False


def _wrap_init_process_group() -> None:
    """Record ``torch.distributed.init_process_group`` calls (once torch.distributed is loaded)."""
    global _dist_wrapped
    dist = sys.modules.get("torch.distributed")
    if dist is None or not hasattr(dist, "init_process_group"):  # not loaded, or still loading
        return
    _dist_wrapped = True
    if getattr(dist.init_process_group, "_spotlight_recorded", False):
        return
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        _record(f"torch.distributed.init_process_group {args[:1]!r}")
        return original(*args, **kwargs)

    init_process_group._spotlight_recorded = True
    dist.init_process_group = init_process_group


def _audit(event: str, args: tuple) -> None:
    if _started is None:
        return
    if event in _SPAWN_EVENTS:
        _record(f"{event} {args[:2]!r}")
    elif not _dist_wrapped and "torch.distributed" in sys.modules:  # first imported by this test
        _wrap_init_process_group()


sys.addaudithook(_audit)

_process_start = multiprocessing.process.BaseProcess.start


def _recorded_process_start(self):
    _record(f"multiprocessing start of {self.name} (target {getattr(self, '_target', None)!r})")
    return _process_start(self)


multiprocessing.process.BaseProcess.start = _recorded_process_start


def _may_start_processes(item) -> bool:
    return any(item.get_closest_marker(name) for name in ("procs", "e2e"))


_children_before: set[int] = set()  # this process's children when the test began (and those reported)
_group_before = False  # a process group was up when the test began (an earlier module's fixture)


def _children() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _check(item, phase: str) -> None:
    """Fail ``item`` if it started a process or a process group since the last check."""
    global _children_before, _group_before
    if _started is None:
        return
    if _process_group_up() and not _group_before:
        _group_before = True
        _record("a torch.distributed process group is up")
    new = _children() - _children_before
    if new:
        _children_before |= new
        _record(f"child processes {sorted(new)}")
    if _started:
        found = "\n  ".join(dict.fromkeys(_started))
        _started.clear()
        pytest.fail(
            f"{item.nodeid} started processes or a process group during {phase} but is not marked "
            f"`procs` (or `e2e`):\n  {found}\nMark it (`pytestmark = pytest.mark.procs`, @pytest.mark.procs, or "
            "tests/conftest.py's PROCS_TESTS), or keep it in-process: the fast lane runs `not e2e and not procs`.",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    global _started, _children_before, _group_before
    _wrap_init_process_group()
    _started = None if _may_start_processes(item) else []
    if _started is not None:
        _children_before, _group_before = _children(), _process_group_up()
    result = yield
    _check(item, "set-up")
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item):
    result = yield
    _check(item, "the test")
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    global _started
    try:
        result = yield
        _check(item, "tear-down")
        return result
    finally:
        _started = None
