"""Path-valued command-line options and arguments that refuse an empty value.

``pathlib.Path("")`` is ``Path(".")``: ``--weights-dir ''`` (or ``--weights-dir=``, or a shell
variable that expanded to nothing) would name the working directory, and a command that
empties, writes or deletes in the folder it is given would do so there (the agent's weight
cache drops its ``v*.safetensors`` at start). Every path of ``spotlight`` and
``spotlight-agent`` goes through :func:`nonempty_path` (a typer ``parser``), so an empty value
is a usage error that names the option (``cli_run.run_app``: status 2) before the command
does anything; ``.`` still means the working directory. The ``argparse`` entry points a person
runs use :func:`nonempty_path_arg`. Never imports torch."""

from __future__ import annotations

import pathlib
from typing import Any

import typer

EMPTY_PATH = "empty; give a path ('.' for the working directory)"
"""Why an empty value is refused (click prefixes ``Invalid value for '--opt': ``)."""

PATH_METAVAR = "<path>"
"""What the help shows for a path option, as typer shows one without a ``parser``."""


def empty_path(value: Any) -> bool:
    """Whether ``value`` (a command-line string, or a default) is an empty path (pure)."""
    return isinstance(value, (str, bytes)) and not value


def nonempty_path(value: Any) -> pathlib.Path:
    """A typer ``parser``: ``value`` as a :class:`pathlib.Path`, an empty one refused.

    Raises:
        typer.BadParameter: ``value`` is empty (click names the option in its usage error)."""
    if empty_path(value):
        raise typer.BadParameter(EMPTY_PATH)
    return pathlib.Path(value)


def nonempty_path_text(value: Any) -> str:
    """A typer ``parser`` for a ``str`` option that names a path (``init --pretrained-path``,
    kept as the text given): ``value``, an empty one refused.

    Raises:
        typer.BadParameter: ``value`` is empty."""
    if empty_path(value):
        raise typer.BadParameter(EMPTY_PATH)
    return str(value)


def nonempty_path_arg(value: str) -> str:
    """An ``argparse`` ``type=`` for a path of the ``python -m`` entry points a person runs
    (``spotlight.workers.train.launch`` under torchrun or srun, the shapes pretraining): ``value``,
    an empty one refused (argparse: ``argument --out: empty; …``, status 2).

    Raises:
        argparse.ArgumentTypeError: ``value`` is empty."""
    import argparse

    if empty_path(value):
        raise argparse.ArgumentTypeError(EMPTY_PATH)
    return value


def path_option(*args: Any, **kwargs: Any) -> Any:
    """``typer.Option(*args, **kwargs)`` for a :class:`pathlib.Path` option (a ``list`` of them
    included) that refuses an empty value (:func:`nonempty_path`); its help shows ``<path>``
    unless ``metavar`` is given."""
    kwargs.setdefault("metavar", PATH_METAVAR)
    return typer.Option(*args, parser=nonempty_path, **kwargs)


def path_argument(*args: Any, **kwargs: Any) -> Any:
    """``typer.Argument(*args, **kwargs)`` for a :class:`pathlib.Path` argument that refuses an
    empty value (:func:`nonempty_path`). (No ``metavar``: an argument's is its name in the help.)"""
    return typer.Argument(*args, parser=nonempty_path, **kwargs)
