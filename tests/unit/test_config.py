"""Typed TOML config: defaults, round trip, validation errors that name the field."""

from __future__ import annotations

import math
import pathlib

import pytest

from spotlight.config import (
    DEFAULT_CONFIG_PATH,
    EXAMPLES_DIR,
    ConfigError,
    SamplerConfig,
    SpotlightConfig,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
)


def test_default_config_loads():
    cfg = load_config()
    assert isinstance(cfg, SpotlightConfig)
    assert DEFAULT_CONFIG_PATH.is_file()
    # a few values straight from examples/default/config.toml: the shapes task
    assert cfg.model.source == "pretrained" and cfg.model.image_size == 32 and cfg.model.max_text_tokens == 16
    assert cfg.reward.kind == "geneval_shapes" and cfg.reward.partial_credit
    # its relative paths resolve against the repository root from any working directory
    assert (cfg.model.pretrained_dir / "config.json").is_file()
    assert cfg.model.axes_dims_rope == (8, 12, 12)
    assert cfg.sampler.num_steps == 10 and cfg.sampler.sde_window_size == 4
    assert cfg.model.guidance_scale == 5.0 and cfg.train.lora_rank == 32
    assert cfg.data.group_size == 8 and cfg.explore.num_candidates == 24
    assert cfg.num_explored_prompts == cfg.data.prompts_per_iteration - cfg.data.num_control_prompts


def test_relative_paths_resolve_from_any_directory(tmp_path, monkeypatch):
    from spotlight.config import REPO_ROOT, resolve_path

    monkeypatch.chdir(tmp_path)
    assert (
        resolve_path("spotlight/tasks/shapes/prompts/train.jsonl")
        == REPO_ROOT / "spotlight/tasks/shapes/prompts/train.jsonl"
    )
    (tmp_path / "spotlight").mkdir()
    (tmp_path / "spotlight" / "mine.jsonl").write_text("{}")
    # a path that exists from the working directory wins
    assert resolve_path("spotlight/mine.jsonl") == pathlib.Path("spotlight/mine.jsonl")
    # a missing one stays as written, so the error names what the user typed
    assert resolve_path("nowhere/x.jsonl") == pathlib.Path("nowhere/x.jsonl")


def test_a_runs_config_keeps_a_relative_path_meaning_the_same_from_any_directory(tmp_path, monkeypatch):
    """Was: a run started with ``pretrained_path = "qi tiny"`` wrote that into its config.toml,
    so ``spotlight bench --run-dir`` (or ``--resume``) from another directory could not find it."""
    from spotlight.config import anchored_path

    work = tmp_path / "w"
    (work / "qi tiny").mkdir(parents=True)
    (work / "p.jsonl").write_text('{"prompt": "a red circle"}\n')
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(overrides={"model.pretrained_path": "qi tiny", "data.prompts_path": "p.jsonl"})
    dump_config(cfg, tmp_path / "run.toml")
    monkeypatch.chdir(tmp_path)
    back = load_config(tmp_path / "run.toml")
    assert back.model.pretrained_path == str(work / "qi tiny") and back.model.pretrained_dir.is_dir()
    assert back.data.prompts_path == str(work / "p.jsonl")
    # the shipped data stays relative (found under the repository on every node), as do paths
    # that do not exist here (another machine's) and absolute ones; ~ is expanded
    assert back.eval.prompts_path == cfg.eval.prompts_path
    assert anchored_path("spotlight/tasks") == "spotlight/tasks"
    assert anchored_path("/models/qwen") == "/models/qwen" and anchored_path("nowhere/x") == "nowhere/x"
    assert anchored_path("~/m") == str(tmp_path / "m") and anchored_path("") == ""


def test_jpeg_toy_example_loads():
    cfg = load_config(EXAMPLES_DIR / "jpeg-toy" / "config.toml")
    assert cfg.model.source == "tiny" and cfg.reward.kind == "jpeg_compressibility"


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(
        overrides={"run.iterations": 7, "train.learning_rate": 3e-4, "cluster.reserved_rollout_gpus": [0, 2]}
    )
    path = tmp_path / "resolved.toml"
    dump_config(cfg, path)
    back = load_config(path)
    assert back == cfg
    assert config_to_dict(back) == config_to_dict(cfg)
    # the built-in defaults round-trip too (every field written out)
    dump_config(SpotlightConfig(), path)
    assert load_config(path) == SpotlightConfig()


