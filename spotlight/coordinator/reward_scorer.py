"""Reward scoring off the serve loop: a thread pool, retries with backoff, and a give-up limit.

Results are scored as they arrive (paper §4.2: "rewards scored asynchronously as samples
finish"); the serve loop collects what is done on every turn with :meth:`RewardScorer.poll`.
A failed job keeps its samples and is retried with exponential backoff (1 s … 30 s); after
``reward.give_up_after_s`` of uninterrupted failures :attr:`RewardScorer.error` says why and
the coordinator stops the run with that line instead of spinning.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Callable, Sequence

import numpy as np

from spotlight.config import RewardConfig

log = logging.getLogger("spotlight.coordinator")

__all__ = ["RewardScorer"]


@dataclasses.dataclass
class _Job:
    ids: list[str]
    images: np.ndarray  # [B, 3, S, S] uint8
    prompts: list[str]
    metadata: list[dict] | None = None  # per image, its prompt's record fields (None: none)
    future: concurrent.futures.Future | None = None  # None: waiting for its retry time
    retry_at: float = 0.0


class RewardScorer:
    """Scores batches of images with ``reward_fn(images, prompts[, metadata]) -> rewards`` on a pool
    (``metadata``: each image's prompt's record fields, passed only when given).

    Args:
        reward_fn: the run's reward (:class:`spotlight.rewards.reward_fn.RewardFn`).
        cfg: the ``[reward]`` section (``num_threads``, ``give_up_after_s``).
    """

    def __init__(self, reward_fn: Callable[[np.ndarray, Sequence[str]], Sequence[float]], cfg: RewardConfig):
        self.reward_fn = reward_fn
        self.cfg = cfg
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: list[_Job] = []
        self._failures = 0
        self._failing_since: float | None = None
        self.error: str | None = None
        """Set once scoring has failed for longer than ``reward.give_up_after_s``."""

    def _submit(self, job: _Job) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.cfg.num_threads, thread_name_prefix="reward"
            )
        if job.metadata is None:
            job.future = self._pool.submit(self.reward_fn, job.images, job.prompts)
        else:
            job.future = self._pool.submit(self.reward_fn, job.images, job.prompts, job.metadata)

    def submit(
        self, ids: list[str], images: np.ndarray, prompts: list[str], metadata: list[dict] | None = None
    ) -> None:
        """Score ``images`` ``[B, 3, S, S] uint8`` (request ``ids``, their ``prompts`` and the
        prompts' ``metadata``, one dict each)."""
        job = _Job(list(ids), images, list(prompts), None if metadata is None else list(metadata))
        self._submit(job)
        self._jobs.append(job)

    def poll(self, now: float) -> list[tuple[str, float]]:
        """``(request id, reward)`` of every job finished since the last call; failed jobs are
        rescheduled (their samples kept) and jobs due for a retry resubmitted."""
        scored: list[tuple[str, float]] = []
        still = []
        for job in self._jobs:
            if job.future is None:  # waiting for its retry time
                if now >= job.retry_at:
                    self._submit(job)
                still.append(job)
                continue
            if not job.future.done():
                still.append(job)
                continue
            try:
                rewards = job.future.result()
            except Exception as exc:  # keep the samples, retry later
                self._failed(job, exc, now)
                still.append(job)
                continue
            self._failures = 0
            self._failing_since = None
            scored += [(rid, float(r)) for rid, r in zip(job.ids, rewards)]
        self._jobs = still
        return scored

    def _failed(self, job: _Job, exc: Exception, now: float) -> None:
        self._failures += 1
        self._failing_since = self._failing_since or now
        backoff = min(30.0, 2.0 ** min(self._failures, 5) / 2)
        if self._failures <= 3 or self._failures % 10 == 0:
            log.error("reward scoring failed (%s); keeping %d samples, retrying in %.0fs", exc, len(job.ids), backoff)
        if now - self._failing_since > self.cfg.give_up_after_s:
            self.error = (
                f"reward scoring has failed for {now - self._failing_since:.0f}s (last error: {exc}); "
                "giving up (reward.give_up_after_s)"
            )
        job.future, job.retry_at = None, now + backoff

    def close(self) -> None:
        """Stop the pool without waiting for jobs in flight."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
