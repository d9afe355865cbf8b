"""Waiting in integration tests on a condition with a deadline, never for a fixed time."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(
    pred: Callable[[], T],
    what: str,
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    alive: Callable[[], bool] | None = None,
    logs: Callable[[], str] | None = None,
) -> T:
    """Call ``pred()`` every ``interval_s`` seconds until it returns something truthy, and return that.

    Fails (AssertionError naming ``what``, with ``logs()`` when given) when ``timeout_s``
    seconds pass first, or when ``alive()`` turns false: the process the wait depends on
    exited, so nothing more will happen (``pred`` gets one last call first).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if alive is not None and not alive():
            got = pred()
            if got:
                return got
            raise AssertionError(f"the process exited while waiting for {what}" + (f"\n{logs()}" if logs else ""))
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout_s:.0f} s waiting for {what}" + (f"\n{logs()}" if logs else "")
            )
        time.sleep(interval_s)
