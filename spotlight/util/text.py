"""Text files a user hands us: UTF-8 or one clear error."""

from __future__ import annotations


def decode_utf8(raw: bytes, where: str) -> str:
    """``raw`` as UTF-8 text, a byte-order mark (some editors write one) dropped.

    Raises:
        ValueError: ``"WHERE:LINE: not UTF-8 text (byte N)"``, the line and byte of the first bad byte.
    """
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ValueError(f"{where}:{line}: not UTF-8 text (byte {exc.start})") from None


def quoted_prompt(prompt: str, limit: int = 80) -> str:
    """``prompt`` quoted (``repr``) for an error line, cut to its first ``limit`` characters with
    its length said when longer: a 10 000-character prompt must not become a 10 KB line. Pure."""
    if len(prompt) <= limit:
        return repr(prompt)
    return f"{prompt[:limit]!r}… ({len(prompt)} characters)"
