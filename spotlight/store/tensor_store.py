"""Tensor Store: durable home of published weight versions and committed rollout state.

Lives on the reserved node, owned by the coordinator (paper §4.1, §4.5; docs/architecture.md §2).
Two kinds of objects, mirrored to disk under ``root`` so a preempted worker's progress
survives the worker:

* weight versions ``v_n``: one safetensors file each, ``weights/v<n>.safetensors`` with its
  digest beside it (``v<n>.digest``). A version arrives in chunks (:meth:`begin_weights`,
  :meth:`put_weights_chunk`) written straight to ``v<n>.safetensors.part`` and renamed when
  its digest matches; it is served in chunks (:meth:`read_weights`) as zero-copy slices of a
  memory map of the file. A version is never assembled in memory, except that versions of
  at most ``memory_max_bytes`` (small runs, LoRA adapters) are also kept as bytes for the
  newest ``keep_versions``. All stay on disk until :meth:`prune_weights`;
* committed in-flight state of a request: tensor metas + raw frames, on disk only
  (``state/<key>/``, written to a hidden temporary folder and renamed, so a crash leaves the
  whole state or none), keyed by the commit key the Request Scheduler records; deleted once no
  request resumes from it (``RequestScheduler.take_released_commits``). Only their sizes are
  kept in memory: when many spot GPUs are preempted at once, every in-flight state is held
  once, on disk, not also in the coordinator's memory.

No torch import: versions and frames are opaque bytes here (the coordinator checks that a
version is a safetensors file through ``validate``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
from typing import Callable

import msgspec

from spotlight.protocol import TensorMeta
from spotlight.store.weight_sync import (
    DEFAULT_DIGEST,
    ChunkReceiver,
    MappedFile,
    WeightSyncError,
    file_digest,
    new_hasher,
    num_chunks,
    parse_digest,
)

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$")


def check_key(key: str) -> str:
    """A Tensor Store key is an id, never a path: letters, digits, ``-``, ``_`` and single
    inner dots (``r3-17.L42``), at most 200 characters.

    Raises:
        ValueError: any other string (``..``, ``/``, a leading dot, empty, too long).
    """
    if not isinstance(key, str) or len(key) > 200 or not _KEY.match(key):
        raise ValueError(f"invalid Tensor Store key {key!r}: expected an id like 'r3-17.L42'")
    return key


@dataclasses.dataclass(frozen=True)
class WeightsInfo:
    """A published version: its number, file size in bytes and ``"<algorithm>:<hex>"`` digest."""

    version: int
    size_bytes: int
    digest: str


class TensorStore:
    """Args:
    root: directory for the on-disk mirror (created by :meth:`open`).
    keep_versions: weight versions kept as bytes in memory (those of at most
        ``memory_max_bytes``) and memory-mapped for serving.
    memory_max_bytes: largest version also kept in memory as bytes; larger ones are only
        ever on disk (0 = none in memory).
    """

    def __init__(self, root: pathlib.Path, keep_versions: int = 3, *, memory_max_bytes: int = 64 << 20):
        self.root = pathlib.Path(root)
        self.keep_versions = keep_versions
        self.memory_max_bytes = int(memory_max_bytes)
        self._weights: dict[int, bytes] = {}
        self._maps: dict[int, MappedFile] = {}
        self._info: dict[int, WeightsInfo] = {}
        self._upload: ChunkReceiver | None = None
        self._state_bytes: dict[str, int] = {}  # committed states written by this store: key -> bytes
        self.latest_version: int = -1

    def open(self) -> "TensorStore":
        """Create the on-disk mirror (``weights/``, ``state/``) and drop an upload a crash cut
        short (``*.part``); returns self. Call once before using the store."""
        (self.root / "weights").mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        for stale in (self.root / "weights").glob("*.part"):  # an upload cut by a crash
            stale.unlink(missing_ok=True)
        for stale in (self.root / "state").glob(".*.tmp"):  # a state write cut by a crash
            shutil.rmtree(stale, ignore_errors=True)
        return self

    def _path(self, version: int) -> pathlib.Path:
        return self.root / "weights" / f"v{int(version)}.safetensors"

    def _digest_path(self, version: int) -> pathlib.Path:
        return self.root / "weights" / f"v{int(version)}.digest"

    # ------------------------------------------------------------ weights: publishing
    def begin_weights(
        self,
        version: int,
        size_bytes: int,
        chunk_bytes: int,
        digest: str,
        *,
        validate: Callable[[pathlib.Path], None] | None = None,
    ) -> None:
        """Start receiving ``version`` (replacing any unfinished upload): its chunks go
        straight to ``v<version>.safetensors.part``.

        Args:
            version: version number (>= 0).
            size_bytes, chunk_bytes: the file's size and the sender's chunk plan (bytes).
            digest: ``"<algorithm>:<hex>"`` of the whole file.
            validate: run on the complete file before it is published; raises to refuse it.

        Raises:
            WeightSyncError: version < 0, an impossible plan or a malformed digest (nothing
                changes: an unfinished upload stays), or not enough disk space (the unfinished
                upload, if any, is discarded).
        """
        if version < 0:
            raise WeightSyncError(f"weight version {version} must be >= 0")
        num_chunks(size_bytes, chunk_bytes)
        parse_digest(digest)
        self.abort_weights()
        self._upload = ChunkReceiver(self._path(version), version, size_bytes, chunk_bytes, digest, validate=validate)

    def put_weights_chunk(self, version: int, index: int, offset: int, data) -> bool:
        """Write one chunk of the upload begun by :meth:`begin_weights`.

        Returns:
            True when it completed the version: it is now published (``latest_version``).

        Raises:
            WeightSyncError: no upload of ``version``, or a chunk that is out of range, of the
                wrong size or offset, or a duplicate (the upload is unchanged); or, on the last
                chunk, a digest mismatch or a file ``validate`` refused (the upload is discarded
                and nothing is published).
        """
        up = self._upload
        if up is None or up.version != version:
            raise WeightSyncError(
                f"no upload of weight version {version} in progress" + (f" (receiving v{up.version})" if up else "")
            )
        try:
            complete = up.add(index, offset, data)
        except WeightSyncError:
            if up.failed:
                self._upload = None
            raise
        if complete:
            self._upload = None
            self._publish(version, up.size_bytes, up.digest)
        return complete

    def abort_weights(self) -> None:
        """Discard an unfinished upload, if any."""
        if self._upload is not None:
            self._upload.abort()
            self._upload = None

    def put_weights(self, version: int, blob: bytes, *, validate: Callable[[pathlib.Path], None] | None = None) -> None:
        """Publish ``version`` from one bytes object (small versions and tests; large ones
        arrive with :meth:`begin_weights` / :meth:`put_weights_chunk`).

        Raises:
            WeightSyncError: an empty blob, or ``validate`` refused it.
        """
        h = new_hasher(DEFAULT_DIGEST)
        h.update(blob)
        self.begin_weights(
            version, len(blob), max(1, len(blob)), f"{DEFAULT_DIGEST}:{h.hexdigest()}", validate=validate
        )
        self.put_weights_chunk(version, 0, 0, blob)

    def _publish(self, version: int, size_bytes: int, digest: str) -> None:
        self._digest_path(version).write_text(digest)
        self._maps.pop(version, None)  # a republished version: the old map keeps the old file
        self._weights.pop(version, None)
        self._info[version] = WeightsInfo(version, size_bytes, digest)
        if size_bytes <= self.memory_max_bytes:
            self._weights[version] = self._path(version).read_bytes()
        self.latest_version = max(self.latest_version, version)
        self._trim()

    def _trim(self) -> None:
        for cache in (self._weights, self._maps):
            for v in sorted(cache)[: -self.keep_versions]:
                del cache[v]  # a dropped map lives on while ZeroMQ still sends slices of it

    # ------------------------------------------------------------ weights: serving
    def weights_info(self, version: int) -> WeightsInfo | None:
        """Size and digest of a published ``version``; None if it was never published (or
        was pruned). A version found on disk without its digest file (written by an older
        Spotlight) is digested once, here.

        Raises:
            ValueError: ``version`` is not an int.
        """
        version = int(version)
        info = self._info.get(version)
        if info is not None:
            if self._path(version).is_file():
                return info
            self._info.pop(version, None)
            return None
        path = self._path(version)
        if version < 0 or not path.is_file():
            return None
        try:
            digest = self._digest_path(version).read_text().strip()
            parse_digest(digest)
        except (OSError, WeightSyncError):
            digest = file_digest(path)
            self._digest_path(version).write_text(digest)
        info = WeightsInfo(version, path.stat().st_size, digest)
        self._info[version] = info
        return info

    def read_weights(self, version: int, offset: int, length: int) -> memoryview | None:
        """Bytes ``[offset, offset + length)`` of ``version``'s file without copying them: a
        slice of its in-memory bytes, else of a read-only memory map (kept for the newest
        ``keep_versions`` served). None if the version is not published.

        Raises:
            WeightSyncError: the range is outside the file.
        """
        blob = self._weights.get(version)
        if blob is not None:
            if offset < 0 or length < 0 or offset + length > len(blob):
                raise WeightSyncError(
                    f"range [{offset}, {offset + length}) is outside version {version} ({len(blob)} bytes)"
                )
            return memoryview(blob)[offset : offset + length]
        mapped = self._maps.get(version)
        if mapped is None:
            if self.weights_info(version) is None:
                return None
            try:
                mapped = MappedFile(self._path(version))
            except FileNotFoundError:
                return None
            self._maps[version] = mapped
            self._trim()
        return mapped.chunk(offset, length)

    def get_weights(self, version: int) -> bytes | None:
        """The whole file of ``version`` as bytes (tests, small versions; servers use
        :meth:`read_weights`); None if never published."""
        blob = self._weights.get(version)
        if blob is None:
            path = self._path(version)
            if path.is_file():
                blob = path.read_bytes()
        return blob

    def weight_versions(self) -> list[int]:
        """Versions with a file on disk (published or with a leftover digest), ascending."""
        out = set()
        for path in (self.root / "weights").glob("v*"):
            head = path.name[1:].split(".", 1)[0]
            if head.isdigit() and path.name.endswith((".safetensors", ".digest")):
                out.add(int(head))
        return sorted(out)

    def delete_weights(self, version: int) -> None:
        """Delete ``version``'s file and digest (a map still sending keeps its file alive until done)."""
        self._path(version).unlink(missing_ok=True)
        self._digest_path(version).unlink(missing_ok=True)
        self._weights.pop(version, None)
        self._maps.pop(version, None)
        self._info.pop(version, None)

    def prune_weights(self, keep_from: int) -> None:
        """Delete on-disk versions older than ``keep_from`` (a map still sending keeps its file
        alive until it is done)."""
        for v in self.weight_versions():
            if v < keep_from:
                self.delete_weights(v)

    # ------------------------------------------------------------ rollout state
    def put_state(self, key: str, metas: list[TensorMeta], frames: list[bytes]) -> int:
        """Store committed state under ``key`` on disk; returns its size in bytes.

        The frames go to ``state/.<key>.tmp/`` first, which then replaces ``state/<key>/``:
        a crash or a full disk mid-write leaves the earlier state under ``key`` or none, never
        part of one.

        Raises:
            ValueError: ``key`` is not a valid id (:func:`check_key`), or metas and frames differ
                in number.
            OSError: the write failed (the temporary folder is removed; nothing is stored).
        """
        check_key(key)
        if len(metas) != len(frames):
            raise ValueError(f"committed state {key}: {len(metas)} tensor metas but {len(frames)} frames")
        state_dir = self.root / "state"
        d, tmp = state_dir / key, state_dir / f".{key}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            for i, f in enumerate(frames):
                (tmp / f"{i}.bin").write_bytes(f)
            (tmp / "meta.json").write_bytes(msgspec.json.encode(list(metas)))
            if d.exists():
                shutil.rmtree(d)
            os.replace(tmp, d)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        size = sum(len(f) for f in frames)
        self._state_bytes[key] = size
        return size

    def get_state(self, key: str) -> tuple[list[TensorMeta], list[bytes]] | None:
        """Committed state under ``key``, read from disk; None if absent or unreadable (a missing
        frame, a meta file that does not parse): the caller then starts the request over.

        Raises:
            ValueError: ``key`` is not a valid id.
        """
        check_key(key)
        d = self.root / "state" / key
        try:
            metas = msgspec.json.decode((d / "meta.json").read_bytes(), type=list[TensorMeta])
            frames = [(d / f"{i}.bin").read_bytes() for i in range(len(metas))]
        except (OSError, msgspec.DecodeError):
            return None
        return metas, frames

    def state_keys(self) -> list[str]:
        """The keys of the committed states on disk (written whole), sorted."""
        d = self.root / "state"
        return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")) if d.is_dir() else []

    def delete_state(self, key: str) -> None:
        """Forget the state under ``key`` (on disk). Raises ValueError on an invalid key."""
        check_key(key)
        self._state_bytes.pop(key, None)
        shutil.rmtree(self.root / "state" / key, ignore_errors=True)

    def stats(self) -> dict:
        return {
            "weights_in_memory": sorted(self._weights),
            "weights_mapped": sorted(self._maps),
            "weights_upload": self._upload.progress() if self._upload is not None else None,
            "latest_version": self.latest_version,
            "committed_states": len(self._state_bytes),
            "state_bytes": sum(self._state_bytes.values()),
        }
