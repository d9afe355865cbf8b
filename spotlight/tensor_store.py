"""Tensor Store: durable home of published weight versions and committed rollout state.

Lives on the reserved node, owned by the coordinator (paper §4.1, §4.5; DESIGN §2).
Two kinds of objects, both kept in memory and mirrored to disk under ``root`` so a
preempted worker's progress survives the worker:

* weight versions ``v_n``: one safetensors blob each (what workers fetch); the newest
  ``keep_versions`` stay in memory, all stay on disk until :meth:`prune_weights`;
* committed in-flight state of a request: tensor metas + raw frames, keyed by the
  commit key the Request Scheduler records; deleted once the request finishes.

No torch import: blobs and frames are opaque bytes here.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import msgspec

from spotlight.protocol import TensorMeta

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


class TensorStore:
    """Args:
        root: directory for the on-disk mirror (created).
        keep_versions: weight versions kept in memory.
    """

    def __init__(self, root: pathlib.Path, keep_versions: int = 3):
        self.root = pathlib.Path(root)
        (self.root / "weights").mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self._weights: dict[int, bytes] = {}
        self._state: dict[str, tuple[list[TensorMeta], list[bytes]]] = {}
        self.latest_version: int = -1

    # ------------------------------------------------------------ weights
    def put_weights(self, version: int, blob: bytes) -> None:
        """Publish ``version`` (safetensors bytes); writes ``weights/v<version>.safetensors``."""
        path = self.root / "weights" / f"v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        self._weights[version] = bytes(blob)
        self.latest_version = max(self.latest_version, version)
        for v in sorted(self._weights)[: -self.keep_versions]:
            del self._weights[v]

    def get_weights(self, version: int) -> bytes | None:
        """The blob of ``version``, from memory or disk; None if never published."""
        blob = self._weights.get(version)
        if blob is None:
            path = self.root / "weights" / f"v{version}.safetensors"
            if path.is_file():
                blob = path.read_bytes()
        return blob

    def prune_weights(self, keep_from: int) -> None:
        """Delete on-disk versions older than ``keep_from``."""
        for path in (self.root / "weights").glob("v*.safetensors"):
            try:
                v = int(path.stem[1:])
            except ValueError:
                continue
            if v < keep_from:
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------ rollout state
    def put_state(self, key: str, metas: list[TensorMeta], frames: list[bytes]) -> int:
        """Store committed state under ``key``; returns its size in bytes.

        Raises:
            ValueError: ``key`` is not a valid id (:func:`check_key`).
        """
        check_key(key)
        frames = [bytes(f) for f in frames]
        self._state[key] = (list(metas), frames)
        d = self.root / "state" / key
        d.mkdir(parents=True, exist_ok=True)
        (d / "meta.json").write_bytes(msgspec.json.encode(metas))
        for i, f in enumerate(frames):
            (d / f"{i}.bin").write_bytes(f)
        return sum(len(f) for f in frames)

    def get_state(self, key: str) -> tuple[list[TensorMeta], list[bytes]] | None:
        """Committed state under ``key`` (memory, else disk); None if absent.

        Raises:
            ValueError: ``key`` is not a valid id.
        """
        check_key(key)
        got = self._state.get(key)
        if got is None:
            d = self.root / "state" / key
            if (d / "meta.json").is_file():
                metas = msgspec.json.decode((d / "meta.json").read_bytes(), type=list[TensorMeta])
                frames = [(d / f"{i}.bin").read_bytes() for i in range(len(metas))]
                got = (metas, frames)
        return got

    def delete_state(self, key: str) -> None:
        """Forget the state under ``key`` (memory and disk). Raises ValueError on an invalid key."""
        check_key(key)
        self._state.pop(key, None)
        d = self.root / "state" / key
        if d.is_dir():
            for f in d.iterdir():
                f.unlink(missing_ok=True)
            d.rmdir()

    def stats(self) -> dict:
        return {
            "weights_in_memory": sorted(self._weights),
            "latest_version": self.latest_version,
            "committed_states": len(self._state),
            "state_bytes": sum(len(f) for _, fr in self._state.values() for f in fr),
        }

    def describe(self) -> str:
        return json.dumps(self.stats())
