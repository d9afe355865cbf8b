"""Sample grids a person can read: prompts wrapped above their row, gaps between tiles, the
reward under each image, files named by the 1-based iteration as on screen."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from spotlight.util.plots import GRID_GAP_PX, sample_grid

SCALE = 4
H = W = 8


MAGENTA = (255, 0, 255)


def _tiles(n):
    return [np.broadcast_to(np.array(MAGENTA, dtype=np.uint8)[:, None, None], (3, H, W)).copy() for _ in range(n)]


def _grid(tmp_path, labels, name="g.png"):
    path = tmp_path / name
    sample_grid(_tiles(4), [0, 0, 1, 1], [0.25, None, 1.0, 0.5], path, title="iteration 1", scale=SCALE, labels=labels)
    return Image.open(path).convert("RGB")


def test_long_prompts_wrap_inside_the_picture(tmp_path):
    short = _grid(tmp_path, {0: "a red cube", 1: "a blue ball"}, "short.png")
    long_prompt = "a photo of " + " ".join(["a very small green triangle left of a large purple circle"] * 4)
    long = _grid(tmp_path, {0: long_prompt, 1: "a blue ball"}, "long.png")
    assert long.width == short.width  # wrapped, not widened or cut off
    assert long.height >= short.height + 2 * 14  # the long prompt takes several lines (one line before)


def test_tiles_are_apart(tmp_path):
    img = np.asarray(_grid(tmp_path, {0: "a", 1: "b"}))
    tile = W * SCALE
    is_tile = (img == MAGENTA).all(axis=2)
    ys, xs = np.nonzero(is_tile)  # the first tile's top-left pixel
    y0, x0 = ys.min(), xs.min()
    assert x0 == GRID_GAP_PX
    assert is_tile[y0 : y0 + tile, x0 : x0 + tile].all()  # the tile, upscaled
    between = img[y0 + tile // 2, x0 + tile : x0 + tile + GRID_GAP_PX]
    assert (
        not is_tile[y0 + tile // 2, x0 + tile : x0 + tile + GRID_GAP_PX].any() and (between > 200).all()
    )  # background between the two tiles of a row (they touched at 4 px on white before)
    assert is_tile[y0 + tile // 2, x0 + tile + GRID_GAP_PX]  # the second tile starts after the gap


def test_coordinator_names_grids_by_the_1_based_iteration(tmp_path):
    from spotlight.coordinator.recorder import write_sample_grid
    from spotlight.core.request_scheduler import RequestKind
    from spotlight.rl.batch import Sample
    from tests.unit.store.test_weight_sync import _Run

    run = _Run(tmp_path)
    try:
        c = run.coord
        S = c.cfg.model.image_size
        for i in range(2):
            c.samples[f"r{i}"] = Sample(
                f"r{i}", RequestKind.ROLLOUT, 0, 0, i, i, "b", torch.zeros(3, S, S, dtype=torch.uint8), reward=0.5
            )
        write_sample_grid(c.run_dir, 0, c.samples.values(), c.prompts, verdicts=False)  # the first iteration (index 0)
    finally:
        run.close()
    assert [p.name for p in (tmp_path / "run" / "samples").iterdir()] == ["iter_0001.png"]  # iter_0000.png before


def test_verl_omni_spot_grid_shows_the_candidates_reused_as_the_rollout(tmp_path):
    """verl-omni-spot has no rollout-kind requests: its rollout is the exploration candidates
    (params ``as_rollout``) the seed bank selected. The grid (and the tracked image) was never
    written in that mode."""
    from spotlight.coordinator.recorder import write_sample_grid
    from spotlight.core.request_scheduler import RequestKind
    from spotlight.rl.batch import Sample
    from tests.unit.store.test_weight_sync import _Run

    run = _Run(tmp_path, **{"run.mode": "verl-omni-spot"})
    try:
        c = run.coord
        S = c.cfg.model.image_size
        for i in range(3):  # three candidates of prompt slot 0; the first two are selected
            c.samples[f"e{i}"] = Sample(
                f"e{i}",
                RequestKind.EXPLORE,
                0,
                0,
                0,
                i,
                "b",
                torch.zeros(3, S, S, dtype=torch.uint8),
                reward=float(i),
                window_latents=torch.zeros(2, 4),
                log_probs=torch.zeros(2),
            )
        c._start_training(0, ["e0", "e1"])
        assert [s.request_id for s in c.samples.values() if s.in_rollout] == ["e0", "e1"]
        grid = write_sample_grid(c.run_dir, 0, c.samples.values(), c.prompts, verdicts=False)
        assert grid == tmp_path / "run" / "samples" / "iter_0001.png"
    finally:
        run.close()
    assert (tmp_path / "run" / "samples" / "iter_0001.png").is_file()
