"""``spotlight status``: one snapshot of a running coordinator, or a live TUI with --watch.

Data comes from one STATUS_REQUEST → STATUS round trip (``spotlight/protocol.py``), or, when
the run's coordinator is not running (a finished or stopped run), from the ``status.json`` it
saved in the run directory after every iteration and at exit, plus ``metrics.jsonl``.
:func:`render_status` is a pure function of that snapshot. Iteration numbers are 1-based,
as in the console progress line and the sample grids' names and titles.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import sys
import time
from typing import Optional

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from spotlight.cli.messages import ERROR, WARNING, print_error
from spotlight.util.cli_paths import path_argument, path_option
from spotlight.util.coordinator_pid import file_pid

SPARK = "▁▂▃▄▅▆▇█"
EVENT_ROWS = 15
GUARD_ROWS = 3  # newest collapse-guard alerts shown above the tables
"""Events shown (the newest); ``--json`` has all the snapshot keeps."""


def sparkline(values: list[float]) -> str:
    """One block character per value (the last 60), scaled between their min and max (NaNs skipped)."""
    vals = [x for v in values if (x := _real(v)) is not None]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in vals[-60:])


def hms(seconds: float | None) -> str:
    """``H:MM:SS`` for a duration in seconds ("?" for None)."""
    if seconds is None or seconds != seconds:
        return "?"
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _real(v) -> float | None:
    """``v`` as a finite float, or None (metrics rows hold null for "not measured", e.g. spot
    busy on the last iteration or in a reserved-only run)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        return None
    return float(v)


def _fmt(v, spec: str, *, scale: float = 1.0, unit: str = "") -> str:
    """``format(v * scale, spec) + unit``, or "-" when ``v`` is not a finite number."""
    x = _real(v)
    return "-" if x is None else f"{format(x * scale, spec)}{unit}"


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _reserved_gpus(gpus: dict, n_res: int) -> str:
    """The reserved part of the GPU line: every reserved GPU the cost meter bills, the Train
    Workers' included (``train``, ``reserved_rollout``: :meth:`InstanceManager.gpu_counts`;
    a snapshot of an older coordinator has neither and counts the reserved nodes' GPUs)."""
    res = gpus["reserved"]
    if "train" not in gpus:
        return f"{res} reserved on {_plural(n_res, 'node')}"
    train, rollout = gpus["train"], gpus.get("reserved_rollout", 0)
    shared = train + rollout - res
    uses = f"{train} training + {rollout} rollout on {_plural(n_res, 'node')}"
    return f"{res} reserved: {uses}" + (f", {shared} shared by both" if shared > 0 else "")


def _clock(unix_s) -> str:
    """Local wall-clock time ``YYYY-MM-DD HH:MM:SS`` of a Unix time ("" if not a number)."""
    x = _real(unix_s)
    return "" if x is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(x))


def _saved_at_exit(snap: dict) -> bool:
    """The snapshot is the one a coordinator saves as it exits (its last event is "finish")."""
    events = snap.get("events") or []
    return bool(events) and isinstance(events[-1], dict) and events[-1].get("kind") == "finish"


def render_status(snap: dict, *, max_events: int = EVENT_ROWS):
    """Rich renderable for a coordinator snapshot (pure: the same snapshot renders the same).

    Args:
        snap: :meth:`spotlight.coordinator.coordinator.Coordinator.snapshot` (live, or ``status.json`` of
            a run directory); keys added by newer coordinators are optional, so an older
            snapshot still renders. ``source`` (set by this CLI, not the coordinator) says
            where a snapshot read from files came from; ``running`` False (likewise) marks
            one whose coordinator is not running: a run that is not finished shows as stopped
            at ``saved_unix_s``, with no ETA and its nodes as last seen, not as live.
        max_events: newest events shown.

    Every string from the snapshot (node ids, statuses, detector errors, request kinds, event
    details) is agent- or coordinator-controlled text: it is escaped (``rich.markup.escape``)
    or placed in a ``Text``, never parsed as markup, so ``[/]`` in a node id shows as ``[/]``.
    """
    gone = snap.get("running") is False  # read from the run directory: no coordinator behind it
    saved_at = _clock(snap.get("saved_unix_s"))
    parts = [
        _headline(snap, gone, saved_at),
        *_run_dir_line(snap),
        *_notes(snap, gone),
        _gpu_line(snap, gone, saved_at),
    ]
    if snap.get("cost"):
        parts.append(_cost_line(snap["cost"], "cost" if snap.get("finished") or gone else "cost so far"))
    parts += [_nodes_table(snap["nodes"], gone, saved_at), _requests_table(snap["requests"])]
    parts.append(_reward_lines(snap))
    events = snap.get("events") or []
    if events:
        parts.append(_events_table(events, max_events))
    return Group(*parts)


def _done(snap: dict) -> int:
    """Iterations done (an older snapshot has only ``iteration``)."""
    return snap.get("iterations_done", snap["iteration"])


