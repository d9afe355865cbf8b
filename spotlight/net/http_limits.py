"""HTTP requests with an OVERALL deadline and a response-size cap.

``requests``' ``timeout`` bounds the connect and each gap between received bytes, not the
whole answer: a server (or a broken proxy) that sends one byte per second keeps a plain
``session.get(url, timeout=2)`` busy forever.  :func:`bounded_request` streams the body
(``stream=True``) and reads it in pieces with ``read1``, checking a monotonic deadline and a
byte count after each piece, so the call ends at most one gap timeout after the deadline
(the gap timeout is ``deadline_s`` itself, so at most ``2 * deadline_s`` in all).

Used by the agent's preemption detectors (``agent/preemption.py``) and the reward HTTP client
(``spotlight/rewards/reward_fn.py``).  Stdlib + ``requests`` only (the agent must not import torch).

Known limit: the status line and headers are read by ``http.client`` before the body; there
each gap is bounded by the per-read timeout, and their size by ``http.client``'s limits (100
header lines of at most 64 KiB), but not by the overall deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import requests
from requests.structures import CaseInsensitiveDict


class DeadlineExceeded(requests.Timeout):
    """The whole answer (headers and body) did not arrive before the overall deadline."""


class ResponseTooLarge(requests.RequestException):
    """The body grew past ``max_bytes``."""


@dataclass(frozen=True)
class BoundedResponse:
    """A fully read answer: status, headers and body bytes (at most ``max_bytes``)."""

    status_code: int
    headers: CaseInsensitiveDict
    content: bytes
    url: str

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (undecodable bytes replaced)."""
        return self.content.decode("utf-8", "replace")


def bounded_request(
    session: requests.Session, method: str, url: str, *, deadline_s: float, max_bytes: int, **kw: Any
) -> BoundedResponse:
    """Send one request and read its whole answer within ``deadline_s`` seconds overall.

    ``deadline_s`` (seconds, > 0) also serves as the connect and per-read timeout, so a
    stalled peer is noticed within that time too.  Redirects are never followed
    (``allow_redirects=False``): a 3xx comes back as an ordinary answer.  The body is asked
    for uncompressed (``Accept-Encoding: identity``) so that ``max_bytes`` counts what is
    stored.  Other keyword arguments go to ``session.request``.

    Raises:
        DeadlineExceeded: (a ``requests.Timeout``) the body was still arriving at the deadline.
        ResponseTooLarge: the body exceeded ``max_bytes`` bytes.
        requests.RequestException: connection refused, reset, or a per-read timeout.
        ValueError: ``deadline_s <= 0`` or ``max_bytes < 0``.
    """
    if not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    t_end = time.monotonic() + deadline_s
    headers = dict(kw.pop("headers", None) or {})
    headers.setdefault("Accept-Encoding", "identity")
    kw.pop("allow_redirects", None)
    kw.pop("stream", None)
    resp = session.request(method, url, headers=headers, timeout=deadline_s, allow_redirects=False, stream=True, **kw)
    try:
        chunks: list[bytes] = []
        size = 0
        while True:
            if time.monotonic() > t_end:
                raise DeadlineExceeded(f"answer from {url} not complete within {deadline_s:g}s ({size} bytes received)")
            try:
                piece = resp.raw.read1(65536, decode_content=False)
            except Exception as exc:  # urllib3 errors: timeouts, resets, protocol errors
                if "timed out" in str(exc).lower():
                    raise requests.Timeout(f"read timed out on {url}") from None
                raise requests.ConnectionError(f"reading the answer from {url} failed: {type(exc).__name__}") from None
            if not piece:
                break
            size += len(piece)
            if size > max_bytes:
                raise ResponseTooLarge(f"answer from {url} exceeds {max_bytes} bytes")
            chunks.append(piece)
        return BoundedResponse(resp.status_code, resp.headers, b"".join(chunks), url)
    finally:
        resp.close()
