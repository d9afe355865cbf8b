"""CLI error messages name where the bad value came from (a flag, not a config key)."""

from __future__ import annotations

from typer.testing import CliRunner

from spotlight.cli import app

runner = CliRunner()


def test_eval_prompts_missing_file_names_the_flag(tmp_path):
    res = runner.invoke(app, ["eval", "--prompts", str(tmp_path / "nope.jsonl")])
    assert res.exit_code != 0
    out = " ".join(res.output.split())
    assert "--prompts: file not found" in out, res.output
    assert "data.prompts_path" not in out


def test_eval_with_bad_weights_fails_before_any_sampling(tmp_path, monkeypatch):
    """Was: the whole base model was evaluated (68 s) before `cannot load final weights`."""
    import pytest

    from spotlight.tasks.shapes import evaluate as ev

    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: pytest.fail("sampled before the weights were checked"))
    res = runner.invoke(app, ["eval", "--weights", str(tmp_path), "--num-seeds", "1", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert out.startswith("error: cannot load final weights:") and "neither a transformer folder" in out, res.output
    assert not (tmp_path / "out").exists()


def test_eval_out_that_is_a_file_fails_before_any_sampling(tmp_path, monkeypatch):
    import pytest

    from spotlight.tasks.shapes import evaluate as ev

    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: pytest.fail("sampled before --out was checked"))
    (tmp_path / "f").write_text("")
    res = runner.invoke(app, ["eval", "--num-seeds", "1", "--out", str(tmp_path / "f")])
    assert res.exit_code == 2 and " ".join(res.output.split()) == f"error: --out {tmp_path / 'f'}: not a directory", (
        res.output
    )


def test_simulate_trace_errors_name_the_flag_as_up_does(tmp_path):
    """Was: `error: [Errno 2] No such file or directory: '…'` and `[Errno 21] Is a directory`."""
    for path, why in ((tmp_path / "nonexist.csv", "No such file or directory"), (tmp_path, "Is a directory")):
        res = runner.invoke(app, ["simulate", "--trace", str(path), "--out", str(tmp_path / "sim")])
        assert res.exit_code == 2, res.output
        assert " ".join(res.output.split()) == f"error: --trace {path}: {why}", res.output
        assert not (tmp_path / "sim").exists()


def test_eval_out_that_cannot_be_created_fails_before_any_sampling(tmp_path, monkeypatch):
    """Was: minutes of sampling, then a traceback ending in FileNotFoundError."""
    import os

    import pytest

    from spotlight.tasks.shapes import evaluate as ev

    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: pytest.fail("sampled before --out was checked"))
    (tmp_path / "f").write_text("")
    res = runner.invoke(app, ["eval", "--num-seeds", "1", "--out", str(tmp_path / "f" / "sub")])
    assert res.exit_code == 2, res.output
    assert " ".join(res.output.split()).startswith(f"error: --out {tmp_path / 'f' / 'sub'}: cannot be created")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        res = runner.invoke(app, ["eval", "--num-seeds", "1", "--out", str(locked / "sub")])
        assert res.exit_code == 2 and "is not writable" in res.output, res.output
    if os.path.isdir("/proc/self"):  # writable by permissions (root), yet nothing can be made there
        res = runner.invoke(app, ["eval", "--num-seeds", "1", "--out", "/proc/spotlight-eval-out"])
        assert res.exit_code == 2 and "cannot be created" in res.output, res.output


def test_a_refused_simulation_leaves_no_out_directory_behind(tmp_path):
    """Was: a profile without iterations to target, or a malformed trace, was refused after
    `--out` had been created, leaving an empty `runs/simulate/`."""
    from spotlight.sim.profile import DEFAULT_PROFILE

    text = DEFAULT_PROFILE.read_text()
    no_targets = tmp_path / "no-targets.toml"
    no_targets.write_text(text[: text.index("[iterations_to_target]")])
    bad_trace = tmp_path / "trace.csv"
    bad_trace.write_text("this is not,a trace\n1,2\n")
    for args, why in (
        (["--profile", str(no_targets)], "has no [iterations_to_target]"),
        (["--trace", str(bad_trace)], ""),
        (["--policy", "nope"], "unknown policy"),
    ):
        out = tmp_path / "runs" / "simulate"
        res = runner.invoke(app, ["simulate", *args, "--out", str(out)])
        assert res.exit_code == 2 and why in " ".join(res.output.split()), res.output
        assert not (tmp_path / "runs").exists(), args


def test_simulate_names_the_flag_that_made_the_spot_node_too_small(tmp_path):
    """Was: `error: …/qwen-image-h100.toml: SP degree 2 needs …`, blaming the profile file."""
    res = runner.invoke(app, ["simulate", "--gpus-per-node", "1", "--out", str(tmp_path / "sim")])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and out.startswith("error: --gpus-per-node: 1 GPU(s) per spot node"), res.output
    assert "[cluster] spot_sp" in out and "give --gpus-per-node 2 or more" in out


def test_an_interrupted_simulation_leaves_no_empty_out_and_the_footer_says_where_iterations_came_from(
    tmp_path, monkeypatch
):
    from spotlight.cli import simulate as cli_simulate

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_simulate, "_simulate_all", interrupted)
    res = runner.invoke(app, ["simulate", "--out", str(tmp_path / "runs" / "sim")])
    assert res.exit_code == 130 and "interrupted" in res.output, res.output
    assert not (tmp_path / "runs").exists()
    monkeypatch.undo()
    args = ["simulate", "--policy", "reserved-only", "--iterations", "1", "--out", str(tmp_path / "sim")]
    res = runner.invoke(app, args)
    out = " ".join(res.output.split())
    assert res.exit_code == 0 and "iterations from --iterations, every cost from" in out, res.output
