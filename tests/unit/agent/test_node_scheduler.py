"""The node Scheduler core (agent/node_scheduler.py): concrete event sequences and the exact
actions they produce. No processes, sockets or clocks: ``now`` is a number the test picks.
The daemon that carries the actions out is exercised in test_agent_restart.py and
test_warm_spare.py (real stand-in processes) and tests/integration/test_elastic_sp.py.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from agent.node_scheduler import (
    VALID_WORKER_TRANSITIONS,
    WORKER_MAX_START_FAILURES,
    DeliverLeases,
    Drain,
    FormGroup,
    GiveUpGpus,
    GroupServing,
    InvalidTransition,
    KillWorker,
    NodeScheduler,
    ReportGpus,
    ReportNotice,
    RestartNode,
    ReturnLeases,
    SpareTiming,
    SpawnWorker,
    SPGroup,
    StartSpare,
    StopSpare,
    StopWorker,
    WorkerStatus,
)
from agent.preemption import PreemptionNotice

CORE = pathlib.Path(__file__).resolve().parents[3] / "agent" / "node_scheduler.py"
FORBIDDEN = {"socket", "zmq", "threading", "subprocess", "time", "torch", "os", "signal", "multiprocessing", "asyncio"}
OVERDUE = "still running at its commit deadline (the coordinator re-runs what it had not committed)"


def imported_modules(source: str) -> set[str]:
    """Top-level names of every module ``source`` imports (``import a.b`` and ``from a.b import c``)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def make_scheduler(gpus=(0, 1), *, ready=True, now=0.0, warm_spare=False, **mode) -> NodeScheduler:
    """A configured scheduler whose first workers started (and said hello when ``ready``)."""
    ns = NodeScheduler("n", list(gpus), grace_s=20.0, warm_spare=warm_spare)
    ns.configure(**mode)
    for action in ns.start(now):
        ns.worker_spawned(action.worker_id, 0, now)
        if ready:
            ns.worker_hello(action.worker_id, pid=100 + action.gpus[0], now=now)
    return ns


def serving_pair(**mode) -> NodeScheduler:
    """SP 2 on GPUs 0 and 1, generation 1 formed by both members."""
    ns = make_scheduler((0, 1), sp_degree=2, **mode)
    for wid in ("n/gpu0", "n/gpu1"):
        ns.group_formed(wid, generation=1, took_s=0.5, now=1.0)
    assert ns.groups[0].serving
    return ns


def node_notice(source="aws", kind="terminate", scope="node", is_hint=False) -> PreemptionNotice:
    return PreemptionNotice(source, scope, 1000.0, f"{source}-{kind}-{scope}", kind, is_hint=is_hint)


# ---------------------------------------------------------------- purity
def test_core_imports_no_sockets_threads_processes_clocks_or_torch():
    got = imported_modules(CORE.read_text())
    assert not got & FORBIDDEN, sorted(got & FORBIDDEN)


def test_the_import_scan_sees_every_import_form():
    src = "import time\nimport zmq.asyncio as z\nfrom subprocess import Popen\nfrom . import sibling\n"
    assert imported_modules(src) == {"time", "zmq", "subprocess"}


# ---------------------------------------------------------------- worker status table
def test_worker_transition_table_edges():
    s = WorkerStatus
    expected = {
        s.STARTING: {s.READY, s.STOPPING, s.EXITED},
        s.READY: {s.STOPPING, s.EXITED},
        s.STOPPING: {s.EXITED},
        s.EXITED: set(),
    }
    assert {k: set(v) for k, v in VALID_WORKER_TRANSITIONS.items()} == expected
    assert set(VALID_WORKER_TRANSITIONS) == set(WorkerStatus)  # a new status needs its edges here


def test_an_exited_worker_cannot_come_back_and_a_hello_does_not_undo_a_stop():
    ns = make_scheduler((0, 1), ready=False, sp_degree=2)
    ns.revoke([1], grace_s=10.0, now=1.0)  # n/gpu1 stopped before its hello
    assert ns.worker_hello("n/gpu1", pid=7, now=2.0) == []  # no group join, no GROUP_FORM
    assert ns.workers["n/gpu1"].status is WorkerStatus.STOPPING and ns.groups[0].members == ["n/gpu0"]
    assert ns.workers["n/gpu1"].pid == 7  # agent-status still shows its process
    ns.worker_exited("n/gpu1", 0, now=3.0)
    with pytest.raises(InvalidTransition, match="exited -> ready"):
        ns._set(ns.workers["n/gpu1"], WorkerStatus.READY)
    assert ns.worker_exited("n/gpu1", 0, now=4.0) == []  # a second report of the same exit


