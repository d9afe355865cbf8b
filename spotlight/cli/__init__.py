"""``spotlight`` command line (typer + rich). Each command lives in its own module and
registers itself on :data:`app`; heavy imports (torch, diffusers) happen inside the
commands, so ``spotlight --help`` and ``spotlight status`` stay fast."""

from __future__ import annotations

import re

import typer
import typer.core


def _help_metavar(shown):
    """typer's rich help prints every option's type in its metavar column, flags included
    (``--json <bool>``, ``--help <bool>``, as if they took a value), a repeatable option as
    ``<list[str]>`` and a bounded number as ``<int range>`` next to its ``[x>=1]``. This wraps
    ``display_type_rich`` (what that column shows) for every command at once: nothing for a
    flag or a counter, the element type for a repeatable option, the number type for a range;
    an explicit ``metavar=`` is shown as given."""

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) or getattr(self, "count", False):
            return None
        label = shown(self, ctx)
        if self.metavar is not None or not isinstance(label, str):
            return label
        label = re.sub(r"^<list\[(.*)\]>", r"<\1>", label)
        return re.sub(r"^<(\w+) range>", r"<\1>", label)

    display_type_rich._spotlight = True
    return display_type_rich


for _cls in (getattr(typer.core, "TyperOption", None), getattr(typer.core, "TyperArgument", None)):
    _shown = getattr(_cls, "display_type_rich", None)  # absent in another typer: its help as it is
    if _shown is not None and not getattr(_shown, "_spotlight", False):
        _cls.display_type_rich = _help_metavar(_shown)

app = typer.Typer(
    help="Spotlight: Flow-GRPO post-training of Diffusion Transformers on reserved + spot GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _register_all() -> None:
    from spotlight.cli import (
        bench,
        init,
        keys,
        mock_metadata,
        plan,
        profile,
        reward_server,
        simulate,
        status,
        up,
    )
    from spotlight.cli import (
        eval as eval_cmd,
    )

    for module in (init, up, status, keys, eval_cmd, profile, simulate, mock_metadata, bench, reward_server, plan):
        module.register(app)


_register_all()


def main() -> None:
    from spotlight.util.cli_run import main_of

    main_of(app, "error:", interrupt=True)
