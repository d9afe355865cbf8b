"""A reserved GPU shared by a Rollout Worker and a Train Worker: who gives its memory back, when (pure).

On the reserved node, Train Worker rank r trains on GPU r of the host
(:class:`spotlight.coordinator.trainer_group.TrainerGroup`) and ``cluster.reserved_rollout_gpus``
run Rollout Workers; a GPU in both holds the worker's model copy while the trainer trains
(docs/architecture.md §10: "a reserved GPU that both rolls out and trains gives its rollout
copy's memory back while it trains"). The exchange, in the words of :mod:`spotlight.protocol`::

    TRAIN starts (the Request Scheduler's training gate closes: the reserved worker has no work)
    worker ── PULL ─────────────────────────▶ coordinator
           ◀── LEASES([], device="release")     (a shared worker, while training runs)
    worker: weights → host memory (pinned on CUDA), frees its device memory
    worker ── PULL(residency="released", offload_s) ─▶ coordinator: every awaited worker
                                                     released → TRAIN_BATCH to the ranks
    ... training; TRAIN_DONE; the gate opens (DRAIN) ...
           ◀── LEASES([...] or [], device="reclaim")
    worker: weights → its device (before any lease runs), reports reload_s in its next PULL

Decisions here take observations and return answers; the coordinator's control plane and the
worker's process loop (``spotlight/workers/rollout/worker.py``) own sockets, clocks and torch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

__all__ = [
    "RELEASE_TIMEOUT_S",
    "DeviceWord",
    "Move",
    "OffloadMeter",
    "Residency",
    "device_word",
    "next_move",
    "offload_enabled",
    "release_wait_over",
    "shares_trainer_gpu",
    "trainer_gpus",
]

RELEASE_TIMEOUT_S = 60.0
"""Longest the coordinator holds an update back for shared workers to report their device
memory released (a worker still busy with a batch, or one that stopped answering): then the
update is sent anyway (and a warning logged). Releasing a 41 GB bf16 copy takes about 2 s over
PCIe at 25 GB/s, plus the pinned buffer's allocation the first time."""


class Residency(str, enum.Enum):
    """Where a Rollout Worker's model weights are, as its PULL says (``Pull.residency``)."""

    UNMANAGED = ""  # the worker never releases its device (disabled, an SP group, an older worker)
    RESIDENT = "resident"  # on its device, ready to denoise
    RELEASED = "released"  # in host memory: its device memory is free for a Train Worker

    def __str__(self) -> str:
        return self.value


class DeviceWord(str, enum.Enum):
    """The coordinator's word on a worker's device memory in a LEASES reply (``Leases.device``)."""

    NONE = ""  # nothing to say (not a shared GPU, an agent's own reply, an older coordinator)
    RELEASE = "release"  # a Train Worker trains on this worker's GPU now: give the memory back
    RECLAIM = "reclaim"  # training on it ended: take the weights back before the next lease


class Move(str, enum.Enum):
    """What a worker does with its weights before it pulls again (or before its batch runs)."""

    OFFLOAD = "offload"
    RELOAD = "reload"


def trainer_gpus(num_train_workers: int) -> frozenset[int]:
    """GPUs of the reserved host the Train Workers use: rank r on GPU r (``TrainerGroup.start``)."""
    return frozenset(range(max(0, int(num_train_workers))))


def shares_trainer_gpu(*, is_spot: bool, worker_gpus: Iterable[int], train_gpus: Iterable[int]) -> bool:
    """True for a worker of the reserved node on a GPU a Train Worker also uses (spot nodes are
    other machines: their GPU indices name other devices)."""
    return not is_spot and bool(set(worker_gpus) & set(train_gpus))


def offload_enabled(setting: bool | None, *, device_type: str, family: str) -> bool:
    """``cluster.offload_rollout_while_training`` resolved for one worker. None (auto): on for a
    worker on CUDA with a real family (a tiny model's copy is a few MB; on the CPU there is no
    device memory to give back); True: always, also on the CPU, where the move is a no-op that
    still runs the same states, messages and accounting (tests); False: never."""
    if setting is None:
        return device_type == "cuda" and family != "tiny"
    return bool(setting)