# ---------------------------------------------------------------- SP groups
def test_start_groups_workers_and_forms_each_group_once_all_its_members_said_hello():
    ns = NodeScheduler("n", [2, 0, 1], grace_s=20.0)
    ns.configure(sp_degree=2)
    assert ns.start(now=0.0) == [
        SpawnWorker("n/gpu0", (0,), cause="start"),
        SpawnWorker("n/gpu1", (1,), cause="start"),
        SpawnWorker("n/gpu2", (2,), cause="start"),
    ]
    assert [g.members for g in ns.groups] == [["n/gpu0", "n/gpu1"], ["n/gpu2"]]
    assert ns.worker_hello("n/gpu0", pid=10, now=1.0) == []  # waits for n/gpu1
    assert ns.worker_hello("n/gpu2", pid=12, now=1.0) == [FormGroup(("n/gpu2",), generation=1)]
    assert ns.worker_hello("n/gpu1", pid=11, now=1.5) == [FormGroup(("n/gpu0", "n/gpu1"), generation=1)]
    assert ns.group_formed("n/gpu0", generation=1, took_s=0.25, now=2.0) == []
    assert ns.group_formed("n/gpu1", generation=1, took_s=0.75, now=2.0) == [
        GroupServing(("n/gpu0", "n/gpu1"), generation=1, after_s=0.5)
    ]
    assert ns.groups[0].status() == {
        "members": ["n/gpu0", "n/gpu1"],
        "generation": 1,
        "serving": True,
        "reform_s": 0.75,
    }
    assert ns.group_formed("n/gpu1", generation=1, took_s=0.75, now=2.5) == []  # already serving


def test_sp1_has_no_groups():
    ns = make_scheduler((0, 1))
    assert ns.groups == [] and ns.group_formed("n/gpu0", generation=1, took_s=0.1, now=1.0) == []


# ---------------------------------------------------------------- elastic reconfiguration
def test_revoked_leader_commits_then_the_survivor_reforms_and_the_commit_ends_the_leader():
    ns = serving_pair()  # elastic, live migration on
    assert ns.revoke([0], grace_s=10.0, now=5.0) == [
        StopWorker("n/gpu0", commit=True, reason="gpu revoked"),
        FormGroup(("n/gpu1",), generation=2),
        ReportGpus((1,), revoked=(0,)),
    ]
    assert ns.gpus == [1] and ns.revoking == {"n/gpu0": 15.0} and ns.groups[0].leader == "n/gpu1"
    assert ns.work_finished("n/gpu0", ["r1"], committed=True) == [
        KillWorker("n/gpu0", "revoked and done (its commit was forwarded)")
    ]
    assert ns.worker_exited("n/gpu0", -9, now=6.0) == []  # revoked: not replaced
    assert ns.revoking == {} and ns.restarts == 0


def test_revoked_follower_holds_nothing_and_is_ended_once_the_survivor_serves():
    ns = serving_pair()
    assert ns.revoke([1], grace_s=10.0, now=5.0) == [
        StopWorker("n/gpu1", commit=False, reason="gpu revoked"),
        FormGroup(("n/gpu0",), generation=2),
        ReportGpus((0,), revoked=(1,)),
    ]
    assert ns.group_formed("n/gpu0", generation=1, took_s=0.5, now=5.1) == []  # a late report of generation 1
    assert ns.group_formed("n/gpu0", generation=2, took_s=0.25, now=5.5) == [
        GroupServing(("n/gpu0",), generation=2, after_s=0.5),
        KillWorker("n/gpu1", "revoked and done (its group re-formed without it)"),
    ]


def test_without_live_migration_a_revoked_worker_gives_its_batch_back():
    ns = make_scheduler((0, 1, 2), live_migration=False)
    assert ns.revoke([1], grace_s=10.0, now=5.0) == [
        StopWorker("n/gpu1", commit=False, reason="gpu revoked"),
        ReportGpus((0, 2), revoked=(1,)),
    ]


