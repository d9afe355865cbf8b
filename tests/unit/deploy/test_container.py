"""deploy/container/Dockerfile and its CPU variant: parsed, not built (no network, no docker here)."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.specifiers import SpecifierSet

from spotlight.config import REPO_ROOT
from tests.unit.deploy.recipes import DEPLOY

DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args(ins) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_base_user_and_entry_points(name):
    ins = instructions(DEPLOY / "container" / name)
    kinds = [k for k, _ in ins]
    assert "FROM" in kinds
    users = [a for k, a in ins if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")  # the last USER is who runs
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")  # nothing runs as root after
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"spotlight", "spotlight-agent"} <= set(scripts)
    run = " ".join(a for k, a in ins if k == "RUN")
    assert re.search(r'pip install -e "/opt/spotlight\[', run)  # the console scripts, with the extras
    assert [a for k, a in ins if k == "EXPOSE"] == ["7400"]
    assert "tini" in dict(ins)["ENTRYPOINT"]  # PID 1 that passes SIGTERM on to the agent


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_no_keys(name):
    ins = instructions(DEPLOY / "container" / name)
    sources = [s for k, a in ins if k in ("COPY", "ADD") for s in a.split()[:-1] if not s.startswith("--")]
    assert sources and set(sources) <= {"pyproject.toml", "README.md", "spotlight", "agent", "examples"}, sources
    assert not [k for k, _ in ins if k == "ADD"]
    ignore = (DEPLOY / "container" / f"{name}.dockerignore").read_text().split()
    assert "**/*.key_secret" in ignore and "**/keys" in ignore and "runs" in ignore


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_torch_is_the_pinned_version(name):
    args = _args(instructions(DEPLOY / "container" / name))
    torch = args["TORCH_VERSION"]
    pinned = re.search(r'"torch==([^"]+)"', (REPO_ROOT / "scripts" / "_venv.sh").read_text()).group(1)
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = SpecifierSet(next(d for d in deps if d.startswith("torch")).removeprefix("torch"))
    assert torch == pinned and torch in spec
    index = args["TORCH_INDEX_URL"]
    assert index.endswith("/cpu") == (name == "Dockerfile.cpu")
