"""`spotlight up` refusals that happen before anything starts (no coordinator, no run
directory): a bad trace, replay options that cannot work, an incomplete checkpoint. Each is one
``error:`` line and exit status 2. In-process through typer's ``CliRunner`` (these were
``spotlight up`` subprocesses under tests/integration/)."""

from __future__ import annotations

import shutil

import tomli_w
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.config import EXAMPLES_DIR, REPO_ROOT

TOY = str(EXAMPLES_DIR / "jpeg-toy" / "config.toml")
P3 = REPO_ROOT / "examples" / "traces" / "bamboo" / "p3-trace.csv"


def _up(tmp_path, *extra: str):
    """``spotlight up --local --config <toy> --run-dir <tmp>/run EXTRA`` in a 400-column terminal."""
    rd = tmp_path / "run"
    args = ["up", "--local", "--config", TOY, "--run-dir", str(rd), "--timeout-s", "60", *extra]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return rd, res


def test_bad_trace_refused_before_anything_starts(tmp_path):
    # an unreadable trace was checked after the coordinator started (half-made run
    # directory), its path printed twice, and a one-line Python list dumped whole
    bad = tmp_path / "trace.txt"
    bad.write_text(repr(list(range(4000))) + "\n")
    rd, res = _up(tmp_path, "--trace", str(bad))
    out = res.output
    assert res.exit_code == 2, out[-2000:]
    assert not rd.exists(), sorted(p.name for p in rd.iterdir())
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unknown trace format" in errors[0], out[-2000:]
    assert errors[0].count(str(bad)) == 1 and len(errors[0]) < 600
    assert "Traceback" not in out and "coordinator listening" not in out


def test_malformed_trace_line_refused_before_anything_starts(tmp_path):
    bad = tmp_path / "gcp.txt"
    bad.write_text("2021-12-11, 11:11:30, 4\n2021-12-11, 11:13:10, four\n")
    rd, res = _up(tmp_path, "--trace", str(bad))
    out = res.output
    assert res.exit_code == 2 and not rd.exists(), out[-2000:]
    assert "gcp.txt:2:" in out and out.count(str(bad)) == 1, out[-2000:]


def test_replay_options_refused_with_one_line_before_anything_starts(tmp_path):
    """`--trace-mode full` says how many agents the trace's peak needs; synthetic
    preemption cycles that overlap are refused by name; nothing is started or written."""
    for extra, want in (
        (
            ("--trace", str(P3), "--trace-mode", "full", "--agents", "2"),
            "at least 32 agents of 1 GPU (or slice the trace)",
        ),
        (
            ("--preemption-cycles", "8", "--cycle-down-s", "5"),
            "--preemption-cycles 8: 8 cycles of 5.0s per 30.0s iteration overlap",
        ),
    ):
        rd, res = _up(tmp_path, *extra)
        out = res.output
        assert res.exit_code == 2 and not rd.exists(), out[-2000:]
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and want in errors[0], out[-2000:]
        assert "Traceback" not in out and "coordinator listening" not in out


def test_incomplete_checkpoint_is_a_clear_error_before_anything_starts(tmp_path):
    """A family checkpoint without its VAE (a transformer folder alone) is refused before the
    run directory is made."""
    from spotlight.config import SpotlightConfig, config_to_dict
    from spotlight.models.families import sd3

    ckpt = tmp_path / "ckpt-sd3"
    sd3.make_random_checkpoint(ckpt, seed=1)
    partial = tmp_path / "partial"
    shutil.copytree(ckpt / "transformer", partial / "transformer")
    conf = config_to_dict(SpotlightConfig())
    conf["model"].update(family="sd3", pretrained_path=str(partial), image_size=32, max_text_tokens=8)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(conf))
    rd = tmp_path / "run"
    res = CliRunner().invoke(app, ["up", "--local", "--config", str(tmp_path / "c.toml"), "--run-dir", str(rd)])
    assert res.exit_code == 2, res.output
    assert "no 'vae/' folder" in res.output
    assert not rd.exists()  # nothing half-made


def test_unscorable_default_prompts_name_the_file_they_come_from(tmp_path):
    """Was: with `data.prompts_path = ""` (the GenEval training set, as README says) and the
    shapes reward, the refusal said the prompts were those of "the GenEval set
    (examples/default/prompts)", a folder holding only the evaluation set."""
    cfg = tmp_path / "c.toml"
    text = (EXAMPLES_DIR / "default" / "config.toml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("prompts_path = "))
    cfg.write_text(text.replace(line, 'prompts_path = ""', 1))
    rd, res = _up(tmp_path, "--config", str(cfg))
    assert res.exit_code == 2 and not rd.exists(), res.output[-2000:]
    [line] = [x for x in res.output.splitlines() if x.startswith("error:")]
    want = "cannot score the prompts of the GenEval training set (examples/prompts/geneval/train_metadata.jsonl, "
    assert want in line and "examples/default/prompts" not in line, line


def test_a_missing_eval_prompts_file_names_the_field_once(tmp_path):
    """Was: "error: eval.prompts_path: eval.prompts_path: file not found: …"."""
    cfg = tmp_path / "c.toml"
    text = (EXAMPLES_DIR / "default" / "config.toml").read_text()
    cfg.write_text(text.replace("[eval]\n", f'[eval]\nprompts_path = "{tmp_path / "none.txt"}"\n', 1))
    rd, res = _up(tmp_path, "--config", str(cfg))
    assert res.exit_code == 2 and not rd.exists(), res.output[-2000:]
    [line] = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert line == f"error: eval.prompts_path: file not found: {tmp_path / 'none.txt'}", line


def test_more_eval_prompts_than_the_file_holds_is_said(tmp_path, monkeypatch):
    """Was: `eval.num_prompts = 1000` scored the 46 test prompts without a word."""
    import spotlight.cli.up as up

    def stop_here(run):
        raise up.Stop("stopped after the announcement", code=2)

    monkeypatch.setattr(up, "encode_prompts", stop_here)
    cfg = tmp_path / "c.toml"
    text = (EXAMPLES_DIR / "default" / "config.toml").read_text()
    cfg.write_text(text.replace("num_prompts = 16 ", "num_prompts = 1000 ", 1))
    rd, res = _up(tmp_path, "--config", str(cfg))
    assert "warning: eval.num_prompts = 1000, but the held-out prompt file has 46 prompts: the panel scores all 46" in (
        res.output
    ), res.output[-2000:]
