"""``spotlight mock-metadata``: serve a mock cloud metadata endpoint on loopback.

Serves :class:`spotlight.cloud.mock_metadata.MockMetadataServer` until Ctrl-C, for manual checks of
``spotlight-agent`` and for trace replayers (docs/preemption-notices.md §5.4).
"""

import threading
from typing import Annotated, Optional

import typer

MOCK_METADATA_HELP = (
    "Serve a mock AWS/GCP/Azure metadata server (real formats) until Ctrl-C.\n\n"
    'Drive it with POST <control>/notice, /maintenance {"value"} (gcp), /cancel, /fault {"kind","count"}, '
    "GET <control>/state."
)
"""``spotlight mock-metadata --help``'s text (its second paragraph is one line: typer keeps a
help text's line breaks)."""


def register(app: "typer.Typer") -> None:
    """Add the ``mock-metadata`` command to ``app``."""

    @app.command("mock-metadata", help=MOCK_METADATA_HELP)
    def mock_metadata(
        cloud: Annotated[str, typer.Option(help="Personality: aws | gcp | azure.")] = "aws",
        host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to bind; 0 picks a free one.")] = 0,
        notice_after_s: Annotated[
            Optional[float],
            typer.Option(help="Issue a preemption notice this many seconds after start (default: never)."),
        ] = None,
        lead_time_s: Annotated[
            Optional[float],
            typer.Option(help="Notice lead time in seconds (default per cloud: aws 120, azure 30, gcp 0)."),
        ] = None,
        vm_name: Annotated[
            str, typer.Option(help="Azure VM name: listed in event Resources and served at instance/compute/name.")
        ] = "spot-vm-0",
    ) -> None:
        """:data:`MOCK_METADATA_HELP`: a :class:`~spotlight.cloud.mock_metadata.MockMetadataServer` until Ctrl-C."""
        from spotlight.cloud.mock_metadata import CLOUDS, MockMetadataServer

        if cloud not in CLOUDS:
            raise typer.BadParameter(f"expected one of {', '.join(CLOUDS)}", param_hint="--cloud")
        if notice_after_s is not None and notice_after_s < 0:
            raise typer.BadParameter("must be >= 0", param_hint="--notice-after-s")
        server = MockMetadataServer(cloud, host, port, vm_name=vm_name).start()
        done = threading.Event()
        timer = None
        try:
            typer.echo(f"base URL:    {server.url}")
            typer.echo(f"control URL: {server.control_url}")
            if notice_after_s is not None:
                timer = threading.Timer(notice_after_s, server.issue_notice, kwargs={"lead_time_s": lead_time_s})
                timer.daemon = True
                timer.start()
            while not done.wait(1.0):
                pass
        except KeyboardInterrupt:
            typer.echo("stopping")
        finally:
            if timer is not None:
                timer.cancel()
            server.stop()