def _headline(snap: dict, gone: bool, saved_at: str) -> Text:
    """The first line: where the run is (iteration, finished or stopped), its weights
    version, the time it ran and its ETA."""
    total, done_n = snap["iterations"], _done(snap)
    it = min(snap["iteration"], total)  # 1-based, the iteration under way (or the last)
    version = snap.get("version")
    weights = "no weights yet" if version is None or version < 0 else f"weights v{version}"
    if snap.get("finished"):
        where = f"finished: {done_n}/{total} iterations" + (f" (at {saved_at})" if gone and saved_at else "")
    elif gone:
        # close() saves a last snapshot with a "finish" event; a killed coordinator leaves the
        # one of its last iteration, so the stop itself came later
        at = (
            "(not running)"
            if not saved_at
            else f"at {saved_at} (not running)"
            if _saved_at_exit(snap)
            else f"(not running; last saved at {saved_at})"
        )
        where = f"stopped {at}: {done_n}/{total} iterations done"
    elif done_n >= total:
        where = f"{done_n}/{total} iterations done, saving"
    else:
        where = f"iteration {it}/{total} ({done_n} done)"
    head = Text.assemble(
        ("Spotlight  ", "bold"),
        f"{where}  {weights}" if gone else f"phase {snap['phase']}  {where}  {weights}",
        style="yellow" if gone and not snap.get("finished") else "",
    )
    if "elapsed_s" in snap:
        eta = snap.get("eta_s")
        head.append(f"  {'ran' if gone else 'elapsed'} {hms(snap['elapsed_s'])}")
        if not snap.get("finished") and not gone:
            head.append(f"  ETA {hms(eta)}" if eta is not None else "  ETA after the first iteration")
    return head


def _run_dir_line(snap: dict) -> list[Text]:
    """Which run this is: its directory (``run_dir``, from the coordinator or this CLI) and, when
    ``status`` chose it (no RUN_DIR given), why that one (``run_dir_note``)."""
    if not snap.get("run_dir"):
        return []
    note = f"  ({snap['run_dir_note']})" if snap.get("run_dir_note") else ""
    return [Text(f"run dir {snap['run_dir']}{note}")]


def _notes(snap: dict, gone: bool) -> list[Text]:
    """Where a snapshot read from files came from, and the run's error or why it stopped."""
    notes = []
    if snap.get("source"):
        notes.append(Text(str(snap["source"]), style="yellow"))
    if snap.get("hint"):  # what else may keep a coordinator from answering (set by this CLI)
        notes.append(Text(str(snap["hint"]), style="yellow"))
    if snap.get("waiting") and not gone:  # iteration 1 waits for cluster.min_spot_nodes
        notes.append(Text(str(snap["waiting"]), style="yellow"))
    for a in (snap.get("guard_alerts") or [])[-GUARD_ROWS:]:
        if isinstance(a, dict):
            notes.append(
                Text(f"collapse guard, iteration {a.get('iteration')}: {a.get('message')}", style="bold yellow")
            )
    if snap.get("error"):
        notes.append(Text(f"error: {snap['error']}", style="red"))
    elif gone and not snap.get("finished") and _saved_at_exit(snap):
        last = (snap.get("events") or [{}])[-1]
        if (
            isinstance(last, dict) and last.get("kind") == "finish" and last.get("detail")
        ):  # why it stopped (close() saved it)
            notes.append(Text(str(last["detail"]), style="yellow"))
    return notes


def _gpu_line(snap: dict, gone: bool, saved_at: str) -> Text:
    """The GPUs held (now, or when the snapshot was saved): spot and reserved, on how many nodes."""
    nodes_list = snap["nodes"]
    gpus = snap.get("gpus")
    if gpus is None:  # older snapshot: count the GPUs of nodes that are not dead
        live = [n for n in nodes_list if n["status"] != "dead"]
        gpus = {
            "spot": sum(len(n["gpus"]) for n in live if n["spot"]),
            "reserved": sum(len(n["gpus"]) for n in live if not n["spot"]),
        }
    n_spot = sum(1 for n in nodes_list if n["spot"] and n["status"] != "dead")
    n_res = sum(1 for n in nodes_list if not n["spot"] and n["status"] != "dead")
    when = (f"at {saved_at}" if saved_at else "last seen") if gone else "now"
    return Text(
        f"GPUs {when}: {gpus['spot'] + gpus['reserved']} ({gpus['spot']} spot on {_plural(n_spot, 'node')}, "
        f"{_reserved_gpus(gpus, n_res)})"
    )


def _cost_line(cost: dict, label: str = "cost so far") -> Text:
    """The cost (so far, on a live run) by GPU kind, against the same GPU-hours all on reserved GPUs."""
    line = (
        f"{label} ${cost['total_usd']:.2f}: spot {cost['spot_gpu_hours']:.2f} GPU-h × "
        f"${cost['spot_usd_per_gpu_hour']:.2f}"
        f" + reserved {cost['reserved_gpu_hours']:.2f} GPU-h × ${cost['reserved_usd_per_gpu_hour']:.2f}"
        f"; the same GPU-hours all on reserved: ${cost['all_reserved_usd']:.2f}"
    )
    if cost["all_reserved_usd"] > 0:
        line += f" (spot saves {100 * (1 - cost['total_usd'] / cost['all_reserved_usd']):.0f}%)"
    return Text(line)