def device_word(*, enabled: bool, shares_gpu: bool, training_active: bool, leased: bool) -> DeviceWord:
    """What the coordinator tells a worker about its device memory with a LEASES reply.

    ``enabled``: ``cluster.offload_rollout_while_training`` is not False; ``shares_gpu``:
    :func:`shares_trainer_gpu`; ``training_active``: the Request Scheduler's training gate
    (closed from StartTraining until the update is published: no work can go to a reserved
    worker meanwhile); ``leased``: the reply carries requests (a worker never releases with work
    in hand, and reclaims before it runs it)."""
    if not enabled or not shares_gpu:
        return DeviceWord.NONE
    if training_active and not leased:
        return DeviceWord.RELEASE
    return DeviceWord.RECLAIM


def next_move(residency: Residency, word: DeviceWord | str, *, has_work: bool) -> Move | None:
    """The worker's move on a LEASES reply: work always runs with the weights on the device;
    without work, follow the coordinator's word; no word (an agent's own reply while it
    reconnects, say) keeps the weights where they are. An unmanaged worker never moves."""
    if residency is Residency.UNMANAGED:
        return None
    word = DeviceWord(word)
    if has_work:
        return Move.RELOAD if residency is Residency.RELEASED else None
    if word is DeviceWord.RELEASE and residency is Residency.RESIDENT:
        return Move.OFFLOAD
    if word is DeviceWord.RECLAIM and residency is Residency.RELEASED:
        return Move.RELOAD
    return None


def release_wait_over(
    residencies: Mapping[str, Residency | str], *, started_at: float, now: float, timeout_s: float = RELEASE_TIMEOUT_S
) -> bool:
    """Whether the update may go to the Train Workers: every awaited worker (shared, alive, and
    managing its residency: ``residencies`` maps each to its last reported one) has released its
    device memory, or ``timeout_s`` passed since ``started_at`` (the update was ready)."""
    if all(Residency(r) is Residency.RELEASED for r in residencies.values()):
        return True
    return now - started_at >= timeout_s


class OffloadMeter:
    """What giving the memory back cost in one metrics row (one iteration).

    Workers report the seconds of their moves in their PULLs (:meth:`moved`); the coordinator
    reports how long an update waited for the release (:meth:`waited`). :meth:`take` returns the
    row's part and starts the next: ``time/offload_s`` and ``time/reload_s`` (the slowest
    worker's total: workers move in parallel), ``time/offload_wait_s`` (the update held back,
    the part on the critical path), ``device/offloads`` and ``device/reloads`` (moves counted)."""

    def __init__(self) -> None:
        self._offload_s: dict[str, float] = {}
        self._reload_s: dict[str, float] = {}
        self._counts = {"offloads": 0, "reloads": 0}
        self._wait_s = 0.0

    def moved(self, worker_id: str, kind: Move | str, seconds: float) -> None:
        """Worker ``worker_id`` made one move of ``kind`` that took ``seconds``."""
        kind = Move(kind)
        spent = self._offload_s if kind is Move.OFFLOAD else self._reload_s
        spent[worker_id] = spent.get(worker_id, 0.0) + max(0.0, float(seconds))
        self._counts["offloads" if kind is Move.OFFLOAD else "reloads"] += 1

    def waited(self, seconds: float) -> None:
        self._wait_s += max(0.0, float(seconds))

    def take(self) -> dict[str, float]:
        row = {
            "time/offload_s": max(self._offload_s.values(), default=0.0),
            "time/reload_s": max(self._reload_s.values(), default=0.0),
            "time/offload_wait_s": self._wait_s,
            "device/offloads": float(self._counts["offloads"]),
            "device/reloads": float(self._counts["reloads"]),
        }
        self.__init__()
        return row
