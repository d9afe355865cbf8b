"""The shapes world and its shipped base model: deterministic rendering, the fixed train/test
split, the prompt files, and the checkpoint whose hash the model card states."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from spotlight.tasks.shapes import world


def test_render_is_deterministic_from_the_seed():
    spec = world.all_prompts()[-1]
    a, objs_a = world.render(spec, np.random.default_rng(7))
    b, objs_b = world.render(spec, np.random.default_rng(7))
    c, _ = world.render(spec, np.random.default_rng(8))
    assert a.shape == (world.IMAGE_SIZE, world.IMAGE_SIZE, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and objs_a == objs_b
    assert not np.array_equal(a, c)


def test_renderings_satisfy_their_prompt_geometry():
    rng = np.random.default_rng(0)
    for spec in world.all_prompts():
        img, objs = world.render(spec, rng)
        assert len(objs) == sum(c.count for c in spec.include)
        # only palette colours and the background: no anti-aliasing
        colours = {tuple(p) for p in img.reshape(-1, 3)}
        assert colours <= set(world.COLORS.values()) | {world.BACKGROUND}
        if spec.tag == "position":
            rel = spec.include[1].position[0]
            assert rel in world.relations_between(objs[1].box, objs[0].box), spec.prompt


def test_six_task_kinds_and_a_fixed_disjoint_split():
    train, test = world.prompt_split()
    assert {p.tag for p in test} == set(world.TASKS) == {p.tag for p in train}
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert len(train) + len(test) == len(world.all_prompts())
    assert world.prompt_split() == (train, test)


def test_shipped_prompt_files_are_the_split():
    train, test = world.prompt_split()
    for path, specs in ((world.TRAIN_PROMPTS_PATH, train), (world.TEST_PROMPTS_PATH, test)):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["prompt"] for r in rows] == [s.prompt for s in specs]
        assert [r["tag"] for r in rows] == [s.tag for s in specs]
        assert all("include" in r for r in rows)


def test_balanced_train_file_weights_task_kinds_equally():
    import collections

    train, test = world.prompt_split()
    rows = [json.loads(line) for line in world.TRAIN_BALANCED_PROMPTS_PATH.read_text().splitlines()]
    assert {r["prompt"] for r in rows} == {s.prompt for s in train}
    counts = collections.Counter(r["tag"] for r in rows)
    assert max(counts.values()) - min(counts.values()) <= 5
    assert not {r["prompt"] for r in rows} & {s.prompt for s in test}


def test_relations_follow_geneval_rule():
    left, right = (0, 10, 8, 18), (20, 10, 28, 18)
    assert world.relations_between(left, right) == {"left of"}
    assert world.relations_between(right, left) == {"right of"}
    above, below = (10, 0, 18, 8), (10, 20, 18, 28)
    assert world.relations_between(above, below) == {"above"}
    # nearly the same place: no relation (GenEval's 0.1 x size margin)
    assert world.relations_between((10, 10, 18, 18), (11, 10, 19, 18)) == set()


def test_shipped_base_model_loads_and_matches_its_model_card():
    from diffusers import QwenImageTransformer2DModel

    from spotlight.config import load_config
    from spotlight.tasks.shapes.pretrain import ARCH, SHIP_DIR, sha256_file

    card = (SHIP_DIR / "MODEL_CARD.md").read_text()
    stated = re.search(r"`diffusion_pytorch_model.safetensors` \| `([0-9a-f]{64})`", card)
    assert stated, "the model card must state the weights' sha256"
    assert sha256_file(SHIP_DIR / "diffusion_pytorch_model.safetensors") == stated.group(1)
    model = QwenImageTransformer2DModel.from_pretrained(SHIP_DIR)
    for key, value in ARCH.items():
        got = model.config[key]
        assert (tuple(got) if isinstance(got, list) else got) == value, key
    # the embedded default points at it and its [model] fields describe it
    cfg = load_config()
    assert cfg.model.pretrained_dir.resolve() == SHIP_DIR.resolve()
    from spotlight.models.families import get_family

    get_family(cfg.model).check()
    assert sum(p.numel() for p in model.parameters()) < 5_000_000


def test_tiny_family_refuses_a_checkpoint_with_another_patch_size(tmp_path):
    import msgspec

    from spotlight.config import load_config
    from spotlight.models.families import ModelLoadError, get_family

    cfg = load_config()
    wrong = msgspec.structs.replace(cfg.model, patch_size=2)
    with pytest.raises(ModelLoadError, match="patch_size"):
        get_family(wrong).check()
