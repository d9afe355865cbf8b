"""Each Train Worker rank watches its peers, and aborts its communicator when one dies.

A rank blocked in an NCCL collective whose peer was killed does not learn it from NCCL: the
collective waits for its timeout (minutes), and then torch's watchdog, as torchrun configures it,
tears the process down. So every rank of a group of more than one runs a :class:`PeerWatch`: a
daemon thread that bumps its own counter in the group's rendezvous store every ``interval_s``
and reads its peers' counters. A peer whose counter has not moved for ``timeout_s``, or a store
that stopped answering (rank 0, or torchrun's agent that serves it, is gone), makes the watch
abort the rank's communicators (:func:`abort_communicators`: ``ncclCommAbort`` through torch), so
the blocked collective raises in the rank's own code, which reports the lost peer and exits with
:data:`EXIT_PEER_LOST` (``spotlight/workers/train/train_worker.py``). NCCL's own watchdog is
configured not to kill the process (:data:`spotlight.workers.train.launch_env.NCCL_ENV`).

The decision is :class:`PeerLiveness` (pure: counters and ``now`` in, dead ranks out); the thread
and the store are the shell.

On gloo (the CPU) a dead peer closes its TCP pairs and the blocked collective raises by itself;
the watch still names the peer, and there is no communicator to abort.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("spotlight.train")

EXIT_PEER_LOST = 4
"""Exit status of a Train Worker that stopped because another rank of its group died."""


@dataclasses.dataclass
class _Seen:
    count: int
    at: float


class PeerLiveness:
    """Which peers look dead, from their heartbeat counters (pure).

    Args:
        peers: the other ranks of the group.
        timeout_s: a peer whose counter has not changed for this long is dead.
        now: the time the watch starts (every peer counts as just seen).
    """

    def __init__(self, peers: list[int], timeout_s: float, now: float):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.seen = {r: _Seen(-1, now) for r in peers}
        self.last_observed = now

    def observe(self, counters: dict[int, int], now: float) -> list[int]:
        """Record the counters read at ``now``; returns the peers that look dead (sorted).

        If this watch itself did not observe for more than half the timeout (its process was
        stopped or starved), every peer counts as seen now: their silence may be ours.
        """
        if now - self.last_observed > self.timeout_s / 2:
            for s in self.seen.values():
                s.at = now
        self.last_observed = now
        for rank, count in counters.items():
            s = self.seen.get(rank)
            if s is not None and count != s.count:
                s.count, s.at = count, now
        return sorted(r for r, s in self.seen.items() if now - s.at > self.timeout_s)


def abort_communicators() -> bool:
    """Abort every NCCL communicator of this process (``torch.distributed``'s own abort), so a
    collective blocked on a dead peer raises instead of waiting for its timeout. Returns whether
    there was one to abort (gloo has none: its collectives fail when a peer's connection closes)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
        return False
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()
    return True


class PeerWatch:
    """The heartbeat thread of one rank (module docstring).

    Args:
        store: a ``torch.distributed.Store`` client of the group's rendezvous, used by this
            thread alone (a blocking call of the main thread on a shared client would hold the
            heartbeats back).
        rank, world_size: this rank's place in the group.
        interval_s: seconds between heartbeats.
        timeout_s: seconds a peer may stay silent.
        abort: called once when a peer is lost (default :func:`abort_communicators`).
        exit_after_s: after the abort, the rank's own code has this long to notice and exit
            with :data:`EXIT_PEER_LOST` before the watch ends the process itself (None: never).
        clock: ``time.monotonic`` (tests pass another).
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 60.0,
        abort: Callable[[], object] = abort_communicators,
        exit_after_s: float | None = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.abort, self.exit_after_s, self.clock = abort, exit_after_s, clock
        self.lost: str | None = None
        """Why the group is broken (None: every peer alive); set once, before the abort."""
        self.aborted = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, rank: int) -> str:
        return f"peer_watch/alive/{rank}"

    def start(self) -> PeerWatch:
        if self.world_size > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"peer-watch-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a clean shutdown: peers leaving now is expected)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))

    def beat(self, liveness: PeerLiveness) -> str | None:
        """One heartbeat: bump this rank's counter, read the peers'. Returns why the group is
        broken, or None."""
        try:
            self.store.add(self._key(self.rank), 1)
            counters = {r: int(self.store.add(self._key(r), 0)) for r in liveness.seen}
        except Exception as exc:  # the store's server (rank 0 or torchrun's agent) is gone
            return (
                f"the trainer group's rendezvous store stopped answering ({type(exc).__name__}: {exc}); a peer is gone"
            )
        dead = liveness.observe(counters, self.clock())
        if dead:
            names = ", ".join(map(str, dead))
            return f"train rank {names} stopped responding for more than {self.timeout_s:g} s (dead or hung)"
        return None

    def _run(self) -> None:
        liveness = PeerLiveness([r for r in range(self.world_size) if r != self.rank], self.timeout_s, self.clock())
        while not self._stop.wait(self.interval_s):
            reason = self.beat(liveness)
            if reason is not None and not self._stop.is_set():
                self.fail(reason)
                return

    def fail(self, reason: str) -> None:
        """Mark the group broken and abort the communicators (once); then, unless the rank's
        code exits first, end the process after ``exit_after_s``."""
        if self.lost is not None:
            return
        self.lost = reason
        log.error("rank %d: %s; aborting the communicator", self.rank, reason)
        try:
            self.aborted = bool(self.abort())
        except Exception as exc:  # an abort that fails must not hide the reason
            log.error("rank %d: aborting the communicator failed: %s: %s", self.rank, type(exc).__name__, exc)
        if self.exit_after_s is not None and not self._stop.wait(self.exit_after_s):
            log.error("rank %d: still running %g s after the abort; exiting (%s)", self.rank, self.exit_after_s, reason)
            logging.shutdown()
            os._exit(EXIT_PEER_LOST)
