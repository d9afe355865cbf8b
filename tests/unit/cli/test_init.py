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
            assert re.search(rf"^(# )?{name} = ", body, re.M), name  # an unset optional field is a comment
            doc = docs.get((cls.__name__, name))
            if doc:  # its first line, as a comment right above (after other comment lines)
                first = doc.splitlines()[0].replace("``", "`")
                block = re.split(rf"\n(?:# )?{name} = ", body)[0].rsplit("\n\n", 1)[-1]
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
    assert "--gpus 0,1,2,3,4,5,6,7" in res.stdout and "--min-spot-nodes 3" in res.stdout
    assert "spotlight up --local" not in res.stdout.split("\n[", 1)[0]  # a cluster is not started on one machine


@pytest.mark.parametrize(
    "args, cluster",
    [
        ((), False),
        (("--family", "jpeg-toy"), False),
        (("--family", "sd3"), True),
        (("--family", "qwen-image", "--pretrained-path", "/models/qwen"), True),
        (("--spot-nodes", "8", "--gpus-per-node", "8"), True),
        (("--train-gpus", "2"), True),
    ],
)
def test_a_cluster_layout_prints_the_readmes_cluster_commands_not_local(args, cluster, tmp_path):
    """`spotlight init` for a cluster layout (a GPU family or layout flags) starts it the README's
    way (port 7400, --keys) and never suggests `spotlight up --local`; the CPU examples with no
    layout flags still do."""
    out = tmp_path / "run.toml"
    res = _init(*args, "--out", str(out))
    assert res.exit_code == 0, res.output
    header = out.read_text().split("\n[", 1)[0]
    closing = " ".join(res.stderr.split())
    assert ("spotlight up --local" in header) is not cluster
    assert ("start with spotlight up --local" in closing) is not cluster
    assert "--reserved 0.0.0.0:7400 --keys /etc/spotlight/keys" in header
    if cluster:
        assert f"spotlight up --config {out} --reserved 0.0.0.0:7400 --keys /etc/spotlight/keys" in closing


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
    res = _init("--family", "sd3", "--sp-degree", "2")  # SD3 has no context-parallel plan
    assert res.exit_code == 2
    out = " ".join(res.output.split())
    assert "error: --sp-degree: cluster.sp_degree:" in out, res.output
    assert "sd3.toml" not in out


def _normalised(cmd: str) -> str:
    cmd = re.split(r"\s+#", cmd.strip())[0]
    cmd = re.sub(r"--gpus \S+", "--gpus G", cmd)
    return re.sub(r"--config \S+", "--config C", cmd)


def test_the_cluster_commands_are_the_readmes():
    """The commands, port and --keys that `spotlight init` prints for real machines are the ones the
    README's 'On real machines' gives (GPU lists and the config's name aside)."""
    from spotlight.config import REPO_ROOT

    res = _init("--spot-nodes", "3", "--gpus-per-node", "2")
    assert res.exit_code == 0, res.output
    header = [line[1:].strip() for line in res.stdout.split("Start it:", 1)[1].split("(README", 1)[0].splitlines()]
    printed = [
        _normalised(line[line.index("spotlight") :]) for line in header if re.search(r"\bspotlight(-agent)? ", line)
    ]
    printed = [c for c in printed if "--local" not in c]
    readme = (REPO_ROOT / "README.md").read_text().split("## On real machines", 1)[1].split("\n## ", 1)[0]
    documented = {_normalised(line) for line in readme.splitlines() if line.startswith("spotlight")}
    assert len(printed) >= 5 and all(":7400" in c for c in printed if "--reserved " in c or "--coordinator" in c)
    assert all("--keys /etc/spotlight/keys" in c for c in printed if c.startswith(("spotlight up", "spotlight-agent")))
    missing = [c for c in printed if c not in documented]
    assert not missing, f"printed by `spotlight init` but not in the README: {missing}"
    assert "--gpus 0,1 --cloud aws" in res.stdout  # the layout's GPUs per spot node


