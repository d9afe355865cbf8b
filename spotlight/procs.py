"""Child-process helpers shared by the coordinator, the agent and the CLI (torch-free)."""

from __future__ import annotations

import os

SECRET_ENV = ("SPOTLIGHT_SECRET", "SPOTLIGHT_KEYS")
"""Environment variables that name or hold credentials; children that do not need them never see them."""


def scrubbed_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) without credentials, plus ``extra``.

    Drops :data:`SECRET_ENV` and any variable whose name ends in ``_SECRET``, ``_TOKEN``,
    ``_PASSWORD`` or ``_KEY`` (cloud credentials a worker never needs).
    """
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k in SECRET_ENV or k.endswith(("_SECRET", "_TOKEN", "_PASSWORD", "_SECRET_KEY", "_ACCESS_KEY")):
            del env[k]
    env.update(extra)
    return env
