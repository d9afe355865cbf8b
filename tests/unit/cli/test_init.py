"""``spotlight init``: an annotated config that loads back to the config it was made from."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.cli.init import FAMILY_EXAMPLES, config_docs
from spotlight.config import load_config

runner = CliRunner()


def _init(*args):
    return runner.invoke(app, ["init", *args])


@pytest.mark.parametrize("family", list(FAMILY_EXAMPLES))
def test_every_family_loads_back_to_its_example(family, tmp_path):
    res = _init("--family", family)
    assert res.exit_code == 0, res.output
    f = tmp_path / "run.toml"
    f.write_text(res.stdout)
    assert load_config(f) == load_config(FAMILY_EXAMPLES[family])


def test_default_is_the_embedded_default_with_every_field_documented(tmp_path):
    res = _init()
    assert res.exit_code == 0, res.output
    f = tmp_path / "run.toml"
    f.write_text(res.stdout)
    assert load_config(f) == load_config(None)
    text = res.stdout
    docs = config_docs()
    assert ("DataConfig", "prompt_column") in docs and ("SpotlightConfig", "") in docs
    cfg = load_config(None)
    for section in cfg.__struct_fields__:
        cls = type(getattr(cfg, section))
        assert f"\n[{section}]\n" in text
        body = "\n" + text.split(f"\n[{section}]\n")[1].split("\n[")[0]
        for name in cls.__struct_fields__:
            # a field that is None (unset) is written commented out: TOML has no null
            line = f"# {name} = " if getattr(getattr(cfg, section), name) is None else f"{name} = "
            assert re.search(rf"^{re.escape(line)}", body, re.M), name
            doc = docs.get((cls.__name__, name))
            if doc:  # its first line, as a comment right above (after other comment lines)
                first = doc.splitlines()[0].replace("``", "`")
                block = body.split(f"\n{line}")[0].rsplit("\n\n", 1)[-1]
                assert ("# " + first).rstrip() in block, name
    # a value that differs from the field's default says what the default is
    assert '# (default: "tiny")\nsource = "pretrained"' in text


def test_cluster_layout_options_land_in_the_config(tmp_path):
    res = _init(
        "--train-gpus",
        "4",
        "--reserved-rollout-gpus",
        "0,1",
        "--sp-degree",
        "2",
        "--spot-nodes",
        "3",
        "--gpus-per-node",
        "8",
    )
    assert res.exit_code == 0, res.output
    f = tmp_path / "run.toml"
    f.write_text(res.stdout)
    cfg = load_config(f)
    assert (
        cfg.train.num_train_workers == 4 and cfg.cluster.reserved_rollout_gpus == [0, 1] and cfg.cluster.sp_degree == 2
    )
    assert "--agents 3 --gpus-per-agent 8" in res.stdout and "--gpus 0,1,2,3,4,5,6,7" in res.stdout


def test_mistakes_are_one_line_errors_and_out_is_not_overwritten(tmp_path):
    res = _init("--family", "sdxl")
    assert (
        res.exit_code == 2
        and "choose one of shapes, jpeg-toy, qwen-image, sd3, flux" in res.stderr
        and res.stdout == ""
    )
    res = _init("--family", "sd3", "--sp-degree", "2")
    assert res.exit_code == 2 and "cluster.sp_degree" in res.stderr
    res = _init("--reserved-rollout-gpus", "0;1")
    assert res.exit_code == 2 and "comma-separated" in res.stderr
    out = tmp_path / "run.toml"
    assert _init("--out", str(out)).exit_code == 0 and load_config(out) == load_config(None)
    out.write_text("mine")
    res = _init("--out", str(out))
    assert res.exit_code == 2 and out.read_text() == "mine"


def test_family_tiny_means_the_shapes_task(tmp_path):
    res = _init("--family", "tiny")
    assert res.exit_code == 0, res.output
    f = tmp_path / "run.toml"
    f.write_text(res.stdout)
    assert load_config(f) == load_config(FAMILY_EXAMPLES["shapes"])
    bad = _init("--family", "sd4")
    assert bad.exit_code == 2 and "tiny = shapes" in " ".join(bad.output.split())


def test_an_invalid_value_from_a_flag_names_the_flag():
    res = _init("--family", "sd3", "--sp-degree", "2")  # sp_degree > 1 runs the tiny family only
    assert res.exit_code == 2
    out = " ".join(res.output.split())
    assert "error: --sp-degree: cluster.sp_degree:" in out, res.output
    assert "sd3.toml" not in out
