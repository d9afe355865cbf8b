"""Per-GPU revocation by a cluster scheduler through a file and SIGUSR1 (docs/preemption-notices.md §6).

A scheduler that takes GPUs back from a running node (a Slurm ``scontrol``/``scancel --signal``
hook, a Kubernetes device-plugin or preStop hook, a site script) writes the agent's indices of
the GPUs it has taken back into the agent's revoked-GPUs file, then sends the agent SIGUSR1::

    echo 1 > <state dir>/<node id>/revoked-gpus && kill -USR1 <agent pid>

The file holds the *whole* set taken back, so writing it twice changes nothing: GPUs listed that
the node still holds are revoked (their workers commit and exit, the rest of the node keeps
running); GPUs that were revoked through the file and are no longer listed are given back (a
worker starts on each, as ``spotlight-agent add-gpu``). An empty or missing file takes nothing.

Pure: the daemon reads the file and passes its text in.
"""

from __future__ import annotations

import dataclasses
import re

from spotlight.protocol import MAX_GPU_INDEX

__all__ = ["RevocationChanges", "revocation_changes"]


@dataclasses.dataclass(frozen=True)
class RevocationChanges:
    """What the file asks for now: GPUs to revoke, GPUs to give back, or why it is unreadable."""

    revoke: tuple[int, ...] = ()
    give_back: tuple[int, ...] = ()
    unknown: tuple[int, ...] = ()
    """Listed GPUs this node neither holds nor lost through the file (ignored, reported)."""
    error: str = ""


def parse_gpu_list(text: str) -> list[int]:
    """GPU indices separated by commas or white space; ``ValueError`` on anything else, an index
    above :data:`spotlight.protocol.MAX_GPU_INDEX` included (no node can hold it)."""
    fields = [f for f in re.split(r"[,\s]+", text.strip()) if f]
    if not all(f.isascii() and f.isdigit() for f in fields):
        raise ValueError(f"expected GPU indices separated by commas or spaces, got {text.strip()[:60]!r}")
    gpus = sorted({int(f) for f in fields})
    if gpus and gpus[-1] > MAX_GPU_INDEX:
        raise ValueError(f"GPU indices are 0 to {MAX_GPU_INDEX}, got {[g for g in gpus if g > MAX_GPU_INDEX][:8]}")
    return gpus


def revocation_changes(text: str, held: list[int], revoked_by_file: set[int]) -> RevocationChanges:
    """The changes the revoked-GPUs file's ``text`` asks of a node that holds ``held`` GPUs and
    lost ``revoked_by_file`` through the file earlier. Unreadable text changes nothing."""
    try:
        listed = set(parse_gpu_list(text))
    except ValueError as exc:
        return RevocationChanges(error=str(exc))
    return RevocationChanges(
        revoke=tuple(sorted(listed & set(held))),
        give_back=tuple(sorted(revoked_by_file - listed)),
        unknown=tuple(sorted(listed - set(held) - revoked_by_file)),
    )