def test_overrides_apply():
    cfg = load_config(overrides={"run.iterations": 3})
    assert cfg.run.iterations == 3
    assert load_config().run.iterations != 3
    # a section the file does not contain is created
    cfg = load_config(overrides={"cost.spot_usd_per_gpu_hour": 1.5})
    assert cfg.cost.spot_usd_per_gpu_hour == 1.5


def _raises_naming(field: str, **overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert field in str(info.value), str(info.value)
    return info.value


def test_unknown_key_names_the_field():
    _raises_naming("learnin_rate", **{"train.learnin_rate": 1e-3})
    _raises_naming("bogus_section", **{"bogus_section.x": 1})


def test_wrong_type_names_the_field():
    err = _raises_naming("run.iterations", **{"run.iterations": "three"})
    assert "run.iterations: Expected `int`, got `str`" in str(err)
    _raises_naming("sampler.noise_level", **{"sampler.noise_level": "high"})
    _raises_naming("explore.enabled", **{"explore.enabled": 3})
    _raises_naming("cluster.warm_spare", **{"cluster.warm_spare": "yes"})


@pytest.mark.parametrize(
    "overrides,field",
    [
        (
            {"sampler.sde_window_start": 2, "sampler.sde_window_size": 8},
            "sampler.sde_window_size",
        ),  # reaches step 9 (last)
        ({"sampler.sde_window_size": 10}, "sampler.sde_window_size"),  # window covers the last step
        ({"sampler.sde_window_size": 0}, "sampler.sde_window_size"),
        ({"sampler.noise_level": 0.0}, "sampler.noise_level"),
        ({"sampler.num_steps": 1}, "sampler.num_steps"),
        ({"data.group_size": 7}, "data.group_size"),
        ({"data.group_size": 1}, "data.group_size"),
        ({"data.num_control_prompts": 13}, "data.num_control_prompts"),
        ({"explore.planner": "fixed", "explore.num_candidates": 4}, "explore.num_candidates"),
        ({"explore.num_steps": 11}, "explore.num_steps"),
        ({"train.learning_rate": 0.0}, "train.learning_rate"),
        ({"train.clip_range": -1.0}, "train.clip_range"),
        ({"reward.kind": "http"}, "reward.url"),
        ({"reward.jpeg_quality": 101}, "reward.jpeg_quality"),
        ({"model.axes_dims_rope": [8, 12, 10]}, "model.axes_dims_rope"),
        ({"model.image_size": 33}, "model.image_size"),
        ({"model.source": "pretrained", "model.pretrained_path": ""}, "model.pretrained_path"),
        ({"cluster.heartbeat_timeout_s": 0.5}, "cluster.heartbeat_timeout_s"),
        ({"cluster.weight_chunk_bytes": 1000}, "cluster.weight_chunk_bytes"),
        ({"cluster.weight_window_chunks": 0}, "cluster.weight_window_chunks"),
        ({"cluster.weight_memory_max_bytes": -1}, "cluster.weight_memory_max_bytes"),
        ({"run.iterations": 0}, "run.iterations"),
        ({"planner.feedback_std_floor": -0.1}, "planner.feedback_std_floor"),
        ({"planner.max_feedback": 0.5}, "planner.max_feedback"),
        ({"planner.min_sequences": 8}, "planner.min_sequences"),  # = data.group_size: selects nothing
        ({"planner.max_sequences": 8}, "planner.max_sequences"),
        ({"planner.sequence_step": 0}, "planner.sequence_step"),
        ({"planner.window": 0}, "planner.window"),
        # negative counts, periods and sizes (was: run.sample_grid_every = -1 accepted)
        ({"run.sample_grid_every": -1}, "run.sample_grid_every"),
        ({"data.num_control_prompts": -1}, "data.num_control_prompts"),
        ({"model.patch_size": 0}, "model.patch_size"),
        ({"model.image_size": -32}, "model.image_size"),
        ({"model.num_attention_heads": 0}, "model.num_attention_heads"),
        ({"model.attention_head_dim": -1}, "model.attention_head_dim"),
        ({"train.weight_decay": -0.1}, "train.weight_decay"),
        ({"train.adv_clip_max": 0.0}, "train.adv_clip_max"),
        ({"train.max_grad_norm": -1.0}, "train.max_grad_norm"),
        ({"cluster.lease_timeout_s": 0.0}, "cluster.lease_timeout_s"),
        ({"cluster.heartbeat_interval_s": -1.0}, "cluster.heartbeat_interval_s"),
        ({"cluster.torch_threads": 0}, "cluster.torch_threads"),
        ({"cost.spot_usd_per_gpu_hour": -1.0}, "cost.spot_usd_per_gpu_hour"),
        ({"cost.reserved_usd_per_gpu_hour": float("nan")}, "cost.reserved_usd_per_gpu_hour"),
        # a GPU index no message can carry: the reserved agent's REGISTER would not decode
        ({"cluster.reserved_rollout_gpus": [0, 4096]}, "cluster.reserved_rollout_gpus"),
        # sizes whose plan would not fit in memory or overflow (was: `spotlight plan` ran out of
        # memory on 10**20 trainers, and an OverflowError traceback on 1e308 GiB)
        ({"train.num_train_workers": 10**20}, "train.num_train_workers"),
        # HSDP runs the same number of ranks on every node
        ({"train.num_train_nodes": 0}, "train.num_train_nodes"),
        ({"train.num_train_workers": 4, "train.num_train_nodes": 3}, "train.num_train_nodes"),
        ({"cluster.gpu_memory_gib": 1e308}, "cluster.gpu_memory_gib"),
        # values the run would only fail on at run time, in a child process's traceback (was:
        # the train worker's AdamW "Invalid beta parameter", the eval worker's torch.device)
        ({"train.adam_betas": [1.5, 2.0]}, "train.adam_betas"),
        ({"train.adam_betas": [-0.5, 0.9]}, "train.adam_betas"),
        ({"train.adam_betas": [0.9, 1.0]}, "train.adam_betas"),
        ({"eval.device": "tpu"}, "eval.device"),
        ({"eval.device": "cuda:x"}, "eval.device"),
        ({"eval.device": ""}, "eval.device"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    _raises_naming(field, **overrides)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_eval_devices_that_parse_are_accepted(device):
    assert load_config(overrides={"eval.device": device}).eval.device == device


def test_an_eval_device_this_host_lacks_is_named_before_the_run():
    from spotlight.config import eval_device_problem

    assert eval_device_problem("auto", 0) is None and eval_device_problem("cpu", 0) is None
    assert eval_device_problem("cuda", 1) is None and eval_device_problem("cuda:1", 2) is None
    assert "has no CUDA device" in eval_device_problem("cuda", 0)
    assert "has 2 CUDA devices (cuda:0 to cuda:1" in eval_device_problem("cuda:2", 2)


def test_planner_d_grid_starts_above_group_size():
    cfg = load_config()
    assert cfg.data.group_size == 8 and cfg.planner.min_sequences == 0
    assert cfg.planner_min_sequences == 16  # K + sequence_step
    assert load_config(overrides={"planner.min_sequences": 10}).planner_min_sequences == 10
    assert load_config(overrides={"planner.max_sequences": 12}).planner_min_sequences == 12
    # the planner section is not checked against K when the bandit does not run
    assert load_config(overrides={"explore.planner": "fixed", "planner.min_sequences": 8}).planner.min_sequences == 8


def test_window_ending_just_before_last_step_is_valid():
    cfg = load_config(overrides={"sampler.sde_window_start": 1, "sampler.sde_window_size": 8})
    assert cfg.sampler.sde_window_start + cfg.sampler.sde_window_size == cfg.sampler.num_steps - 1


def test_few_candidates_allowed_when_exploration_is_off():
    cfg = load_config(overrides={"explore.enabled": False, "explore.num_candidates": 4})
    assert cfg.explore.num_candidates == 4


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_invalid_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[run\niterations = = 3\n")
    with pytest.raises(ConfigError, match="TOML"):
        load_config(path)


def test_error_message_names_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[run]\niterations = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "run.iterations" in str(info.value)


def test_partial_file_fills_in_the_embedded_default(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[sampler]\nnum_steps = 6\nsde_window_size = 2\n[data]\nprompts_path = 'mine.jsonl'\n")
    cfg = load_config(path)
    default = load_config()
    assert (cfg.sampler.num_steps, cfg.sampler.sde_window_size) == (6, 2)
    assert cfg.sampler.noise_level == default.sampler.noise_level
    # a user who changes only the prompts still runs the shapes task's model and reward
    assert cfg.data.prompts_path == "mine.jsonl" and cfg.data.group_size == default.data.group_size
    assert cfg.model == default.model and cfg.reward == default.reward and cfg.train == default.train


def test_config_from_dict_errors_are_config_errors():
    with pytest.raises(ConfigError):
        config_from_dict({"sampler": {"num_steps": "x"}})
    with pytest.raises(ConfigError):
        config_from_dict({"data": {"group_size": 3}})
    with pytest.raises(ConfigError):
        SamplerConfig(num_steps=4, sde_window_size=4)


@pytest.mark.parametrize("name", ["qwen-image", "sd3", "flux"])
def test_family_example_configs_load(name):
    from spotlight.config import EXAMPLES_DIR, load_config

    cfg = load_config(EXAMPLES_DIR / "families" / f"{name}.toml")
    assert cfg.model.family == name and cfg.model.pretrained_path
    assert cfg.train.use_lora and cfg.run.keep_weight_versions >= 2


TABLE_2 = {  # paper Table 2: learning rate, weight decay, #Seqs, denoising steps, SDE window
    "deepseek-ocr-512": (3e-4, 1e-5, 16, 20, (0, 15), 512),
    "geneval-512": (1.5e-5, 1e-5, 16, 10, (0, 5), 512),
    "deepseek-ocr-1280": (3e-5, 5e-5, 16, 20, (0, 15), 1280),
    "geneval-1280": (5e-6, 0.0, 16, 10, (0, 5), 1280),
}


@pytest.mark.parametrize("name", sorted(TABLE_2))
def test_paper_table_2_configs(name):
    from spotlight.config import EXAMPLES_DIR, load_config

    cfg = load_config(EXAMPLES_DIR / "paper" / f"{name}.toml")
    lr, wd, k, steps, window, res = TABLE_2[name]
    assert (cfg.train.learning_rate, cfg.train.weight_decay, cfg.data.group_size) == (lr, wd, k)
    assert (cfg.sampler.num_steps, cfg.sampler.sde_window_range, cfg.model.image_size) == (steps, window, res)
    assert cfg.model.family == "qwen-image" and cfg.data.prompts_per_iteration == 32 and cfg.planner.beta == 0.5


def test_family_needs_a_checkpoint_path():
    from spotlight.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="pretrained_path"):
        config_from_dict({"model": {"family": "sd3"}})
    with pytest.raises(ConfigError, match="sp_degree"):  # no context-parallel plan
        config_from_dict(
            {"model": {"family": "sd3", "pretrained_path": "/x", "image_size": 32}, "cluster": {"sp_degree": 2}}
        )


def test_sp_degrees_that_cannot_split_the_model_are_refused_when_the_config_loads():
    """Accepted before and failing at run time: tiny with 4 heads at SP 3 (every group form raised);
    FLUX whose text has no mask, at a degree that does not divide its tokens."""
    from spotlight.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"cluster.sp_degree: SP degree 3 does not divide .* 4 attention heads"):
        config_from_dict(
            {"model": {"num_attention_heads": 4, "axes_dims_rope": [8, 12, 12]}, "cluster": {"sp_degree": 3}}
        )
    with pytest.raises(ConfigError, match="cluster.reserved_sp_degree: .* image tokens"):
        config_from_dict({"model": {"image_size": 34}, "cluster": {"reserved_sp_degree": 2}})  # 17² tokens
    with pytest.raises(ConfigError, match="max_text_tokens = 15"):
        flux = {"family": "flux", "pretrained_path": "/x", "image_size": 32, "max_text_tokens": 15}
        config_from_dict({"model": flux, "cluster": {"sp_degree": 2}})
    ok = config_from_dict({"model": {"num_attention_heads": 4}, "cluster": {"sp_degree": 4}})
    assert ok.cluster.sp_degree == 4  # 3 does not work either, but groups are never formed at 3
    qwen = {"family": "qwen-image", "pretrained_path": "/x", "image_size": 32, "max_text_tokens": 15}
    assert config_from_dict({"model": qwen, "cluster": {"sp_degree": 2}}).cluster.sp_degree == 2  # text is padded


def test_more_text_tokens_than_the_family_encoder_takes_are_refused():
    """Was: `model.max_text_tokens = 1000` passed `spotlight plan` and `up`'s checks, then the run
    failed while encoding the prompts (MiniLM has 512 positions) with a traceback."""
    err = _raises_naming("model.max_text_tokens", **{"model.max_text_tokens": 513})
    assert "must be <= 512 for family = 'tiny'" in str(err)
    assert load_config(overrides={"model.max_text_tokens": 512}).model.max_text_tokens == 512
    qwen = {"family": "qwen-image", "pretrained_path": "/x", "image_size": 32}
    assert config_from_dict({"model": {**qwen, "max_text_tokens": 1024}}).model.max_text_tokens == 1024
    with pytest.raises(ConfigError, match="model.max_text_tokens: must be <= 1024 for family = 'qwen-image'"):
        config_from_dict({"model": {**qwen, "max_text_tokens": 1025}})
    with pytest.raises(ConfigError, match="model.max_text_tokens: must be <= 512 for family = 'flux'"):
        config_from_dict({"model": {**qwen, "family": "flux", "max_text_tokens": 513}})


@pytest.mark.parametrize(
    "url", ["not a url", "127.0.0.1:18085", "ftp://host/", "http://", "http://host:port/", "http://ho st/s"]
)
def test_a_reward_url_that_is_no_http_url_is_refused(url):
    """Was: `reward.url = "not a url"` was accepted and refused only after three connection
    attempts at start-up."""
    http = {"reward.kind": "http", "eval.every": 0}
    err = _raises_naming("reward.url", **http, **{"reward.url": url})
    assert "is not an http(s) URL" in str(err)
    ok = load_config(overrides={**http, "reward.url": "https://scorer.internal:8443/score"})
    assert ok.reward.url.startswith("https://")


def test_bad_enum_value_in_a_file_lists_the_choices(tmp_path):
    (tmp_path / "c.toml").write_text('[model]\nfamily = "sd4"\n')
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.toml")
    msg = str(info.value)
    assert "c.toml: model.family: invalid value 'sd4'; choose from 'tiny', 'qwen-image', 'sd3', 'flux'" in msg, msg
    (tmp_path / "c.toml").write_text('[run]\nmode = "fastest"\n')
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.toml")
    assert "run.mode: invalid value 'fastest'; choose from 'spotlight', 'rlboost'" in str(info.value), str(info.value)


def test_every_literal_field_reports_its_choices():
    from typing import Literal, get_args, get_origin, get_type_hints

    from spotlight.config import SpotlightConfig

    seen = 0
    for section, sec_type in get_type_hints(SpotlightConfig).items():
        for name, tp in get_type_hints(sec_type).items():
            if get_origin(tp) is not Literal:
                continue
            seen += 1
            with pytest.raises(ConfigError) as info:
                load_config(overrides={f"{section}.{name}": "no-such-value"})
            assert f"{section}.{name}: invalid value 'no-such-value'; choose from {repr(get_args(tp)[0])}" in str(
                info.value
            ), str(info.value)
    assert seen >= 10


def test_an_overridden_value_is_blamed_on_the_flag_not_the_file():
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"run.trackers": ["foo"]})
    msg = str(info.value)
    assert msg.startswith("--tracker: run.trackers: unknown tracker(s) ['foo']"), msg
    assert "config.toml" not in msg
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"cost.spot_usd_per_gpu_hour": "cheap"})
    assert str(info.value).startswith("override cost.spot_usd_per_gpu_hour: "), str(info.value)
    assert "cost.spot_usd_per_gpu_hour: cost.spot_usd_per_gpu_hour" not in str(info.value)  # said once
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"cluster.gpu_memory_gib": 0.0})  # `spotlight plan --gpu-memory-gib 0`
    assert str(info.value).startswith("--gpu-memory-gib: "), str(info.value)