def _nodes_table(nodes_list: list[dict], gone: bool, saved_at: str) -> Table:
    """One row per node: status, kind, GPUs, workers, detector health, last seen, why."""
    nodes = Table(
        title=f"nodes as last seen{f' at {saved_at}' if saved_at else ''} (not running now)" if gone else "nodes",
        expand=True,
    )
    status = "status then" if gone else "status"  # a stopped run's nodes: as they were, not alive now
    for col in ("node", status, "kind", "GPUs", "GPU ids", "workers", "detector", "last seen", "why"):
        nodes.add_column(col)
    for n in nodes_list:
        why = n.get("why", "") if n["status"] != "alive" else n.get("workers_error", "")
        given_up = set(n.get("gpus_given_up", []))
        gpu_ids = Text()
        for i, g in enumerate(n["gpus"]):
            gpu_ids.append(("," if i else "") + str(g) + ("✗" if g in given_up else ""), "red" if g in given_up else "")
        nodes.add_row(
            Text(str(n["node_id"])),
            Text(
                str(n["status"]),
                style="red" if n["status"] == "dead" else "yellow" if n["status"] == "draining" else "",
            ),
            "spot" if n["spot"] else "reserved",
            str(n.get("num_gpus", len(n["gpus"]))),
            gpu_ids,
            str(len(n["workers"])),
            "ok" if n["detector_healthy"] else Text.assemble(("unhealthy ", "red"), str(n["detector_error"])),
            Text(f"{n['last_seen_s_ago']}s {'before' if gone else 'ago'}"),
            Text(str(why)),
        )
    return nodes


def _requests_table(requests: dict) -> Table:
    """Request counts by kind (rows) and status (columns)."""
    reqs = Table(title="requests", expand=True)
    statuses = sorted({s for c in requests.values() for s in c})
    reqs.add_column("kind")
    for s in statuses:
        reqs.add_column(escape(str(s)))
    for kind, counts in requests.items():
        reqs.add_row(escape(str(kind)), *[escape(str(counts.get(s, 0))) for s in statuses])
    return reqs


def _reward_lines(snap: dict) -> Text:
    """The reward curve as a sparkline, and the last iteration's reward and phase times."""
    curve = [x for v in snap.get("reward_curve", []) if (x := _real(v)) is not None]
    m = snap.get("last_metrics") or {}
    lines = []
    if curve:
        lines.append(
            f"reward {sparkline(curve)}  min {min(curve):+.4f}  max {max(curve):+.4f}  last {curve[-1]:+.4f}  "
            f"({_plural(len(curve), 'iteration')})"
        )
    else:
        lines.append("reward: no iteration finished yet")
    if m:
        lines.append(
            f"iteration {_done(snap)}: reward {_fmt(m.get('reward/mean'), '+.4f')}  "
            f"rollout {_fmt(m.get('time/rollout_s'), '.1f', unit='s')}  "
            f"train {_fmt(m.get('time/train_s'), '.1f', unit='s')}  "
            f"explore critical {_fmt(m.get('time/explore_critical_path_s'), '.1f', unit='s')}  "
            f"spot busy {_fmt(m.get('spot/busy_fraction'), '.0f', scale=100, unit='%')}"
        )
    evals = snap.get("eval_results") or []
    evals = [e for e in evals if isinstance(e, dict) and _real(e.get("eval/score")) is not None]
    if evals:
        # the score the console's held-out lines lead with: GenEval's strict verdict where the task
        # has one (the shapes task), else the panel's mean reward (docs/evaluation.md)
        strict = all(_real(e.get("eval/strict")) is not None for e in evals)
        key, name = ("eval/strict", "strict") if strict else ("eval/score", "reward")
        scores = [float(e[key]) for e in evals]
        best = max(evals, key=lambda e: float(e[key]))
        last = evals[-1]
        lines.append(
            f"held-out {name} {sparkline(scores)}  last {scores[-1]:.3f} (v{last.get('version')})  "
            f"best {float(best[key]):.3f} (v{best.get('version')})  ({_plural(len(evals), 'evaluation')})"
        )
    return Text("\n".join(lines))


def _events_table(events: list[dict], max_events: int) -> Table:
    """The newest ``max_events`` events: time, kind, node, detail."""
    ev = Table(title=f"events (newest {min(max_events, len(events))} of {len(events)})", expand=True)
    for col in ("time", "event", "node", "detail"):
        ev.add_column(col)
    for x in events[-max_events:]:
        ev.add_row(
            hms(x.get("t_s")),
            Text(str(x.get("kind", ""))),
            Text(str(x.get("node", ""))),
            Text(str(x.get("detail", ""))),
        )
    return ev


