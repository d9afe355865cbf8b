"""``spotlight status`` renders agent-controlled strings as text, never as Rich markup."""

from __future__ import annotations

from rich.console import Console

from spotlight.cli.status import render_status

NASTY = ["[/]", "[bold red]boom[/bold red]", "[link=http://x]y[/link]", "trailing\\", "[/red]"]


def snapshot():
    nodes = [{"node_id": nid, "status": "[/]alive", "spot": i % 2 == 0, "gpus": [0, 1], "workers": ["w"],
              "detector_healthy": False, "detector_error": f"gcp: HTTP 503 on [/] {nid}", "last_seen_s_ago": 1.5}
             for i, nid in enumerate(NASTY)]
    return {"phase": "explore", "iteration": 0, "iterations": 3, "version": 1, "nodes": nodes,
            "requests": {"[/]explore": {"[/]done": 2, "leased": 1}}, "reward_curve": [0.1, 0.2],
            "last_metrics": {"reward/mean": 0.25}}


def test_render_status_shows_markup_like_strings_verbatim():
    console = Console(record=True, width=400, color_system=None)
    console.print(render_status(snapshot()))  # `[/]` in a node id raised MarkupError before
    text = console.export_text()
    for nid in NASTY:
        assert nid in text
        assert f"gcp: HTTP 503 on [/] {nid}" in text
    assert "[/]alive" in text and "[/]explore" in text and "[/]done" in text
    assert "unhealthy" in text and "[red]" not in text  # our own markup still applies
