"""Elastic SP groups for the real families (Qwen-Image with true CFG, FLUX.1 with pooled
projections and a guidance embedding), from saved tiny checkpoints of their real classes, full
fine-tuning and LoRA, on CPU with gloo.

One set of processes runs every case in turn (leader, follower, joiner): a batch is denoised
2 steps at SP 2, 2 steps at SP 1 (the follower's GPU revoked), the rest at SP 2 again (a new
member joins and receives the version by broadcast), and must equal one uninterrupted
single-process run of the family's own velocity bit for bit. Cases share processes so the imports are
paid once.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from spotlight.config import ModelConfig, SamplerConfig
from spotlight.rl.sampler import Conditioning, Sampler
from spotlight.workers.sp.group import GroupSpec, SPGroupMember
from tests.factories import free_ports
from tests.unit.workers.sp.test_group import _guard, _run, _setup_child

SAMPLER = SamplerConfig(num_steps=6, sde_window_start=1, sde_window_size=3, noise_level=1.0)
SEEDS = [5, 6]
"""Two rows per batch: every rank's GEMMs have at least 4 token rows at SP 2 (the CPU GEMM's
row-invariant range, spotlight/workers/sp/invariant.py)."""
LORA = {"rank": 2, "alpha": 4.0, "target_modules": []}
CASES = [("qwen-image", False), ("qwen-image", True), ("flux", False), ("flux", True), ("tiny", True)]
"""(family, LoRA). Qwen-Image's text (7 tokens) is padded to 8 at SP 2; FLUX's 8 tokens divide."""

CFG_PARALLEL_TOLERANCE = 2e-5
"""Largest |difference| allowed between a CFG-parallel group's latents and one worker's (fp32 on
CPU): a rank there runs its branch as its own ``[B]`` forward where one worker runs the ``[2B]``
batch, and a GEMM with twice the rows rounds differently; measured: about 7e-7. Ulysses groups
(the default) match one worker bit for bit (:mod:`spotlight.workers.sp.invariant`)."""


def _model_cfg(family: str, root: str) -> ModelConfig:
    if family == "tiny":
        return ModelConfig()
    tokens = 7 if family == "qwen-image" else 8
    return ModelConfig(
        family=family, pretrained_path=str(pathlib.Path(root) / family), image_size=32, max_text_tokens=tokens
    )


def _conditioning(family: str, cfg: ModelConfig) -> Conditioning:
    g = torch.Generator().manual_seed(77)
    n, t = len(SEEDS), cfg.max_text_tokens
    if family == "tiny":
        mask = torch.ones(n, t, dtype=torch.long)
        mask[1, -2:] = 0
        return Conditioning(torch.randn(n, t, 384, generator=g), mask)
    if family == "qwen-image":  # true CFG: the negative prompt is one shared row
        mask = torch.ones(n, t, dtype=torch.long)
        mask[1, -3:] = 0
        neg_mask = torch.zeros(1, t, dtype=torch.long)
        neg_mask[0, :2] = 1
        return Conditioning(
            torch.randn(n, t, 32, generator=g) * mask[..., None],
            mask,
            {"neg.embeds": torch.randn(1, t, 32, generator=g) * neg_mask[..., None], "neg.mask": neg_mask},
        )
    return Conditioning(
        torch.randn(n, t, 64, generator=g),
        torch.ones(n, t, dtype=torch.long),
        {"pooled": torch.randn(n, 32, generator=g)},
    )


def _sampler(family) -> Sampler:
    return Sampler(SAMPLER, family.latent_shape, family.sigmas(SAMPLER.num_steps, SAMPLER.shift))


def _adapter(entries) -> dict[str, torch.Tensor]:
    """A LoRA version with every tensor random (so the adapter changes the output)."""
    g = torch.Generator().manual_seed(99)
    return {n: torch.randn(shape, generator=g) * 0.3 for n, shape, _ in entries}


def _weights(member: SPGroupMember) -> dict[str, torch.Tensor]:
    if member.lora:
        return _adapter(member._skeleton_entries())
    return member.family.build_transformer(torch.float32).state_dict()


def _spec(members, port, gen):
    return GroupSpec(members=tuple(members), master_addr="127.0.0.1", master_port=port, generation=gen)


def _t_cases(q, role, root, ports):
    """Every CASES entry in turn: SP 2 → 1 → 2 around one batch (leader), or serving it."""
    _setup_child()
    from spotlight.workers.sp.group import release_followers, run_group_batch, serve_until_released

    def body():
        for i, (family, lora) in enumerate(CASES):
            cfg = _model_cfg(family, root)
            spec = LORA if lora else None
            p = ports[3 * i : 3 * i + 3]
            if role == "leader":
                m = SPGroupMember(cfg, "w0", torch.device("cpu"), lora=spec)
                sampler, cond = _sampler(m.family), _conditioning(family, cfg)
                m.form(_spec(["w0", "w1"], p[0], 1), state_dict=_weights(m), version=1)
                state = sampler.initial_state(SEEDS)
                run_group_batch(m, sampler, state, cond, stop_at=2)
                release_followers(m)
                m.form(_spec(["w0"], p[1], 2))  # shrink: the follower's GPU was revoked
                source_sp1 = m.weights_source
                run_group_batch(m, sampler, state, cond, stop_at=4)
                m.form(_spec(["w0", "w2"], p[2], 3))  # grow: w2 joins and receives the version
                run_group_batch(m, sampler, state, cond)
                release_followers(m)
                q.put((f"{i}.leader", (state.latents.numpy(), torch.stack(state.log_probs, 1).numpy(), source_sp1)))
                m.leave()
            elif role == "follower":
                m = SPGroupMember(cfg, "w1", torch.device("cpu"), lora=spec)
                m.form(_spec(["w0", "w1"], p[0], 1))
                q.put((f"{i}.follower", (m.weights_source, serve_until_released(m))))
                m.leave()
            else:
                m = SPGroupMember(cfg, "w2", torch.device("cpu"), lora=spec)
                m.form(_spec(["w0", "w2"], p[2], 3))
                q.put((f"{i}.joiner", (m.weights_source, serve_until_released(m), m.weights_version)))
                m.leave()

    _guard(q, role, body)


def _reference(family_name: str, lora: bool, root: str):
    """One uninterrupted single-process run of the family's own velocity (no SP code)."""
    from spotlight.models.alignment import realign_
    from spotlight.models.families import get_family
    from spotlight.models.lora import add_lora, load_version

    cfg = _model_cfg(family_name, root)
    family = get_family(cfg)
    model = realign_(family.build_transformer(torch.float32))  # as a Rollout Worker does on the CPU
    if lora:
        add_lora(model, LORA, family.default_lora_targets, seed=cfg.init_seed)
        entries = SPGroupMember(cfg, "ref", torch.device("cpu"), lora=LORA)._skeleton_entries()
        load_version(model, _adapter(entries))
    sampler = _sampler(family)
    state = sampler.initial_state(SEEDS)
    with torch.no_grad():
        sampler.run(state, family.make_velocity_fn(model.eval()), _conditioning(family_name, cfg))
    return state.latents.numpy(), torch.stack(state.log_probs, 1).numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    from spotlight.models.families import flux, qwen_image

    root = tmp_path_factory.mktemp("sp-ckpts")
    qwen_image.make_random_checkpoint(root / "qwen-image", seed=1)
    flux.make_random_checkpoint(root / "flux", seed=1)
    return str(root)


