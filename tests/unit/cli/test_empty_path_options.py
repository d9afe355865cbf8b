"""An empty path option or argument (``--weights-dir ''``, ``--out=``, ``keys init ''``) is a
usage error that names it (status 2), before the command does anything: ``pathlib.Path('')`` is
``Path('.')``, so it used to name the working directory, and ``spotlight-agent join
--weights-dir ''`` emptied the ``v*.safetensors`` there. ``.`` still means the working
directory, and an option that is no path keeps its empty value (``init --reserved-rollout-gpus
""``: no reserved rollout GPUs).

The walk covers every command of both CLIs, so a new path option that skips
:func:`spotlight.util.cli_paths.path_option` fails here. Each case is parsed
(``make_context``) and never run: a regression cannot start a run in the working directory.
"""

from __future__ import annotations

import pathlib
import typing

import pytest
import typer
from typer.testing import CliRunner

from agent.main import app as agent_app
from spotlight.cli import app as spotlight_app
from spotlight.util.cli_paths import EMPTY_PATH, nonempty_path, nonempty_path_text
from spotlight.util.cli_run import run_app

try:  # as spotlight.util.cli_run imports them
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import UsageError

AGENT_ERROR = "spotlight-agent: error:"

STR_PATHS = {("spotlight", "init", "--pretrained-path")}
"""``str`` options that name a path (the walk finds the ``pathlib.Path`` ones by their type)."""

OTHER_ARGS = {
    ("spotlight-agent", "join"): ["-c", "127.0.0.1:9"],
    ("spotlight-agent", "revoke"): ["--gpu", "0", "--node-id", "x"],
    ("spotlight-agent", "add-gpu"): ["--gpu", "0", "--node-id", "x"],
    ("spotlight-agent", "agent-status"): ["--node-id", "x"],
    ("spotlight", "keys", "add"): ["agent", "node-a"],
    ("spotlight", "keys", "revoke"): ["agent.node-a"],
    ("spotlight", "bench", "stale-ranking"): ["--run-dir", "runs/x"],
}
"""What else a command needs to parse (after the empty path, so that it is what fails)."""


def _walk(command, path):
    subcommands = getattr(command, "commands", None)
    if isinstance(subcommands, dict):  # typer's groups (not click.Group subclasses with every typer)
        for name, sub in subcommands.items():
            yield from _walk(sub, (*path, name))
    else:
        yield path, command


def _is_path(param) -> bool:
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation is None:  # pragma: no cover - a typer without type descriptors
        return type(param.type).__name__ == "Path"
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    return isinstance(annotation, type) and issubclass(annotation, pathlib.PurePath)


def _path_params():
    for prog, app in (("spotlight", spotlight_app), ("spotlight-agent", agent_app)):
        for path, command in _walk(typer.main.get_command(app), (prog,)):
            for param in command.params:
                name = param.opts[0] if param.param_type_name == "option" else param.name
                if _is_path(param) or (*path, name) in STR_PATHS:
                    yield path, command, param, name


CASES = [
    pytest.param(
        path,
        command,
        param,
        name,
        id=f"{' '.join(path)} {name}",
    )
    for path, command, param, name in _path_params()
]


def _args(path, param, value: str) -> list[str]:
    given = [param.opts[0], value] if param.param_type_name == "option" else [value]
    others = OTHER_ARGS.get(path, [])
    if given[0] in others:  # the option under test is one the command needs: given once, empty
        i = others.index(given[0])
        others = others[:i] + others[i + 2 :]
    return [*given, *others]


def test_the_walk_finds_the_path_options_of_both_clis():
    """Guard against a vacuous walk (one that reached the root command alone)."""
    found = {(*path, name) for path, _, _, name in _path_params()}
    for expected in [
        ("spotlight-agent", "join", "--weights-dir"),
        ("spotlight-agent", "join", "--keys"),
        ("spotlight-agent", "agent-status", "--state-dir"),
        ("spotlight", "up", "--resume"),
        ("spotlight", "up", "--run-dir"),
        ("spotlight", "keys", "init", "directory"),
        ("spotlight", "plan", "config"),
        ("spotlight", "init", "--pretrained-path"),
        ("spotlight", "reward-server", "--geneval-metadata"),
    ]:
        assert expected in found, sorted(found)


@pytest.mark.parametrize(("path", "command", "param", "name"), CASES)
def test_an_empty_path_is_a_usage_error_that_names_it(path, command, param, name):
    with pytest.raises(UsageError) as info:
        command.make_context(command.name, _args(path, param, ""))
    message = info.value.format_message()
    shown = name if param.param_type_name == "option" else (param.metavar or name)  # an argument: as its help names it
    assert message.startswith(f"Invalid value for '{shown}'") and message.endswith(EMPTY_PATH), message


@pytest.mark.parametrize(("path", "command", "param", "name"), CASES)
def test_dot_still_names_the_working_directory(path, command, param, name):
    ctx = command.make_context(command.name, _args(path, param, "."))
    value = ctx.params[param.name]
    assert value in (pathlib.Path("."), [pathlib.Path(".")], "."), value


