"""Weight versions in chunks: chunk plan, digest, safetensors header check, the receiver's
assembler and the sender's stream. Torch-free: the agent daemon imports it.

A weight version is one safetensors file (header + raw tensor data). It never travels, and
is never held, as one piece: a WEIGHTS header announces its size, chunk size, chunk count
and the digest of the whole file, and WEIGHTS_CHUNK messages carry it ``chunk_bytes`` at a
time (the wire is drawn in :mod:`spotlight.protocol`). Every holder keeps it as a file:

* trainer rank 0 writes the version with :func:`spotlight.store.tensor_wire.save_version` and
  pushes it with :func:`send_version` from a read-only memory map (zero-copy frames);
* the coordinator's Tensor Store assembles the upload with :class:`ChunkReceiver` into
  ``v<n>.safetensors.part`` and renames it when the digest matches, then serves chunks as
  zero-copy slices of a memory map (:class:`MappedFile`);
* an agent assembles the chunks it pulls with the same :class:`ChunkReceiver` into its
  node cache, and its workers map that file (:func:`spotlight.store.tensor_wire.mmap_state_dict`).

So no process ever needs two whole copies of a version in memory: what is resident is the
kernel's page cache of the file (shared by every reader, reclaimable) plus at most a window
of chunks in flight.

The digest is ``"<algorithm>:<hex>"`` with algorithm ``sha256`` (the default: SHA-NI makes
it about 3× faster than BLAKE2b on current x86 servers) or ``blake2b`` (64-byte digest).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import pathlib
import shutil
import time
from typing import Callable, Iterator

from spotlight.errors import SpotlightError

DIGEST_ALGORITHMS = ("sha256", "blake2b")
DEFAULT_DIGEST = "sha256"
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20
"""Largest safetensors JSON header accepted (safetensors' own limit)."""

ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
"""Bytes per element of every safetensors dtype name this module accepts."""


class WeightSyncError(SpotlightError):
    """A weight version's header, chunk or file is inconsistent (wrong size, offset, index,
    duplicate, digest mismatch, malformed safetensors header)."""


# ---------------------------------------------------------------- chunk plan and digest


def num_chunks(size_bytes: int, chunk_bytes: int) -> int:
    """Chunks of ``chunk_bytes`` (the last one shorter) that cover ``size_bytes``.

    Raises:
        WeightSyncError: ``chunk_bytes`` < 1 or ``size_bytes`` < 1.
    """
    if chunk_bytes < 1 or size_bytes < 1:
        raise WeightSyncError(f"a version of {size_bytes} bytes in chunks of {chunk_bytes} bytes is impossible")
    return -(-size_bytes // chunk_bytes)


def chunk_span(index: int, size_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """``(offset, length)`` in bytes of chunk ``index``.

    Raises:
        WeightSyncError: ``index`` outside ``[0, num_chunks)``.
    """
    n = num_chunks(size_bytes, chunk_bytes)
    if not 0 <= index < n:
        raise WeightSyncError(f"chunk {index} is out of range (the version has {n} chunks)")
    offset = index * chunk_bytes
    return offset, min(chunk_bytes, size_bytes - offset)


def new_hasher(algorithm: str = DEFAULT_DIGEST):
    """A hashlib object for ``algorithm`` (one of :data:`DIGEST_ALGORITHMS`).

    Raises:
        WeightSyncError: any other algorithm.
    """
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake2b":
        return hashlib.blake2b()
    raise WeightSyncError(f"digest algorithm {algorithm!r} is not supported (use one of {DIGEST_ALGORITHMS})")


def parse_digest(digest: str) -> tuple[str, str]:
    """``"sha256:<64 hex>"`` → ``("sha256", "<hex>")``.

    Raises:
        WeightSyncError: unknown algorithm, or a hex part of the wrong length or alphabet.
    """
    algo, _, hexpart = digest.partition(":")
    if algo not in DIGEST_ALGORITHMS:
        raise WeightSyncError(
            f"digest {digest[:80]!r}: expected '<algorithm>:<hex>' with algorithm in {DIGEST_ALGORITHMS}"
        )
    want = new_hasher(algo).digest_size * 2
    if len(hexpart) != want or any(c not in "0123456789abcdef" for c in hexpart):
        raise WeightSyncError(f"digest {digest[:80]!r}: expected {want} lowercase hex digits after '{algo}:'")
    return algo, hexpart


def file_digest(path: pathlib.Path | str, algorithm: str = DEFAULT_DIGEST, *, block_bytes: int = 8 << 20) -> str:
    """``"<algorithm>:<hex>"`` of a whole file, read ``block_bytes`` at a time.

    Raises:
        OSError: the file cannot be read. WeightSyncError: unknown algorithm.
    """
    h = new_hasher(algorithm)
    buf = bytearray(block_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return f"{algorithm}:{h.hexdigest()}"


# ---------------------------------------------------------------- safetensors header


def read_safetensors_header(path: pathlib.Path | str) -> tuple[dict, int, int]:
    """Parse and check a safetensors file's header without reading its data.

    Returns:
        ``(tensors, data_start, file_size)``: ``tensors`` maps each name to
        ``{"dtype", "shape", "data_offsets"}`` (``__metadata__`` removed); data offsets are
        relative to ``data_start``.

    Raises:
        WeightSyncError: a file shorter than its header, a header over 100 MiB or not a JSON
            object, an unknown dtype, a bad shape, or data offsets that do not match the shape
            or fall outside the file.
        OSError: the file cannot be read.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightSyncError(f"{path}: {size} bytes is too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n < 2 or n > MAX_SAFETENSORS_HEADER_BYTES or 8 + n > size:
            raise WeightSyncError(f"{path}: safetensors header length {n} does not fit a file of {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise WeightSyncError(f"{path}: safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WeightSyncError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise WeightSyncError(f"{path}: tensor {name[:100]!r} lacks dtype, shape or data_offsets") from None
        if dtype not in ST_ITEMSIZE:
            raise WeightSyncError(f"{path}: tensor {name[:100]!r} has unknown dtype {str(dtype)[:20]!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > 16
            or not all(isinstance(d, int) and 0 <= d < 1 << 50 for d in shape)
        ):
            raise WeightSyncError(f"{path}: tensor {name[:100]!r} has a bad shape")
        numel = 1
        for d in shape:
            numel *= d
        if not (
            isinstance(b, int)
            and isinstance(e, int)
            and 0 <= b <= e <= data_len
            and e - b == numel * ST_ITEMSIZE[dtype]
        ):
            raise WeightSyncError(
                f"{path}: tensor {name[:100]!r} data offsets {[b, e]} do not match its shape or the file"
            )
    return header, 8 + n, size


def check_safetensors_file(path: pathlib.Path | str) -> None:
    """:func:`read_safetensors_header`, for callers that only need the check (same errors)."""
    read_safetensors_header(path)


# ---------------------------------------------------------------- receiving


class ChunkReceiver:
    """Assembles one version from chunks into ``<path>.part`` and renames it to ``path``
    when the last chunk arrives and the digest of the whole file matches.

    Chunks may arrive in any order, each exactly once; the digest is computed over the
    contiguous prefix as it grows (a chunk that arrives early is read back from the file
    when the gap before it fills), so nothing but the chunk in hand is ever in memory.
    A rejected chunk (:class:`WeightSyncError`) changes nothing; a digest mismatch or a
    failed ``validate`` discards the whole upload (``failed``) and raises.

    Args:
        path: final file name (its directory must exist).
        version: the version number (messages name it; checked by :meth:`add`).
        size_bytes: total file size (>= 1).
        chunk_bytes: chunk size of the plan (>= 1).
        digest: ``"<algorithm>:<hex>"`` of the whole file.
        validate: called with the ``.part`` path after the digest matched and before the
            rename; raises to refuse the file (e.g. :func:`check_safetensors_file`).

    Raises:
        WeightSyncError: impossible size/chunk plan, a malformed digest, or not enough free
            disk space for ``size_bytes``.
        OSError: the ``.part`` file cannot be created.
    """

    def __init__(
        self,
        path: pathlib.Path | str,
        version: int,
        size_bytes: int,
        chunk_bytes: int,
        digest: str,
        *,
        validate: Callable[[pathlib.Path], None] | None = None,
    ):
        self.path = pathlib.Path(path)
        self.version = int(version)
        self.size_bytes = int(size_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self.num_chunks = num_chunks(self.size_bytes, self.chunk_bytes)
        self.digest = digest
        self.algorithm, self._expect_hex = parse_digest(digest)
        self.validate = validate
        free = shutil.disk_usage(self.path.parent).free
        if free < self.size_bytes:
            raise WeightSyncError(
                f"version {version} needs {self.size_bytes} bytes but {self.path.parent} has {free} free"
            )
        self.part = self.path.with_name(self.path.name + ".part")
        self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, self.size_bytes)
        self._received = bytearray(self.num_chunks)  # 1 byte per chunk: 40 GB / 1 MiB = 40 KB
        self._hasher = new_hasher(self.algorithm)
        self._hashed = 0  # chunks [0, _hashed) are in the digest
        self.received_chunks = 0
        self.received_bytes = 0
        self.done = False
        self.failed = False
        self.started_at = time.monotonic()

    def expected(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``index`` (raises WeightSyncError when out of range)."""
        return chunk_span(index, self.size_bytes, self.chunk_bytes)

    def has(self, index: int) -> bool:
        return 0 <= index < self.num_chunks and bool(self._received[index])

    def missing(self) -> list[int]:
        """Indices not received yet, ascending."""
        return [i for i, got in enumerate(self._received) if not got]

    def add(self, index: int, offset: int, data) -> bool:
        """Write chunk ``index`` (bytes-like ``data`` at byte ``offset``).

        Returns:
            True when this was the last chunk: the digest matched, ``validate`` passed and the
            file is now at ``path``.

        Raises:
            WeightSyncError: the receiver is finished or failed; ``index`` out of range; an
                offset or length that does not match the plan; a duplicate chunk (all of
                these change nothing); or, on the last chunk, a digest mismatch or a refused
                file (the upload is then discarded and ``failed`` is set).
            OSError: writing failed (disk full): the upload is discarded.
        """
        if self.done or self.failed:
            raise WeightSyncError(
                f"version {self.version}: the upload is already {'complete' if self.done else 'discarded'}"
            )
        want_off, want_len = self.expected(index)
        view = memoryview(data).cast("B")
        if offset != want_off or len(view) != want_len:
            raise WeightSyncError(
                f"version {self.version} chunk {index}: got {len(view)} bytes at offset {offset}, "
                f"expected {want_len} at {want_off}"
            )
        if self._received[index]:
            raise WeightSyncError(f"version {self.version} chunk {index} arrived twice")
        try:
            _pwrite_all(self._fd, view, offset)
        except OSError:
            self.abort()
            raise
        self._received[index] = 1
        self.received_chunks += 1
        self.received_bytes += want_len
        if index == self._hashed:
            self._hasher.update(view)
            self._hashed += 1
            self._hash_ready_chunks()
        if self.received_chunks < self.num_chunks:
            return False
        self._hash_ready_chunks()
        got = self._hasher.hexdigest()
        if got != self._expect_hex:
            self.abort()
            raise WeightSyncError(
                f"version {self.version}: digest mismatch ({self.algorithm}:{got[:16]}… != {self.digest[:24]}…); "
                "upload discarded"
            )
        os.close(self._fd)
        self._fd = -1
        if self.validate is not None:
            try:
                self.validate(self.part)
            except Exception:
                self.abort()
                raise
        os.replace(self.part, self.path)
        self.done = True
        return True

    def _hash_ready_chunks(self) -> None:
        """Extend the digest over chunks that arrived ahead of the prefix (read back from the file)."""
        while self._hashed < self.num_chunks and self._received[self._hashed]:
            off, length = self.expected(self._hashed)
            pos = 0
            while pos < length:
                block = os.pread(self._fd, min(8 << 20, length - pos), off + pos)
                if not block:
                    raise WeightSyncError(f"version {self.version}: short read at offset {off + pos}")
                self._hasher.update(block)
                pos += len(block)
            self._hashed += 1

    def abort(self) -> None:
        """Discard the upload (closes and deletes the ``.part`` file). Idempotent."""
        if self.done:
            return
        self.failed = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.part.unlink(missing_ok=True)

    def progress(self) -> dict:
        return {
            "version": self.version,
            "received_bytes": self.received_bytes,
            "size_bytes": self.size_bytes,
            "chunks": f"{self.received_chunks}/{self.num_chunks}",
        }


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(view):
        n = os.pwrite(fd, view[pos:], offset + pos)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        pos += n


# ---------------------------------------------------------------- serving


class MappedFile:
    """A read-only memory map of a complete version file; :meth:`chunk` slices it without
    copying (ZeroMQ sends such slices zero-copy, so N peers fetching one version share the
    page cache instead of holding N copies).

    The map is never closed explicitly: frames still queued in ZeroMQ keep it alive through
    their slices, and it is unmapped when the last one is sent and the object is dropped.
    Deleting or replacing the file (a new version with the same number, pruning) is safe:
    the map keeps the old inode.

    Raises:
        OSError: the file cannot be opened or mapped. ValueError: it is empty.
    """

    def __init__(self, path: pathlib.Path | str):
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size_bytes = len(self._mm)
        self._view = memoryview(self._mm)

    def chunk(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` as a read-only view (no copy).

        Raises:
            WeightSyncError: the range is outside the file.
        """
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise WeightSyncError(f"range [{offset}, {offset + length}) is outside a file of {self.size_bytes} bytes")
        return self._view[offset : offset + length]


def fetch_replies(
    request, size_bytes: int, chunk_bytes: int, digest: str, read: Callable[[int, int], "memoryview | bytes | None"]
) -> Iterator[tuple]:
    """The replies to one FETCH_WEIGHTS for a published version, in the order to send them:
    its WEIGHTS header (if ``request.header``), then the WEIGHTS_CHUNK messages
    ``request.first_chunk`` … ``first_chunk + num_chunks - 1`` clipped to the version, each
    with one frame that ``read`` returns (zero-copy slices, read one at a time as the
    iterator advances, so a sender that stops early reads no more).

    This is the coordinator's serving code (``Coordinator.on_fetch_weights``); stand-in
    coordinators in tests and benchmarks serve through it too (:class:`ServedVersion`).

    Args:
        request: a :class:`spotlight.protocol.FetchWeights`.
        size_bytes: size of the version's file (>= 1).
        chunk_bytes: chunk size this server uses (>= 1).
        digest: ``"<algorithm>:<hex>"`` of the whole file.
        read: ``(offset, length)`` → those bytes of the file, or None when the version is
            gone (pruned since the request): a WEIGHTS(found=False) reply then ends the stream.

    Returns:
        An iterator of ``(message, frames)`` (``frames``: a list of 0 or 1 buffers).

    Raises:
        WeightSyncError: at once, before anything is read, when ``request.first_chunk`` is
            past the version's last chunk (and chunks are asked for).
    """
    from spotlight import protocol as P

    n = num_chunks(size_bytes, chunk_bytes)
    if request.num_chunks and request.first_chunk >= n:
        raise WeightSyncError(f"version {request.version} has {n} chunks; chunk {request.first_chunk} does not exist")

    def replies():
        if request.header:
            yield (
                P.Weights(
                    version=request.version, size_bytes=size_bytes, chunk_bytes=chunk_bytes, num_chunks=n, digest=digest
                ),
                [],
            )
        for i in range(request.first_chunk, min(n, request.first_chunk + request.num_chunks)):
            off, length = chunk_span(i, size_bytes, chunk_bytes)
            data = read(off, length)
            if data is None:
                yield P.Weights(version=request.version, size_bytes=0, found=False), []
                return
            yield P.WeightsChunk(version=request.version, index=i, offset=off, size_bytes=length), [data]

    return replies()


class ServedVersion:
    """One complete version file served to FETCH_WEIGHTS requests the way the coordinator
    serves it (:func:`fetch_replies` over a :class:`MappedFile`): for stand-in coordinators
    (integration tests, benchmarks) that must speak the real weight protocol.

    Args:
        path: the version's safetensors file (e.g. written by
            :func:`spotlight.store.tensor_wire.save_version`).
        version: its version number.
        chunk_bytes: chunk size to serve it in (>= 1).
        digest: ``"<algorithm>:<hex>"`` of the file; computed (sha256) when not given.

    Raises:
        OSError: the file cannot be read or mapped. ValueError: it is empty.
    """

    def __init__(self, path: pathlib.Path | str, version: int, chunk_bytes: int, *, digest: str | None = None):
        self.version = int(version)
        self.chunk_bytes = int(chunk_bytes)
        self.digest = digest or file_digest(path)
        parse_digest(self.digest)
        self.mapped = MappedFile(path)
        self.size_bytes = self.mapped.size_bytes

    def replies(self, request) -> list[tuple]:
        """``(message, frames)`` to send for one FETCH_WEIGHTS: WEIGHTS(found=False) for any
        other version, else :func:`fetch_replies`.

        Raises:
            WeightSyncError: ``request.first_chunk`` past the last chunk.
        """
        if request.version != self.version:
            from spotlight import protocol as P

            return [(P.Weights(version=request.version, size_bytes=0, found=False), [])]
        return list(fetch_replies(request, self.size_bytes, self.chunk_bytes, self.digest, self.mapped.chunk))


# ---------------------------------------------------------------- sending (trainer rank 0)


def send_version(
    sock,
    version: int,
    path: pathlib.Path | str,
    digest: str,
    chunk_bytes: int,
    *,
    alive: Callable[[], bool] = lambda: True,
    poll_ms: int = 1000,
    unlink: bool = False,
) -> int:
    """Push weight ``version`` (the file at ``path``) on a ZeroMQ DEALER: one WEIGHTS header,
    then its WEIGHTS_CHUNK messages in order, each a zero-copy slice of a memory map.

    Sends wait for room in the socket's queue (the coordinator's bounded receive queue
    pushes back through TCP), so at most a few chunks are ever in flight; while waiting,
    ``alive()`` is asked every ``poll_ms`` and a False answer stops the stream. With
    ``unlink`` the file is deleted as soon as it is mapped (its disk space is freed when the
    last queued chunk is sent).

    Returns:
        The number of chunks sent.

    Raises:
        WeightSyncError: ``alive()`` returned False before the stream was complete.
        OSError: the file cannot be mapped.
    """
    import zmq

    from spotlight import protocol as P

    mapped = MappedFile(path)
    if unlink:
        os.unlink(path)
    size = mapped.size_bytes
    n = num_chunks(size, chunk_bytes)

    def send(frames) -> None:
        while not sock.poll(poll_ms, zmq.POLLOUT):
            if not alive():
                raise WeightSyncError(f"stopped streaming version {version}: the receiver is gone")
        sock.send_multipart(frames, copy=False)

    send(P.encode(P.Weights(version=version, size_bytes=size, chunk_bytes=chunk_bytes, num_chunks=n, digest=digest)))
    for i in range(n):
        off, length = chunk_span(i, size, chunk_bytes)
        send(
            P.encode(
                P.WeightsChunk(version=version, index=i, offset=off, size_bytes=length), [mapped.chunk(off, length)]
            )
        )
    return n