@pytest.mark.procs
def test_families_survive_sp_2_1_2_mid_denoising_full_and_lora(checkpoints):
    ports = free_ports(3 * len(CASES))
    out = _run([(_t_cases, (role, checkpoints, ports)) for role in ("leader", "follower", "joiner")], timeout=900)
    for i, (family, lora) in enumerate(CASES):
        latents, log_probs, source_sp1 = out[f"{i}.leader"]
        assert source_sp1 == "memory", (family, lora)
        assert out[f"{i}.follower"] == ("broadcast", 1)
        assert out[f"{i}.joiner"] == ("broadcast", 1, 1)  # the version number travelled with the weights
        ref_latents, ref_log_probs = _reference(family, lora, checkpoints)
        assert latents.shape == ref_latents.shape and log_probs.shape == (len(SEEDS), SAMPLER.sde_window_size)
        # bit for bit: SP 2 → 1 → 2 mid-denoising changes nothing (spotlight/workers/sp/invariant.py)
        assert np.array_equal(latents, ref_latents), (family, lora, np.abs(latents - ref_latents).max())
        assert np.array_equal(log_probs, ref_log_probs), (family, lora, np.abs(log_probs - ref_log_probs).max())


def test_lora_member_reads_the_checkpoint_base_through_a_memory_map_and_moves_adapters_only(checkpoints, tmp_path):
    """A LoRA member's frozen base is the checkpoint's safetensors read through a memory map: a
    tensor the file puts on a 64-byte boundary is the mapped tensor (the node's page cache holds
    the copy every worker shares), one off it an aligned private copy (CPU kernels round
    differently off it: spotlight/models/alignment.py). Both kinds are checked: the checkpoint as
    diffusers wrote it (every tensor off the boundary) and a copy whose header is padded so they
    all sit on it. Versions are the adapter alone, and a version that is not an adapter of this
    architecture is refused before anything is sent."""
    from spotlight.models.lora import WeightVersionError

    _setup_child()
    as_written = _base_mapping(_model_cfg("qwen-image", checkpoints))
    assert not any(as_written.values())  # diffusers' file: every tensor 24 bytes past the boundary
    padded = tmp_path / "padded"
    _copy_with_aligned_data(pathlib.Path(checkpoints), padded)
    assert all(_base_mapping(_model_cfg("qwen-image", str(padded))).values())

    m = SPGroupMember(_model_cfg("qwen-image", checkpoints), "w0", torch.device("cpu"), lora=LORA)
    m.form(_spec(["w0"], 1, 1), state_dict=_adapter(m._skeleton_entries()), version=4)
    with pytest.raises(WeightVersionError, match="missing"):
        m.form(_spec(["w0"], 1, 2), state_dict={"transformer_blocks.0.attn.to_q.weight": torch.zeros(1)})
    m.leave()