def fetch_snapshot(endpoint: str, keys, timeout_s: float = 3.0) -> dict:
    """Ask the coordinator for a snapshot over CURVE.

    Args:
        keys: a :class:`spotlight.net.security.ClientKeys` (any role may ask for status).

    Raises:
        TimeoutError: no answer within ``timeout_s`` (the request and the wait for the answer
            together: a send that cannot go, as when the CURVE handshake failed, a wrong key,
            before the request was queued, times out too instead of blocking for ever).
    """
    import zmq

    from spotlight import protocol as P
    from spotlight.net.security import apply_client

    deadline = time.monotonic() + timeout_s
    no_answer = f"no answer from {endpoint} within {timeout_s}s"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        apply_client(sock, keys)
        sock.connect(endpoint)
        try:
            sock.send_multipart(P.encode(P.StatusRequest()))
        except zmq.Again:
            raise TimeoutError(no_answer) from None
        if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise TimeoutError(no_answer)
        mtype, body, _ = P.decode(sock.recv_multipart())
        if mtype != P.MsgType.STATUS:
            raise TimeoutError(f"unexpected reply {mtype.name}")
        return body.snapshot
    finally:
        sock.close()


def snapshot_from_run_dir(run_dir: pathlib.Path, note: str, *, running: bool = False) -> dict:
    """The last snapshot a coordinator saved (``run_dir/status.json``), its reward curve and last
    metrics row refreshed from ``metrics.jsonl`` (lines that do not parse are skipped), and
    ``source`` = ``note`` (what the renderer says about where it came from).

    ``run_dir`` is the directory read (resolved), not the one the coordinator recorded in the
    file: a copied or moved run is named where it is now.

    ``running``: whether the run's coordinator is still running (it did not answer). False
    (default) adds ``running`` = False, ``saved_unix_s`` (when the snapshot was taken) and, for
    a run that had not finished, ``eta_s`` = None: the renderer then shows a stopped run, not a
    live one. When the snapshot was taken (also the ``written`` time in ``source``): the time it
    records (its ``started_unix_s`` + ``session_elapsed_s``), else the file's time (which a copy
    of the run sets to the time of the copy).

    Raises:
        FileNotFoundError: no ``status.json`` (a run started by an older Spotlight, or one that
            ended before its first iteration).
        ValueError: ``status.json`` is not a JSON object.
    """
    path = pathlib.Path(run_dir) / "status.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the run saved no status (it ended before its first iteration, "
            "or an older Spotlight ran it)"
        )
    try:
        snap = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(snap, dict) or "nodes" not in snap or "iterations" not in snap:
        raise ValueError(f"{path}: not a Spotlight status snapshot")
    rows = []
    metrics = pathlib.Path(run_dir) / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("reward/mean"), (int, float)):
                rows.append(row)
    if len(rows) >= len(snap.get("reward_curve") or []):
        snap["reward_curve"] = [r["reward/mean"] for r in rows]
        snap["last_metrics"] = rows[-1] if rows else {}
    snap["run_dir"] = str(pathlib.Path(run_dir).resolve())
    saved = _saved_unix_s(snap)
    if saved is None:
        try:
            saved = path.stat().st_mtime
        except OSError:
            saved = None
    snap["source"] = f"{note}; showing {path}" + (f" (written {_clock(saved)})" if saved is not None else "")
    if not running:
        snap["running"] = False
        snap["saved_unix_s"] = saved
        if not snap.get("finished"):
            snap["eta_s"] = None
    return snap


def _saved_unix_s(snap: dict) -> float | None:
    """When the coordinator took ``snap`` (Unix time), as the snapshot records it: its
    coordinator's start (``started_unix_s``) plus that coordinator's run time
    (``session_elapsed_s``; an older snapshot has only ``elapsed_s``, the same then); None
    when it records neither."""
    start = _real(snap.get("started_unix_s"))
    elapsed = _real(snap.get("session_elapsed_s", snap.get("elapsed_s")))
    return start + elapsed if start is not None and elapsed is not None else None


def _not_running(run_dir: Optional[pathlib.Path], pid) -> Optional[str]:
    """None when ``pid`` (from ``run_dir/coordinator.json``) is the run's coordinator, still
    running; else why not, in words ("" when the process has simply ended): the check
    ``spotlight up --resume`` makes too (:func:`spotlight.util.coordinator_pid.coordinator_not_running`:
    a pid reused by a process that started after the file was written, a zombie or a process that
    is not Spotlight's is no coordinator)."""
    from spotlight.util.coordinator_pid import coordinator_not_running

    return coordinator_not_running(run_dir, pid)


def _gone_note(pid, why: str) -> str:
    """The line that says the run's coordinator is not running (``why``: :func:`_not_running`)."""
    if isinstance(pid, bool) or not isinstance(pid, int):
        return f"its coordinator is not running ({why}): the run has finished or stopped"
    return f"the coordinator (pid {pid}) is not running{f' ({why})' if why else ''}: the run has finished or stopped"


STATUS_HELP = (
    "Show a job: progress and ETA, nodes and GPUs, cost, events, reward curve "
    "(a running job, or a finished one from its run directory). Exit status: 0 shown; 1 the coordinator "
    "did not answer (or runs, and its coordinator.json does not say where), the run has no status.json yet, "
    "or its status.json is unreadable; "
    "2 a usage error (no such run, not a run directory, several running, bad options or keys)."
)
"""``spotlight status --help``'s text (one line: typer keeps a help text's line breaks)."""


