"""``spotlight status`` renders agent-controlled strings as text, never as Rich markup."""

from __future__ import annotations

import pytest
from rich.console import Console

from spotlight.cli.status import render_status

NASTY = ["[/]", "[bold red]boom[/bold red]", "[link=http://x]y[/link]", "trailing\\", "[/red]"]


def snapshot():
    nodes = [
        {
            "node_id": nid,
            "status": "[/]alive",
            "spot": i % 2 == 0,
            "gpus": [0, 1],
            "workers": ["w"],
            "detector_healthy": False,
            "detector_error": f"gcp: HTTP 503 on [/] {nid}",
            "last_seen_s_ago": 1.5,
        }
        for i, nid in enumerate(NASTY)
    ]
    return {
        "phase": "explore",
        "iteration": 0,
        "iterations": 3,
        "version": 1,
        "nodes": nodes,
        "requests": {"[/]explore": {"[/]done": 2, "leased": 1}},
        "reward_curve": [0.1, 0.2],
        "last_metrics": {"reward/mean": 0.25},
    }


def test_render_status_shows_markup_like_strings_verbatim():
    console = Console(record=True, width=400, color_system=None)
    console.print(render_status(snapshot()))  # `[/]` in a node id raised MarkupError before
    text = console.export_text()
    for nid in NASTY:
        assert nid in text
        assert f"gcp: HTTP 503 on [/] {nid}" in text
    assert "[/]alive" in text and "[/]explore" in text and "[/]done" in text
    assert "unhealthy" in text and "[red]" not in text  # our own markup still applies


# ---------------------------------------------------------------- what a person reads


def _text(snap, width=220) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(render_status(snap))
    return console.export_text()


def _node(node_id, status="alive", spot=True, gpus=(0, 1, 2, 3), why="registered"):
    return {
        "node_id": node_id,
        "status": status,
        "why": why,
        "spot": spot,
        "num_gpus": len(gpus),
        "gpus": list(gpus),
        "workers": [f"{node_id}/g0"],
        "detector_healthy": True,
        "detector_error": "",
        "last_seen_s_ago": 0.4,
    }


def _cost(spot_h=2.0, res_h=1.0):
    return {
        "spot_gpu_hours": spot_h,
        "reserved_gpu_hours": res_h,
        "spot_usd": spot_h * 2.87,
        "reserved_usd": res_h * 10.08,
        "total_usd": spot_h * 2.87 + res_h * 10.08,
        "all_reserved_usd": (spot_h + res_h) * 10.08,
        "spot_usd_per_gpu_hour": 2.87,
        "reserved_usd_per_gpu_hour": 10.08,
    }


def start_snapshot():
    """As Coordinator.snapshot() reads before any iteration ended and before the first weights."""
    return {
        "phase": "starting",
        "iteration": 1,
        "iterations_done": 0,
        "iterations": 10,
        "finished": False,
        "error": None,
        "version": None,
        "started_unix_s": 1.7e9,
        "elapsed_s": 4.2,
        "eta_s": None,
        "gpus": {"spot": 0, "reserved": 1},
        "cost": _cost(0.0, 0.001),
        "nodes": [_node("reserved-0", spot=False, gpus=[0])],
        "requests": {},
        "last_metrics": {},
        "reward_curve": [],
        "events": [{"t_s": 1.0, "kind": "join", "node": "reserved-0", "detail": "1 reserved GPU"}],
    }


def mid_snapshot():
    nodes = [
        _node("reserved-0", spot=False, gpus=[0]),
        _node("spot-0"),
        _node("spot-1", gpus=[0, 1]),
        _node("spot-2", status="dead", why="no heartbeat for 31.0s"),
    ]
    events = [
        {"t_s": 2.0, "kind": "join", "node": "spot-2", "detail": "4 spot GPUs"},
        {"t_s": 65.0, "kind": "notice", "node": "spot-1", "detail": "gcp preempt, deadline in 30s"},
        {"t_s": 70.5, "kind": "revoke", "node": "spot-1", "detail": "gpu:2,3, 30s grace"},
        {"t_s": 71.0, "kind": "commit", "node": "spot-1", "detail": "spot-1/g0: 4 requests at step 7"},
        {"t_s": 75.0, "kind": "reform", "node": "spot-1", "detail": "1 worker: 2 GPUs"},
        {"t_s": 3725.0, "kind": "dead", "node": "spot-2", "detail": "no heartbeat for 31.0s"},
    ]
    return {
        "phase": "rollout",
        "iteration": 4,
        "iterations_done": 3,
        "iterations": 10,
        "finished": False,
        "error": None,
        "version": 3,
        "started_unix_s": 1.7e9,
        "elapsed_s": 3730.0,
        "eta_s": 8703.0,
        "gpus": {"spot": 6, "reserved": 1},
        "cost": _cost(),
        "nodes": nodes,
        "requests": {"rollout": {"done": 10, "leased": 2}},
        "last_metrics": {"iteration": 2, "reward/mean": 0.5},
        "reward_curve": [0.1, 0.25, 0.5],
        "events": events,
    }


