"""``spotlight bench stale-ranking`` refuses bad input with one ``error:`` line (exit 2) before it
encodes a prompt or samples a seed: a weight version that is no readable safetensors file, an
``--out`` that cannot take the files, a bad ``--versions`` list, too few seeds for a rank
correlation, a reward service that does not answer. A reward service that stops answering
mid-run is one line too (exit 1), and a study whose rewards all tie says why it has no ρ.

The run directories are real: a config.toml and tiny transformers saved as
``tensor_store/weights/v<N>.safetensors``, loaded by the command's own loaders."""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import socket

import pytest
from typer.testing import CliRunner

from spotlight.cli import app
from tests import fakes

runner = CliRunner()


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> pathlib.Path:
    """A finished run: 8x8 tiny transformers v0 and v1 (the minilm text width), 3 prompts, the JPEG
    reward; copied by :func:`run` for each test that changes it."""
    from safetensors.torch import save_file

    from spotlight.config import (
        ClusterConfig,
        DataConfig,
        ModelConfig,
        RunConfig,
        SamplerConfig,
        SpotlightConfig,
        dump_config,
    )
    from spotlight.models.dit import build_transformer
    from spotlight.models.text_encoder import TEXT_DIM

    root = tmp_path_factory.mktemp("bench-run")
    (root / "prompts.txt").write_text("a red cube\na photo of a cat\ntwo blue balls\n")
    run = root / "run"
    (run / "tensor_store" / "weights").mkdir(parents=True)
    model = ModelConfig(image_size=8, max_text_tokens=8)
    cfg = SpotlightConfig(
        model=model,
        sampler=SamplerConfig(num_steps=3, sde_window_start=0, sde_window_size=1),
        cluster=ClusterConfig(worker_batch_size=4),
        data=DataConfig(
            prompts_path=str(root / "prompts.txt"), group_size=4, num_control_prompts=0, prompts_per_iteration=2
        ),
        run=RunConfig(iterations=2),
    )
    dump_config(cfg, run / "config.toml")
    for v in (0, 1):
        state = build_transformer(model, TEXT_DIM, seed=v + 1).state_dict()
        save_file({k: t.contiguous() for k, t in state.items()}, run / "tensor_store" / "weights" / f"v{v}.safetensors")
    return run