def test_granted_gpu_gets_a_worker_that_joins_the_group_that_lost_a_member():
    ns = serving_pair()
    ns.revoke([1], grace_s=10.0, now=5.0)
    assert ns.add([3], now=8.0) == [SpawnWorker("n/gpu3", (3,), cause="grant"), ReportGpus((0, 3), added=(3,))]
    assert ns.worker_hello("n/gpu3", pid=13, now=9.0) == [FormGroup(("n/gpu0", "n/gpu3"), generation=3)]


def test_only_group_sizes_the_model_runs_at_are_formed():
    """SP 4 of a model with 4 heads cannot run at 3 (Ulysses splits heads): 3 survivors of a
    revocation split into SP 2 + SP 1, a granted GPU joins the SP 1 group (making 2, not 3),
    and a node of 3 GPUs starts as 2 + 1."""
    ns = make_scheduler((0, 1, 2, 3), sp_degree=4, sp_degrees=[1, 2, 4])
    assert [g.members for g in ns.groups] == [["n/gpu0", "n/gpu1", "n/gpu2", "n/gpu3"]]
    actions = ns.revoke([3], grace_s=10.0, now=5.0)
    forms = [a for a in actions if isinstance(a, FormGroup)]
    assert forms == [FormGroup(("n/gpu0", "n/gpu1"), generation=2), FormGroup(("n/gpu2",), generation=1)]
    assert sorted(len(g.members) for g in ns.groups) == [1, 2]
    ns.add([3], now=8.0)
    assert ns.worker_hello("n/gpu3.r1", pid=13, now=9.0) == [FormGroup(("n/gpu2", "n/gpu3.r1"), generation=2)]
    assert sorted(len(g.members) for g in ns.groups) == [2, 2]
    fresh = make_scheduler((0, 1, 2), ready=False, sp_degree=4, sp_degrees=[1, 2, 4])
    assert [g.members for g in fresh.groups] == [["n/gpu0", "n/gpu1"], ["n/gpu2"]]
    assert make_scheduler((0, 1, 2), ready=False, sp_degree=4).sp_degrees == [1, 2, 3, 4]  # default: all


def test_crashed_member_leaves_its_group_its_leases_go_back_and_its_replacement_joins():
    ns = serving_pair()
    assert ns.leases_granted("n/gpu0", [("r1", 7), ("r2", 8)], now=2.0) == [DeliverLeases("n/gpu0")]
    assert ns.in_flight() == ["r1", "r2"]
    assert ns.worker_exited("n/gpu0", 1, now=3.0) == [
        FormGroup(("n/gpu1",), generation=2),
        ReturnLeases("n/gpu0", ("r1", "r2"), (7, 8), "worker exited with code 1"),
        SpawnWorker("n/gpu0.r1", (0,), cause="replace"),
    ]
    # leases answering the dead worker's pull, or reaching its replacement before its hello
    for wid in ("n/gpu0", "n/gpu0.r1"):
        assert ns.leases_granted(wid, [("r3", 9)], now=3.5) == [
            ReturnLeases(wid, ("r3",), (9,), "worker exited before its leases arrived")
        ]
    assert ns.worker_hello("n/gpu0.r1", pid=20, now=4.0) == [FormGroup(("n/gpu1", "n/gpu0.r1"), generation=3)]


def _fail_starts(ns, worker_id: str, times: int, now: float) -> tuple[str, list]:
    """The worker ``worker_id`` and each of its replacements exit with code 1 before a hello,
    ``times`` times; returns the last replacement's id and the last exit's actions."""
    actions: list = []
    for i in range(times):
        actions = ns.worker_exited(worker_id, 1, now=now + i)
        spawned = [a for a in actions if isinstance(a, SpawnWorker)]
        if spawned:
            worker_id = spawned[0].worker_id
            ns.worker_spawned(worker_id, 0, now + i)
    return worker_id, actions


