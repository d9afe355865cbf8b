"""One parser for every option that names a coordinator endpoint (``spotlight status
--coordinator``, ``spotlight up --reserved``, ``spotlight-agent join --coordinator``): checked
before anything connects or binds, so a typo is one line, not a ZeroMQ traceback or a wait
for a timeout. Never imports zmq."""

from __future__ import annotations


def parse_host_port(text: str, *, flag: str = "--coordinator", any_port: bool = False) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` or ``tcp://HOST:PORT``.

    ``any_port``: port 0 is allowed (a listening address: any free port).

    Raises:
        ValueError: one line naming ``flag`` and the expected form.
    """
    body = text[len("tcp://") :] if text.startswith("tcp://") else text
    host, sep, port = body.rpartition(":")
    low = 0 if any_port else 1
    expected = f"expected HOST:PORT (port {low} to 65535{'; 0 = any free port' if any_port else ''})"
    if (
        not sep
        or not host
        or "://" in host
        or any(c.isspace() for c in body)
        or not port.isascii()
        or not port.isdigit()
        or not low <= int(port) <= 65535
    ):
        raise ValueError(f"{flag} {text}: {expected}")
    return host, int(port)


def tcp_endpoint(text: str, *, flag: str = "--coordinator", any_port: bool = False) -> str:
    """``tcp://HOST:PORT`` for ``text`` (:func:`parse_host_port`)."""
    host, port = parse_host_port(text, flag=flag, any_port=any_port)
    return f"tcp://{host}:{port}"