@pytest.fixture
def run(template, tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return pathlib.Path(shutil.copytree(template, tmp_path / "run"))


@pytest.fixture
def no_work(monkeypatch):
    """Encoding a prompt or sampling fails the test: a refusal must come before both."""
    from spotlight.models import families
    from spotlight.studies import stale_ranking

    def fail(*args, **kwargs):
        pytest.fail("bench stale-ranking encoded or sampled before it refused its input")

    monkeypatch.setattr(families, "cached_conditioning", fail)
    monkeypatch.setattr(stale_ranking, "run_stale_ranking", fail)


def _bench(run: pathlib.Path, *args: str):
    return runner.invoke(app, ["bench", "stale-ranking", "--run-dir", str(run), *args], env={"COLUMNS": "300"})


def _refused(res, *needles: str) -> str:
    """Exit 2, nothing on stdout, one ``error:`` line on stderr holding every needle."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.stdout == "", res.stdout
    text = res.stderr.strip()
    assert text.startswith("error: ") and "\n" not in text, text
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def _set_reward(run: pathlib.Path, url: str) -> None:
    """Point the run's ``[reward]`` at the HTTP service ``url``, one attempt per batch."""
    import tomllib

    import tomli_w

    doc = tomllib.loads((run / "config.toml").read_text())
    doc["reward"].update(kind="http", url=url, max_retries=1, timeout_s=5.0)
    (run / "config.toml").write_text(tomli_w.dumps(doc))


# -- (b) weight versions that are no readable safetensors file ------------------------------------


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda b: b"", "header too small"),
        (lambda b: b"garbage" * 20, "header too large"),
        (lambda b: b[:-100], "incomplete metadata"),
    ],
    ids=["empty", "garbage", "truncated"],
)
def test_a_corrupt_weight_version_is_one_line_naming_it_before_any_encoding(run, no_work, corrupt, reason):
    """Was: the prompts encoded, then `SafetensorError: Error while deserializing header: header
    too small` as a Rich traceback, naming no file."""
    v1 = run / "tensor_store" / "weights" / "v1.safetensors"
    v1.write_bytes(corrupt(v1.read_bytes()))
    text = _refused(_bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"), str(v1), reason)
    assert "not a readable safetensors file" in text


def test_a_weight_version_without_tensors_is_refused(run, no_work):
    from safetensors.torch import save_file

    v1 = run / "tensor_store" / "weights" / "v1.safetensors"
    save_file({}, str(v1))
    _refused(_bench(run, "--num-seeds", "3"), str(v1), "without tensors")


# -- (c) --out ----------------------------------------------------------------------------------


def test_out_that_is_a_file_is_refused_before_any_encoding(run, tmp_path, no_work):
    """Was: every version sampled, then `FileExistsError: [Errno 17] File exists: 'afile'`."""
    afile = tmp_path / "afile"
    afile.write_text("")
    _refused(_bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3", "--out", str(afile)),
             f"--out {afile}", "not a directory")  # fmt: skip
    _refused(_bench(run, "--out", str(afile / "sub")), f"--out {afile / 'sub'}", "cannot be created")
    assert afile.read_text() == ""


def test_out_whose_result_file_is_a_directory_is_refused(run, tmp_path, no_work):
    out = tmp_path / "out"
    (out / "stale_ranking.json").mkdir(parents=True)
    _refused(_bench(run, "--out", str(out)), str(out / "stale_ranking.json"), "is a directory")


def test_the_default_out_is_checked_too(run, no_work):
    (run / "bench").write_text("")
    _refused(_bench(run), f"the default --out {run / 'bench'}", "not a directory")


# -- (e) --versions and --num-seeds -------------------------------------------------------------


@pytest.mark.parametrize(
    "value, says",
    [
        ("a,b", "'a' is not an integer"),
        ("0,x", "'x' is not an integer"),
        ("0,,1", "an empty element"),
        ("0,-1", "'-1' is negative"),
        ("1", "at least two versions"),
        ("0,0", "'0' is listed twice"),
    ],
)
def test_a_bad_versions_list_names_the_option_and_the_form(run, no_work, value, says):
    """Was: `error: invalid literal for int() with base 10: 'a'` (no option, no form)."""
    _refused(_bench(run, "--versions", value), f"--versions {value!r}", says, "e.g. 3,4,5")


def test_versions_out_of_order_are_refused_not_compared_backwards(run, no_work):
    """Was: v1→v0 computed, the newer weights taken as the stale ones (the help says v_n → v_{n+1})."""
    _refused(_bench(run, "--versions", "1,0"), "--versions '1,0'", "oldest first", "e.g. 0,1")


def test_versions_may_name_v_and_skip_versions(run):
    from spotlight.cli.bench import choose_pairs

    assert choose_pairs([0, 1, 2], 3, "v0,v2") == ([0, 2], [(0, 1)])
    assert choose_pairs([0, 1, 2], 3, " 0, 1 ,2") == ([0, 1, 2], [(0, 1), (1, 2)])


def test_two_seeds_are_refused_with_the_minimum(run, no_work):
    """Was: accepted; the Spearman ρ of two seeds is ±1 or undefined whatever the weights are."""
    res = _bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "2")
    assert res.exit_code == 2, res.output
    assert "--num-seeds" in res.output and "3" in res.output, res.output
    assert "Traceback" not in res.output


# -- (d) the reward service ---------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def reward_service():
    """``start(answers)``: :func:`tests.fakes.reward_service` for the rest of the test; its URL."""
    with contextlib.ExitStack() as stack:
        yield lambda answers=None: stack.enter_context(fakes.reward_service(answers))[0]


def test_an_unreachable_reward_service_is_one_line_before_any_encoding(run, no_work):
    """Was: the prompts encoded and v0 sampled, then `RewardError: reward service … failed after
    3 attempts` as a Rich traceback."""
    url = f"http://127.0.0.1:{_closed_port()}/score"
    _set_reward(run, url)
    _refused(_bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"),
             f"error: reward service check failed: reward service {url} failed")  # fmt: skip
    assert not (run / "bench").exists()


