"""Training prompt sets are disjoint from their evaluation sets (spotlight/tasks/prompt_sets.py,
examples/prompts/), and every example config trains on a training set."""

from __future__ import annotations

import json
import pathlib

import pytest

from spotlight.tasks import prompt_sets
from spotlight.tasks.prompt_sets import geneval_train_records, load_jsonl, ocr_target, ocr_train_prompts

ROOT = pathlib.Path(__file__).resolve().parents[3]
PROMPTS = ROOT / "examples" / "prompts"
GENEVAL_EVAL = ROOT / "examples" / "default" / "prompts" / "evaluation_metadata.jsonl"
CLASSES = [c for c in (PROMPTS / "geneval" / "object_names.txt").read_text().splitlines() if c]


def test_shipped_geneval_train_set_is_disjoint_from_the_553():
    eval_prompts = {r["prompt"].lower() for r in load_jsonl(GENEVAL_EVAL)}
    train = load_jsonl(PROMPTS / "geneval" / "train_metadata.jsonl")
    assert len(eval_prompts) == 553
    assert len(train) > 1000
    assert not eval_prompts & {r["prompt"].lower() for r in train}
    assert len({r["prompt"] for r in train}) == len(train)
    assert {r["tag"] for r in train} == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}


def test_geneval_records_follow_the_evaluation_schema():
    recs = geneval_train_records(CLASSES, [], seed=3, tag_counts={"counting": 20, "position": 20, "color_attr": 20})
    for r in recs:
        for obj in r["include"]:
            assert obj["class"] in CLASSES and obj["count"] >= 1
        if r["tag"] == "counting":
            (inc,), (exc,) = r["include"], r["exclude"]
            assert exc["count"] == inc["count"] + 1
        if r["tag"] == "position":
            assert r["include"][1]["position"][0] in prompt_sets.GENEVAL_POSITIONS
            assert r["prompt"].startswith(f"a photo of {prompt_sets.article(r['include'][1]['class'])}")
    assert geneval_train_records(CLASSES, [], seed=3, tag_counts={"counting": 20}) == geneval_train_records(
        CLASSES, [], seed=3, tag_counts={"counting": 20}
    )


def test_geneval_generator_leaves_out_what_it_is_told():
    first = geneval_train_records(CLASSES, [], seed=0, tag_counts={"colors": 50})
    again = geneval_train_records(CLASSES, [r["prompt"] for r in first], seed=0, tag_counts={"colors": 50})
    assert not {r["prompt"] for r in first} & {r["prompt"] for r in again}


def test_geneval_plurals_match_the_evaluation_spelling():
    assert prompt_sets.plural("bench") == "benchs"  # GenEval's own spelling
    assert prompt_sets.plural("bus") == "buses"
    assert prompt_sets.plural("wine glass") == "wine glasses"
    assert prompt_sets.article("apple") == "an apple"


def test_shipped_ocr_train_set_is_disjoint_from_flow_grpo_test():
    test = [p for p in (PROMPTS / "ocr" / "test.txt").read_text(encoding="utf-8").splitlines() if p.strip()]
    train = [p for p in (PROMPTS / "ocr" / "train.txt").read_text(encoding="utf-8").splitlines() if p.strip()]
    assert len(test) == 1018
    norm = lambda t: "".join(t.split()).lower()
    test_targets = {norm(ocr_target(p)) for p in test if ocr_target(p)}
    assert all(ocr_target(p) for p in train)
    assert not test_targets & {norm(ocr_target(p)) for p in train}
    assert not set(test) & set(train)


def test_ocr_generator_drops_targets_of_the_test_set():
    out = ocr_train_prompts(['a sign that reads "Fresh Bakery"'], n=10_000)
    assert out and all(ocr_target(p).replace(" ", "").lower() != "freshbakery" for p in out)


def norm(prompt: str) -> str:
    """A prompt as text: case, surrounding and repeated whitespace and a final full stop ignored."""
    return " ".join(prompt.casefold().split()).removesuffix(".").rstrip()


