"""benchmarks/shapes_binding.py refuses bad arguments with one line and exit 2, before sampling
anything, and its table rows read the counts right."""

from __future__ import annotations

import pathlib
import sys

import pytest

from tests.factories import load_benchmark

BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"
REPO = BENCH.parent


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("shapes_binding")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--seeds", "0"], "--seeds 0"),
        (["--threads", "-1"], "--threads -1"),
        (["--pairs", "0", "--probe", "likelihood"], "--pairs 0"),
        (["--config", "/nonexistent.toml"], "not found"),
        (["--config", str(REPO / "examples/jpeg-toy/config.toml")], "not a shapes-task config"),
        (["--weights", "/nonexistent/final"], "/nonexistent/final: no such file or directory"),
        (["--prompts", "/nonexistent.jsonl"], "--prompts"),
        (["--prompts", str(REPO / "spotlight/tasks/shapes/prompts/test.jsonl"), "--seeds", "-3"], "--seeds -3"),
    ],
)
def test_bad_arguments_fail_with_one_line(bench, monkeypatch, capsys, argv, says):
    monkeypatch.setattr(sys, "argv", ["shapes_binding.py", *argv])
    sampled = []
    from spotlight.tasks.shapes import evaluate

    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: sampled.append(a))
    monkeypatch.setattr(evaluate, "likelihood_margins", lambda *a, **k: sampled.append(a))
    assert bench.main() == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and says in err and len(err.splitlines()) == 1
    assert not sampled


@pytest.mark.parametrize(
    "text",
    ["a photo of a circle\n", "a photo of a red circle and a blue circle\na photo of a circle left of a circle\n"],
)
def test_prompts_without_binding_kinds_are_refused(bench, monkeypatch, capsys, tmp_path, text):
    prompts = tmp_path / "single.txt"
    prompts.write_text(text)
    monkeypatch.setattr(sys, "argv", ["shapes_binding.py", "--prompts", str(prompts)])
    from spotlight.tasks.shapes import evaluate

    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: pytest.fail("sampled"))
    assert bench.main() == 2
    err = capsys.readouterr().err.strip()
    assert "no colour-attribution or position prompts" in err and len(err.splitlines()) == 1


def test_rows_show_the_share_and_its_interval(bench):
    counts = {
        "color_attr": {"images": 240, "both_shapes_once": 68, "both_colors": 53, "bound_right": 29},
        "position": {"images": 48, "both_shapes_once": 0, "on_axis": 0, "relation_right": 0},
    }
    ca, pos = bench.rows("base", counts)
    assert ca.startswith("| base | color_attr | 240 | 0.28 | 53 | 29 | 0.55 [0.41, 0.67] |")
    assert "| 0 | 0 | nan [nan, nan] |" in pos


def test_the_likelihood_table_has_a_column_per_sigma(bench):
    rows = [
        {"kind": k, "sigma": s, "pairs": 8, "loss": 0.1, "margin": m, "stderr": 0.01, "accuracy": a}
        for k, m, a in (("colors", 0.1, 0.95), ("color_attr", -0.004, 0.5))
        for s in (0.5, 0.8)
    ]
    head, rule, colors, attr = bench.likelihood_table([("base", rows)])
    assert head.startswith("| model | kind | pairs | σ 0.5 | σ 0.8 |") and rule == "|---|---|---|---|---|"
    assert colors == "| base | colors | 8 | +100 % (0.95) | +100 % (0.95) |"
    assert attr == "| base | color_attr | 8 | -4 % (0.50) | -4 % (0.50) |"
