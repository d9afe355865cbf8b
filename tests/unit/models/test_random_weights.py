"""The streamed random-weight checkpoint writer (spotlight/models/random_weights.py,
``qwen_image.make_streamed_checkpoint``): a tiny Qwen-Image written block by block into sharded
safetensors files with diffusers' index loads with diffusers' ``from_pretrained`` (the model and
the whole pipeline), the family and the Train Worker's sharded load; the writer holds about one
block on the host, whatever the model's size (its own accounting); bad groups are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from spotlight.models.families.qwen_image import make_streamed_checkpoint, write_random_transformer
from spotlight.models.random_weights import Group, plan_shards, write_sharded_safetensors
from spotlight.store.tensor_wire import SafetensorsStream

LAYERS = 6
TRANSFORMER = {"num_layers": LAYERS, "attention_head_dim": 16, "num_attention_heads": 2, "axes_dims_rope": (4, 6, 6)}
TEXT = {  # wider than the tiny default, so txt_in takes the text width from the encoder
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
}
VAE = {"z_dim": 8}


def _files_state(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _block_bytes() -> int:
    """bf16 bytes of one transformer block, counted on the meta device."""
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    with init_empty_weights():
        m = QwenImageTransformer2DModel(**TRANSFORMER, in_channels=32, out_channels=8, joint_attention_dim=64)
    return 2 * sum(p.numel() for p in m.transformer_blocks[0].parameters())


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    path = tmp_path_factory.mktemp("streamed")
    lines = []
    w = make_streamed_checkpoint(
        path,
        seed=3,
        transformer_kwargs=TRANSFORMER,
        text_kwargs=TEXT,
        vae_kwargs=VAE,
        dtype=torch.bfloat16,
        max_shard_bytes=int(2.5 * _block_bytes()),  # about two blocks a file: several files and an index
        progress=lines.append,
    )
    return path, w, lines


def test_the_layout_is_diffusers_sharded_one(streamed):
    ckpt, w, lines = streamed
    folder = ckpt / "transformer"
    assert len(w.files) >= 3 and [f.name for f in sorted(folder.glob("*.safetensors"))] == list(w.files)
    assert w.files[0] == f"diffusion_pytorch_model-00001-of-{len(w.files):05d}.safetensors"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    state = _files_state(folder)
    assert index["metadata"]["total_size"] == w.data_bytes == sum(t.numel() * 2 for t in state.values())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(w.files)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert w.params == sum(t.numel() for t in state.values()) and w.groups == LAYERS + 1
    config = json.loads((folder / "config.json").read_text())
    assert config["_class_name"] == "QwenImageTransformer2DModel" and config["joint_attention_dim"] == 64
    assert config["in_channels"] == 4 * VAE["z_dim"] and config["num_layers"] == LAYERS
    model_index = json.loads((ckpt / "model_index.json").read_text())
    assert model_index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    assert len(lines) == LAYERS + 1 and lines[-1].startswith(f"block {LAYERS - 1} → ")


def test_the_writer_holds_about_one_block(streamed):
    _, w, _ = streamed
    # a block built on the CPU in fp32 (4 bytes) beside its bf16 copy (2 bytes): 3x its bf16 bytes
    assert w.peak_host_bytes == 3 * w.largest_group_bytes
    assert w.largest_group_bytes * LAYERS <= w.data_bytes  # the model is many blocks; one at a time was held


def test_it_loads_with_diffusers_and_the_family(streamed):
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    from spotlight.config import ModelConfig
    from spotlight.models.families import get_family

    ckpt, _, _ = streamed
    want = _files_state(ckpt / "transformer")
    model = QwenImageTransformer2DModel.from_pretrained(str(ckpt), subfolder="transformer")
    got = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    pipe = QwenImagePipeline.from_pretrained(str(ckpt))
    assert type(pipe.transformer).__name__ == "QwenImageTransformer2DModel"
    assert pipe.text_encoder.config.text_config.hidden_size == 64 and pipe.vae.config.z_dim == 8
    family = get_family(ModelConfig(family="qwen-image", pretrained_path=str(ckpt), image_size=32))
    assert family.latent_shape == (4, 32) and len(family.transformer_weight_files()) >= 3
    x = torch.randn(1, *family.latent_shape)
    cond = family.encode_prompts(["a red cube"], "cpu")
    with torch.no_grad():
        v = family.make_velocity_fn(family.build_transformer(torch.float32))(x, torch.full((1,), 0.5), cond)
    assert v.shape == x.shape and torch.isfinite(v).all()


def test_blocks_do_not_depend_on_the_shard_size(streamed, tmp_path):
    ckpt, _, _ = streamed
    config = {k: v for k, v in json.loads((ckpt / "transformer" / "config.json").read_text()).items() if k[0] != "_"}
    again = write_random_transformer(tmp_path / "one", config, seed=3, dtype=torch.bfloat16, max_shard_bytes=1 << 40)
    assert again.files == ("diffusion_pytorch_model.safetensors",)
    assert not (tmp_path / "one" / "diffusion_pytorch_model.safetensors.index.json").exists()
    a, b = _files_state(ckpt / "transformer"), _files_state(tmp_path / "one")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    other = _files_state(write_random_transformer(tmp_path / "seed4", config, seed=4, dtype=torch.bfloat16).folder)
    assert not torch.equal(other["transformer_blocks.0.attn.to_q.weight"], a["transformer_blocks.0.attn.to_q.weight"])


@pytest.mark.procs  # a gloo process group in this process
def test_the_trainers_sharded_load_reads_it(streamed, pg):
    from spotlight.config import ModelConfig, SamplerConfig, SpotlightConfig
    from spotlight.workers.train.train_worker import FlowGRPOTrainer

    ckpt, _, _ = streamed
    cfg = SpotlightConfig(
        model=ModelConfig(family="qwen-image", pretrained_path=str(ckpt), image_size=32, max_text_tokens=6),
        sampler=SamplerConfig(num_steps=4, sde_window_size=2),
    )
    trainer = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"))
    assert trainer.was_meta_before_load
    got, want = trainer.full_state_dict(), _files_state(ckpt / "transformer")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].float()) for k in want)


# ------------------------------------------------------------------ the generic writer's checks
def test_shards_hold_whole_groups():
    assert plan_shards([3, 3, 3, 3], 7) == [[0, 1], [2, 3]]
    assert plan_shards([10, 1, 1], 4) == [[0], [1, 2]]  # a group larger than a shard gets its own
    assert plan_shards([], 4) == []


def _group(label, names, shape=(2, 3), dtype=torch.float32):
    return Group(label, tuple(names), lambda: ({n: torch.zeros(shape, dtype=dtype) for n in names}, 0))


def test_groups_must_cover_the_specs_and_make_what_they_say(tmp_path):
    specs = {"a": (torch.float32, (2, 3)), "b": (torch.float32, (2, 3))}
    with pytest.raises(ValueError, match="missing \\['b'\\]"):
        write_sharded_safetensors(tmp_path, specs, [_group("g", ["a"])])
    with pytest.raises(
        ValueError, match="expected 'a' torch.float32 \\[2, 3\\] next, got 'a' torch.float32 \\[3, 3\\]"
    ):
        write_sharded_safetensors(tmp_path, specs, [_group("g", ["a", "b"], shape=(3, 3))])
    w = write_sharded_safetensors(tmp_path, specs, [_group("g", ["a"]), _group("h", ["b"])], max_shard_bytes=24)
    assert w.files == (
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
    )
    assert w.peak_host_bytes == 24 and w.data_bytes == 48


def test_the_stream_refuses_a_tensor_out_of_order_and_a_missing_one(tmp_path):
    specs = [("x", torch.float32, (2,)), ("y", torch.bfloat16, (1, 2))]
    with pytest.raises(ValueError, match="expected 'x'"):
        with SafetensorsStream(tmp_path / "f.safetensors", specs) as out:
            out.write("y", torch.zeros(1, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="1 tensors never written"):
        with SafetensorsStream(tmp_path / "f.safetensors", specs) as out:
            out.write("x", torch.ones(2))
    with SafetensorsStream(tmp_path / "f.safetensors", specs) as out:
        out.write("x", torch.tensor([1.0, 2.0]))
        out.write("y", torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16))
    got = load_file(str(tmp_path / "f.safetensors"))
    assert torch.equal(got["x"], torch.tensor([1.0, 2.0])) and got["y"].dtype == torch.bfloat16