def texts(path: pathlib.Path) -> set[str]:
    from spotlight.tasks.prompts import load_prompt_set

    return {norm(p) for p in load_prompt_set(path).prompts}


EVALUATION_SETS = {  # every evaluation (test) set this repository ships
    "GenEval's 553": GENEVAL_EVAL,
    "Flow-GRPO OCR test": PROMPTS / "ocr" / "test.txt",
    "Flow-GRPO PickScore test": PROMPTS / "pickscore" / "test.txt",
    "shapes test": ROOT / "spotlight" / "tasks" / "shapes" / "prompts" / "test.jsonl",
}


def test_pickscore_split_is_disjoint():
    """Flow-GRPO's split repeats 7 test prompts in train up to case, whitespace and a final full stop; the shipped
    train.txt leaves them out (examples/prompts/SOURCES.md)."""
    train = (PROMPTS / "pickscore" / "train.txt").read_text(encoding="utf-8").splitlines()
    test = (PROMPTS / "pickscore" / "test.txt").read_text(encoding="utf-8").splitlines()
    assert len(train) == 25_425 and len(test) == 2048
    assert not {norm(p) for p in train} & {norm(p) for p in test}


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.toml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_example_config_trains_on_an_evaluation_set(path):
    """The prompts each example config actually trains on -- its file as `spotlight up` resolves
    it (merged onto the embedded default; "" = the default training set; category filter
    applied) -- share no prompt, by text, with its own held-out panel nor with any evaluation
    set shipped here."""
    from spotlight.config import load_config
    from spotlight.tasks.prompts import prompt_set_from_config
    from spotlight.workers.eval.eval_worker import eval_prompts

    cfg = load_config(path)
    if cfg.data.prompts_path.startswith("/"):
        return  # the user's own file
    train = {norm(p) for p in prompt_set_from_config(cfg.data, path).prompts}
    assert train, path
    evaluations = dict(EVALUATION_SETS)
    if cfg.eval.prompts_path or cfg.reward.kind == "geneval_shapes":  # its own held-out panel
        own = cfg.eval.prompts_path
        evaluations["its eval.prompts_path"] = ROOT / own if own else EVALUATION_SETS["shapes test"]
        panel, _ = eval_prompts(cfg)
        assert not train & {norm(p) for p in panel}, f"{path.name} trains on prompts of its own panel"
    for name, evaluation in evaluations.items():
        shared = train & texts(evaluation)
        assert not shared, f"{path.name} trains on {len(shared)} prompts of {name}, e.g. {sorted(shared)[:3]}"


def test_an_empty_prompts_path_is_a_training_set():
    from spotlight.config import DataConfig
    from spotlight.tasks.prompts import DEFAULT_PROMPTS_PATH, prompt_set_from_config

    ps = prompt_set_from_config(DataConfig(prompts_path=""))
    assert ps.path == DEFAULT_PROMPTS_PATH and ps.path.name == "train_metadata.jsonl"
    assert not {norm(p) for p in ps.prompts} & texts(GENEVAL_EVAL)


def test_regenerating_gives_the_shipped_files(tmp_path):
    for sub in ("geneval", "ocr"):
        (tmp_path / sub).mkdir()
    (tmp_path / "geneval" / "object_names.txt").write_text((PROMPTS / "geneval" / "object_names.txt").read_text())
    (tmp_path / "ocr" / "test.txt").write_text((PROMPTS / "ocr" / "test.txt").read_text(encoding="utf-8"))
    prompt_sets.main(["--out", str(tmp_path), "--geneval-eval", str(GENEVAL_EVAL)])
    for rel in ("geneval/train_metadata.jsonl", "ocr/train.txt"):
        assert (tmp_path / rel).read_bytes() == (PROMPTS / rel).read_bytes(), rel
    assert json.loads((tmp_path / "geneval" / "train_metadata.jsonl").read_text().splitlines()[0])["prompt"]
