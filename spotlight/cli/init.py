"""``spotlight init``: write an annotated run config for a model family and cluster layout.

Every section and field of :class:`spotlight.config.SpotlightConfig` is written with its
value, its default where the value differs, and its documentation: the attribute
docstrings of ``spotlight/config.py``, read with :mod:`ast` (a string expression right
after an annotated assignment documents that field). Values are written by tomli-w, so
quoting is TOML's; the file loads back with :func:`spotlight.config.load_config` to the
config it was made from.
"""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import shlex
from typing import Optional

import msgspec
import tomli_w
import typer
from rich.markup import escape

from spotlight.cli.messages import CallTimeConsole
from spotlight.config import EXAMPLES_DIR, SpotlightConfig
from spotlight.protocol import MAX_GPUS_PER_NODE
from spotlight.util.atomic_file import write_text_atomic
from spotlight.util.cli_paths import nonempty_path_text, path_option

console = CallTimeConsole(emoji=False, soft_wrap=True, stderr=True)  # sized when it prints (messages.py)

FAMILY_EXAMPLES = {
    "shapes": EXAMPLES_DIR / "default" / "config.toml",
    "jpeg-toy": EXAMPLES_DIR / "jpeg-toy" / "config.toml",
    "qwen-image": EXAMPLES_DIR / "families" / "qwen-image.toml",
    "sd3": EXAMPLES_DIR / "families" / "sd3.toml",
    "flux": EXAMPLES_DIR / "families" / "flux.toml",
}
"""``--family`` choices and the example config each starts from (``shapes`` = the embedded default)."""

FAMILY_ALIASES = {"tiny": "shapes"}
"""``model.family`` names (the README's family table) ``--family`` also takes: ``tiny`` is the
tiny family's task, the shapes task (``jpeg-toy`` is the other tiny-family example)."""


