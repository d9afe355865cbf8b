"""``spotlight keys``: create, list and revoke the CURVE keys of the control plane.

See :mod:`spotlight.net.security` for the directory layout and README "Security model" for
how keys reach a new spot node.
"""

from __future__ import annotations

import pathlib
import shlex

import typer
from rich.markup import escape
from rich.table import Table

from spotlight.cli.messages import WARNING, CallTimeConsole, print_error
from spotlight.util.cli_paths import path_argument

keys_app = typer.Typer(
    help="Create, list and revoke control-plane keys (ZeroMQ CURVE; README 'Security model').",
    no_args_is_help=True,
    add_completion=False,
)
console = CallTimeConsole(emoji=False, soft_wrap=True)  # sized when it prints (messages.py)


def _fail(exc: Exception) -> None:
    if isinstance(exc, OSError) and exc.strerror:  # "PATH: Not a directory", not "[Errno 20] …"
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    else:
        text = str(exc)
    print_error(f"[red]error:[/red] {escape(text)}")
    raise typer.Exit(2)


@keys_app.command("init")
def init(
    directory: pathlib.Path = path_argument(
        ..., help="Keys directory to create (mode 0700), e.g. /etc/spotlight/keys."
    ),
) -> None:
    """Create the coordinator's key pair and its allow-list, with one read-only key for `spotlight status` here."""
    from spotlight.net.security import KeysError, add_client, init_keys

    try:
        pub = init_keys(directory)
        status_secret = add_client(directory, "status", "local")
    except (KeysError, OSError) as exc:
        _fail(exc)
    console.print(
        f"coordinator key created: public [cyan]{escape(str(pub))}[/cyan] (give it to every client), "
        f"secret {escape(str(directory / 'server.key_secret'))} (keep it on the reserved node)"
    )
    console.print(
        f"allow-listed [bold]status.local[/bold] ({escape(str(directory / 'clients' / 'status.local.key'))}): "
        f"its secret {escape(str(status_secret))} lets `spotlight status` on this host read the run (read-only)"
    )
    console.print(
        f"next: [cyan]{escape(shlex.join(['spotlight', 'keys', 'add', str(directory)]))} agent NODE[/cyan] "
        "for each spot node (or one shared name for a pool)"
    )


@keys_app.command("add")
def add(
    directory: pathlib.Path = path_argument(..., help="The coordinator's keys directory."),
    role: str = typer.Argument(
        ..., help="agent (spot node), reserved (the reserved node's rollout agent), status (read-only), trainer."
    ),
    name: str = typer.Argument(..., help="Key name, e.g. the node id or a pool name (letters, digits, - and _)."),
) -> None:
    """Create a client key and allow-list it; prints the files to copy to the client."""
    from spotlight.net.security import KeysError, add_client

    try:
        secret = add_client(directory, role, name)
    except (KeysError, OSError) as exc:
        _fail(exc)
    console.print(f"allow-listed [bold]{role}.{name}[/bold] (a running coordinator picks it up within a second)")
    console.print(
        "copy to the client's keys directory (mode 0600, readable by the service user only):\n"
        f"  {directory / 'server.key'}\n  {secret}"
    )
    console.print(f"then remove {secret} from this directory if the client runs elsewhere")


@keys_app.command("list")
def list_(directory: pathlib.Path = path_argument(..., help="The coordinator's keys directory.")) -> None:
    """List allow-listed clients (role, name, public key, whether the secret is still here).

    A file in clients/ that is no client key is listed as unreadable and warned about on stderr."""
    from spotlight.net.security import KeysError, list_keys, server_key_problem

    try:
        rows = list_keys(directory, keep_bad=True)
    except (KeysError, OSError) as exc:
        _fail(exc)
    t = Table(title=f"allow-list of {escape(str(directory))}")
    for col in ("principal", "role", "public key", "secret here"):
        t.add_column(col, overflow="fold")  # a key wraps whole on a narrow terminal, never cut with …
    for r in rows:
        # a Z85 key may hold '[' and ']': printed as it is, never read as markup
        public = escape(r["public"]) if r["problem"] is None else f"[red]unreadable: {escape(r['problem'])}[/red]"
        t.add_row(escape(r["principal"]), escape(r["role"]), public, "yes" if r["has_secret"] else "no")
    console.print(t)
    for r in rows:
        if r["problem"] is not None:
            f = directory / "clients" / f"{r['principal']}.key"
            print_error(
                f"{WARNING} {escape(str(f))}: {escape(r['problem'])}; a coordinator cannot (re)load the "
                f"allow-list until the file is removed: {escape(_removal_hint(directory, f, r))}"
            )
    _warn_server_key(server_key_problem(directory))


def _removal_hint(directory: pathlib.Path, f: pathlib.Path, row: dict) -> str:
    """How to drop the bad allow-list file ``f``: ``spotlight keys revoke`` when it is a file named
    for a principal (and ``keys add`` for a new key), else ``rm``."""
    from spotlight.net.security import KeysError, Principal

    try:
        Principal.parse(row["principal"])
    except KeysError:
        return f"`{shlex.join(['rm', str(f)])}`"
    if not f.is_file():
        return f"`{shlex.join(['rm', '-r', str(f)])}`"
    role, _, name = row["principal"].partition(".")
    return (
        f"`{shlex.join(['spotlight', 'keys', 'revoke', str(directory), row['principal']])}` "
        f"(then `{shlex.join(['spotlight', 'keys', 'add', str(directory), role, name])}` for a new key)"
    )


def _warn_server_key(problem: str | None) -> None:
    """One ``warning:`` line when the keys directory's ``server.key`` is no key a client can use."""
    if problem:
        print_error(f"{WARNING} {escape(problem)}")


@keys_app.command("revoke")
def revoke(
    directory: pathlib.Path = path_argument(..., help="The coordinator's keys directory."),
    principal: str = typer.Argument(..., help="<role>.<name> to remove from the allow-list."),
) -> None:
    """Remove a client from the allow-list: new connections with that key are refused."""
    from spotlight.net.security import KeysError, revoke_client, server_key_problem

    try:
        secret = revoke_client(directory, principal)
    except (KeysError, OSError) as exc:
        _fail(exc)
    console.print(
        f"revoked {escape(principal)}: new connections with it are refused (restart the coordinator to drop live ones)"
    )
    if secret is not None:
        console.print(f"removed its secret key {escape(str(secret))} (a revoked key is never valid again)")
    _warn_server_key(server_key_problem(directory))  # revoked all the same: a revocation is never held up


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")