def _base_mapping(cfg: ModelConfig) -> dict[str, bool]:
    """Form a LoRA member at SP 1 and return, per base tensor, whether it is the checkpoint's
    mapped data; asserts every base tensor is 64-byte aligned and mapped exactly where the file
    puts it on the boundary, and that the adapter is kept as handed in."""
    m = SPGroupMember(cfg, "w0", torch.device("cpu"), lora=LORA)
    entries = m._skeleton_entries()
    assert entries and all("lora_" in n for n, _, _ in entries)
    adapter = _adapter(entries)
    m.form(_spec(["w0"], 1, 1), state_dict=adapter, version=4)  # port 1: never bound at SP 1
    assert m.state_dict() is adapter  # used as handed in: no copy
    base = m._base_state()
    in_file = _mapped_checkpoint(m)  # keeps a map of the files open while the ranges are read
    files = {str(f.resolve()) for f in m.family.transformer_weight_files()}
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[5] in files:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    assert ranges, "the checkpoint's safetensors are not mapped"
    mapped = {n: any(lo <= t.data_ptr() < hi for lo, hi in ranges) for n, t in base.items() if t.numel()}
    assert all(base[n].data_ptr() % 64 == 0 for n in mapped), "a base tensor is off the 64-byte boundary"
    for n, is_mapped in mapped.items():
        assert is_mapped == (in_file[m._base_names[n]].data_ptr() % 64 == 0), n
    m.leave()
    return mapped


