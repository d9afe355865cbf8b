"""Prompt files as benchmarks publish them (spotlight/tasks/prompts.py), written here in tmp_path."""

from __future__ import annotations

import hashlib
import json

import pytest

from spotlight.config import ConfigError, DataConfig
from spotlight.tasks.prompts import load_prompt_set, prompt_set_from_config, truncation_report

BOM = "\ufeff"


def _write(path, text: str, encoding="utf-8"):
    path.write_bytes(text.encode(encoding))
    return path


def test_csv_with_bom_header_and_quoted_fields(tmp_path):
    text = (
        BOM
        + 'Prompt,Category\r\n"a cat, sitting on a mat",animals\r\n'
        + '"the sign reads ""OPEN""",text\r\nplain dog,animals\r\n'
    )
    f = _write(tmp_path / "bench.csv", text)
    ps = load_prompt_set(f)
    assert ps.prompts == ["a cat, sitting on a mat", 'the sign reads "OPEN"', "plain dog"]
    assert ps.format == "csv" and ps.prompt_column == "Prompt"
    assert ps.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()


def test_csv_through_the_run_path_drops_header_bom_and_glued_columns(tmp_path):
    """What `spotlight up` loads (cli.up.load_prompts): no header, no BOM, no category text."""
    from spotlight.cli.up import load_prompts

    f = _write(tmp_path / "bench.csv", BOM + 'Prompt,Category\n"a cat, on a mat",animals\n')
    assert load_prompts(str(f)) == ["a cat, on a mat"]
    assert load_prompts(DataConfig(prompts_path=str(f))) == ["a cat, on a mat"]


def test_tsv_and_category_filter(tmp_path):
    f = _write(
        tmp_path / "bench.tsv",
        "id\ttext\tcategory\n1\ta red cube\tcolor\n2\ttwo dogs\tcounting\n3\t\tcolor\n4\ta blue ball\tcolor\n",
    )
    assert load_prompt_set(f).prompts == ["a red cube", "two dogs", "a blue ball"]
    assert load_prompt_set(f).num_skipped_empty == 1
    ps = prompt_set_from_config(DataConfig(prompts_path=str(f), category_column="category", categories=["color"]))
    assert ps.prompts == ["a red cube", "a blue ball"] and ps.num_filtered_out == 1 and ps.format == "tsv"