def test_a_file_value_is_still_blamed_on_the_file(tmp_path):
    (tmp_path / "c.toml").write_text('[run]\ntrackers = ["foo"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.toml", {"run.iterations": 2})
    assert str(info.value).startswith(f"{tmp_path / 'c.toml'}: run.trackers: "), str(info.value)


def test_a_wrong_file_value_is_reported_even_when_a_flag_overrides_it(tmp_path):
    """Was: `iterations = "five"` plus --iterations 1 ran; without the flag it is rejected."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\niterations = "five"\n')
    with pytest.raises(ConfigError) as info:
        load_config(cfg, {"run.iterations": 1})
    assert str(info.value) == f"{cfg}: run.iterations: Expected `int`, got `str`", str(info.value)
    cfg.write_text('[run]\nmode = "fast"\n')
    with pytest.raises(ConfigError, match=r"run\.mode: invalid value 'fast'; choose from"):
        load_config(cfg, {"run.mode": "spotlight"})
    cfg.write_text('[run]\ntrackers = "tensorboard"\n')
    with pytest.raises(ConfigError, match=r"run\.trackers: Expected `array`, got `str`"):
        load_config(cfg, {"run.trackers": []})


def test_a_section_the_file_sets_to_a_value_is_a_config_error_under_a_flag(tmp_path):
    """Was: `run = 3` plus --iterations 1 crashed with a TypeError while the flag was written into
    the section; without the flag it was a one-line error. Both are now, and an override that
    descends into a value, or names an unknown table, is blamed on the override, not the file."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("run = 3\n")
    for overrides in ({"run.iterations": 1}, {}):
        with pytest.raises(ConfigError) as info:
            load_config(cfg, overrides)
        assert str(info.value) == f"{cfg}: run: Expected `object`, got `int`", str(info.value)
    with pytest.raises(ConfigError, match=r"^override run\.iterations\.x: run\.iterations is a value, not a table"):
        load_config(None, {"run.iterations.x": 1})
    with pytest.raises(ConfigError, match=r"^override nosuch\.x: \[nosuch\]: unknown section"):
        load_config(None, {"nosuch.x": 1})
    with pytest.raises(ConfigError, match=r"^override run\.nosuch: unknown key"):
        load_config(None, {"run.nosuch": 1})


def test_an_overridden_file_value_is_range_checked_only_merged(tmp_path):
    """Only the type of an overridden file value is checked: a value the flag replaces may be
    out of range on its own (the merged config is what runs)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\niterations = 0\n")
    assert load_config(cfg, {"run.iterations": 3}).run.iterations == 3


def test_a_missing_prompt_file_names_the_config_file(tmp_path):
    from spotlight.tasks.prompts import prompt_set_from_config

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[data]\nprompts_path = "{tmp_path / "nope.txt"}"\n')
    with pytest.raises(ConfigError) as info:
        prompt_set_from_config(load_config(cfg).data, cfg)
    assert str(info.value) == f"{cfg}: data.prompts_path: file not found: {tmp_path / 'nope.txt'}", str(info.value)


def test_unset_optional_field_round_trips_through_toml(tmp_path):
    from spotlight.config import SpotlightConfig, config_to_dict, dump_config, load_config

    cfg = SpotlightConfig()
    assert cfg.cluster.gpu_memory_gib is None and "gpu_memory_gib" not in config_to_dict(cfg)["cluster"]
    dump_config(cfg, tmp_path / "a.toml")  # TOML has no null: it used to fail on None
    assert load_config(tmp_path / "a.toml").cluster.gpu_memory_gib is None
    set_ = load_config(tmp_path / "a.toml", {"cluster.gpu_memory_gib": 80.0})
    dump_config(set_, tmp_path / "b.toml")
    assert load_config(tmp_path / "b.toml").cluster.gpu_memory_gib == 80.0


def test_unset_fields_round_trip_through_toml(tmp_path):
    """A None field (unset: train.activation_checkpointing, train.micro_batch_size) is left out of
    the TOML, which has no null, and loads back as None; a set one keeps its value."""
    from spotlight.config import SpotlightConfig, TrainConfig, dump_config, load_config

    for train in (TrainConfig(), TrainConfig(activation_checkpointing=False, micro_batch_size=3)):
        cfg = SpotlightConfig(train=train)
        dump_config(cfg, tmp_path / "c.toml")
        assert load_config(tmp_path / "c.toml").train == train


def test_the_default_s_guidance_scale_is_inherited_only_by_its_own_family(tmp_path):
    """A file is merged on the embedded default, but the default's guidance scale (its shapes
    model was trained for CFG) is not another family's: a qwen-image file without the key gets
    the family default (0); a tiny file inherits it; an explicit value always wins."""
    other = tmp_path / "qwen.toml"
    other.write_text('[model]\nfamily = "qwen-image"\n')
    assert load_config(other).model.guidance_scale == 0.0
    same = tmp_path / "tiny.toml"
    same.write_text("[run]\niterations = 3\n")
    assert load_config(same).model.guidance_scale == load_config().model.guidance_scale == 5.0
    explicit = tmp_path / "explicit.toml"
    explicit.write_text('[model]\nfamily = "qwen-image"\nguidance_scale = 2.5\n')
    assert load_config(explicit).model.guidance_scale == 2.5


def test_every_prompt_a_control_prompt_with_exploration_on_is_refused():
    """Was accepted: exploration then had nothing to explore (spot GPUs idle all run)."""
    with pytest.raises(ConfigError, match="data.num_control_prompts"):
        load_config(overrides={"data.num_control_prompts": 12, "data.prompts_per_iteration": 12})
    cfg = load_config(
        overrides={"data.num_control_prompts": 12, "data.prompts_per_iteration": 12, "explore.enabled": False}
    )
    assert cfg.num_explored_prompts == 0


def _float_keys() -> list[str]:
    """Every dotted key of the resolved default config whose value is a float (or holds floats)."""
    out = []
    for section, table in config_to_dict(load_config()).items():
        for key, value in table.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, float) for v in values):
                out.append(f"{section}.{key}")
    return out


FLOAT_KEYS = _float_keys()


def test_the_default_config_has_float_keys_in_every_numeric_section():
    assert len(FLOAT_KEYS) > 20 and {"sampler.noise_level", "train.learning_rate", "cluster.lease_timeout_s"} <= set(
        FLOAT_KEYS
    )


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_no_float_key_accepts_a_non_finite_number(key, value, tmp_path):
    """``inf`` once passed every check and reached the workers as JSON null, which they refused
    at every start: the run hung while its worker crash-looped. Every float key refuses it at
    load time, from a file and from an override, naming the key."""
    default = config_to_dict(load_config())
    section, name = key.split(".")
    bad = [value] * len(default[section][name]) if isinstance(default[section][name], (list, tuple)) else value
    path = tmp_path / "bad.toml"
    path.write_text(f"[{section}]\n{name} = {bad}\n")  # TOML spells them inf, -inf, nan
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{key}: must be a finite number" in str(info.value) and str(path) in str(info.value), str(info.value)
    _raises_naming(key, **{key: bad})


def test_a_simulation_profile_given_as_run_config_is_named_as_one():
    """Was: `cluster.reserved_gpus: unknown key; did you mean cluster.reserved_rollout_gpus?`
    (`spotlight plan` or `up --config` on the simulator's profile)."""
    from spotlight.sim.profile import DEFAULT_PROFILE

    tables = r"\(\[exploration\], \[prices\], \[timing\], \[workload\]\)"
    with pytest.raises(ConfigError, match=rf"profile {tables}, not a run config: `spotlight simulate --profile "):
        load_config(DEFAULT_PROFILE)
