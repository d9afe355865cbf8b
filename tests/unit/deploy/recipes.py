"""The deployment recipes under deploy/ and the command lines in them (for the tests of this folder)."""

from __future__ import annotations

import pathlib
import re
import shlex

from spotlight.config import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
RECIPE_FILES = sorted(
    p
    for p in DEPLOY.rglob("*")
    if p.is_file() and (p.suffix in (".yaml", ".sbatch", ".sh", ".md") or p.name.startswith("Dockerfile"))
)
PROGRAMS = ("spotlight", "spotlight-agent")

_START = re.compile(r"(?:^|(?<=[\s;&|(\"'\[]))(spotlight(?:-agent)?)\s+(?=[a-z])")
_END = re.compile(r";|\s(?:&&|\|\||[&|<>])|\s*&$|\)\s*[:.,]?\s*$|`")


def _substitute(text: str, env: dict[str, str] | None = None) -> str:
    """Shell expansions as sample values: ``$X`` / ``${X}`` → ``env[X]`` if set and not empty, else
    ``${X:-d}`` → d, else 1; ``$(...)`` → 0."""
    env = {k: str(v) for k, v in (env or {}).items() if str(v)}
    text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), m.group(0)), text)
    prev = None
    while prev != text:
        prev = text
        text = re.sub(r"\$\(\(([^()]*)\)\)", "1", text)
        text = re.sub(r"\$\(([^()]*)\)", "0", text)
    text = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:\+[^}]*\}", "", text)  # ${X:+word}: X unset
    text = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", lambda m: m.group(1) or "1", text)
    text = re.sub(r"\$\{[^}]*\}", "1", text)
    return re.sub(r"\$[A-Za-z_][A-Za-z0-9_]*", "1", text)


def shell_commands(text: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """Every ``spotlight …`` / ``spotlight-agent …`` command line in shell-like ``text`` (comment
    markers and line continuations removed), as argv lists with sample values for expansions."""
    lines = []
    for raw in text.replace("\\\n", " ").splitlines():
        lines.append(re.sub(r"^\s*#+\s?", "", raw))
    out = []
    for line in lines:
        for m in _START.finditer(line):
            rest = line[m.start() :]
            end = _END.search(rest)
            cmd = rest[: end.start()] if end else rest
            cmd = re.split(r"\s+#\s", cmd)[0]  # a trailing comment
            try:
                argv = shlex.split(_substitute(cmd, env))
            except ValueError:  # an unbalanced quote: the command went on past this line
                argv = shlex.split(_substitute(cmd, env) + '"')
            if len(argv) >= 2 and argv[0] in PROGRAMS:
                out.append(argv)
    return out


LAUNCHER = "spotlight.workers.train.launch"
"""The multi-node trainer entry point (``python -m`` / ``torchrun -m``)."""
_LAUNCH = re.compile(r"-m\s+spotlight\.workers\.train\.launch(?=\s|$)")


def launcher_commands(text: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """The arguments of every ``-m spotlight.workers.train.launch …`` (under ``python`` or
    ``torchrun``) in shell-like ``text``, as argv lists (what follows the module name) with sample
    values for expansions."""
    out = []
    for raw in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"^\s*#+\s?", "", raw)
        for m in _LAUNCH.finditer(line):
            rest = line[m.end() :]
            end = _END.search(rest)
            cmd = re.split(r"\s+#\s", rest[: end.start()] if end else rest)[0]
            out.append(shlex.split(_substitute(cmd, env)))
    return out


def manifest_commands(docs: list[dict]) -> list[list[str]]:
    """The ``args`` (or ``command``) of every container of Kubernetes ``docs`` that run one of our
    programs, ``$(VAR)`` expanded to a sample value."""
    out = []
    for doc in docs:
        spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            argv = [*c.get("command", []), *c.get("args", [])]
            if argv and argv[0] in PROGRAMS:
                out.append([re.sub(r"\$\([A-Za-z_]+\)", "0", str(a)) for a in argv])
    return out


def read(path: pathlib.Path) -> str:
    return path.read_text()
