"""The node's weight-version cache: one file per version, pulled from the coordinator in
chunks with a bounded window. Torch-free and socket-free (the agent daemon sends what it
returns), so it is tested and benchmarked without a daemon.

A fetch of version v (the wire is drawn in :mod:`spotlight.protocol`)::

    FETCH_WEIGHTS(v, header, chunks 0..W-1) ─▶ coordinator
    ◀─ WEIGHTS(v, size, chunk_bytes, n, digest)      → a ChunkReceiver on <dir>/v<v>.safetensors.part
    ◀─ WEIGHTS_CHUNK(v, i)  → written at its offset → FETCH_WEIGHTS(v, next missing chunk) ─▶
    … last chunk, digest verified → renamed to <dir>/v<v>.safetensors → workers are told

At most ``window_chunks`` chunks are requested and not yet received, so neither the agent
nor the coordinator ever queues more than that for this node, however slow either side
is. Requests unanswered for ``retry_s`` (lost while the coordinator restarted, or dropped
because a queue was full) are asked again; a chunk that does not fit the plan, a digest
mismatch, or :data:`MAX_RETRIES` retries without progress (e.g. a restarted coordinator
that chunks differently and refuses our ranges) restart that version from its header.
"""

from __future__ import annotations

import logging
import pathlib

from spotlight import protocol as P
from spotlight.store.weight_sync import ChunkReceiver, WeightSyncError

log = logging.getLogger("spotlight.agent.weights")

MAX_RETRIES = 3
"""Retries of a version's outstanding chunks without progress before it restarts from its header."""


class _Download:
    def __init__(self, version: int, now: float):
        self.version = version
        self.receiver: ChunkReceiver | None = None
        self.header: P.Weights | None = None
        self.asked: dict[int, float] = {}  # chunk index -> when requested
        self.next_index = 0  # every chunk below it has been requested at least once
        self.last_progress = now
        self.restarts = 0
        self.retries = 0  # retries since the last chunk arrived