def test_a_worker_that_fails_every_start_is_given_up_after_max_failures_and_reported():
    """A fault that fails every start (a bad install, a value the worker cannot read) must not be
    restarted forever in silence: after WORKER_MAX_START_FAILURES exits before a hello in a row,
    those GPUs get no worker and the node reports why; the other GPU's worker is untouched."""
    ns = make_scheduler((0, 1), ready=False)
    ns.worker_hello("n/gpu1", pid=101, now=0.0)
    wid, last = _fail_starts(ns, "n/gpu0", WORKER_MAX_START_FAILURES - 1, now=1.0)
    assert last == [SpawnWorker(wid, (0,), cause="replace")]  # still replaced
    assert ns.given_up_gpus() == []
    assert ns.worker_exited(wid, 1, now=20.0) == [GiveUpGpus((0,), WORKER_MAX_START_FAILURES, 1)]
    assert [s.worker_id for s in ns.live_workers()] == ["n/gpu1"]
    assert ns.given_up_gpus() == [0]  # the heartbeat's gpus_given_up: no rollout capacity
    ns.revoke([0], grace_s=10.0, now=21.0)  # a GPU the node no longer has is not reported
    assert ns.given_up_gpus() == []


def test_a_hello_or_a_clean_exit_resets_the_start_failures():
    ns = make_scheduler((0,), ready=False)
    wid, _ = _fail_starts(ns, "n/gpu0", WORKER_MAX_START_FAILURES - 1, now=1.0)
    ns.worker_hello(wid, pid=7, now=10.0)  # it started: the earlier failures no longer count
    wid, last = _fail_starts(ns, wid, WORKER_MAX_START_FAILURES - 1, now=11.0)
    assert last == [SpawnWorker(wid, (0,), cause="replace")]
    # a worker that said hello and then crashed is replaced and counts as no failed start
    ns.worker_hello(wid, pid=8, now=30.0)
    actions = ns.worker_exited(wid, 1, now=31.0)
    assert [type(a) for a in actions] == [SpawnWorker]
    wid = actions[0].worker_id
    ns.worker_spawned(wid, 0, 31.0)
    _, last = _fail_starts(ns, wid, WORKER_MAX_START_FAILURES - 1, now=32.0)
    assert all(not isinstance(a, GiveUpGpus) for a in last)


def test_stopped_worker_past_its_deadline_is_killed():
    ns = make_scheduler((0,))
    ns.revoke([0], grace_s=10.0, now=0.0)
    assert ns.overdue(now=10.0) == []
    assert ns.overdue(now=10.5) == [KillWorker("n/gpu0", OVERDUE)]
    ns.worker_exited("n/gpu0", -9, now=11.0)
    assert ns.overdue(now=12.0) == []


# ---------------------------------------------------------------- restart reconfiguration
def test_restart_mode_stops_every_worker_and_starts_fresh_ones_once_all_exited():
    ns = make_scheduler((0, 1, 2), reconfiguration="restart", live_migration=False)
    reason = "GPUs [1] revoked"
    assert ns.revoke([1], grace_s=30.0, now=5.0) == [
        RestartNode(reason, gpus=(0, 2), grace_s=30.0),
        StopWorker("n/gpu0", commit=False, reason=reason),
        StopWorker("n/gpu1", commit=False, reason=reason),
        StopWorker("n/gpu2", commit=False, reason=reason),
        ReportGpus((0, 2), revoked=(1,)),
    ]
    assert ns.restarts == 1 and ns.restart_pending
    assert ns.worker_exited("n/gpu1", 0, now=6.0) == []
    assert ns.worker_exited("n/gpu0", 0, now=6.5) == []
    assert ns.worker_exited("n/gpu2", 0, now=7.0) == [
        SpawnWorker("n/gpu0.r1", (0,), cause="restart"),
        SpawnWorker("n/gpu2.r1", (2,), cause="restart"),
    ]
    for wid in ("n/gpu0.r1", "n/gpu2.r1"):
        ns.worker_hello(wid, pid=1, now=8.0)
    added = ns.add([1], now=9.0)  # an addition restarts the node too (deadline: the agent's grace)
    assert added[0] == RestartNode("GPUs [1] added", gpus=(0, 1, 2), grace_s=20.0)
    assert added[1:] == [
        StopWorker("n/gpu0.r1", commit=False, reason="GPUs [1] added"),
        StopWorker("n/gpu2.r1", commit=False, reason="GPUs [1] added"),
        ReportGpus((0, 1, 2), added=(1,)),
    ]
    assert ns.restarts == 2