def register(app: typer.Typer) -> None:
    @app.command(help=STATUS_HELP)
    def status(
        run_dir_arg: Optional[pathlib.Path] = path_argument(
            None, metavar="RUN_DIR", help="Run directory (same as --run-dir)."
        ),
        coordinator: Optional[str] = typer.Option(
            None, "--coordinator", "-c", help="Coordinator endpoint tcp://HOST:PORT (default: read from --run-dir)."
        ),
        run_dir: Optional[pathlib.Path] = path_option(
            None,
            "--run-dir",
            help="Run directory (its coordinator.json names the endpoint; a finished run is shown from its "
            "status.json); default: the run under runs/ whose coordinator is running (with several running, "
            "name one), else the newest.",
        ),
        watch: bool = typer.Option(False, "--watch", "-w", help="Refresh continuously (live TUI); Ctrl-C exits."),
        as_json: bool = typer.Option(False, "--json", help="Print the raw snapshot as JSON."),
        interval_s: float = typer.Option(1.0, "--interval-s", min=0.1, help="Refresh period with --watch."),
        keys: Optional[pathlib.Path] = path_option(
            None,
            "--keys",
            envvar="SPOTLIGHT_KEYS",
            help="Keys directory with server.key and a client key (default: the run directory's keys/, status.local).",
        ),
        key: Optional[str] = typer.Option(
            None, "--key", help="Which client key in --keys to use (default: the only status key)."
        ),
    ) -> None:
        """:data:`STATUS_HELP`: one snapshot (or ``--watch``), from the coordinator or the run directory.

        Exit status: 0, shown; 1 (:data:`UNREADABLE_EXIT`), the coordinator did not answer (the
        saved status is shown where there is one), the run has no ``status.json`` yet, its
        ``status.json`` is unreadable, or its ``coordinator.json`` is (also when ``status`` picks
        the run and every ``runs/*/coordinator.json`` is) and there is no saved status to show
        instead (:meth:`_View.unusable`; with one, a running coordinator exits 1, a stopped
        one 0); 2, a usage error: no such directory, no
        ``coordinator.json`` (not a run directory), no run under ``runs/``, several running,
        bad options, no usable keys.
        """
        # off a terminal (a file, a pipe) rich would cut the tables to 80 columns: node names to "reserv…"
        wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        console = Console(emoji=False, width=160) if wide else Console(emoji=False)
        if run_dir is not None and run_dir_arg is not None and run_dir.resolve() != run_dir_arg.resolve():
            # one run per call: showing one and dropping the other in silence misleads
            print_error(
                f"[red]error:[/red] RUN_DIR {escape(str(run_dir_arg))} and --run-dir {escape(str(run_dir))} "
                "name different runs: give one"
            )
            raise typer.Exit(2)
        if coordinator is not None:  # checked before anything connects: one line, not a ZeroMQ error
            from spotlight.net.endpoints import tcp_endpoint

            try:
                coordinator = tcp_endpoint(coordinator)
            except ValueError as exc:
                print_error(f"[red]error:[/red] {escape(str(exc))}")
                raise typer.Exit(2)
        rd = run_dir or run_dir_arg
        endpoint, pid, why = coordinator, None, ""
        if endpoint is None:
            rd, info, fault, why = _run_dir_info(rd)
            if info is None:  # coordinator.json cannot say where the coordinator listens
                _View(console, rd, as_json=as_json, watch=watch, interval_s=interval_s, why=why).unusable(
                    fault, file_pid(rd)
                )
                return
            endpoint, pid = info["endpoint"], info.get("pid")
            if keys is None and info.get("keys_dir"):
                keys = pathlib.Path(info["keys_dir"])
        elif rd is not None:  # by hand: the run's coordinator's pid only if it is that endpoint
            pid = _coordinator_pid(rd, endpoint)
        view = _View(console, rd, as_json=as_json, watch=watch, interval_s=interval_s, why=why)
        if rd is not None and coordinator is None:
            gone = _not_running(rd, pid)
            if gone is not None:
                view.saved(_gone_note(pid, gone))
                return
        keys_dir, client = _client_keys(keys, rd, key)
        view.live(_tcp(endpoint), client, pid, keys_dir=keys_dir, own=coordinator is None)


UNREADABLE_EXIT = 1
"""Exit status when the run directory is there but a file ``status`` needs is unreadable: a
``status.json`` that is not JSON, not a snapshot, or none yet (a ``coordinator.json`` that is
not JSON, not an object, or lacks what it must hold only when there is no ``status.json`` to
show instead). 2 is for what the command line names: no such run, no
``coordinator.json`` (not a run directory), several running, bad options."""


def read_coordinator_json(rd: pathlib.Path) -> dict:
    """``rd/coordinator.json``: a JSON object with an ``endpoint`` (a string), a ``pid`` and
    a ``keys_dir`` (a string or null) when it has them.

    Raises:
        FileNotFoundError: no such file.
        ValueError: it is unreadable or lacks what it must hold; the message says which, in words.
    """
    meta = pathlib.Path(rd) / "coordinator.json"
    try:
        text = meta.read_text()
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{meta}: not readable ({getattr(exc, 'strerror', None) or exc})") from None
    if not text.strip():  # as a write cut short (a full disk, a crash) leaves it
        raise ValueError(f"{meta}: not JSON (empty)")
    try:
        info = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{meta}: not JSON ({exc})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{meta}: not a JSON object")
    if "endpoint" not in info:
        raise ValueError(f"{meta} has no 'endpoint' (where the run's coordinator listens)")
    if not isinstance(info["endpoint"], str) or not info["endpoint"]:
        raise ValueError(f"{meta}: its 'endpoint' is {json.dumps(info['endpoint'])}, not HOST:PORT")
    if info.get("keys_dir") is not None and not isinstance(info["keys_dir"], str):
        raise ValueError(f"{meta}: its 'keys_dir' is {json.dumps(info['keys_dir'])}, not a path")
    return info