@functools.cache
def config_docs() -> dict[tuple[str, str], str]:
    """Documentation of every config class and field, from ``spotlight/config.py``.

    Returns:
        ``{(class name, field name): text}``, with ``(class name, "")`` for the class
        docstring; texts are dedented (:func:`inspect.cleandoc`).
    """
    import spotlight.config as config_module

    tree = ast.parse(pathlib.Path(config_module.__file__).read_text())
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        doc = ast.get_docstring(node)
        if doc:
            docs[(node.name, "")] = doc
        for stmt, nxt in zip(node.body, node.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = inspect.cleandoc(nxt.value.value)
    return docs


def _comment(text: str) -> list[str]:
    return [("# " + line).rstrip() for line in text.replace("``", "`").splitlines()]


def _toml_value(key: str, value) -> str:
    """``key = value`` on one line, the values as tomli-w writes them (arrays inline)."""
    if value is None:  # TOML has no null: an unset optional field stays a comment
        return f"# {key} = (unset)"
    if isinstance(value, (list, tuple)):
        return f"{key} = [" + ", ".join(_toml_value("x", v).split(" = ", 1)[1] for v in value) + "]"
    return tomli_w.dumps({key: value}).strip()


def annotated_config(cfg: SpotlightConfig, header: list[str] | None = None) -> str:
    """TOML text of ``cfg``: every section and field, each preceded by its documentation
    as ``#`` comments and, where the value is not the field's default, ``(default: X)``.

    Args:
        cfg: the config to write.
        header: comment lines (without ``#``) put first.

    Returns:
        The file's text; ``load_config`` of it gives ``cfg`` back.
    """
    docs = config_docs()
    out = _comment("\n".join(header)) + [""] if header else []
    for section in cfg.__struct_fields__:
        obj = getattr(cfg, section)
        cls = type(obj)
        values = msgspec.to_builtins(obj)
        defaults = msgspec.to_builtins(cls())
        if (cls.__name__, "") in docs:
            out += _comment(docs[(cls.__name__, "")])
        out.append(f"[{section}]")
        for name in cls.__struct_fields__:
            doc = docs.get((cls.__name__, name), "")
            if values[name] != defaults[name]:
                default = _toml_value(name, defaults[name]).split(" = ", 1)[1]
                doc = (doc + "\n" if doc else "") + f"(default: {default})"
            out += ([""] + _comment(doc)) if doc else []
            out.append(_toml_value(name, values[name]))
        out.append("")
    return "\n".join(out)


def _example_header(path: pathlib.Path) -> list[str]:
    """The leading comment block of an example config (its description), without ``#``."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].removeprefix(" "))
    return lines


def register(app: typer.Typer) -> None:
    @app.command()
    def init(
        family: str = typer.Option(
            "shapes",
            "--family",
            metavar="NAME",
            help=f"{', '.join(FAMILY_EXAMPLES)} (shapes: the CPU default; tiny = shapes).",
        ),
        pretrained_path: Optional[str] = typer.Option(
            None,
            "--pretrained-path",
            metavar="DIR",
            parser=nonempty_path_text,
            help="Local checkpoint folder (model.pretrained_path).",
        ),
        train_gpus: Optional[int] = typer.Option(
            None, "--train-gpus", min=1, metavar="N", help="Training GPUs (train.num_train_workers)."
        ),
        reserved_rollout_gpus: Optional[str] = typer.Option(
            None, "--reserved-rollout-gpus", metavar="LIST", help="Reserved GPUs that also roll out, e.g. 0,1."
        ),
        sp_degree: Optional[int] = typer.Option(
            None, "--sp-degree", min=1, metavar="N", help="Spot SP degree (cluster.sp_degree)."
        ),
        spot_nodes: Optional[int] = typer.Option(
            None, "--spot-nodes", min=0, metavar="N", help="Spot nodes (for the header's commands; default 2)."
        ),
        gpus_per_node: Optional[int] = typer.Option(
            None,
            "--gpus-per-node",
            min=1,
            max=MAX_GPUS_PER_NODE,  # the header's join --gpus list must be one a node may register
            metavar="N",
            help="GPUs per spot node (header; default 1).",
        ),
        out: Optional[pathlib.Path] = path_option(
            None, "--out", "-o", metavar="FILE", help="Write here, not to stdout."
        ),
        try_out: bool = typer.Option(
            False,
            "--try-out",
            help="Sizes for a tiny random-weight checkpoint on CPU (README 'No weights at hand?'): "
            "32-pixel images, 4 prompts x 4 samples per iteration, one Train Worker.",
        ),
    ) -> None:
        """Print an annotated run config: every field with its value, default and documentation.

        Example: `spotlight init > run.toml && spotlight up --local --config run.toml`.
        """
        family = FAMILY_ALIASES.get(family, family)
        if family not in FAMILY_EXAMPLES:
            console.print(
                f"[red]error:[/red] --family {escape(family)!r}: choose one of {', '.join(FAMILY_EXAMPLES)} "
                "(tiny = shapes)"
            )
            raise typer.Exit(2)
        example = FAMILY_EXAMPLES[family]
        cfg = _layout_config(
            example,
            pretrained_path=pretrained_path,
            train_gpus=train_gpus,
            rollout_gpus=_gpu_list(reserved_rollout_gpus),
            sp_degree=sp_degree,
            try_out=try_out,
        )
        cluster = not try_out and is_cluster_layout(
            family, train_gpus, reserved_rollout_gpus, sp_degree, spot_nodes=spot_nodes, gpus_per_node=gpus_per_node
        )
        spot_nodes = 2 if spot_nodes is None else spot_nodes
        gpus_per_node = 1 if gpus_per_node is None else gpus_per_node
        header = _header(
            family, example, cfg, spot_nodes=spot_nodes, gpus_per_node=gpus_per_node, out=out, cluster=cluster
        )
        text = annotated_config(cfg, header)
        if out is None:
            typer.echo(text, nl=False)
        else:
            _write(out, text, cluster=cluster)
        if pretrained_path is not None:  # once the config is out: a refused --out needs no warning
            _warn_checkpoint(pretrained_path, cfg.model)


def _warn_checkpoint(given: str, model) -> None:
    """Warn (not refuse: the config may be written here for the reserved node, where the folder
    is) when ``--pretrained-path`` is no folder on this machine, or a folder that ``spotlight
    up`` would refuse for this ``--family`` (another family's checkpoint, a missing component;
    the family's own up-front check, which reads config files only)."""
    folder = model.pretrained_dir
    if not folder.is_dir():
        what = "a file, not a checkpoint folder" if folder.exists() else "no such folder"
        console.print(
            f"[yellow]warning:[/yellow] --pretrained-path {escape(given)}: {what} on this machine; "
            "`spotlight up` refuses the config wherever the checkpoint folder is missing"
        )
        return
    from spotlight.models.families import ModelLoadError, get_family

    try:
        get_family(model).check()
    except ModelLoadError as exc:
        why = str(exc).replace("check model.family", "check --family")
        console.print(
            f"[yellow]warning:[/yellow] --pretrained-path {escape(given)}: {escape(why)}; "
            "`spotlight up` refuses this config until that is fixed"
        )


TRY_OUT = {
    "model.image_size": 32,
    "data.prompts_per_iteration": 4,
    "data.group_size": 4,
    "train.num_train_workers": 1,
    "cluster.reserved_rollout_gpus": [0],
}
"""``spotlight init --try-out``: what a tiny random-weight checkpoint (``make_random_checkpoint``,
32 pixels) needs to finish two iterations in minutes on a CPU, not the family's Flow-GRPO batch
of 48 prompts × 24 samples on 4 Train Workers (about 20 min per iteration on 2 loaded cores)."""

CPU_FAMILIES = frozenset({"shapes", "jpeg-toy"})
"""``--family`` choices that run as shipped on this machine's CPU (``spotlight up --local``)."""


def is_cluster_layout(family: str, *layout_flags, spot_nodes=None, gpus_per_node=None) -> bool:
    """Whether ``spotlight init`` describes a cluster (pure): a family whose checkpoint needs GPUs
    (qwen-image, sd3, flux) or any layout flag given (``--train-gpus``, ``--reserved-rollout-gpus``,
    ``--sp-degree``, ``--spot-nodes``, ``--gpus-per-node``). Its header and closing line then give
    the commands for real machines (the README's), not ``spotlight up --local``."""
    given = [f for f in (*layout_flags, spot_nodes, gpus_per_node) if f is not None]
    return family not in CPU_FAMILIES or bool(given)


def _gpu_list(reserved_rollout_gpus: Optional[str]) -> Optional[list[int]]:
    """``--reserved-rollout-gpus`` as GPU indices (None: not given).

    Raises:
        typer.Exit: 2 with one line: not comma-separated integers, or an index above
            :data:`spotlight.protocol.MAX_GPU_INDEX` (the reserved agent's REGISTER would not decode).
    """
    from spotlight.protocol import MAX_GPU_INDEX
    from spotlight.util.gpus import parse_gpu_indices

    if reserved_rollout_gpus is None:
        return None
    try:
        gpus = parse_gpu_indices(reserved_rollout_gpus)
    except ValueError as exc:
        console.print(f"[red]error:[/red] --reserved-rollout-gpus: {escape(str(exc))}")
        raise typer.Exit(2)
    too_big = sorted({g for g in gpus if g > MAX_GPU_INDEX})
    if too_big:
        console.print(
            f"[red]error:[/red] --reserved-rollout-gpus {escape(reserved_rollout_gpus)!r}: GPU indices are at most "
            f"{MAX_GPU_INDEX} (the largest the coordinator accepts), got {too_big[:8]}"
        )
        raise typer.Exit(2)
    return gpus


def _layout_config(
    example: pathlib.Path,
    *,
    pretrained_path: Optional[str],
    train_gpus: Optional[int],
    rollout_gpus: Optional[list[int]],
    sp_degree: Optional[int],
    try_out: bool = False,
) -> SpotlightConfig:
    """The config of ``example`` with the layout flags applied (each None: as the example has it),
    and with ``try_out`` the :data:`TRY_OUT` sizes on top.

    Raises:
        typer.Exit: 2 with one line: the result is not a valid config (a value a flag set is
            named by its flag, as :func:`spotlight.config.load_config` names a file's key).
    """
    from spotlight.config import ConfigError, anchored_path, config_from_dict, config_to_dict, load_config

    # a relative --pretrained-path that exists here is written absolute: the config then means
    # the same checkpoint from any working directory
    given = {"model.pretrained_path": anchored_path(pretrained_path)} if pretrained_path is not None else None
    try:
        data = config_to_dict(load_config(example, given))
        if train_gpus is not None:
            data["train"]["num_train_workers"] = train_gpus
        if rollout_gpus is not None:
            data["cluster"]["reserved_rollout_gpus"] = rollout_gpus
        if try_out:
            for key, value in TRY_OUT.items():
                section, name = key.split(".")
                data[section][name] = value
            data["data"]["num_control_prompts"] = min(data["data"]["num_control_prompts"], 1)
        if sp_degree is not None:
            data["cluster"]["sp_degree"] = sp_degree
        given = {
            "train.num_train_workers": ("--train-gpus", train_gpus),
            "cluster.reserved_rollout_gpus": ("--reserved-rollout-gpus", rollout_gpus),
            "cluster.sp_degree": ("--sp-degree", sp_degree),
        }
        try:
            return config_from_dict(data)
        except ConfigError as exc:  # a value this command set: name its flag, as load_config does
            flag, value = given.get(exc.field or "", (None, None))
            raise ConfigError(f"{flag}: {exc}" if value is not None else f"{example}: {exc}", exc.field) from None
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2)


def _header(
    family: str,
    example: pathlib.Path,
    cfg: SpotlightConfig,
    *,
    spot_nodes: int,
    gpus_per_node: int,
    out: Optional[pathlib.Path],
    cluster: bool = False,
) -> list[str]:
    """The file's leading comment: where it came from, how to use it, the example's own
    description, the layout and the commands that start it (``cluster``: on real machines only,
    as the README gives them; else also on this machine with ``--local``)."""
    gpus = ",".join(str(g) for g in range(gpus_per_node))
    cfg_name = shlex.quote(str(out)) if out is not None else "run.toml"  # a command line to copy
    local = [
        "  on one machine (CPU 'GPUs'):  spotlight up --local "
        f"--agents {spot_nodes} --gpus-per-agent {gpus_per_node} --config {cfg_name}",
    ]
    wait = [
        f"  (add --min-spot-nodes {spot_nodes} to the reserved node's command to start iteration 1 only once "
        f"the {spot_nodes} spot nodes are alive)"
    ]
    return [
        f"Spotlight run config: {family} (from {example.relative_to(EXAMPLES_DIR.parent)}), "
        f"written by `spotlight init --family {family}`.",
        "Every field is listed with its documentation (spotlight/config.py); a file only needs the keys",
        "it changes (the rest come from the embedded default), so delete what you keep as it is.",
        "",
        *_example_header(example),
        "",
        f"Layout: {cfg.train.num_train_workers} training GPU(s) and "
        + (
            f"rollout GPUs {list(cfg.cluster.reserved_rollout_gpus)}"
            if cfg.cluster.reserved_rollout_gpus
            else "no rollout GPUs"
        )
        + " on the reserved node,",
        (
            f"{spot_nodes} spot node(s) x {gpus_per_node} GPU(s). Start it:"
            if spot_nodes
            else "no spot nodes at the start (they may join at any time: the last command). Start it:"
        ),
        *([] if cluster else local),
        *(f"  {line}" for line in cluster_commands(cfg_name, cfg, gpus)),
        *(wait if cluster and spot_nodes > 1 else []),
        "  (README 'On real machines'; recipes for SkyPilot, Kubernetes, Slurm, a container: deploy/, docs/deploy/)",
    ]


PORT = 7400
"""The coordinator's port in the README, docs/deploy/ and every recipe under deploy/."""
KEYS_DIR = "/etc/spotlight/keys"
"""The keys directory in the README and the recipes (the container mounts the keys there)."""


def cluster_commands(cfg_name: str, cfg: SpotlightConfig, gpus: str) -> list[str]:
    """The commands that start ``cfg_name`` (as a command line spells it: shell-quoted) on real
    machines, as the README's 'On real machines' gives them (``tests/unit/cli/test_init.py``
    checks that the README holds each one)."""
    reserved = ",".join(str(g) for g in cfg.cluster.reserved_rollout_gpus)
    # no reserved rollout GPUs: no reserved agent to key or start (`join --gpus ""` is refused)
    reserved_key = [f"                       spotlight keys add {KEYS_DIR} reserved reserved-0"] if reserved else []
    reserved_agent = (
        [
            f"reserved node, beside: spotlight-agent join --reserved --coordinator 127.0.0.1:{PORT} "
            f"--keys {KEYS_DIR} --gpus {reserved}"
        ]
        if reserved
        else []
    )
    return [
        f"reserved node, once:   spotlight keys init {KEYS_DIR}",
        f"                       spotlight keys add {KEYS_DIR} agent spot-7",
        *reserved_key,
        f"reserved node:         spotlight up --config {cfg_name} --reserved 0.0.0.0:{PORT} --keys {KEYS_DIR} "
        "--run-dir /var/lib/spotlight/run",
        *reserved_agent,
        f"each spot node:        spotlight-agent join --coordinator reserved-host:{PORT} --keys {KEYS_DIR} "
        f"--gpus {gpus} --cloud aws",
    ]


def _write(out: pathlib.Path, text: str, *, cluster: bool = False) -> None:
    """Write ``text`` to a new file ``out`` and say how to start it (``cluster``: on the reserved
    node, as the README's 'On real machines'; else on this machine with ``--local``).

    Raises:
        typer.Exit: 2 with one line: ``out`` exists or cannot be written.
    """
    if out.is_dir():
        console.print(
            f"[red]error:[/red] --out {escape(str(out))} is a directory; give a file, "
            f"e.g. {escape(str(out / 'run.toml'))}"
        )
        raise typer.Exit(2)
    if out.exists():
        console.print(f"[red]error:[/red] {escape(str(out))} exists; choose another --out or remove it")
        raise typer.Exit(2)
    try:
        write_text_atomic(out, text)
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot write {escape(str(out))}: {escape(exc.strerror or str(exc))}")
        raise typer.Exit(2)
    config = escape(shlex.quote(str(out)))  # in a command line to copy
    if not cluster:
        console.print(f"wrote {escape(str(out))}; start with [cyan]spotlight up --local --config {config}[/cyan]")
        return
    console.print(
        f"wrote {escape(str(out))}; on the reserved node start it with [cyan]spotlight up --config "
        f"{config} --reserved 0.0.0.0:{PORT} --keys {KEYS_DIR} --run-dir /var/lib/spotlight/run[/cyan], "
        "then join the reserved and spot agents (the commands are in its header; README 'On real machines')"
    )