def test_the_parsers():
    assert nonempty_path("a/b") == pathlib.Path("a/b") and nonempty_path(".") == pathlib.Path(".")
    assert nonempty_path(pathlib.Path("runs")) == pathlib.Path("runs")  # a default
    assert nonempty_path_text("~/ckpt") == "~/ckpt"
    for parse in (nonempty_path, nonempty_path_text):
        with pytest.raises(typer.BadParameter, match="empty"):
            parse("")


@pytest.mark.parametrize("form", [["--weights-dir", ""], ["--weights-dir="]])
def test_agent_join_with_an_empty_weights_dir_keeps_the_files_in_the_working_directory(
    form, tmp_path, monkeypatch, capsys
):
    """The agent empties its weight cache (``v*.safetensors``) once registered: ``''`` was ``.``."""
    import agent.main as agent_main
    from agent.weight_cache import WeightCache

    mine = tmp_path / "v1.safetensors"
    mine.write_bytes(b"a user's file")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path / "state"))
    monkeypatch.delenv("SPOTLIGHT_KEYS", raising=False)
    started = []

    def daemon(*args, weights_dir=None, **kwargs):
        started.append(weights_dir)
        return WeightCache(weights_dir)  # what the agent does to its cache at registration

    monkeypatch.setattr(agent_main, "_checked_keys", lambda *a: None)
    monkeypatch.setattr(agent_main, "AgentDaemon", daemon)
    monkeypatch.setattr(agent_main, "_run_daemon", lambda *a: 0)
    rc = run_app(agent_app, AGENT_ERROR, ["join", "-c", "127.0.0.1:9", *form])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"{AGENT_ERROR} Invalid value for '--weights-dir': {EMPTY_PATH}", err
    assert started == [] and mine.read_bytes() == b"a user's file"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["up", "--local", "--resume", ""], "'--resume'"),
        (["up", "--local", "--config="], "'--config'"),
        (["init", "--pretrained-path", ""], "'--pretrained-path'"),
        (["init", "-o", ""], "'--out' / '-o'"),
        (["keys", "init", ""], "'directory'"),
        (["eval", "--weights="], "'--weights'"),
    ],
    ids=lambda a: " ".join(repr(x) if x == "" else x for x in a) if isinstance(a, list) else "",
)
def test_spotlight_refuses_an_empty_path_in_one_line_before_any_work(args, named, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = run_app(spotlight_app, "error:", args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"error: Invalid value for {named}: {EMPTY_PATH}", err
    assert list(tmp_path.iterdir()) == []  # nothing written in the working directory


def test_an_option_that_is_no_path_keeps_its_empty_value():
    res = CliRunner().invoke(spotlight_app, ["init", "--reserved-rollout-gpus", ""])
    assert res.exit_code == 0 and "reserved_rollout_gpus = []" in res.stdout, res.output


def test_path_options_still_read_path_in_the_help():
    res = CliRunner().invoke(agent_app, ["join", "--help"], env={"COLUMNS": "120"})
    assert "--weights-dir <path>" in res.stdout and "--keys <path>" in res.stdout, res.stdout


ARGPARSE_PATHS = [
    ("spotlight.workers.train.launch", "_parse", ["--coordinator", "127.0.0.1:9", "--keys", "k"], "--keys"),
    ("spotlight.workers.train.launch", "_parse", ["--coordinator", "127.0.0.1:9", "--keys", "k"], "--checkpoint-dir"),
    ("spotlight.workers.train.launch", "_parse", ["--coordinator", "127.0.0.1:9", "--keys", "k"], "--spool-dir"),
    ("spotlight.workers.train.launch", "_parse", ["--coordinator", "127.0.0.1:9", "--keys", "k"], "--log-file"),
    ("spotlight.tasks.shapes.pretrain", "main", [], "--out"),
    ("spotlight.tasks.prompt_sets", "main", [], "--out"),
    ("spotlight.tasks.prompt_sets", "main", [], "--geneval-eval"),
]
"""The ``python -m`` entry points a person runs (torchrun/srun ranks, the shapes pretraining, the
prompt sets): argparse, not typer, so the walk above does not see them."""


@pytest.mark.parametrize("module, func, others, option", ARGPARSE_PATHS, ids=lambda v: v if isinstance(v, str) else "")
def test_an_empty_path_of_an_argparse_entry_point_is_a_usage_error(module, func, others, option, capsys, monkeypatch):
    """Was: ``--checkpoint-dir ''`` fell back to the default in silence, and ``pretrain --out ''``
    wrote its checkpoints into the working directory."""
    import importlib

    monkeypatch.delenv("SPOTLIGHT_KEYS", raising=False)
    entry = getattr(importlib.import_module(module), func)
    argv = [a for i, a in enumerate(others) if not (a == option or (i and others[i - 1] == option))]
    with pytest.raises(SystemExit) as exc:
        entry([*argv, f"{option}="])
    assert exc.value.code == 2
    assert f"argument {option}: {EMPTY_PATH}" in capsys.readouterr().err
