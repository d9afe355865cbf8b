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

from spotlight.cli.messages import print_error

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
    for col in ("node", "status", "kind", "GPUs", "GPU ids", "workers", "detector", "last seen", "why"):
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
        TimeoutError: no answer within ``timeout_s``.
    """
    import zmq

    from spotlight import protocol as P
    from spotlight.net.security import apply_client

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    apply_client(sock, keys)
    sock.connect(endpoint)
    try:
        sock.send_multipart(P.encode(P.StatusRequest()))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from {endpoint} within {timeout_s}s")
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

    ``running``: whether the run's coordinator is still running (it did not answer). False
    (default) adds ``running`` = False, ``saved_unix_s`` (when the snapshot was taken: its
    ``started_unix_s`` + ``elapsed_s``, else the file's time) and, for a run that had not
    finished, ``eta_s`` = None: the renderer then shows a stopped run, not a live one.

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
    mtime = path.stat().st_mtime
    snap["source"] = f"{note}; showing {path} (written {_clock(mtime)})"
    if not running:
        start, elapsed = (
            _real(snap.get("started_unix_s")),
            _real(snap.get("session_elapsed_s", snap.get("elapsed_s"))),
        )  # this coordinator's start
        snap["running"] = False
        snap["saved_unix_s"] = start + elapsed if start is not None and elapsed is not None else mtime
        if not snap.get("finished"):
            snap["eta_s"] = None
    return snap


def _pid_running(pid) -> bool:
    import psutil

    try:
        return (
            isinstance(pid, int)
            and pid > 0
            and psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        )
    except psutil.Error:
        return False


STATUS_HELP = (
    "Show a job: progress and ETA, nodes and GPUs, cost, events, reward curve "
    "(a running job, or a finished one from its run directory)."
)
"""``spotlight status --help``'s text (one line: typer keeps a help text's line breaks)."""


def register(app: typer.Typer) -> None:
    @app.command(help=STATUS_HELP)
    def status(
        run_dir_arg: Optional[pathlib.Path] = typer.Argument(
            None, metavar="RUN_DIR", help="Run directory (same as --run-dir)."
        ),
        coordinator: Optional[str] = typer.Option(
            None, "--coordinator", "-c", help="Coordinator endpoint tcp://HOST:PORT (default: read from --run-dir)."
        ),
        run_dir: Optional[pathlib.Path] = typer.Option(
            None,
            "--run-dir",
            help="Run directory (its coordinator.json names the endpoint; a finished run is shown from its "
            "status.json); default: the run under runs/ whose coordinator is running (with several running, "
            "name one), else the newest.",
        ),
        watch: bool = typer.Option(False, "--watch", "-w", help="Refresh continuously (live TUI); Ctrl-C exits."),
        as_json: bool = typer.Option(False, "--json", help="Print the raw snapshot as JSON."),
        interval_s: float = typer.Option(1.0, "--interval-s", min=0.1, help="Refresh period with --watch."),
        keys: Optional[pathlib.Path] = typer.Option(
            None,
            "--keys",
            envvar="SPOTLIGHT_KEYS",
            help="Keys directory with server.key and a client key (default: the run directory's keys/, status.local).",
        ),
        key: Optional[str] = typer.Option(
            None, "--key", help="Which client key in --keys to use (default: the only status key)."
        ),
    ) -> None:
        """:data:`STATUS_HELP`: one snapshot (or ``--watch``), from the coordinator or the run directory."""
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
            rd, endpoint, info, why = _run_dir_info(rd)
            pid = info.get("pid")
            if keys is None and info.get("keys_dir"):
                keys = pathlib.Path(info["keys_dir"])
        elif rd is not None:  # by hand: the run's coordinator's pid only if it is that endpoint
            pid = _coordinator_pid(rd, endpoint)
        view = _View(console, rd, as_json=as_json, watch=watch, interval_s=interval_s, why=why)
        if rd is not None and coordinator is None and not _pid_running(pid):
            view.saved(f"the coordinator (pid {pid}) is not running: the run has finished or stopped")
            return
        view.live(_tcp(endpoint), _client_keys(keys, rd, key), pid)


def _run_dir_info(rd: Optional[pathlib.Path]) -> tuple[pathlib.Path, str, dict, str]:
    """``(run directory, its coordinator's endpoint, its coordinator.json, why this run)``;
    without ``rd`` the run under ``runs/`` that :func:`pick_run` picks ("why" is then its
    reason, else "").

    Raises:
        typer.Exit: 2 with one line: no run found, several running, not a run directory, or an
            unreadable ``coordinator.json``.
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
    try:
        info = json.loads(meta.read_text())
        endpoint = info["endpoint"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print_error(f"[red]error:[/red] {escape(str(meta))}: not readable ({escape(str(exc))})")
        raise typer.Exit(2)
    return rd, endpoint, info, why


def _coordinator_pid(run_dir: pathlib.Path, endpoint: Optional[str] = None):
    """The pid in ``run_dir/coordinator.json`` (None: none readable); with ``endpoint``, only if
    the file names that endpoint (``tcp://`` or not)."""
    try:
        info = json.loads((pathlib.Path(run_dir) / "coordinator.json").read_text())
        if endpoint is not None and _tcp(str(info["endpoint"])) != _tcp(endpoint):
            return None
        return info.get("pid")
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _tcp(endpoint: str) -> str:
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"


def pick_run(runs: pathlib.Path) -> tuple[pathlib.Path, str]:
    """The run ``status`` shows when it is given none: the one whose coordinator is running, or,
    with none running, the newest (by its ``coordinator.json``); and the reason, for the screen.

    Raises:
        typer.Exit: 2 with one line: no run under ``runs``, or several running (which to show is
            the user's choice: the line names them).
    """
    found = sorted(runs.glob("*/coordinator.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not found:
        print_error(f"[red]error:[/red] no --coordinator or RUN_DIR given and no {runs}/*/coordinator.json found")
        raise typer.Exit(2)
    running = [p.parent for p in found if _pid_running(_coordinator_pid(p.parent))]
    if len(running) > 1:
        names = ", ".join(escape(str(d)) for d in running)
        print_error(
            f"[red]error:[/red] {len(running)} runs are running ({names}): name one, "
            f"e.g. [cyan]{escape(shlex.join(['spotlight', 'status', str(running[0])]))}[/cyan]"
        )
        raise typer.Exit(2)
    if running:
        return running[0], f"the only running run under {runs}/"
    others = f" of {len(found)}" if len(found) > 1 else ""
    return found[0].parent, f"the newest run{others} under {runs}/; none is running"


def _client_keys(keys: Optional[pathlib.Path], rd: Optional[pathlib.Path], key: Optional[str]):
    """The client keys ``status`` asks with: ``key`` (default: the only status key) in ``keys``
    (default: the run directory's ``keys/``).

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
        return load_client_keys(keys_dir, name=key, role=None if key else "status")
    except KeysError as exc:
        print_error(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)


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
        self.notes = Console(stderr=True, emoji=False)  # what --watch did instead, beside the snapshot
        self.as_json, self.watch, self.interval_s = as_json, watch, interval_s

    def named(self, snap: dict) -> dict:
        """``snap`` with the run directory it is of (``run_dir``: the coordinator's own, else the
        one this command read) and why ``status`` chose it (``run_dir_note``)."""
        if self.rd is not None and not snap.get("run_dir"):
            snap["run_dir"] = str(self.rd)
        if self.why:
            snap["run_dir_note"] = self.why
        return snap

    def show(self, snap: dict) -> None:
        snap = self.named(snap)
        if self.as_json:
            self.console.print_json(json.dumps(snap))
        else:
            self.console.print(render_status(snap))

    def from_files(self, note: str, running: bool = False) -> dict:
        """:func:`snapshot_from_run_dir` of the run directory.

        Raises:
            typer.Exit: 1 with one line: it saved no readable status.
        """
        try:
            return snapshot_from_run_dir(pathlib.Path(self.rd), note, running=running)
        except (FileNotFoundError, ValueError) as exc:
            print_error(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(1)

    def _watch(self, snapshot) -> None:
        """Render ``snapshot()`` in a live view, refreshed every ``interval_s``; returns on Ctrl-C."""
        from rich.live import Live

        try:
            with Live(render_status(self.named(snapshot())), console=self.console, refresh_per_second=4) as live:
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

    def live(self, endpoint: str, client, pid) -> None:
        """The running coordinator's snapshots over CURVE; one that does not answer falls back
        to the run directory's saved status (exit 1). ``pid``: the run's coordinator's, when
        ``endpoint`` is its endpoint (None: unknown, e.g. an endpoint given with --coordinator
        that is not the run's).

        Raises:
            typer.Exit: 1 when the coordinator did not answer.
        """
        try:
            if self.watch and not self.console.is_terminal:  # a Live view draws nothing into a pipe or file
                self.notes.print("--watch needs a terminal: one snapshot instead (--json for scripts)")
            if not self.watch or not self.console.is_terminal:
                self.show(fetch_snapshot(endpoint, client))
                return
            self._watch(lambda: fetch_snapshot(endpoint, client))
        except TimeoutError as exc:
            if self.rd is not None and (pathlib.Path(self.rd) / "status.json").is_file():
                if _pid_running(pid):
                    note = f"the coordinator (pid {pid}) is running but did not answer: {exc}"
                    self.show(self.from_files(note, running=True))
                    raise typer.Exit(1)
                # not the run's own coordinator, or no pid known: no claim that anything runs
                said, prefix = str(exc), f"no answer from {endpoint} "
                note = f"the coordinator at {endpoint} did not answer" + (
                    f" {said[len(prefix) :]}" if said.startswith(prefix) else f": {said}"
                )
                self.show(self.from_files(note, running=_pid_running(_coordinator_pid(pathlib.Path(self.rd)))))
                raise typer.Exit(1)
            msg = f"{exc} (the run has finished, or its coordinator is not reachable)"
            if self.as_json:
                print(json.dumps({"error": msg}))
            else:
                print_error(f"[red]error:[/red] {escape(msg)}")
            raise typer.Exit(1)
        except KeyboardInterrupt:
            return