@pytest.mark.parametrize("version", [-1, None])
def test_start_shows_no_weights_yet_and_no_eta(version):
    text = _text(start_snapshot() | {"version": version})
    assert "iteration 1/10 (0 done)" in text
    assert "no weights yet" in text and "v-1" not in text and "vNone" not in text  # read `weights v-1` before
    assert "ETA after the first iteration" in text
    assert "no iteration finished yet" in text


def test_mid_run_tells_the_story():
    text = _text(mid_snapshot())
    assert "iteration 4/10 (3 done)" in text and "weights v3" in text
    assert "elapsed 1:02:10" in text and "ETA 2:25:03" in text
    # GPU counts, not indices: spot-0 has 4 GPUs, spot-1 two; totals of the nodes not dead
    assert "GPUs now: 7 (6 spot on 2 nodes, 1 reserved on 1 node)" in text
    row = next(l for l in text.splitlines() if "spot-0" in l and "alive" in l)
    assert " 4 " in row and "0,1,2,3" in row
    # cost so far and what the same GPU-hours would cost on reserved
    assert "cost so far $15.82" in text and "the same GPU-hours all on reserved: $30.24" in text
    # reward sparkline with its range
    assert "min +0.1000" in text and "max +0.5000" in text and "▁" in text and "█" in text
    # the event log, with times
    for needle in ("0:01:05", "notice", "gcp preempt", "revoke", "gpu:2,3", "commit", "reform", "1:02:05"):
        assert needle in text, needle


def test_gpu_line_counts_the_trainers_gpus_like_the_cost():
    """The reserved GPUs on the line are those the cost bills: the Train Workers' too, a GPU
    shared by a trainer and a reserved Rollout Worker once."""
    snap = mid_snapshot() | {"gpus": {"spot": 6, "reserved": 3, "train": 2, "reserved_rollout": 2}}
    assert "GPUs now: 9 (6 spot on 2 nodes, 3 reserved: 2 training + 2 rollout on 1 node, 1 shared by both)" in _text(
        snap
    )
    snap["gpus"] = {"spot": 6, "reserved": 5, "train": 4, "reserved_rollout": 1}  # trainers on a host of their own
    assert "GPUs now: 11 (6 spot on 2 nodes, 5 reserved: 4 training + 1 rollout on 1 node)" in _text(snap)


def test_dead_node_shows_why():
    text = _text(mid_snapshot())
    row = next(l for l in text.splitlines() if "spot-2" in l and "dead" in l)
    assert "no heartbeat for 31.0s" in row  # `dead` with no reason before
    ev = [l for l in text.splitlines() if "dead" in l and "spot-2" in l and "1:02:05" in l]
    assert ev, text


def test_finished_run_from_files_says_so():
    snap = mid_snapshot() | {
        "phase": "finished",
        "finished": True,
        "iteration": 10,
        "iterations_done": 10,
        "eta_s": 0.0,
        "source": "the coordinator (pid 123) is not running: the run has finished or stopped; "
        "showing runs/x/status.json",
    }
    text = _text(snap)
    assert "finished: 10/10 iterations" in text and "ETA" not in text
    assert "is not running" in text and "status.json" in text
    assert "cost $15.82" in text and "cost so far" not in text  # a finished run's cost is its cost


def test_event_details_are_not_markup():
    snap = mid_snapshot()
    snap["events"].append({"t_s": 3800.0, "kind": "leave", "node": "spot-0", "detail": "[/]bye [bold]now[/bold]"})
    assert "[/]bye [bold]now[/bold]" in _text(snap)


