"""``cluster.min_spot_nodes`` / ``spotlight up --min-spot-nodes``: iteration 1 waits for that many
spot agents, with a console line per change and a status note (the coordinator is only built,
never started: no socket is served, no process spawned)."""

from __future__ import annotations

from rich.console import Console
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.cli.status import render_status
from spotlight.config import EXAMPLES_DIR, ConfigError, load_config
from spotlight.coordinator.status import snapshot
from tests.factories import toy_coordinator

TOY = EXAMPLES_DIR / "jpeg-toy" / "config.toml"


def _coordinator(tmp_path, said: list, **overrides):
    return toy_coordinator(tmp_path / "run", progress=said.append, **overrides)


def test_iteration_1_waits_with_a_console_line_per_change_and_a_status_note(tmp_path):
    said: list[str] = []
    coord = _coordinator(tmp_path, said, **{"cluster.min_spot_nodes": 2})
    coord.instances.register("reserved-0", "s0", [0], False, 0.0)
    coord._say_waiting(0.0)
    coord._say_waiting(0.5)  # nothing changed: said once
    assert said == [
        "waiting for spot nodes: 0 of 2 alive (cluster.min_spot_nodes); iteration 1 starts when 2 more join"
    ]
    assert not coord.observation().num_spot_nodes
    snap = snapshot(coord, 1.0)
    assert snap["waiting"] == said[0]
    console = Console(width=200, record=True)
    console.print(render_status(snap))
    assert "waiting for spot nodes: 0 of 2 alive" in console.export_text()  # `spotlight status` says so
    coord.instances.register("spot-0", "s1", [0], True, 1.0)
    coord._say_waiting(1.0)
    assert said[-1].startswith("waiting for spot nodes: 1 of 2 alive") and coord.observation().num_spot_nodes == 1
    coord.instances.register("spot-1", "s2", [0], True, 2.0)
    coord._say_waiting(2.0)
    assert len(said) == 2 and coord.waiting_for_spot_nodes() is None and snapshot(coord, 2.0)["waiting"] is None


def test_default_does_not_wait(tmp_path):
    said: list[str] = []
    coord = _coordinator(tmp_path, said)
    coord._say_waiting(0.0)
    assert said == [] and coord.waiting_for_spot_nodes() is None


def test_min_spot_nodes_is_refused_where_it_would_wait_for_ever(tmp_path):
    import pytest

    with pytest.raises(ConfigError, match="cluster.min_spot_nodes.*use_spot = false"):
        load_config(TOY, overrides={"cluster.min_spot_nodes": 1, "cluster.use_spot": False})
    res = CliRunner().invoke(
        app, ["up", "--local", "--config", str(TOY), "--min-spot-nodes", "3", "--run-dir", str(tmp_path / "r")]
    )
    assert res.exit_code == 2, res.output
    assert "--min-spot-nodes 3: --local starts 2 spot agents" in " ".join(res.output.split())
    assert not (tmp_path / "r").exists()
