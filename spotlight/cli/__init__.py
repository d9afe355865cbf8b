"""``spotlight`` command line (typer + rich). Each command lives in its own module and
registers itself on :data:`app`; heavy imports (torch, diffusers) happen inside the
commands, so ``spotlight --help`` and ``spotlight status`` stay fast."""

from __future__ import annotations

import typer

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

    main_of(app, "error:")
