"""Seed bank: which seeds each prompt group of a batch is rolled out with.

Pure logic (paper §5 "Dynamic Exploration"): exploration scores d candidate seeds per
prompt with stale weights; the bank keeps the top-k and bottom-k by reward (k = K/2,
DanceGRPO-style best/worst selection) so next iteration's group has maximal reward
contrast. Prompts that were not explored (the control group, or exploration that
failed) use default seeds.

Seeds are derived deterministically from ``(run seed, iteration, prompt slot, index)``
so a run is reproducible and a candidate seed explored under v_n is rolled out under
v_{n+1} from the very same noise (DESIGN §3).
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

_STATE_VERSION = 1


def derive_seed(*parts: object) -> int:
    """A 31-bit seed from any tuple of parts (stable across processes and machines)."""
    h = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def default_seeds(run_seed: int, iteration: int, slot: int, group_size: int) -> list[int]:
    """The K seeds of an unexplored prompt group."""
    return [derive_seed(run_seed, "default", iteration, slot, k) for k in range(group_size)]


def candidate_seeds(run_seed: int, iteration: int, slot: int, num_candidates: int) -> list[int]:
    """The d candidate seeds explored for prompt slot ``slot`` of iteration ``iteration``."""
    return [derive_seed(run_seed, "candidate", iteration, slot, j) for j in range(num_candidates)]


def select_top_bottom(seeds: Sequence[int], rewards: Sequence[float], group_size: int) -> list[int]:
    """Top ``K/2`` and bottom ``K/2`` seeds by reward (ties broken by seed order).

    Non-finite rewards are ignored. Returns fewer than K seeds when fewer finite
    candidates exist (the caller fills up with default seeds).

    Raises:
        ValueError: length mismatch or odd group size.
    """
    if len(seeds) != len(rewards):
        raise ValueError(f"{len(seeds)} seeds but {len(rewards)} rewards")
    if group_size % 2:
        raise ValueError("group_size must be even")
    scored = sorted(
        ((r, i) for i, r in enumerate(rewards) if math.isfinite(r)),
        key=lambda x: (-x[0], x[1]),
    )
    half = group_size // 2
    if len(scored) <= group_size:
        return [seeds[i] for _, i in scored]
    picked = scored[:half] + scored[-half:]
    return [seeds[i] for _, i in picked]


class SeedBank:
    """Selected seeds per (iteration, slot), filled by exploration, read at rollout."""

    def __init__(self, run_seed: int, group_size: int):
        self.run_seed = run_seed
        self.group_size = group_size
        self._selected: dict[tuple[int, int], list[int]] = {}

    def record_exploration(self, iteration: int, slot: int, seeds: Sequence[int], rewards: Sequence[float]) -> list[int]:
        picked = select_top_bottom(seeds, rewards, self.group_size)
        self._selected[(iteration, slot)] = picked
        return picked

    def seeds_for(self, iteration: int, slot: int) -> tuple[list[int], bool]:
        """``(K seeds, explored?)`` for a prompt slot; defaults fill any shortfall."""
        picked = list(self._selected.get((iteration, slot), []))
        explored = len(picked) > 0
        if len(picked) < self.group_size:
            for s in default_seeds(self.run_seed, iteration, slot, self.group_size):
                if len(picked) == self.group_size:
                    break
                if s not in picked:
                    picked.append(s)
        return picked[: self.group_size], explored

    def forget(self, before_iteration: int) -> None:
        for key in [k for k in self._selected if k[0] < before_iteration]:
            del self._selected[key]

    def state_dict(self) -> dict:
        """JSON-able state for the run checkpoint: the selected seeds per (iteration, slot)
        plus ``run_seed`` and ``group_size`` (checked on load). Seeds are ints < 2**31."""
        return {
            "version": _STATE_VERSION,
            "run_seed": self.run_seed,
            "group_size": self.group_size,
            "selected": [[it, slot, list(seeds)] for (it, slot), seeds in sorted(self._selected.items())],
        }

    def load_state_dict(self, d: dict) -> None:
        """Replace the selected seeds with a :meth:`state_dict`'s.

        Raises:
            ValueError: unknown state version, or a ``run_seed`` / ``group_size`` other than
                this bank's (the seeds would not be this run's); the bank is then unchanged.
        """
        if d.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported seed bank state version {d.get('version')!r}")
        if (d["run_seed"], d["group_size"]) != (self.run_seed, self.group_size):
            raise ValueError(
                f"seed bank state is for run_seed={d['run_seed']}, group_size={d['group_size']}; "
                f"this bank has run_seed={self.run_seed}, group_size={self.group_size}"
            )
        self._selected = {(int(it), int(slot)): [int(s) for s in seeds] for it, slot, seeds in d["selected"]}
