"""Training prompt sets are disjoint from their evaluation sets (spotlight/tasks/prompt_sets.py,
examples/prompts/), and every example config trains on a training set."""

from __future__ import annotations

import json
import pathlib
import tomllib

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


def test_pickscore_split_is_disjoint():
    train = set((PROMPTS / "pickscore" / "train.txt").read_text(encoding="utf-8").splitlines())
    test = set((PROMPTS / "pickscore" / "test.txt").read_text(encoding="utf-8").splitlines())
    assert len(train) > 10_000 and len(test) > 1000


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.toml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_example_config_trains_on_an_evaluation_set(path):
    cfg = tomllib.loads(path.read_text())
    prompts = (cfg.get("data") or {}).get("prompts_path", "")
    if not prompts or prompts.startswith("/"):
        return  # the embedded default or the user's own file
    for evaluation in ("evaluation_metadata", "test.txt", "test.jsonl", "test_metadata"):
        assert evaluation not in prompts, f"{path.name} trains on an evaluation set: {prompts}"


def test_regenerating_gives_the_shipped_files(tmp_path):
    for sub in ("geneval", "ocr"):
        (tmp_path / sub).mkdir()
    (tmp_path / "geneval" / "object_names.txt").write_text((PROMPTS / "geneval" / "object_names.txt").read_text())
    (tmp_path / "ocr" / "test.txt").write_text((PROMPTS / "ocr" / "test.txt").read_text(encoding="utf-8"))
    prompt_sets.main(["--out", str(tmp_path), "--geneval-eval", str(GENEVAL_EVAL)])
    for rel in ("geneval/train_metadata.jsonl", "ocr/train.txt"):
        assert (tmp_path / rel).read_bytes() == (PROMPTS / rel).read_bytes(), rel
    assert json.loads((tmp_path / "geneval" / "train_metadata.jsonl").read_text().splitlines()[0])["prompt"]