def test_jsonl_geneval_prompt_key_and_caption_fallback(tmp_path):
    rows = [{"tag": "single_object", "prompt": "a photo of a bench"}, {"tag": "counting", "prompt": "two cows"}]
    f = _write(tmp_path / "meta.jsonl", "".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert load_prompt_set(f).prompts == ["a photo of a bench", "two cows"]
    assert load_prompt_set(f, category_column="tag", categories=["counting"]).prompts == ["two cows"]
    g = _write(tmp_path / "caps.jsonl", '{"caption": "a lighthouse"}\n{"caption": "a harbour"}\n')
    ps = load_prompt_set(g)
    assert ps.prompts == ["a lighthouse", "a harbour"] and ps.prompt_column == "caption"


def test_jsonl_record_without_the_key_names_its_line(tmp_path):
    f = _write(tmp_path / "meta.jsonl", '{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=r"meta\.jsonl:2: no 'prompt' key"):
        load_prompt_set(f)


def test_text_one_per_line_skips_blank_lines(tmp_path):
    f = _write(tmp_path / "p.txt", "a red cube\n\n  two dogs  \n")
    ps = load_prompt_set(f)
    assert ps.prompts == ["a red cube", "two dogs"] and ps.format == "text"


def test_text_file_with_a_csv_header_is_refused(tmp_path):
    f = _write(tmp_path / "p.txt", "Prompt,Category\na cat,animals\n")
    with pytest.raises(ConfigError, match=r"p\.txt:1: .*CSV header.*rename it to \.csv"):
        load_prompt_set(f)


def test_two_prompt_columns_are_ambiguous(tmp_path):
    f = _write(tmp_path / "b.csv", "prompt,caption\na,b\n")
    with pytest.raises(
        ConfigError, match=r"b\.csv:1: more than one prompt column \('prompt', 'caption'\).*data\.prompt_column"
    ):
        load_prompt_set(f)
    assert load_prompt_set(f, prompt_column="caption").prompts == ["b"]


def test_missing_prompt_column_names_the_columns(tmp_path):
    f = _write(tmp_path / "b.csv", "id,description\n1,a cat\n")
    with pytest.raises(ConfigError, match=r"no prompt column .* columns: 'id', 'description'"):
        load_prompt_set(f)
    with pytest.raises(ConfigError, match=r"data\.prompt_column = 'desc' is not a column"):
        load_prompt_set(f, prompt_column="desc")
    assert load_prompt_set(f, prompt_column="Description").prompts == ["a cat"]


def test_unknown_category_column_or_value(tmp_path):
    f = _write(tmp_path / "b.csv", "prompt,cat\na,x\nb,y\n")
    with pytest.raises(ConfigError, match=r"data\.category_column = 'kind' is not a column"):
        load_prompt_set(f, category_column="kind", categories=["x"])
    with pytest.raises(ConfigError, match=r"\['z'\] occur nowhere in column 'cat'; its values: 'x', 'y'"):
        load_prompt_set(f, category_column="cat", categories=["x", "z"])
    with pytest.raises(ConfigError, match=r"data\.categories"):
        DataConfig(category_column="cat")


def test_ragged_row_and_empty_file(tmp_path):
    f = _write(tmp_path / "b.csv", "prompt,cat\na,x\nb, c,y\n")
    with pytest.raises(ConfigError, match=r"b\.csv:3: 3 fields but the header has 2"):
        load_prompt_set(f)
    with pytest.raises(ConfigError, match=r"empty CSV file"):
        load_prompt_set(_write(tmp_path / "e.csv", BOM))
    with pytest.raises(ConfigError, match=r"e\.txt: no prompts"):
        load_prompt_set(_write(tmp_path / "e.txt", "\n\n"))
    with pytest.raises(ConfigError, match=r"file not found"):
        load_prompt_set(tmp_path / "nope.csv")


def test_not_utf8_names_the_line(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes("one\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.txt:2: not UTF-8"):
        load_prompt_set(f)


def test_truncation_report_counts_once():
    n, msg = truncation_report([3, 20, 17, 16], 16)
    assert n == 2 and msg.startswith("2 of 4 prompts are longer than model.max_text_tokens = 16 tokens (longest 20)")
    assert truncation_report([1, 16], 16) == (0, "")


LONG = "a photo of " + " and ".join(["a small red cube next to a large blue sphere"] * 3)


def test_tiny_family_counts_the_prompts_minilm_cuts():
    from spotlight.config import ModelConfig
    from spotlight.models.families import get_family

    counts = get_family(ModelConfig(max_text_tokens=16)).prompt_token_counts(["a cat", LONG])
    assert counts[0] == 4  # [CLS] a cat [SEP]
    assert counts[1] > 16
    assert truncation_report(counts, 16)[0] == 1


def test_sd3_and_flux_count_t5_tokens(tmp_path):
    from spotlight.config import ModelConfig
    from spotlight.models import offline_tokenizers as ot
    from spotlight.models.families import get_family

    for family, sub in (("sd3", "tokenizer_3"), ("flux", "tokenizer_2")):
        ot.build_t5_tokenizer(tmp_path / family / sub)
        fam = get_family(
            ModelConfig(family=family, pretrained_path=str(tmp_path / family), image_size=32, max_text_tokens=8)
        )
        short, long = fam.prompt_token_counts(["a cat", LONG])
        assert short < 8 < long


def test_run_records_prompts_json_and_reports_the_cut_once(tmp_path, capsys):
    from spotlight.cli.up import _record_prompts

    f = _write(tmp_path / "bench.csv", "prompt\na cat\n" + LONG + "\n")
    ps = load_prompt_set(f)
    _record_prompts(tmp_path, ps, [4, 30], 16)
    rec = json.loads((tmp_path / "prompts.json").read_text())
    assert rec["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest() and rec["num_prompts"] == 2
    assert (
        rec["format"] == "csv"
        and rec["prompt_column"] == "prompt"
        and rec["num_cut"] == 1
        and rec["max_text_tokens"] == 16
    )
    out, err = capsys.readouterr()  # a warning: on stderr
    assert err.count("1 of 2 prompts are longer than model.max_text_tokens = 16") == 1 and not out, (out, err)
    assert ps.summary().startswith(f"2 prompts loaded from {f} (csv, column 'prompt', sha256 {rec['sha256'][:12]}")


def test_tsv_has_no_quoting_fields_begin_or_end_with_quotes(tmp_path):
    """IANA text/tab-separated-values has no quoting: a published prompt that begins with a
    quoted word (the CSV reader refused it: ' ' expected after '"') is kept as written."""
    text = (
        "id\tprompt\tocr_target\n"
        '1\t"G I G G L E" painted in bold letters\tG I G G L E\n'
        '2\ta sign that reads "OPEN"\tOPEN\n'
        '3\t"quoted whole"\t"x"\n'
        "4\tit's 5\" tall\tno\n"
    )
    ps = load_prompt_set(_write(tmp_path / "ocr.tsv", text))
    assert ps.prompts == [
        '"G I G G L E" painted in bold letters',
        'a sign that reads "OPEN"',
        '"quoted whole"',
        "it's 5\" tall",
    ]
    assert ps.metadata[0] == {"id": "1", "ocr_target": "G I G G L E"} and ps.metadata[2]["ocr_target"] == '"x"'
    assert ps.lines == [2, 3, 4, 5]


def test_tsv_ragged_row_says_tsv_cannot_hold_a_tab(tmp_path):
    f = _write(tmp_path / "p.tsv", "prompt\tk\na\tb\tc\n")
    with pytest.raises(ConfigError, match=r"p\.tsv:2: 3 fields but the header has 2; a TSV field cannot hold a tab"):
        load_prompt_set(f)


def test_csv_still_reads_quotes_and_keeps_other_columns_as_metadata(tmp_path):
    f = _write(tmp_path / "p.csv", 'prompt,tag\n"""G I G G L E"" painted",ocr\n"two, cats",counting\n')
    ps = load_prompt_set(f)
    assert ps.prompts == ['"G I G G L E" painted', "two, cats"]
    assert ps.metadata == [{"tag": "ocr"}, {"tag": "counting"}] and ps.lines == [2, 3]


def test_jsonl_keeps_geneval_fields_as_metadata(tmp_path):
    rows = [
        {"tag": "counting", "include": [{"class": "cow", "count": 2}], "prompt": "two cows"},
        {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a bench"},
    ]
    f = _write(tmp_path / "meta.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    ps = load_prompt_set(f)
    assert ps.metadata == [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    assert load_prompt_set(f, category_column="tag", categories=["single_object"]).metadata == [
        {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
    ]


def test_json_array_of_strings_or_objects(tmp_path):
    f = _write(tmp_path / "p.json", '[\n  "a red cube",\n  "two dogs"\n]\n')
    ps = load_prompt_set(f)
    assert ps.prompts == ["a red cube", "two dogs"] and ps.format == "json" and ps.lines == [2, 3]
    g = _write(tmp_path / "q.json", json.dumps([{"prompt": "a cat", "ocr_target": "CAT"}, {"prompt": "b"}]))
    ps = load_prompt_set(g)
    assert ps.prompts == ["a cat", "b"] and ps.metadata == [{"ocr_target": "CAT"}, {}]


def test_json_that_is_not_one_array_is_refused_with_a_jsonl_hint(tmp_path):
    jsonl_named_json = _write(tmp_path / "p.json", '{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(ConfigError, match=r"p\.json:2: not one JSON array .*name the file \.jsonl"):
        load_prompt_set(jsonl_named_json)
    one_object = _write(tmp_path / "o.json", '{"prompt": "a"}')
    with pytest.raises(ConfigError, match=r"o\.json:1: .*got a dict; .*\.jsonl"):
        load_prompt_set(one_object)
    bad_item = _write(tmp_path / "b.json", '[{"prompt": "a"},\n {"text": "b"}]')
    with pytest.raises(ConfigError, match=r"b\.json:2: item 1: no 'prompt' key"):
        load_prompt_set(bad_item)
