"""What the coordinator keeps of a finished request (spotlight.rl.batch.result_sample): a
rollout keeps its image, window latents and log-probs for the update; an exploration candidate
keeps only what ranks it, its reward (its image goes to the reward and no further)."""

from __future__ import annotations

import numpy as np
import torch

from spotlight.core.request_scheduler import Request, RequestKind
from spotlight.rl.batch import result_sample


def _tensors(rows: int = 3) -> dict:
    return {
        "images": torch.arange(rows * 3 * 4 * 4, dtype=torch.uint8).reshape(rows, 3, 4, 4),
        "window_latents": torch.randn(rows, 3, 16, 8),
        "log_probs": torch.randn(rows, 2),
    }


def _request(kind: RequestKind, **params) -> Request:
    return Request("r1", kind, iteration=2, prompt_index=5, seed=11, weight_version=2, params=params)


def test_a_rollout_keeps_its_image_and_window():
    tensors = _tensors()
    s, image = result_sample(_request(RequestKind.ROLLOUT), 0, 5, "b1", tensors, 1, window_start=0)
    assert np.array_equal(image, tensors["images"][1].numpy())
    assert torch.equal(s.image, tensors["images"][1]) and s.in_rollout
    assert torch.equal(s.window_latents, tensors["window_latents"][1]) and torch.equal(
        s.log_probs, tensors["log_probs"][1]
    )
    assert (s.iteration, s.prompt_index, s.seed, s.batch_id, s.window_start) == (2, 5, 11, "b1", 0)


def test_an_exploration_candidate_keeps_no_image_once_handed_to_the_reward():
    """Was: every candidate's image stayed on the coordinator until the end of the iteration it
    was explored for: at 1280 px with 32 prompts × 256 candidates, about 37 GiB of images kept
    only to be ranked by their rewards."""
    tensors = _tensors()
    s, image = result_sample(_request(RequestKind.EXPLORE, sde_window_start=1), 0, 5, "b1", tensors, 2, window_start=0)
    assert np.array_equal(image, tensors["images"][2].numpy())  # what the reward scores
    assert s.image is None and s.window_latents is None and s.log_probs is None and not s.in_rollout
    assert s.window_start == 1


def test_a_candidate_that_may_become_the_rollout_keeps_everything():
    """verl-omni-spot reuses its selected candidates as the rollout (params ``as_rollout``)."""
    tensors = _tensors()
    s, _ = result_sample(_request(RequestKind.EXPLORE, as_rollout=True), 0, 5, "b1", tensors, 0, window_start=0)
    assert torch.equal(s.image, tensors["images"][0]) and s.window_latents is not None
