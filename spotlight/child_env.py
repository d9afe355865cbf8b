"""Environments for child processes that must not inherit Spotlight's secrets.

Rollout workers, Train Workers, a reward server or a mock metadata server never authenticate
to the coordinator, so they get no copy of its credentials (DESIGN.md §9: anyone who can read
a process's environment, e.g. ``/proc/<pid>/environ`` of the same user, a core dump or a crash
report, must not learn the key).  Stdlib only (the agent imports it and must not import torch).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

#: Variables that hold Spotlight credentials, dropped whatever their value.
SECRET_NAMES = frozenset({"SPOTLIGHT_SECRET", "SPOTLIGHT_KEYS"})
#: Name suffixes treated as secrets too (``*_SECRET``, ``*_KEY_SECRET``, ``*_SECRET_KEY``).
SECRET_SUFFIXES = ("_SECRET", "_SECRET_KEY")


def is_secret_name(name: str, extra_names: Iterable[str] = ()) -> bool:
    """True for a variable name that holds a secret (case-insensitive)."""
    up = name.upper()
    return up in SECRET_NAMES or up.endswith(SECRET_SUFFIXES) or up in {n.upper() for n in extra_names}


def scrubbed_env(base: Mapping[str, str] | None = None, *, extra_names: Iterable[str] = (),
                 secret_values: Iterable[str] = (), **overrides: str) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) without secrets, then ``overrides`` applied.

    Dropped: :data:`SECRET_NAMES`, names ending in :data:`SECRET_SUFFIXES`, ``extra_names``
    (e.g. the variable an agent was told to read its secret from), and any variable whose value
    equals one of the non-empty ``secret_values`` (the secret under a name the parent does not
    know).
    """
    env = dict(os.environ if base is None else base)
    extra = list(extra_names)
    values = {v for v in secret_values if v}
    for name in list(env):
        if is_secret_name(name, extra) or env[name] in values:
            del env[name]
    env.update(overrides)
    return env
