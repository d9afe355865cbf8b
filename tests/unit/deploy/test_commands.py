"""Every command line in every recipe under deploy/ (and in docs/deploy/) is one our CLI accepts:
each is parsed by the real ``spotlight`` / ``spotlight-agent`` command (click's own parser, every
option, type and range checked) without running it."""

from __future__ import annotations

import pytest
import typer
import yaml

from spotlight.config import REPO_ROOT
from tests.unit.deploy.recipes import DEPLOY, RECIPE_FILES, launcher_commands, manifest_commands, shell_commands


def _group(program: str):
    if program == "spotlight":
        from spotlight.cli import app
    else:
        from agent.main import app
    return typer.main.get_command(app)


def parse(argv: list[str]) -> str:
    """Parse ``argv`` with the real command tree; the command's path (``spotlight-agent join``).
    Raises the parser's error (click's UsageError or BadParameter) on anything it refuses."""
    cmd = _group(argv[0])
    ctx = cmd.context_class(cmd, info_name=argv[0])
    path, args = [argv[0]], list(argv[1:])
    while hasattr(cmd, "get_command"):  # a group: its first argument names the subcommand
        assert args, f"{' '.join(argv)}: no subcommand"
        name, *args = args
        sub = cmd.get_command(ctx, name)
        assert sub is not None, f"{' '.join(argv)}: no command {name!r}"
        path.append(name)
        cmd = sub
        ctx = sub.context_class(sub, info_name=name, parent=ctx) if hasattr(sub, "get_command") else None
    cmd.make_context(path[-1], args, parent=ctx)
    return " ".join(path)


def _all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in RECIPE_FILES + sorted((REPO_ROOT / "docs" / "deploy").glob("*.md")):
        text = path.read_text()
        rel = str(path.relative_to(REPO_ROOT))
        if path.suffix == ".yaml" and DEPLOY / "kubernetes" in path.parents:
            found += [(rel, argv) for argv in manifest_commands(list(yaml.safe_load_all(text)))]
        env = {}
        if path.suffix == ".yaml" and DEPLOY / "skypilot" in path.parents:
            env = {**(yaml.safe_load(text).get("envs") or {}), "COORDINATOR": "reserved-host:7400"}
        found += [(rel, argv) for argv in shell_commands(text, env)]
    return found


COMMANDS = _all_commands()


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[f"{w}:{' '.join(a[:2])}" for w, a in COMMANDS])
def test_every_recipe_command_parses(where, argv):
    parse(argv)


def test_the_recipes_hold_the_commands_they_are_for():
    """Not vacuous: each recipe's join and up commands were found."""
    by_file: dict[str, set[str]] = {}
    for where, argv in COMMANDS:
        by_file.setdefault(where, set()).add(" ".join(argv[:2]))
    for recipe in ("skypilot/agents.yaml", "kubernetes/agents.yaml", "slurm/agents.sbatch", "container/Dockerfile"):
        assert "spotlight-agent join" in by_file[f"deploy/{recipe}"], (recipe, by_file.get(f"deploy/{recipe}"))
    for recipe in ("skypilot/reserved.yaml", "kubernetes/coordinator.yaml", "slurm/reserved.sbatch"):
        got = by_file[f"deploy/{recipe}"]
        assert {"spotlight up", "spotlight-agent join"} <= got, (recipe, got)


@pytest.mark.parametrize(
    "argv",
    [
        ["spotlight-agent", "join", "--gpu", "0"],  # a misspelt option
        ["spotlight-agent", "join", "--coordinator", "h:1", "--grace-s", "-1"],  # out of range
        ["spotlight", "up", "--resume-existing", "--reserved"],  # missing value
        ["spotlight", "nosuch"],
    ],
)
def test_the_check_refuses_what_the_cli_refuses(argv):
    with pytest.raises(Exception):
        parse(argv)


def test_extraction_handles_shell_forms():
    text = (
        'srun --ntasks=1 spotlight up --config "$CONFIG" --reserved 0.0.0.0:$PORT --keys "$KEYS" &\n'
        "#   spotlight keys init ~/.spotlight/keys\n"
        'exec spotlight-agent join --gpus "$(seq -s, 0 $((N - 1)))" --grace-s "${GRACE_S:-20}" \\\n'
        "    --cloud none  # a comment\n"
    )
    assert shell_commands(text) == [
        ["spotlight", "up", "--config", "1", "--reserved", "0.0.0.0:1", "--keys", "1"],
        ["spotlight", "keys", "init", "~/.spotlight/keys"],
        ["spotlight-agent", "join", "--gpus", "0", "--grace-s", "20", "--cloud", "none"],
    ]


LAUNCH_FILES = [
    *RECIPE_FILES,
    *sorted((REPO_ROOT / "docs" / "deploy").glob("*.md")),
    REPO_ROOT / "README.md",
    REPO_ROOT / "docs" / "architecture.md",
    *sorted((REPO_ROOT / "examples" / "deploy").glob("*.sh")),
]
LAUNCHES = [
    (str(p.relative_to(REPO_ROOT)), argv)
    for p in LAUNCH_FILES
    if p.is_file()
    for argv in launcher_commands(p.read_text())
]


@pytest.mark.parametrize(("where", "argv"), LAUNCHES, ids=[f"{w}:{i}" for i, (w, _) in enumerate(LAUNCHES)])
def test_every_trainer_launch_parses(where, argv):
    """``-m spotlight.workers.train.launch ARGS`` in a recipe or a doc: ARGS are ones the entry point accepts."""
    from spotlight.workers.train.launch import _parse

    _parse(argv)


def test_the_trainer_launches_are_found():
    where = {w for w, _ in LAUNCHES}
    assert {"deploy/slurm/reserved.sbatch", "examples/deploy/two-node-trainer-local.sh", "README.md"} <= where, where
    with pytest.raises(SystemExit):  # not vacuous: the entry point's parser refuses a bad line
        from spotlight.workers.train.launch import _parse

        _parse(["--coordinator", "h:1", "--keys", "k", "--peer-timeout-s", "0"])