class WeightCache:
    """Args:
        directory: where version files live (created; emptied, see ``clear``: files from an
            earlier agent may belong to another run).
        keep_versions: complete versions kept; older ones are deleted (a worker that mapped
            one keeps reading it: the kernel keeps the inode until it unmaps).
        window_chunks: chunks requested and not yet received, per version.
        retry_s: re-ask for a version's outstanding chunks after this long without progress.

    Every method returns the FETCH_WEIGHTS messages to send to the coordinator (without
    node id and session: the caller stamps them).
    """

    def __init__(
        self,
        directory: pathlib.Path | str,
        *,
        keep_versions: int = 3,
        window_chunks: int = 4,
        retry_s: float = 10.0,
        clear: bool = True,
    ):
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if clear:
            self.remove_stale()
        self.keep_versions = keep_versions
        self.window_chunks = window_chunks
        self.retry_s = retry_s
        self.complete: dict[int, P.Weights] = {}  # version -> its header (what workers are told)
        self.downloads: dict[int, _Download] = {}

    def remove_stale(self) -> None:
        """Delete the version files in the directory (the constructor does, unless ``clear=False``:
        the agent waits until it is registered, so a refused second agent of the same node id
        leaves the live agent's files alone)."""
        for stale in list(self.dir.glob("v*.safetensors")) + list(self.dir.glob("v*.safetensors.part")):
            stale.unlink(missing_ok=True)

    def path(self, version: int) -> pathlib.Path:
        """The file of ``version`` in the cache (``<dir>/v<version>.safetensors``)."""
        return self.dir / f"v{int(version)}.safetensors"

    def latest(self) -> int | None:
        return max(self.complete) if self.complete else None

    def ready(self, version: int) -> P.Weights | None:
        """The header to give a worker if ``version`` is complete in the cache, else None."""
        hdr = self.complete.get(version)
        if hdr is not None and not self.path(version).is_file():  # deleted under us
            del self.complete[version]
            return None
        return hdr

    # ------------------------------------------------------------ requests
    def fetch(self, version: int, now: float) -> list[P.FetchWeights]:
        """Start fetching ``version`` unless it is cached or on its way; a fetch without
        progress for ``retry_s`` is asked again."""
        if self.ready(version) is not None:
            return []
        d = self.downloads.get(version)
        if d is None:
            self.downloads[version] = d = _Download(version, now)
            return [self._first_request(d, now)]
        return self._retry(d, now) if now - d.last_progress > self.retry_s else []

    def overdue(self, now: float) -> list[P.FetchWeights]:
        """Re-requests for every fetch without progress for ``retry_s``."""
        out: list[P.FetchWeights] = []
        for d in list(self.downloads.values()):
            if now - d.last_progress > self.retry_s:
                out += self._retry(d, now)
        return out

    def restart_all(self, now: float) -> list[P.FetchWeights]:
        """Ask again for everything outstanding (the coordinator lost our requests: a new session)."""
        out: list[P.FetchWeights] = []
        for d in list(self.downloads.values()):
            out += self._retry(d, now)
        return out

    def _first_request(self, d: _Download, now: float) -> P.FetchWeights:
        d.last_progress = now
        return P.FetchWeights(version=d.version, header=True, first_chunk=0, num_chunks=self.window_chunks)

    def _retry(self, d: _Download, now: float) -> list[P.FetchWeights]:
        d.retries += 1
        if d.receiver is not None and d.retries > MAX_RETRIES:
            log.error("weights v%d: no chunk for %d retries; fetching it again from its header", d.version, MAX_RETRIES)
            self._restart(d)
        if d.receiver is None:  # the header never came: start over
            return [self._first_request(d, now)]
        d.last_progress = now
        for i in d.asked:
            d.asked[i] = now
        again = [P.FetchWeights(version=d.version, header=False, first_chunk=i, num_chunks=1) for i in sorted(d.asked)]
        return again + self._top_up(d, now)

    def _top_up(self, d: _Download, now: float) -> list[P.FetchWeights]:
        """Request chunks in order until ``window_chunks`` are outstanding (contiguous ones in one message)."""
        r = d.receiver
        first, count = None, 0
        while len(d.asked) < self.window_chunks and d.next_index < r.num_chunks:
            i = d.next_index
            d.next_index += 1
            if r.has(i) or i in d.asked:
                continue
            d.asked[i] = now
            if first is None:
                first = i
            count += 1
        return [P.FetchWeights(version=d.version, header=False, first_chunk=first, num_chunks=count)] if count else []

    # ------------------------------------------------------------ replies
    def on_weights(self, body: P.Weights, now: float) -> tuple[list[P.FetchWeights], bool]:
        """A WEIGHTS header from the coordinator.

        Returns:
            ``(requests, not_found)``: ``not_found`` is True when the coordinator does not have
            the version (the fetch is dropped; the workers waiting for it are to be told).
        """
        d = self.downloads.get(body.version)
        if d is None:
            return [], False  # nobody asked (a late duplicate)
        if not body.found:
            del self.downloads[body.version]
            return [], True
        if d.receiver is not None:
            if (d.header.size_bytes, d.header.chunk_bytes, d.header.digest) == (
                body.size_bytes,
                body.chunk_bytes,
                body.digest,
            ):
                return [], False  # the answer to a repeated first request: already under way
            d.receiver.abort()  # the version changed under us (republished): start over
            d.receiver = None
        try:
            d.receiver = ChunkReceiver(
                self.path(body.version), body.version, body.size_bytes, body.chunk_bytes, body.digest
            )
        except WeightSyncError as exc:
            log.error("cannot fetch weights v%d: %s", body.version, exc)
            del self.downloads[body.version]
            return [], True
        d.header = P.Weights(
            version=body.version,
            size_bytes=body.size_bytes,
            chunk_bytes=body.chunk_bytes,
            num_chunks=d.receiver.num_chunks,
            digest=body.digest,
        )
        d.last_progress = now
        # the first request also asked for chunks 0..window-1: they are on their way
        d.asked = {i: now for i in range(min(self.window_chunks, d.receiver.num_chunks))}
        d.next_index = len(d.asked)
        return [], False

    def on_chunk(self, body: P.WeightsChunk, frame, now: float) -> tuple[list[P.FetchWeights], P.Weights | None]:
        """A WEIGHTS_CHUNK from the coordinator (``frame``: its bytes).

        Returns:
            ``(requests, header)``: ``header`` is set when this chunk completed the version
            (digest verified, file in place): the workers waiting for it are to be told.
        """
        d = self.downloads.get(body.version)
        if d is None or d.receiver is None:
            return [], None  # not asked for, or before its header: a retry will cover it
        r = d.receiver
        if r.has(body.index):
            d.asked.pop(body.index, None)
            return self._top_up(d, now), None  # an answer to a retry: already written
        try:
            if len(frame) != body.size_bytes:
                raise WeightSyncError(f"chunk {body.index} declares {body.size_bytes} bytes but carries {len(frame)}")
            done = r.add(body.index, body.offset, frame)
        except (WeightSyncError, OSError) as exc:
            log.error(
                "weights v%d: %s; fetching it again from its header (restart %d)", body.version, exc, d.restarts + 1
            )
            self._restart(d)
            return [self._first_request(d, now)], None
        d.asked.pop(body.index, None)
        d.last_progress = now
        d.retries = 0
        if not done:
            return self._top_up(d, now), None
        del self.downloads[body.version]
        self.complete[body.version] = d.header
        for v in sorted(self.complete)[: -self.keep_versions]:
            del self.complete[v]
            self.path(v).unlink(missing_ok=True)
        log.info("weights v%d cached: %d bytes in %d chunks", body.version, r.size_bytes, r.num_chunks)
        return [], d.header

    def _restart(self, d: _Download) -> None:
        """Drop what ``d`` received; its next request asks for the header again."""
        d.restarts += 1
        d.retries = 0
        if d.receiver is not None:
            d.receiver.abort()
        d.receiver = None
        d.header = None
        d.asked.clear()
        d.next_index = 0

    def clear(self) -> None:
        """Abort fetches and delete every cached file (agent shutdown)."""
        for d in self.downloads.values():
            if d.receiver is not None:
                d.receiver.abort()
        self.downloads.clear()
        for v in list(self.complete):
            self.path(v).unlink(missing_ok=True)
        self.complete.clear()