def test_a_reward_service_that_fails_mid_run_is_one_line(run, reward_service):
    """It answers the check, then fails while the versions are scored: one line, exit 1, no files."""
    _set_reward(run, reward_service(answers=1))
    res = _bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3")
    assert res.exit_code == 1, (res.output, res.exception)
    text = res.stderr.strip()
    assert text.startswith("error: scoring the samples failed: reward service") and "\n" not in text, text
    assert "HTTP 500" in text and "Traceback" not in res.output
    assert not (run / "bench" / "stale_ranking.json").exists()


@pytest.mark.procs  # the heat map's matplotlib may run fc-list for its font cache
def test_rewards_that_all_tie_say_why_there_is_no_rank_correlation(run, reward_service):
    """Was: `overall Spearman ρ = nan ± nan (0 prompt groups)`, no word on why."""
    _set_reward(run, reward_service())  # 0.5 for every image: every group ties
    res = _bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3")
    assert res.exit_code == 0, (res.output, res.exception)
    out = " ".join(res.stdout.split())
    assert "overall Spearman ρ = undefined: the rewards tied within each of the 1 prompt groups" in out, out
    assert "left out" in out and "more --num-seeds" in out, out
    assert "overall Spearman ρ = nan" not in out
    data = json.loads((run / "bench" / "stale_ranking.json").read_text())
    assert data["overall"]["num_valid"] == 0


# -- (f) weight versions that are readable but not this run's transformer's -----------------------


def _save(path: pathlib.Path, state: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: t.contiguous() for k, t in state.items()}, str(path))


@pytest.mark.parametrize(
    "model_change, says",
    [
        ({"num_attention_heads": 4}, "tensors of another shape"),
        ({"num_layers": 3}, "tensors the model does not have"),
        ({"num_layers": 1}, "lacks"),
    ],
    ids=["wider", "deeper", "shallower"],
)
def test_a_weight_version_of_another_model_size_is_one_line_naming_it(run, no_work, model_change, says):
    """Was: the prompts encoded, then torch's `RuntimeError: Error(s) in loading state_dict …
    size mismatch for img_in.weight …` as a Rich traceback (or `WeightVersionError: weight
    version has 8 unknown keys`), naming no file."""
    from spotlight.config import ModelConfig
    from spotlight.models.dit import build_transformer
    from spotlight.models.text_encoder import TEXT_DIM

    other = ModelConfig(image_size=8, max_text_tokens=8, **model_change)
    v1 = run / "tensor_store" / "weights" / "v1.safetensors"
    _save(v1, build_transformer(other, TEXT_DIM, seed=2).state_dict())
    text = _refused(_bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"), str(v1), says)
    assert "not a weight version of this run's QwenImageTransformer2DModel transformer" in text, text


def test_a_weight_version_whose_names_match_nothing_is_refused(run, no_work):
    """Was: `WeightVersionError: weight version has 1 unknown keys` as a traceback after the
    prompts were encoded; no file named."""
    import torch

    v1 = run / "tensor_store" / "weights" / "v1.safetensors"
    _save(v1, {"unet.conv_in.weight": torch.zeros(4, 4)})
    _refused(_bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"), str(v1),
             "holds no weights of this run's", "'unet.conv_in.weight'")  # fmt: skip


@pytest.fixture(scope="module")
def lora_template(template, tmp_path_factory) -> pathlib.Path:
    """:func:`template` as a LoRA run (``train.lora_rank = 4``): v0 and v1 are its rank-4 adapters."""
    import msgspec

    from spotlight.config import dump_config, load_config
    from spotlight.studies.profiling import initial_version

    run = pathlib.Path(shutil.copytree(template, tmp_path_factory.mktemp("bench-lora") / "run"))
    cfg = load_config(run / "config.toml")
    cfg = msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, lora_rank=4))
    dump_config(cfg, run / "config.toml")
    for v in (0, 1):
        _save(run / "tensor_store" / "weights" / f"v{v}.safetensors", initial_version(cfg))
    return run


@pytest.fixture
def lora_run(lora_template, tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return pathlib.Path(shutil.copytree(lora_template, tmp_path / "run"))


def _lora_cfg(run: pathlib.Path, rank: int):
    import msgspec

    from spotlight.config import load_config

    cfg = load_config(run / "config.toml")
    return msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, lora_rank=rank))


