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

from spotlight.cli.messages import print_error
from spotlight.cli.progress import working
from spotlight.util.cli_paths import path_option


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
                "geneval_shapes_partial (fraction of GenEval clauses that hold), geneval and geneval_partial "
                "(GenEval's rules on real images: --detector-path, --clip-path for colours, --geneval-metadata), "
                "ocr (Flow-GRPO's OCR reward, RapidOCR), aesthetic (LAION predictor: --aesthetic-head), "
                "jpeg_compressibility and jpeg_incompressibility (its negative).",
            ),
        ] = [],  # noqa: B006 - typer needs a list default
        clip_path: Annotated[
            Optional[pathlib.Path],
            path_option(
                "--clip-path", help="Local CLIPModel directory for clip/pickscore (e.g. a PickScore_v1 download)."
            ),
        ] = None,
        clip_processor_path: Annotated[
            Optional[pathlib.Path],
            path_option(
                "--clip-processor-path",
                help="Processor (image processor + tokenizer) directory when it is not --clip-path "
                "(PickScore_v1 uses the processor of LAION's CLIP ViT-H-14 laion2B model).",
            ),
        ] = None,
        detector_path: Annotated[
            Optional[pathlib.Path],
            path_option(
                "--detector-path",
                help="Local transformers object detector (COCO class names, e.g. DETR) for the geneval "
                "scorers; colours are classified with --clip-path.",
            ),
        ] = None,
        geneval_metadata: Annotated[
            list[pathlib.Path],
            path_option(
                "--geneval-metadata",
                help="GenEval records (tag, include, exclude) per prompt, a JSONL file; repeatable "
                "(the README names the shipped ones).",
            ),
        ] = [],  # noqa: B006 - typer needs a list default
        aesthetic_head: Annotated[
            Optional[pathlib.Path],
            path_option(
                "--aesthetic-head",
                help="Weights of the LAION aesthetic predictor head (.pth or .safetensors).",
            ),
        ] = None,
        aesthetic_clip_path: Annotated[
            Optional[pathlib.Path],
            path_option("--aesthetic-clip-path", help="CLIP ViT-L/14 directory for aesthetic (default: --clip-path)."),
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

        POST / {"version": 2, "images": [<base64 PNG>, ...], "prompts": [...], "metadata": [{...}, ...]}
        → {"rewards": [...], "scores": {name: [...]}};
        GET /health → {"status": "ok", "scorers": {name: weight}}.
        Example: spotlight reward-server --scorer clip:1.0 --scorer jpeg_compressibility:0.1 --clip-path ./PickScore_v1
        or: spotlight reward-server --scorer geneval_shapes_partial
        """
        from rich.console import Console

        console = Console(emoji=False)
        level = getattr(logging, log_level.upper(), None)
        if not isinstance(level, int):
            _fail(f"unknown --log-level {log_level!r}")
        if not (math.isfinite(max_body_mb) and max_body_mb > 0):
            _fail("--max-body-mb must be a finite number > 0")
        weights = _scorer_weights(console, scorer, clip_path=clip_path, clip_processor_path=clip_processor_path)
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if any(n.startswith("geneval") and n not in ("geneval_shapes", "geneval_shapes_partial") for n in weights):
            if detector_path is None:
                _fail("the geneval scorers need --detector-path DIR (a local transformers object detector)")
            if not geneval_metadata:
                console.print("[yellow]note:[/yellow] no --geneval-metadata: prompts must carry GenEval metadata")
        multi = _build(
            console,
            weights,
            clip_path=clip_path,
            clip_processor_path=clip_processor_path,
            device=device,
            detector_path=detector_path,
            geneval_metadata=geneval_metadata,
            aesthetic_head=aesthetic_head,
            aesthetic_clip_path=aesthetic_clip_path,
        )
        from spotlight.rewards.server import serve

        try:
            serve(
                multi,
                host,
                port,
                on_ready=_on_ready(console, multi, host),
                max_body_bytes=int(max_body_mb * 1024 * 1024),
                max_batch=max_batch,
            )
        except OSError as exc:
            _fail(f"cannot listen on {host}:{port}: {exc}")
        console.print("stopped")


def _fail(message: str) -> NoReturn:
    """Print ``error: message`` (plain text) on stderr and exit 2."""
    from rich.markup import escape

    print_error(f"[red]error:[/red] {escape(message)}", highlight=False)
    raise typer.Exit(2)


def _scorer_weights(
    console, scorer: list[str], *, clip_path: Optional[pathlib.Path], clip_processor_path: Optional[pathlib.Path]
) -> dict[str, float]:
    """The ``--scorer`` specs as ``{name: weight}``; the clip scorer needs ``--clip-path``, and
    a ``--clip-path`` without it is noted as ignored.

    Raises:
        typer.Exit: 2 with one line: a bad spec, or clip without ``--clip-path``.
    """
    from spotlight.errors import SpotlightError
    from spotlight.rewards.server import parse_scorer_specs

    try:
        weights = parse_scorer_specs(scorer)
    except SpotlightError as exc:
        _fail(str(exc))
    uses_clip = any(name in ("clip", "pickscore") for name in weights)
    if uses_clip and clip_path is None:
        _fail("the clip/pickscore scorer needs --clip-path DIR (a local CLIPModel checkpoint)")
    colours = any(name in ("geneval", "geneval_partial", "aesthetic") for name in weights)  # they use CLIP too
    if not uses_clip and not colours and (clip_path is not None or clip_processor_path is not None):
        console.print("[yellow]note:[/yellow] --clip-path is ignored: no clip/pickscore/geneval scorer selected")
    return weights


def _build(
    console,
    weights: dict[str, float],
    *,
    clip_path: Optional[pathlib.Path],
    clip_processor_path: Optional[pathlib.Path],
    device: Optional[str],
    detector_path: Optional[pathlib.Path] = None,
    geneval_metadata: list[pathlib.Path] = (),
    aesthetic_head: Optional[pathlib.Path] = None,
    aesthetic_clip_path: Optional[pathlib.Path] = None,
):
    """The weighted scorer of ``weights`` (:func:`spotlight.rewards.server.build_multi_scorer`;
    CLIP loads under a spinner).

    Raises:
        typer.Exit: 2 with one line: a scorer cannot be built.
    """
    from spotlight.errors import SpotlightError
    from spotlight.rewards.server import build_multi_scorer

    try:
        if any(name in ("clip", "pickscore") for name in weights):
            with working(console, f"loading CLIP from {clip_path}…"):
                return build_multi_scorer(
                    weights, clip_path=clip_path, clip_processor_path=clip_processor_path, device=device
                )
        if detector_path is not None or "aesthetic" in weights:
            with working(console, "loading the scorers' models…"):
                return build_multi_scorer(
                    weights,
                    clip_path=clip_path,
                    device=device,
                    detector_path=detector_path,
                    geneval_metadata=geneval_metadata,
                    aesthetic_head=aesthetic_head,
                    aesthetic_clip_path=aesthetic_clip_path,
                )
        return build_multi_scorer(weights)
    except SpotlightError as exc:
        _fail(str(exc))


def _on_ready(console, multi, host: str):
    """The ``on_ready(server)`` callback of :func:`spotlight.rewards.server.serve`: the address,
    each scorer's weight, and a note when the address is not a loopback one."""

    def ready(server) -> None:
        console.print(
            f"[bold]reward server[/bold] listening on [cyan]{server.url}[/cyan]  (POST / or /score, GET /health)",
            highlight=False,
        )
        for name, weight in multi.weights.items():
            console.print(f"  scorer {name:<24} weight {weight:g}", highlight=False)
        if host not in ("127.0.0.1", "localhost", "::1"):
            console.print("[yellow]note:[/yellow] no authentication: keep this port on a private network")

    return ready
