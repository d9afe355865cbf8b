"""Helpers for test functions run as torch.multiprocessing-spawned gloo ranks."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def exit_together() -> None:
    """End a spawned rank that succeeded: wait for every rank, then leave at once.

    Tearing gloo down (``destroy_process_group`` or the interpreter's exit) while a peer is
    still in a collective, or is removing the shared FileStore, can abort the process
    ("terminate called without an active exception": SIGABRT, a flaky failure on a loaded
    machine). After the barrier nothing is left to do, so the rank exits with status 0
    without running those destructors. A rank that raises does not get here: its exception
    reaches ``mp.spawn`` as usual."""
    dist.barrier()
    leave_now()


def leave_now() -> None:
    """End a spawned rank with status 0 at once, without tearing gloo down: the way out for a
    rank whose peer is dead (no barrier can be passed, and gloo's destructors abort)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
