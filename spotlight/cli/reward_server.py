"""``spotlight reward-server``: serve weighted reward scorers over JSON HTTP.

The server side of ``[reward] kind = "http"`` (protocol in :mod:`spotlight.rewards.server`):
built-in JPEG scorers, the rule-based shapes-world GenEval scorers (``geneval_shapes``,
``geneval_shapes_partial``) and a PickScore-style CLIP scorer loaded from a local checkpoint.
"""

import logging
import math
import pathlib
from typing import Annotated, NoReturn, Optional

import typer


def register(app: "typer.Typer") -> None:
    """Add the ``reward-server`` command to ``app``."""

    @app.command("reward-server")
    def reward_server(
        scorer: Annotated[
            list[str],
            typer.Option(
                "--scorer",
                "-s",
                help="NAME[:WEIGHT], repeatable; reward = Σ weight·score. Names: clip, pickscore (= clip), "
                "geneval_shapes (strict 0/1 GenEval verdict on shapes-world captions), "
                "geneval_shapes_partial (fraction of GenEval clauses that hold), "
                "jpeg_compressibility and jpeg_incompressibility (its negative).",
            ),
        ] = [],  # noqa: B006 - typer needs a list default
        clip_path: Annotated[
            Optional[pathlib.Path],
            typer.Option(
                "--clip-path", help="Local CLIPModel directory for clip/pickscore (e.g. a PickScore_v1 download)."
            ),
        ] = None,
        clip_processor_path: Annotated[
            Optional[pathlib.Path],
            typer.Option(
                "--clip-processor-path",
                help="Processor (image processor + tokenizer) directory when it is not --clip-path "
                "(PickScore_v1 uses the processor of LAION's CLIP ViT-H-14 laion2B model).",
            ),
        ] = None,
        device: Annotated[
            Optional[str], typer.Option(help="Torch device for CLIP (default: cuda if available).")
        ] = None,
        host: Annotated[str, typer.Option(help="Address to bind (no authentication: keep it private).")] = "127.0.0.1",
        port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind; 0 picks a free one.")] = 18085,
        max_body_mb: Annotated[
            float, typer.Option("--max-body-mb", help="Largest request body in MiB; larger ones get 413 unread.")
        ] = 256.0,
        max_batch: Annotated[int, typer.Option(min=1, help="Most images per request.")] = 512,
        log_level: Annotated[str, typer.Option(help="Python logging level.")] = "info",
    ) -> None:
        """Serve reward scorers over JSON HTTP until Ctrl-C.

        POST / {"images": [<base64 PNG>, ...], "prompts": [...]} → {"rewards": [...], "scores": {name: [...]}};
        GET /health → {"status": "ok", "scorers": {name: weight}}.
        Example: spotlight reward-server --scorer clip:1.0 --scorer jpeg_compressibility:0.1 --clip-path ./PickScore_v1
        or: spotlight reward-server --scorer geneval_shapes_partial
        """
        from rich.console import Console
        from rich.markup import escape

        from spotlight.errors import SpotlightError

        console = Console(emoji=False)

        def fail(message: str) -> NoReturn:
            console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)

        level = getattr(logging, log_level.upper(), None)
        if not isinstance(level, int):
            fail(f"unknown --log-level {log_level!r}")
        if not (math.isfinite(max_body_mb) and max_body_mb > 0):
            fail("--max-body-mb must be a finite number > 0")
        from spotlight.rewards.server import build_multi_scorer, parse_scorer_specs, serve

        try:
            weights = parse_scorer_specs(scorer)
        except SpotlightError as exc:
            fail(str(exc))
        uses_clip = any(name in ("clip", "pickscore") for name in weights)
        if uses_clip and clip_path is None:
            fail("the clip/pickscore scorer needs --clip-path DIR (a local CLIPModel checkpoint)")
        if not uses_clip and (clip_path is not None or clip_processor_path is not None):
            console.print("[yellow]note:[/yellow] --clip-path is ignored: no clip/pickscore scorer selected")
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        try:
            if uses_clip:
                with console.status(f"loading CLIP from {clip_path}…"):
                    multi = build_multi_scorer(
                        weights, clip_path=clip_path, clip_processor_path=clip_processor_path, device=device
                    )
            else:
                multi = build_multi_scorer(weights)
        except SpotlightError as exc:
            fail(str(exc))

        def ready(server) -> None:
            console.print(
                f"[bold]reward server[/bold] listening on [cyan]{server.url}[/cyan]  (POST / or /score, GET /health)",
                highlight=False,
            )
            for name, weight in multi.weights.items():
                console.print(f"  scorer {name:<24} weight {weight:g}", highlight=False)
            if host not in ("127.0.0.1", "localhost", "::1"):
                console.print("[yellow]note:[/yellow] no authentication: keep this port on a private network")

        try:
            serve(multi, host, port, on_ready=ready, max_body_bytes=int(max_body_mb * 1024 * 1024), max_batch=max_batch)
        except OSError as exc:
            fail(f"cannot listen on {host}:{port}: {exc}")
        console.print("stopped")
