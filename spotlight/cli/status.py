"""``spotlight status``: one snapshot of a running coordinator, or a live TUI with --watch.

Data comes from one STATUS_REQUEST → STATUS round trip (``spotlight/protocol.py``);
:func:`render_status` is a pure function of that snapshot.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Optional

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in vals[-60:])


def render_status(snap: dict):
    """Rich renderable for a coordinator snapshot (pure).

    Every string from the snapshot (node ids, statuses, detector errors, request kinds) is
    agent- or coordinator-controlled text: it is escaped (``rich.markup.escape``) or placed in
    a ``Text``, never parsed as markup, so ``[/]`` in a node id shows as ``[/]``.
    """
    e = lambda v: escape(str(v))  # noqa: E731
    head = Text.assemble(
        ("Spotlight  ", "bold"),
        f"phase {snap['phase']}  iteration {snap['iteration'] + 1}/{snap['iterations']}  weights v{snap['version']}",
    )
    nodes = Table(title="nodes", expand=True)
    for col in ("node", "status", "kind", "GPUs", "workers", "detector", "last seen"):
        nodes.add_column(col)
    for n in snap["nodes"]:
        nodes.add_row(
            e(n["node_id"]), e(n["status"]), "spot" if n["spot"] else "reserved", e(",".join(map(str, n["gpus"]))), e(len(n["workers"])),
            "ok" if n["detector_healthy"] else f"[red]unhealthy[/red] {e(n['detector_error'])}", f"{e(n['last_seen_s_ago'])}s",
        )
    reqs = Table(title="requests", expand=True)
    statuses = sorted({s for c in snap["requests"].values() for s in c})
    reqs.add_column("kind")
    for s in statuses:
        reqs.add_column(e(s))
    for kind, counts in snap["requests"].items():
        reqs.add_row(e(kind), *[e(counts.get(s, 0)) for s in statuses])
    m = snap.get("last_metrics") or {}
    lines = [f"reward curve {sparkline(snap.get('reward_curve', []))}"]
    if m:
        lines.append(
            f"last iteration: reward {m.get('reward/mean', float('nan')):+.4f}  rollout {m.get('time/rollout_s', 0):.1f}s  "
            f"train {m.get('time/train_s', 0):.1f}s  explore critical {m.get('time/explore_critical_path_s', 0):.1f}s  "
            f"spot busy {100 * m.get('spot/busy_fraction', float('nan')):.0f}%  cost ${m.get('cost/usd', 0):.4f}"
        )
    return Group(head, nodes, reqs, Text("\n".join(lines)))


def fetch_snapshot(endpoint: str, keys, timeout_s: float = 3.0) -> dict:
    """Ask the coordinator for a snapshot over CURVE.

    Args:
        keys: a :class:`spotlight.security.ClientKeys` (any role may ask for status).

    Raises:
        TimeoutError: no answer within ``timeout_s``.
    """
    import zmq

    from spotlight import protocol as P
    from spotlight.security import apply_client

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


def register(app: typer.Typer) -> None:
    @app.command()
    def status(
        coordinator: Optional[str] = typer.Option(None, "--coordinator", "-c", help="Coordinator endpoint tcp://HOST:PORT (default: read from --run-dir)."),
        run_dir: Optional[pathlib.Path] = typer.Option(None, "--run-dir", help="Run directory of a local run (its coordinator.json names the endpoint); default: newest under runs/."),
        watch: bool = typer.Option(False, "--watch", "-w", help="Refresh continuously (live TUI); Ctrl-C exits."),
        as_json: bool = typer.Option(False, "--json", help="Print the raw snapshot as JSON."),
        interval_s: float = typer.Option(1.0, "--interval-s", help="Refresh period with --watch."),
        keys: Optional[pathlib.Path] = typer.Option(None, "--keys", envvar="SPOTLIGHT_KEYS", help="Keys directory with server.key and a client key (default: the run directory's keys/, status.local)."),
        key: Optional[str] = typer.Option(None, "--key", help="Which client key in --keys to use (default: the only status key)."),
    ) -> None:
        """Show nodes, request queues, weights version and the reward curve of a running job."""
        console = Console()
        endpoint = coordinator
        rd = run_dir
        if endpoint is None:
            if rd is None:
                runs = sorted(pathlib.Path("runs").glob("*/coordinator.json"), key=lambda p: p.stat().st_mtime)
                if not runs:
                    console.print("[red]error:[/red] no --coordinator given and no runs/*/coordinator.json found")
                    raise typer.Exit(2)
                rd = runs[-1].parent
            meta = pathlib.Path(rd) / "coordinator.json"
            if not meta.is_file():
                console.print(f"[red]error:[/red] {meta} not found: not a Spotlight run directory")
                raise typer.Exit(2)
            info = json.loads(meta.read_text())
            endpoint = info["endpoint"]
            if keys is None and info.get("keys_dir"):
                keys = pathlib.Path(info["keys_dir"])
        if "://" not in endpoint:
            endpoint = f"tcp://{endpoint}"
        from spotlight.security import KeysError, load_client_keys

        keys_dir = keys or (pathlib.Path(rd) / "keys" if rd is not None else None)
        if keys_dir is None:
            console.print("[red]error:[/red] --coordinator needs --keys DIR (server.key and a client key; README 'Security model')")
            raise typer.Exit(2)
        try:
            client = load_client_keys(keys_dir, name=key, role=None if key else "status")
        except KeysError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2)
        try:
            if not watch:
                snap = fetch_snapshot(endpoint, client)
                console.print_json(json.dumps(snap)) if as_json else console.print(render_status(snap))
                return
            from rich.live import Live

            with Live(render_status(fetch_snapshot(endpoint, client)), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(interval_s)
                    live.update(render_status(fetch_snapshot(endpoint, client)))
        except TimeoutError as exc:
            msg = f"{exc} (the run has finished, or its coordinator is not reachable)"
            if as_json:
                print(json.dumps({"error": msg}))
            else:
                console.print(f"[red]error:[/red] {msg}")
            raise typer.Exit(1)
        except KeyboardInterrupt:
            return
