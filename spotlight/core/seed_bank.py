"""Seed bank: which seeds each prompt group of a batch is rolled out with.

Pure logic (paper §5 "Dynamic Exploration"): exploration scores d candidate seeds per
prompt with stale weights; the bank keeps the top-k and bottom-k by reward (k = K/2,
DanceGRPO-style best/worst selection) so next iteration's group has maximal reward
contrast. Prompts that were not explored (the control group, or exploration that
failed) use default seeds.

A slot counts as *explored* (for the Planner's feedback, §4.3.2) only when at least
``required`` (the action's d) candidates were scored with a finite reward for it; a
slot whose exploration was cancelled or partial still uses the seeds it got, but its
rollout group is neither the action's result nor the control baseline.

Seeds are derived deterministically from ``(run seed, iteration, prompt slot, index)``
so a run is reproducible and a candidate seed explored under v_n is rolled out under
v_{n+1} from the very same noise (docs/architecture.md §3).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from typing import Sequence

_STATE_VERSION = 2  # 2: per-slot (scored, required) counts; version 1 still loads


MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One SplitMix64 round: a stable, well-mixed 64-bit hash of an integer (Steele et al.
    2014). Used for seeded noise (``spotlight.rl.sampler``) and the simulator's rewards."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: object) -> int:
    """A 31-bit seed from any tuple of parts (stable across processes and machines)."""
    return seed_from_text("|".join(map(str, parts)))


def seed_prefix(*parts: object) -> str:
    """The text :func:`derive_seed` hashes for ``parts`` followed by more parts, up to
    them: ``derive_seed(*parts, *more) == seed_from_text(seed_prefix(*parts) +
    "|".join(map(str, more)))``. Lets a caller deriving many seeds that share their leading
    parts format those once."""
    return "".join(f"{p}|" for p in parts)


def seed_from_text(text: str) -> int:
    """The seed of :func:`derive_seed`'s joined text (see :func:`seed_prefix`)."""
    return int.from_bytes(_blake2b(text.encode(), digest_size=8).digest(), "little") & 0x7FFFFFFF


_blake2b = hashlib.blake2b


def default_seeds(run_seed: int, iteration: int, slot: int, group_size: int) -> list[int]:
    """The K seeds of an unexplored prompt group."""
    return [derive_seed(run_seed, "default", iteration, slot, k) for k in range(group_size)]


def candidate_seeds(run_seed: int, iteration: int, slot: int, num_candidates: int) -> list[int]:
    """The d candidate seeds explored for prompt slot ``slot`` of iteration ``iteration``."""
    prefix = seed_prefix(run_seed, "candidate", iteration, slot)
    return [seed_from_text(f"{prefix}{j}") for j in range(num_candidates)]


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
    isfinite = math.isfinite
    # sort keys (-reward, index): unique, so the first and last ``half`` of the sorted order
    # are the ``half`` smallest and (reversed) largest keys, found without sorting them all
    scored = [(-r, i) for i, r in enumerate(rewards) if isfinite(r)]
    half = group_size // 2
    if len(scored) <= group_size or not half:
        scored.sort()
        return [seeds[i] for _, i in scored]
    picked = heapq.nsmallest(half, scored) + heapq.nlargest(half, scored)[::-1]
    return [seeds[i] for _, i in picked]


class SeedBank:
    """Selected seeds per (iteration, slot), filled by exploration, read at rollout."""

    def __init__(self, run_seed: int, group_size: int):
        self.run_seed = run_seed
        self.group_size = group_size
        self._selected: dict[tuple[int, int], list[int]] = {}
        # (iteration, slot) -> (finite-reward candidates scored, candidates required);
        # absent for entries loaded from a version-1 state (explored = any seed picked)
        self._counts: dict[tuple[int, int], tuple[int, int]] = {}

    def record_exploration(
        self,
        iteration: int,
        slot: int,
        seeds: Sequence[int],
        rewards: Sequence[float],
        *,
        required: int | None = None,
    ) -> list[int]:
        """Select the slot's seeds from its scored candidates and remember how many were scored.

        Args:
            seeds, rewards: the candidates that finished, with their rewards (non-finite
                rewards are ignored).
            required: d, the candidates the exploration action asked for; the slot is
                explored iff at least ``required`` finite rewards were scored. None =
                ``group_size + 1`` (the least that selects anything).

        Raises:
            ValueError: length mismatch, or ``required`` < 1.
        """
        if required is None:
            required = self.group_size + 1
        if isinstance(required, bool) or not isinstance(required, int) or required < 1:
            raise ValueError(f"required must be an int >= 1, got {required!r}")
        picked = select_top_bottom(seeds, rewards, self.group_size)
        self._selected[(iteration, slot)] = picked
        self._counts[(iteration, slot)] = (sum(1 for r in rewards if math.isfinite(r)), required)
        return picked

    def is_explored(self, iteration: int, slot: int) -> bool:
        """True iff at least ``required`` finite-reward candidates were scored for the slot
        (entries from a version-1 state: iff any seed was picked)."""
        key = (iteration, slot)
        if key in self._counts:
            scored, required = self._counts[key]
            return scored >= required
        return len(self._selected.get(key, [])) > 0

    def explored_slots(self, iteration: int) -> set[int]:
        """Slots of ``iteration`` that count as explored (:meth:`is_explored`)."""
        return {slot for (it, slot) in self._selected if it == iteration and self.is_explored(it, slot)}

    def seeds_for(self, iteration: int, slot: int) -> tuple[list[int], bool]:
        """``(K seeds, explored?)`` for a prompt slot; defaults fill any shortfall.
        ``explored`` is :meth:`is_explored`: a partly explored slot still gets its picked
        seeds but is not explored."""
        picked = list(self._selected.get((iteration, slot), []))
        explored = self.is_explored(iteration, slot)
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
            self._counts.pop(key, None)

    def state_dict(self) -> dict:
        """JSON-able state for the run checkpoint: the selected seeds per (iteration, slot),
        the (scored, required) counts behind the explored flag, plus ``run_seed`` and
        ``group_size`` (checked on load). Seeds are ints < 2**31."""
        return {
            "version": _STATE_VERSION,
            "run_seed": self.run_seed,
            "group_size": self.group_size,
            "selected": [[it, slot, list(seeds)] for (it, slot), seeds in sorted(self._selected.items())],
            "counts": [[it, slot, scored, required] for (it, slot), (scored, required) in sorted(self._counts.items())],
        }

    def load_state_dict(self, d: dict) -> None:
        """Replace the selected seeds with a :meth:`state_dict`'s.

        A version-1 state (no counts) loads; its slots count as explored iff any seed
        was picked (the rule it was written under).

        Raises:
            ValueError: unknown state version, or a ``run_seed`` / ``group_size`` other than
                this bank's (the seeds would not be this run's); the bank is then unchanged.
        """
        if d.get("version") not in (1, _STATE_VERSION):
            raise ValueError(f"unsupported seed bank state version {d.get('version')!r}")
        if (d["run_seed"], d["group_size"]) != (self.run_seed, self.group_size):
            raise ValueError(
                f"seed bank state is for run_seed={d['run_seed']}, group_size={d['group_size']}; "
                f"this bank has run_seed={self.run_seed}, group_size={self.group_size}"
            )
        self._selected = {(int(it), int(slot)): [int(s) for s in seeds] for it, slot, seeds in d["selected"]}
        self._counts = {(int(it), int(slot)): (int(sc), int(rq)) for it, slot, sc, rq in d.get("counts", [])}