def test_restart_mode_with_live_migration_commits_and_a_node_without_workers_restarts_at_once():
    ns = make_scheduler((0,), reconfiguration="restart")
    ns.revoke([0], grace_s=5.0, now=1.0)
    assert ns.worker_exited("n/gpu0", 0, now=2.0) == []  # no GPU left: nothing to start
    assert ns.add([0], now=3.0) == [
        RestartNode("GPUs [0] added", gpus=(0,), grace_s=20.0),
        SpawnWorker("n/gpu0.r1", (0,), cause="restart"),
        ReportGpus((0,), added=(0,)),
    ]
    ns.worker_hello("n/gpu0.r1", pid=1, now=4.0)
    assert ns.revoke([0], grace_s=5.0, now=5.0)[1] == StopWorker("n/gpu0.r1", commit=True, reason="GPUs [0] revoked")


def test_restart_mode_keeps_no_spare():
    ns = make_scheduler((0,), warm_spare=True, reconfiguration="restart")
    assert ns.spare.enabled is False and ns.spare_tick(now=1000.0) == []


# ---------------------------------------------------------------- notices and stops
def test_node_notice_drains_every_worker_with_commit():
    ns = make_scheduler((0, 1))
    ns.add([2], now=1.0)  # n/gpu2 has not said hello yet: it is stopped too
    notice = node_notice()
    assert ns.notice(notice, remaining_s=60.0, now=10.0) == [
        ReportNotice(notice, acknowledge=True),
        Drain("aws terminate", grace_s=20.0),
        StopSpare(),
        StopWorker("n/gpu0", commit=True, reason="aws terminate"),
        StopWorker("n/gpu1", commit=True, reason="aws terminate"),
        StopWorker("n/gpu2", commit=True, reason="aws terminate"),
    ]
    assert ns.draining and ns.stop_deadline == 30.0 and not ns.may_pull("n/gpu0")
    again = node_notice(source="gcp", kind="preempt")
    assert ns.notice(again, remaining_s=5.0, now=11.0) == [ReportNotice(again, acknowledge=True)]  # drains once
    assert ns.notice(node_notice(source="sigterm"), remaining_s=5.0, now=11.0) == []  # finishing the stop
    assert ns.worker_exited("n/gpu0", 0, now=12.0) == []  # draining: not replaced


def test_notice_grace_is_capped_by_the_deadline():
    ns = make_scheduler((0,))
    actions = ns.notice(node_notice(), remaining_s=5.0, now=0.0)
    assert actions[1] == Drain("aws terminate", grace_s=4.0)  # a second before the deadline
    ns = make_scheduler((0,))
    assert ns.notice(node_notice(), remaining_s=0.2, now=0.0)[1] == Drain("aws terminate", grace_s=0.5)


def test_hint_is_only_reported():
    ns = make_scheduler((0,))
    hint = node_notice(kind="rebalance", is_hint=True)
    assert ns.notice(hint, remaining_s=120.0, now=0.0) == [ReportNotice(hint, acknowledge=False)]
    assert not ns.draining


def test_gpu_scope_notice_revokes_those_gpus_only():
    ns = make_scheduler((0, 1))
    notice = node_notice(source="revoke", kind="revoke", scope="gpu:1")
    assert ns.notice(notice, remaining_s=10.0, now=0.0) == [
        ReportNotice(notice, acknowledge=False),
        StopWorker("n/gpu1", commit=True, reason="gpu revoked"),
        ReportGpus((0,), revoked=(1,)),
    ]
    assert ns.revoking == {"n/gpu1": 9.0} and not ns.draining


def test_sigterm_after_the_coordinators_shutdown_is_not_a_preemption():
    ns = make_scheduler((0,))
    assert ns.shutdown("run finished", now=0.0) == [StopWorker("n/gpu0", commit=False, reason="shutdown"), StopSpare()]
    assert ns.stop_reason == "run finished" and ns.stop_deadline == 5.0
    assert ns.notice(node_notice(source="sigterm"), remaining_s=20.0, now=1.0) == []


def test_drain_without_a_deadline_uses_the_agents_grace():
    ns = make_scheduler((0,))
    assert ns.drain("coordinator lost", None, now=1.0)[:1] == [Drain("coordinator lost", grace_s=20.0)]
    assert ns.drain("again", 5.0, now=2.0) == [] and ns.stop_reason == "coordinator lost"