def _run_dir_info(rd: Optional[pathlib.Path]) -> tuple[pathlib.Path, Optional[dict], str, str]:
    """``(run directory, its coordinator.json, what is wrong with that file, why this run)``;
    without ``rd`` the run under ``runs/`` that :func:`pick_run` picks ("why" is then its
    reason, else ""). The file's ``endpoint`` is ``tcp://HOST:PORT``; the file is None, and
    what is wrong with it says why in words, when it cannot say where the run's coordinator
    listens (:func:`read_coordinator_json`, or an endpoint that is not ``HOST:PORT``); what is
    wrong is "" otherwise.

    Raises:
        typer.Exit: with one line: 2, no run found, several running, not a run directory;
            :data:`UNREADABLE_EXIT`, every ``runs/*/coordinator.json`` is unreadable (no ``rd``).
    """
    why = ""
    if rd is None:
        rd, why = pick_run(pathlib.Path("runs"))
    meta = pathlib.Path(rd) / "coordinator.json"
    if not pathlib.Path(rd).is_dir():
        what = "not a directory" if pathlib.Path(rd).exists() else "no such directory"
        print_error(f"[red]error:[/red] {escape(str(rd))}: {what}")
        raise typer.Exit(2)
    if not meta.is_file():
        print_error(f"[red]error:[/red] {escape(str(meta))} not found: not a Spotlight run directory")
        raise typer.Exit(2)
    from spotlight.net.endpoints import tcp_endpoint

    try:
        info = read_coordinator_json(rd)
    except (OSError, ValueError) as exc:
        return rd, None, str(exc), why
    try:
        info["endpoint"] = tcp_endpoint(info["endpoint"])
    except ValueError:
        return rd, None, f"{meta}: its 'endpoint' {json.dumps(info['endpoint'])} is not HOST:PORT", why
    return rd, info, "", why


def _coordinator_pid(run_dir: pathlib.Path, endpoint: Optional[str] = None):
    """The pid in ``run_dir/coordinator.json`` (None: none readable); with ``endpoint``, only if
    the file names that endpoint (``tcp://`` or not)."""
    try:
        info = read_coordinator_json(run_dir)
    except (OSError, ValueError):
        return None
    if endpoint is not None and _tcp(info["endpoint"]) != _tcp(endpoint):
        return None
    return info.get("pid")


def _tcp(endpoint: str) -> str:
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"


def _listed(paths: list, shown: int = 3) -> str:
    names = ", ".join(str(p) for p in paths[:shown])
    return names + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def pick_run(runs: pathlib.Path) -> tuple[pathlib.Path, str]:
    """The run ``status`` shows when it is given none: the one whose coordinator is running, or,
    with none running, the newest (by its ``coordinator.json``); and the reason, for the screen.
    Runs whose ``coordinator.json`` is unreadable (:func:`read_coordinator_json`) are skipped,
    and the reason names them; when every run's is, the newest that saved a ``status.json``.

    Raises:
        typer.Exit: with one line: 2, no run under ``runs`` or several running (which to show is
            the user's choice: the line names them); :data:`UNREADABLE_EXIT`, every run's
            ``coordinator.json`` is unreadable and none saved its status (the line says why, for each).
    """
    found, bad = [], []
    for meta in runs.glob("*/coordinator.json"):
        try:
            info = read_coordinator_json(meta.parent)
            found.append((meta.stat().st_mtime, meta.parent, info))
        except (OSError, ValueError) as exc:
            bad.append((meta.parent, exc, meta.stat().st_mtime if meta.exists() else 0.0))
    if not found and not bad:
        print_error(f"[red]error:[/red] no --coordinator or RUN_DIR given and no {runs}/*/coordinator.json found")
        raise typer.Exit(2)
    if not found:
        # a crash can leave every coordinator.json unreadable; the newest run that saved its
        # status is then shown from it (with a warning naming the fault: _View.unusable)
        saved = sorted((m, d) for d, _, m in bad if (d / "status.json").is_file())
        if saved:
            return saved[-1][1], f"the newest run under {runs}/ that saved its status; no coordinator.json is readable"
        why = "; ".join(escape(str(exc)) for _, exc, _ in sorted(bad, key=lambda b: str(b[0])))
        print_error(
            f"[red]error:[/red] no --coordinator or RUN_DIR given and no readable {runs}/*/coordinator.json: {why}"
        )
        raise typer.Exit(UNREADABLE_EXIT)
    found.sort(key=lambda f: f[0], reverse=True)
    skipped = f"; skipped {_listed(sorted(str(d) for d, _, _ in bad))} (coordinator.json unreadable)" if bad else ""
    running = [d for _, d, info in found if _not_running(d, info.get("pid")) is None]
    if len(running) > 1:
        names = ", ".join(escape(str(d)) for d in running)
        print_error(
            f"[red]error:[/red] {len(running)} runs are running ({names}): name one, "
            f"e.g. [cyan]{escape(shlex.join(['spotlight', 'status', str(running[0])]))}[/cyan]"
        )
        raise typer.Exit(2)
    if running:
        return running[0], f"the only running run under {runs}/{skipped}"
    others = f" of {len(found)}" if len(found) > 1 else ""
    return found[0][1], f"the newest run{others} under {runs}/; none is running{skipped}"


