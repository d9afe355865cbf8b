"""The README's "Post-train your own checkpoint" recipe as a new user runs it: every command in
its code blocks is one the CLI accepts (parsed by the real command tree, not run), the try-out's
reward server listens where the family configs' ``reward.url`` points, its checkpoint writer
exists, and ``spotlight init --try-out`` gives each family's config at try-out sizes."""

from __future__ import annotations

import importlib
import re
import urllib.parse

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from spotlight.config import EXAMPLES_DIR, REPO_ROOT, load_config
from spotlight.rewards.server import DEFAULT_PORT
from tests.unit.deploy.recipes import shell_commands
from tests.unit.deploy.test_commands import parse

SECTION = (REPO_ROOT / "README.md").read_text().split("## Post-train your own checkpoint", 1)[1].split("\n## ", 1)[0]
RECIPE = SECTION.split("### Reward server", 1)[0]
BLOCKS = [re.sub(r"^\s{2}", "", b, flags=re.M) for b in re.findall(r"```bash\n(.*?)```", RECIPE, re.S)]
COMMANDS = [argv for block in BLOCKS for argv in shell_commands(block)]


def test_the_recipe_has_its_commands():
    programs = {" ".join(argv[:2]) for argv in COMMANDS}
    assert {"spotlight init", "spotlight reward-server", "spotlight up"} <= programs, programs


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a)[:70])
def test_every_recipe_command_parses(argv):
    parse(argv)


def test_the_try_outs_reward_server_is_where_the_family_configs_call():
    (server,) = [a for a in COMMANDS if a[:2] == ["spotlight", "reward-server"]]
    port = int(server[server.index("--port") + 1]) if "--port" in server else DEFAULT_PORT
    for family in ("qwen-image", "sd3", "flux"):
        reward = load_config(EXAMPLES_DIR / "families" / f"{family}.toml").reward
        assert reward.kind == "http" and urllib.parse.urlsplit(reward.url).port == port, family


def test_the_try_outs_checkpoint_writer_and_init_work(tmp_path):
    (block,) = [b for b in BLOCKS if "make_random_checkpoint" in b]
    for module in re.findall(r"\b(qwen_image|sd3|flux)\b", block):
        assert callable(importlib.import_module(f"spotlight.models.families.{module}").make_random_checkpoint)
    (init,) = [a for a in COMMANDS if a[:2] == ["spotlight", "init"]]
    assert "--try-out" in init
    for family in ("qwen-image", "sd3", "flux"):
        out = tmp_path / f"{family}.toml"
        args = ["init", "--family", family, "--pretrained-path", "/tmp/x", "--try-out", "--out", str(out)]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        cfg = load_config(out)
        assert cfg.model.image_size == 32 and cfg.train.num_train_workers == 1, family
        assert (cfg.data.prompts_per_iteration, cfg.data.group_size) == (4, 4), family
        assert cfg.model.family == family and cfg.reward.kind == "http"  # the rest is the family's config
        assert "spotlight up --local" in " ".join(res.stderr.split())  # a try-out runs on this machine