def test_a_lora_version_of_another_rank_is_one_line_naming_it(lora_run, no_work):
    """Was: torch's `size mismatch for …lora_A.default.weight: copying a param with shape
    torch.Size([8, 64]) …` as a traceback after the prompts were encoded."""
    from spotlight.studies.profiling import initial_version

    v1 = lora_run / "tensor_store" / "weights" / "v1.safetensors"
    _save(v1, initial_version(_lora_cfg(lora_run, 8)))
    _refused(_bench(lora_run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"), str(v1),
             "LoRA adapter (rank 4)", "tensors of another shape", "train.lora_rank = 4")  # fmt: skip


def test_full_weights_in_a_lora_run_are_refused(lora_run, template, no_work):
    v1 = lora_run / "tensor_store" / "weights" / "v1.safetensors"
    shutil.copy(template / "tensor_store" / "weights" / "v1.safetensors", v1)
    _refused(_bench(lora_run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"), str(v1),
             "holds no weights of this run's LoRA adapter (rank 4)")  # fmt: skip


def test_a_diffusers_format_lora_file_is_refused(lora_run, no_work):
    """A ``final/pytorch_lora_weights.safetensors`` copied in as a version: its names
    (``transformer.….lora_A.weight``) are none of the model's."""
    from spotlight.studies.profiling import initial_version

    adapter = initial_version(_lora_cfg(lora_run, 4))
    v1 = lora_run / "tensor_store" / "weights" / "v1.safetensors"
    _save(v1, {"transformer." + k.replace(".default", ""): t for k, t in adapter.items()})
    _refused(_bench(lora_run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"), str(v1),
             "holds no weights")  # fmt: skip


def test_a_lora_run_with_its_own_adapters_is_accepted_by_the_checks(lora_run, monkeypatch):
    """The checks pass the adapters a LoRA run publishes: the study itself is reached."""
    from spotlight.studies import stale_ranking

    reached = []

    def stop(*args, **kwargs):
        reached.append(True)
        raise SystemExit(0)

    monkeypatch.setattr(stale_ranking, "run_stale_ranking", stop)
    res = _bench(lora_run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3")
    assert reached, (res.exit_code, res.output, res.exception)


def test_a_version_replaced_between_its_check_and_its_load_is_one_line(run, monkeypatch):
    """The file checked fine, then changed before it was loaded: one line naming it, exit 2."""
    import torch

    from spotlight.studies import stale_ranking
    from spotlight.util import weights_file

    wrong = {"unet.conv_in.weight": torch.zeros(2)}
    monkeypatch.setattr(weights_file, "load_safetensors", lambda path, **kw: wrong)

    monkeypatch.setattr(stale_ranking, "run_stale_ranking", lambda *a, **k: pytest.fail("sampled"))
    _refused(_bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"),
             str(run / "tensor_store" / "weights" / "v0.safetensors"), "holds no weights")  # fmt: skip


# -- (g) an empty config.toml ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, says",
    [(b"", "0 bytes"), (b"\n  \n", "only whitespace or comments"), (b"# nothing here\n\n# [model]\n", "comments")],
    ids=["zero-bytes", "whitespace", "comments"],
)
def test_an_empty_run_config_is_refused_not_replaced_by_the_default(run, no_work, content, says):
    """Was: the embedded default config (a 32x32 model, the shapes prompts) studied in its place,
    without a word: the run's own versions then failed to load, or another study ran."""
    cfg = run / "config.toml"
    cfg.write_bytes(content)
    text = _refused(_bench(run, "--versions", "0,1", "--num-prompts", "1", "--num-seeds", "3"), f"{cfg} is empty", says)
    assert "written in full" in text, text


def test_a_run_config_that_sets_something_is_not_called_empty():
    from spotlight.config import holds_no_setting

    assert holds_no_setting(b"") and holds_no_setting(b"  \n# c\n") and holds_no_setting(b"\xef\xbb\xbf\n")
    assert not holds_no_setting(b"[run]\niterations = 2\n")
    assert not holds_no_setting(b"[run]\n")  # a table: not empty (load_config judges it)
    assert not holds_no_setting(b"not toml =")  # load_config's to refuse, with its own words
    assert not holds_no_setting(b"\xff\xfe")