def _client_keys(keys: Optional[pathlib.Path], rd: Optional[pathlib.Path], key: Optional[str]):
    """``(keys directory, client keys)``: the keys ``status`` asks with, ``key`` (default: the
    only status key) in ``keys`` (default: the run directory's ``keys/``).

    Raises:
        typer.Exit: 2 with one line: no keys directory, or no usable key in it.
    """
    from spotlight.net.security import KeysError, load_client_keys

    keys_dir = keys or (pathlib.Path(rd) / "keys" if rd is not None else None)
    if keys_dir is None:
        print_error(
            "[red]error:[/red] --coordinator needs --keys DIR (server.key and a client key; README 'Security model')"
        )
        raise typer.Exit(2)
    try:
        return keys_dir, load_client_keys(keys_dir, name=key, role=None if key else "status")
    except KeysError as exc:
        print_error(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)


def _same_dir(recorded, rd: pathlib.Path) -> bool:
    """Whether the run directory a coordinator recorded (``recorded``) is ``rd`` (the same
    directory, by any path); False when ``recorded`` does not exist here (a copy's original
    that was removed, a path on another machine) and its path differs."""
    try:
        return os.path.samefile(str(recorded), rd)
    except (OSError, ValueError, TypeError):
        try:
            return pathlib.Path(str(recorded)).resolve() == pathlib.Path(rd).resolve()
        except (OSError, ValueError, RuntimeError):
            return False


def _key_hint(client, keys_dir) -> str:
    """The cause of a silent coordinator that is not the network: CURVE drops, without a word,
    a request from a key not on its allow-list, or one made with another coordinator's public key."""
    principal = getattr(getattr(client, "principal", None), "id", None) or "the client key"
    if keys_dir is None:
        return f"it does not take {principal}: not on its allow-list, or the server.key used is not this coordinator's"
    where = pathlib.Path(keys_dir)
    return (
        f"it does not take the key {principal} of {where}: that key is not on its allow-list, "
        f"or {where / 'server.key'} is not this coordinator's"
    )