def _copy_with_aligned_data(src: pathlib.Path, dst: pathlib.Path) -> None:
    """``src``'s Qwen-Image checkpoint copied to ``dst`` with each transformer safetensors
    header padded with spaces (the format allows it) so its data starts on a 64-byte boundary."""
    import shutil
    import struct

    shutil.copytree(src / "qwen-image", dst / "qwen-image")
    for f in (dst / "qwen-image" / "transformer").glob("*.safetensors"):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header, data = raw[8 : 8 + n].rstrip(b" "), raw[8 + n :]
        header += b" " * (-(8 + len(header)) % 64)
        f.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _mapped_checkpoint(member) -> dict[str, torch.Tensor]:
    from spotlight.store.tensor_wire import mmap_state_dict

    out: dict[str, torch.Tensor] = {}
    for f in member.family.transformer_weight_files():
        out.update(mmap_state_dict(f))
    return out


def test_sp_degree_checks_read_the_checkpoint(checkpoints):
    from spotlight.models.families import get_family
    from spotlight.workers.sp.degrees import degree_problem, sp_shape, usable_degrees

    qwen = sp_shape(get_family(_model_cfg("qwen-image", checkpoints)))
    assert (qwen.heads, qwen.image_tokens, qwen.pads_text) == (2, 4, True)
    assert degree_problem(qwen, 2) is None  # 7 text tokens: padded
    assert "attention heads" in degree_problem(qwen, 4)
    flux = sp_shape(get_family(ModelConfig(**{**_fields(_model_cfg("flux", checkpoints)), "max_text_tokens": 7})))
    assert "max_text_tokens = 7" in degree_problem(flux, 2)
    assert usable_degrees(flux, 2) == [1]


def _fields(cfg: ModelConfig) -> dict:
    import msgspec

    return msgspec.to_builtins(cfg)


def _t_cfg_parallel(q, rank, root, ports):
    """Qwen-Image with true CFG at SP 2, CFG-parallel: rank 0 the positive rows, rank 1 the
    negative ones; a full batch, then one with First Block Cache at a huge threshold."""
    _setup_child()
    from spotlight.workers.sp.group import release_followers, run_group_batch, serve_until_released

    def body():
        cfg = _model_cfg("qwen-image", root)
        m = SPGroupMember(cfg, f"w{rank}", torch.device("cpu"), cfg_parallel=True)
        m.form(_spec(["w0", "w1"], ports[0], 1), state_dict=_weights(m) if rank == 0 else None, version=1)
        q.put((f"r{rank}.split", (m.cfg_split, m.ulysses_degree)))
        if rank == 0:
            sampler, cond = _sampler(m.family), _conditioning("qwen-image", cfg)
            state = sampler.initial_state(SEEDS)
            run_group_batch(m, sampler, state, cond)
            q.put(("full", (state.latents.numpy(), torch.stack(state.log_probs, 1).numpy())))
            cached = sampler.initial_state(SEEDS)
            run_group_batch(m, sampler, cached, cond, cache_threshold=100.0)
            q.put(("cached_steps", cached.computed_steps.tolist()))
            release_followers(m)
        else:
            serve_until_released(m)
        m.leave()

    _guard(q, f"r{rank}", body)


@pytest.mark.procs
def test_cfg_parallel_runs_each_cfg_branch_on_its_own_rank_and_matches_one_process(checkpoints):
    ports = free_ports(1)
    out = _run([(_t_cfg_parallel, (r, checkpoints, ports)) for r in range(2)], timeout=600)
    assert out["r0.split"] == out["r1.split"] == (True, 1)  # two halves of one rank: no Ulysses split
    latents, log_probs = out["full"]
    ref_latents, ref_log_probs = _reference("qwen-image", False, checkpoints)
    assert np.abs(latents - ref_latents).max() <= CFG_PARALLEL_TOLERANCE
    assert np.abs(log_probs - ref_log_probs).max() <= CFG_PARALLEL_TOLERANCE * 10
    assert out["cached_steps"] == [1, 1]  # the group-wide cache decision: every step after the first skipped