def test_a_pretrained_path_missing_here_is_warned_about_and_the_config_still_written(tmp_path):
    """Was: written without a word; `spotlight up` then refused the config. The folder may be on
    the reserved node only, so init warns on stderr instead of refusing."""
    from typer.testing import CliRunner

    from spotlight.cli import app

    out = tmp_path / "run.toml"
    for path, warned in ((tmp_path / "nonexistent", True), (tmp_path, False)):
        out.unlink(missing_ok=True)
        args = ["init", "--family", "sd3", "--pretrained-path", str(path), "--try-out", "--out", str(out)]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        err = " ".join(res.stderr.split())
        assert (f"warning: --pretrained-path {path}: no such folder on this machine" in err) is warned, err
        assert f'pretrained_path = "{path}"' in out.read_text()
    (tmp_path / "afile").write_text("")
    res = CliRunner().invoke(app, [*args[:4], str(tmp_path / "afile"), "--out", str(tmp_path / "b.toml")])
    assert "afile: a file, not a checkpoint folder on this machine" in " ".join(res.stderr.split())
    # a refused --out gets its one error line and no warning about the checkpoint
    res = CliRunner().invoke(app, args)  # run.toml exists now
    assert res.exit_code == 2 and "warning" not in res.stderr, res.stderr


def test_a_checkpoint_of_another_family_is_warned_about_and_a_right_one_is_not(tmp_path):
    """Was: `init --family sd3 --pretrained-path <a Qwen-Image checkpoint>` wrote the config
    without a word, and only `spotlight up` refused it."""
    import json

    from typer.testing import CliRunner

    from spotlight.cli import app
    from spotlight.models.families.sd3 import SD3Family

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    out = tmp_path / "run.toml"
    res = CliRunner().invoke(app, ["init", "--family", "sd3", "--pretrained-path", str(qwen), "--out", str(out)])
    assert res.exit_code == 0 and out.is_file(), res.output
    err = " ".join(res.stderr.split())
    assert f"warning: --pretrained-path {qwen}: {qwen} is a QwenImagePipeline checkpoint" in err, err
    assert "check --family" in err and "`spotlight up` refuses this config" in err, err

    sd3 = SD3Family.make_random_checkpoint(tmp_path / "sd3", seed=1)
    res = CliRunner().invoke(
        app, ["init", "--family", "sd3", "--pretrained-path", str(sd3), "--out", str(tmp_path / "ok.toml")]
    )
    assert res.exit_code == 0 and "warning" not in res.stderr, res.stderr


def test_a_relative_pretrained_path_that_exists_is_written_absolute(tmp_path, monkeypatch):
    """Was: written as given, so the config meant another folder from any other directory."""
    from typer.testing import CliRunner

    from spotlight.cli import app

    (tmp_path / "qi tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["init", "--family", "sd3", "--pretrained-path", "qi tiny", "--out", "c.toml"])
    assert res.exit_code == 0, res.output
    assert f'pretrained_path = "{tmp_path / "qi tiny"}"' in (tmp_path / "c.toml").read_text()


def test_no_reserved_rollout_gpus_or_spot_nodes_leave_out_what_would_not_work(tmp_path):
    """Was: `--reserved-rollout-gpus ""` wrote `spotlight-agent join --reserved … --gpus` (which join
    refuses) and a reserved key to make; `--spot-nodes 0` said "0 spot node(s)"; `--out DIR` said
    to remove the directory."""
    from typer.testing import CliRunner

    from spotlight.cli import app

    res = CliRunner().invoke(app, ["init", "--reserved-rollout-gpus", "", "--spot-nodes", "0"])
    assert res.exit_code == 0, res.output
    header = res.stdout.split("\n\n", 1)[0]
    assert "join --reserved" not in header and "reserved reserved-0" not in header, header
    assert "no rollout GPUs on the reserved node" in header and "no spot nodes at the start" in header, header
    assert "each spot node:" in header  # they may still join
    res = CliRunner().invoke(app, ["init", "--reserved-rollout-gpus", "0,1", "--spot-nodes", "3"])
    assert "join --reserved --coordinator 127.0.0.1:7400 --keys /etc/spotlight/keys --gpus 0,1" in res.stdout
    assert "3 spot node(s)" in res.stdout
    res = CliRunner().invoke(app, ["init", "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert f"error: --out {tmp_path} is a directory; give a file, e.g. {tmp_path / 'run.toml'}" in res.stderr


def test_gpus_per_node_above_what_join_takes_is_refused():
    """Was: `--gpus-per-node 4097` wrote a `join --gpus 0,…,4096` line that join refuses, and
    `--gpus-per-node 1000` one whose registration the coordinator refuses (64 GPUs a node)."""
    from typer.testing import CliRunner

    from spotlight.cli import app

    for n in ("4097", "1000", "65"):
        res = CliRunner().invoke(app, ["init", "--gpus-per-node", n])
        assert res.exit_code == 2 and "--gpus-per-node" in res.stderr, res.output
    assert CliRunner().invoke(app, ["init", "--gpus-per-node", "64"]).exit_code == 0