# ---------------------------------------------------------------- warm spare
def test_grant_with_a_warm_spare_hands_it_over_and_the_next_follows_once_that_worker_serves():
    ns = make_scheduler((0,), ready=False, warm_spare=True)
    assert ns.spare_tick(now=1.0) == []  # the first spare waits for the initial workers' hellos
    ns.worker_hello("n/gpu0", pid=10, now=2.0)
    assert ns.spare_tick(now=2.0) == [StartSpare()]
    ns.spare_started()
    assert ns.spare_tick(now=3.0) == []  # one spare at a time
    assert ns.add([1], now=10.0) == [
        SpawnWorker("n/gpu1", (1,), from_spare=True, cause="grant"),
        ReportGpus((0, 1), added=(1,)),
    ]
    ns.worker_spawned("n/gpu1", spare_pid=4242, now=10.0)
    assert ns.spare.used == 1 and ns.workers["n/gpu1"].spare_pid == 4242
    assert ns.add([2], now=10.5)[0] == SpawnWorker("n/gpu2", (2,), from_spare=False, cause="grant")  # none left
    ns.worker_spawned("n/gpu2", spare_pid=0, now=10.5)
    assert ns.spare_tick(now=11.0) == []  # not before the worker it became serves
    ns.worker_hello("n/gpu1", pid=4242, now=12.0)
    assert ns.spare_tick(now=12.0) == [StartSpare()]


def test_first_spare_starts_after_the_wait_even_if_a_worker_never_says_hello():
    ns = make_scheduler((0,), ready=False, warm_spare=True)
    assert ns.spare_tick(now=120.0) == []
    assert ns.spare_tick(now=120.5) == [StartSpare()]


def test_taken_spare_is_replaced_at_the_latest_after_the_replace_wait():
    ns = make_scheduler((0,), warm_spare=True, sp_degree=2)
    ns.spare_tick(now=1.0)
    ns.spare_started()
    (spawn, _) = ns.add([1], now=2.0)
    ns.worker_spawned(spawn.worker_id, spare_pid=7, now=2.0)
    ns.worker_hello(spawn.worker_id, pid=7, now=3.0)  # said hello, but its group has not formed
    assert ns.spare_tick(now=62.0) == []
    assert ns.spare_tick(now=62.5) == [StartSpare()]


def test_spare_that_keeps_dying_unused_is_restarted_with_backoff_then_given_up():
    ns = make_scheduler((0,), warm_spare=True)
    ns.spare.first_deadline = None
    delays = []
    for now in (0.0, 10.0, 30.0):
        ns.spare_started()
        delays.append(ns.spare_died(now))
    assert delays == [5.0, 10.0, None] and ns.spare.enabled is False
    assert ns.spare_tick(now=100.0) == []
    ns = make_scheduler((0,), warm_spare=True)
    ns.spare_timing = SpareTiming(max_failures=2)
    ns.spare_started()
    ns.spare_died(now=0.0)
    ns.spare_started()
    ns.spare_ready()  # it warmed up: the count starts again
    assert ns.spare_died(now=1.0) == 5.0


def test_spare_that_initialised_cuda_gives_spares_up_and_the_worker_restarts_cold():
    ns = make_scheduler((0,), warm_spare=True)
    ns.spare_tick(now=1.0)
    ns.spare_started()
    (spawn, _) = ns.add([1], now=2.0)
    ns.worker_spawned(spawn.worker_id, spare_pid=99, now=2.0)
    assert ns.worker_exited("n/gpu1", 76, now=3.0, spare_refused=True) == [
        StopSpare(give_up="the warm spare that was to become n/gpu1 had initialised CUDA early"),
        SpawnWorker("n/gpu1.r1", (1,), from_spare=False, cause="replace"),
    ]
    assert ns.spare.enabled is False


def test_stale_spare_is_replaced_at_once():
    ns = make_scheduler((0,), warm_spare=True)
    ns.spare.first_deadline = None
    ns.spare_started()
    ns.spawn([1])  # the daemon finds the spare dead or of an older configuration
    ns.spare_unusable(now=5.0)
    assert ns.spare_tick(now=5.0) == [StartSpare()]


def test_no_spare_while_draining_or_before_registration():
    ns = NodeScheduler("n", [0], warm_spare=True)
    ns.start(now=0.0)
    assert ns.spare_tick(now=500.0) == []  # not configured by the coordinator yet
    ns.configure()
    ns.drain("bye", 1.0, now=1.0)
    assert ns.spare_tick(now=500.0) == []


def test_groups_compare_by_identity():
    a, b = SPGroup(["w"]), SPGroup(["w"])
    assert a != b and [a, b].index(b) == 1
