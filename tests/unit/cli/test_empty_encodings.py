"""Prompts and negative prompts that a checkpoint's tokenizer encodes to no tokens
(spotlight/cli/up.py ``check_encodings``, spotlight/tasks/prompts.py ``empty_encoding_report``):
one line naming the prompt file's line or ``model.negative_prompt``, never a traceback from
inside the Qwen-Image pipeline. The tokenizer is a real word-level one, as some checkpoints have."""

from __future__ import annotations

import json

import pytest

from spotlight.cli.up_preflight import Stop
from spotlight.config import load_config
from spotlight.models.families import get_family
from spotlight.models.families.qwen_image import QWEN_SPECIAL_TOKENS, _pipeline_template
from spotlight.tasks.prompts import empty_encoding_report, load_prompt_set


def _word_level_checkpoint(root):
    """A qwen-image checkpoint folder holding only a word-level tokenizer (whitespace words):
    the template's system prefix is far fewer than the 34 tokens the pipeline drops."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, _ = _pipeline_template()
    words = sorted(set(template.replace("{}", " ").split()) | {"a", "cat", "blurry"})
    vocab = {w: i for i, w in enumerate(["<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    fast.save_pretrained(root / "tokenizer")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    return root


class _Run:
    def __init__(self, cfg, prompt_set):
        self.cfg, self.prompt_set = cfg, prompt_set

    @property
    def prompts(self):
        return self.prompt_set.prompts


def test_blank_default_negative_prompt_is_one_line_naming_the_field(tmp_path):
    from spotlight.cli.up import check_encodings

    ckpt = _word_level_checkpoint(tmp_path / "ckpt")
    cfg = load_config(overrides={"model.family": "qwen-image", "model.pretrained_path": str(ckpt)})
    family = get_family(cfg.model)
    assert family.negative_prompt == " " and family.guidance_scale > 1
    assert family.prompt_token_counts([" "])[0] <= 0  # the word-level tokenizer: no tokens at all
    (tmp_path / "p.txt").write_text("a cat " * 40 + "\n")
    ps = load_prompt_set(tmp_path / "p.txt")
    with pytest.raises(Stop) as err:
        check_encodings(_Run(cfg, ps), family, family.prompt_token_counts(ps.prompts))
    msg = err.value.line
    assert "model.negative_prompt: the default ' ' encodes to no tokens" in msg and "\n" not in msg
    # a negative prompt with words passes
    cfg2 = load_config(
        overrides={
            "model.family": "qwen-image",
            "model.pretrained_path": str(ckpt),
            "model.negative_prompt": "blurry " * 40,
        }
    )
    fam2 = get_family(cfg2.model)
    check_encodings(_Run(cfg2, ps), fam2, fam2.prompt_token_counts(ps.prompts))


def test_a_prompt_that_encodes_to_no_tokens_names_its_line(tmp_path):
    from spotlight.cli.up import check_encodings

    ckpt = _word_level_checkpoint(tmp_path / "ckpt")
    f = tmp_path / "p.tsv"
    f.write_text("id\tprompt\n1\t" + "a cat " * 40 + "\n2\ta cat\n")
    ps = load_prompt_set(f)
    cfg = load_config(
        overrides={"model.family": "qwen-image", "model.pretrained_path": str(ckpt), "model.guidance_scale": 1.0}
    )
    family = get_family(cfg.model)
    counts = family.prompt_token_counts(ps.prompts)
    assert counts[0] > 0 >= counts[1]
    with pytest.raises(Stop) as err:
        check_encodings(_Run(cfg, ps), family, counts)
    msg = err.value.line
    assert f"{f}:3: prompt 'a cat' encodes to no tokens with the qwen-image checkpoint's tokenizer" in msg


def test_empty_encoding_report_is_empty_when_every_prompt_has_tokens(tmp_path):
    (tmp_path / "p.txt").write_text("a\nb\n")
    ps = load_prompt_set(tmp_path / "p.txt")
    assert empty_encoding_report(ps, [3, 1], "tiny") == ""
    assert "p.txt:2:" in empty_encoding_report(ps, [3, 0], "tiny")