def test_unmeasured_metrics_render_as_dashes():
    """The last iteration (and every reserved-only one) has spot/busy_fraction = null:
    `spotlight status RUN_DIR` crashed on every finished run (new-user trial)."""
    snap = mid_snapshot() | {
        "finished": True,
        "iterations_done": 10,
        "reward_curve": [0.1, None, float("nan"), 0.3],
        "last_metrics": {"reward/mean": None, "time/rollout_s": None, "spot/busy_fraction": None, "time/train_s": "x"},
    }
    text = _text(snap)
    assert "spot busy -" in text and "reward -" in text and "train -" in text
    assert "min +0.1000" in text and "max +0.3000" in text


def test_stopped_run_from_files_is_not_shown_as_live():
    """`spotlight status RUN_DIR` of a run stopped before its end showed the nodes of its last
    status.json as if they were live, the phase it was in and an ETA."""
    import time as _time

    saved = 1.7e9 + 3730.0
    clock = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(saved))
    stopped = mid_snapshot() | {
        "running": False,
        "saved_unix_s": saved,
        "eta_s": None,
        "source": "the coordinator (pid 123) is not running: the run has finished or stopped; "
        "showing runs/x/status.json",
    }
    stopped["events"] = stopped["events"] + [
        {
            "t_s": 3730.0,
            "kind": "finish",
            "node": "",
            "detail": "stopped after 3/10 iterations (interrupted or timed out)",
        }
    ]
    text = _text(stopped)
    assert f"stopped at {clock} (not running): 3/10 iterations done" in text
    assert "ETA" not in text and "phase rollout" not in text and "elapsed" not in text and "ran 1:02:10" in text
    assert (
        f"nodes as last seen at {clock} (not running now)" in text
        and f"GPUs at {clock}: 7" in text
        and "GPUs now" not in text
    )
    assert "0.4s before" in text and "s ago" not in text
    assert "status then" in text  # its nodes' status as it was, not "alive" now
    timed_out = stopped | {
        "events": stopped["events"][:-1]
        + [
            {
                "t_s": 3730.0,
                "kind": "finish",
                "node": "",
                "detail": "stopped after 3/10 iterations (run did not finish within 40s)",
            }
        ]
    }
    assert (
        _text(timed_out).splitlines()[2] == "stopped after 3/10 iterations (run did not finish within 40s)"
    )  # why, under the head and source lines (new-user trial)
    killed = stopped | {"events": mid_snapshot()["events"]}  # kill -9: status.json of its last iteration, no "finish"
    assert f"stopped (not running; last saved at {clock}): 3/10 iterations done" in _text(killed)
    live = _text(mid_snapshot())  # a live coordinator's snapshot is unchanged
    assert "phase rollout" in live and "ETA 2:25:03" in live and "GPUs now" in live and "not running" not in live


def test_collapse_guard_alerts_show_newest_first_lines():
    snap = snapshot() | {
        "guard_alerts": [
            {"kind": "image_drift", "iteration": i, "metric": "image/speckle", "message": f"speckle [/] {i}"}
            for i in range(1, 6)
        ]
    }
    text = _text(snap, width=400)
    assert "collapse guard, iteration 5: speckle [/] 5" in text
    assert "iteration 3:" in text and "iteration 2:" not in text  # the newest three
    assert "collapse guard" not in _text(snapshot())


def test_held_out_scores_show_as_a_sparkline_with_the_best():
    evals = [{"iteration": i - 1, "version": i, "eval/score": v} for i, v in enumerate([0.0, 0.5, 0.4])]
    text = _text(snapshot() | {"eval_results": evals})
    assert "held-out reward" in text and "last 0.400 (v2)" in text and "best 0.500 (v1)" in text
    assert "(3 evaluations)" in text  # a score of 0 is a score
    assert "held-out" not in _text(snapshot())
    # the shapes task: the strict verdict, as the console's held-out lines lead with, named as such
    strict = [e | {"eval/strict": v} for e, v in zip(evals, [0.1, 0.2, 0.6])]
    text = _text(snapshot() | {"eval_results": strict})
    assert "held-out strict" in text and "last 0.600 (v2)" in text and "best 0.600 (v2)" in text


def test_a_given_up_gpu_is_marked_and_the_node_says_why():
    """Was: a node whose GPU 1 got no workers any more (every start failed) looked healthy."""
    snap = mid_snapshot()
    node = snap["nodes"][2]  # spot-1, GPUs 0 and 1
    node["gpus_given_up"] = [1]
    node["workers_error"] = "workers on GPUs [1] failed 5 starts in a row (last exit code 1)"
    text = _text(snap, width=300)
    assert "0,1✗" in text and "0✗" not in text
    assert "failed 5 starts in a row" in text