class _View:
    """How ``status`` shows snapshots: once (``--json`` prints the raw snapshot) or, with
    ``--watch``, refreshed every ``interval_s`` in a ``rich.live.Live`` until Ctrl-C."""

    def __init__(
        self,
        console: Console,
        rd: Optional[pathlib.Path],
        *,
        as_json: bool,
        watch: bool,
        interval_s: float,
        why: str = "",
    ):
        self.console, self.rd, self.why = console, rd, why
        self.other = ""  # the live coordinator's run directory, when it is not ``rd`` (--coordinator by hand)
        self.notes = Console(stderr=True, emoji=False)  # what --watch did instead, beside the snapshot
        self.as_json, self.watch, self.interval_s = as_json, watch, interval_s

    def named(self, snap: dict) -> dict:
        """``snap`` with the run directory it is of (``run_dir``) and why ``status`` chose it
        (``run_dir_note``). The directory is the one this command was given (resolved), as the
        user knows it; a coordinator's own record of it is shown only where it is another
        directory (a coordinator named with --coordinator that runs another run), or where no
        directory was given."""
        if self.rd is not None and (not snap.get("run_dir") or _same_dir(snap["run_dir"], self.rd)):
            snap["run_dir"] = str(pathlib.Path(self.rd).resolve())
        notes = [n for n in (self.other, self.why) if n]
        if notes:
            snap["run_dir_note"] = "; ".join(notes)
        return snap

    def show(self, snap: dict) -> None:
        snap = self.named(snap)
        if self.as_json:
            self.console.print_json(json.dumps(snap))
        else:
            self.console.print(render_status(snap))

    def from_files(self, note: str, running: bool = False, hint: str = "") -> dict:
        """:func:`snapshot_from_run_dir` of the run directory (``hint``: a line shown under
        ``note``, e.g. what else may keep a coordinator from answering).

        Raises:
            typer.Exit: :data:`UNREADABLE_EXIT` with one line: it saved no readable status.
        """
        try:
            snap = snapshot_from_run_dir(pathlib.Path(self.rd), note, running=running)
        except (FileNotFoundError, ValueError) as exc:
            print_error(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(UNREADABLE_EXIT)
        if hint:
            snap["hint"] = hint
        return snap

    def _watch(self, snapshot, first: dict) -> None:
        """Render ``first``, then ``snapshot()`` every ``interval_s``, in a live view; returns on Ctrl-C."""
        from rich.live import Live

        try:
            with Live(render_status(self.named(first)), console=self.console, refresh_per_second=4) as live:
                while True:
                    time.sleep(self.interval_s)
                    live.update(render_status(self.named(snapshot())))
        except KeyboardInterrupt:
            return

    def saved(self, note: str) -> None:
        """The run as its coordinator last saved it (the coordinator is not running): shown once,
        also with ``--watch`` — nothing will change it until a coordinator runs again."""
        if self.watch and not self.as_json:
            self.notes.print("--watch: the coordinator is not running; its last saved status:")
        self.show(self.from_files(note))

    def unusable(self, fault: str, pid) -> None:
        """The run as its coordinator last saved it, when its ``coordinator.json`` cannot say
        where that coordinator listens (``fault``: why, in words): a stopped or crashed run's
        saved status is what is wanted then. A ``warning:`` line on standard error names the
        fault; the run shows as stopped, or, when ``pid`` (the file's, where it names one) is
        still the run's coordinator (:func:`_not_running`), as running but not asked.

        Raises:
            typer.Exit: :data:`UNREADABLE_EXIT` with one ``error:`` line naming both faults, when
                the run saved no readable status either; 1 after the saved status of a
                coordinator that runs (its live status could not be had).
        """
        meta = pathlib.Path(self.rd) / "coordinator.json"
        running = _not_running(self.rd, pid) is None
        if running:
            note = f"the coordinator (pid {pid}) is running, but {meta} does not say where it listens"
        else:
            note = f"{meta} does not say where its coordinator listens: the run is shown from its saved status"
        try:
            snap = snapshot_from_run_dir(pathlib.Path(self.rd), note, running=running)
        except (FileNotFoundError, ValueError) as exc:
            print_error(f"{ERROR} {escape(fault)}; and {escape(str(exc))}")
            raise typer.Exit(UNREADABLE_EXIT)
        print_error(f"{WARNING} {escape(fault)}; showing the run's last saved status")
        if running:
            snap["hint"] = "ask it with spotlight status --coordinator HOST:PORT --keys DIR"
        self.show(snap)
        if running:
            raise typer.Exit(1)

    def live(self, endpoint: str, client, pid, *, keys_dir=None, own: bool = False) -> None:
        """The running coordinator's snapshots over CURVE; one that does not answer falls back
        to the run directory's saved status (exit 1). ``pid``: the run's coordinator's, when
        ``endpoint`` is its endpoint (None: unknown, e.g. an endpoint given with --coordinator
        that is not the run's). ``keys_dir``: where ``client`` (the keys) came from. ``own``:
        ``endpoint`` is the one the run directory's ``coordinator.json`` names; a coordinator
        there that records another run directory (this one is a copy, or was moved) is then not
        this run's, and the run directory's saved status is shown instead.

        Raises:
            typer.Exit: 1 when the coordinator did not answer.
        """
        try:
            first = fetch_snapshot(endpoint, client)
            recorded = first.get("run_dir")
            if self.rd is not None and recorded and not _same_dir(recorded, self.rd):
                if own:
                    self.saved(
                        f"the coordinator at {endpoint} (pid {pid}) runs {recorded}, not this directory "
                        "(a copy of that run, or moved since it started)"
                    )
                    return
                self.other = f"the coordinator at {endpoint} runs this directory, not {pathlib.Path(self.rd).resolve()}"
            if self.watch and not self.console.is_terminal:  # a Live view draws nothing into a pipe or file
                self.notes.print("--watch needs a terminal: one snapshot instead (--json for scripts)")
            if not self.watch or not self.console.is_terminal:
                self.show(first)
                return
            self._watch(lambda: fetch_snapshot(endpoint, client), first)
        except TimeoutError as exc:
            self._no_answer(endpoint, pid, exc, _key_hint(client, keys_dir))
        except KeyboardInterrupt:
            return

    def _no_answer(self, endpoint: str, pid, exc: TimeoutError, hint: str) -> None:
        """The coordinator at ``endpoint`` did not answer: the run directory's saved status, with
        a note that says so (and ``hint``: another cause than a stopped or unreachable
        coordinator), else one error line.

        Raises:
            typer.Exit: 1, always.
        """
        if self.rd is not None and (pathlib.Path(self.rd) / "status.json").is_file():
            if _not_running(self.rd, pid) is None:
                note = f"the coordinator (pid {pid}) is running but did not answer: {exc}"
                self.show(self.from_files(note, running=True, hint=f"if it is not busy, {hint}"))
                raise typer.Exit(1)
            # not the run's own coordinator, or no pid known: no claim that anything runs
            said, prefix = str(exc), f"no answer from {endpoint} "
            note = f"the coordinator at {endpoint} did not answer" + (
                f" {said[len(prefix) :]}" if said.startswith(prefix) else f": {said}"
            )
            running = _not_running(self.rd, _coordinator_pid(pathlib.Path(self.rd))) is None
            self.show(self.from_files(note, running=running, hint=f"it is not running, not reachable, or {hint}"))
            raise typer.Exit(1)
        msg = f"{exc} (the run has finished, its coordinator is not reachable, or {hint})"
        if self.as_json:
            print(json.dumps({"error": msg}))
        else:
            print_error(f"[red]error:[/red] {escape(msg)}")
        raise typer.Exit(1)
