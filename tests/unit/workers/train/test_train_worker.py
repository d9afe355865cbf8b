"""Train Worker: Flow-GRPO step under FSDP2 (CPU, gloo).

The rollout batch is produced by the real Sampler with the same (unwrapped) weights, in
rollout micro-batches of uneven sizes, so the trainer's recomputation must reproduce the
stored log-probs bit for bit (ratio exactly 1 on the first pass).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from spotlight.config import SpotlightConfig, TrainConfig
from spotlight.models.dit import build_transformer, make_velocity_fn, token_shape
from spotlight.rl.sampler import Conditioning, Sampler
from spotlight.workers.train.train_worker import FlowGRPOTrainer
from tests.unit.spawned import exit_together

# diffusers returns a tuple view; FSDP2's warning about in-place ops on it is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")

TEXT_DIM = 16
T_TOKENS = 5
SEEDS = [11, 12, 13, 14, 15, 16]
ROLLOUT_MBS = [[0], [1], [2], [3, 4, 5]]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0]


def _cfg(**train) -> SpotlightConfig:
    return SpotlightConfig(train=TrainConfig(**train))


def make_rollout(cfg: SpotlightConfig, advantages=ADVANTAGES) -> dict[str, torch.Tensor]:
    """Real SDE rollout of SEEDS in the ROLLOUT_MBS batches with the initial weights."""
    model = build_transformer(cfg.model, TEXT_DIM)
    vf = make_velocity_fn(model, cfg.model)
    sampler = Sampler(cfg.sampler, token_shape(cfg.model))
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(len(SEEDS), T_TOKENS, TEXT_DIM, generator=g)
    mask = torch.ones(len(SEEDS), T_TOKENS, dtype=torch.int64)
    mask[0, 3:] = 0
    mask[4, 2:] = 0
    wl = torch.zeros(len(SEEDS), cfg.sampler.sde_window_size + 1, *token_shape(cfg.model))
    lp = torch.zeros(len(SEEDS), cfg.sampler.sde_window_size)
    with torch.no_grad():
        for mb in ROLLOUT_MBS:
            st = sampler.run(sampler.initial_state([SEEDS[i] for i in mb]), vf, Conditioning(embeds[mb], mask[mb]))
            wl[mb] = torch.stack(st.window_latents, 1)
            lp[mb] = torch.stack(st.log_probs, 1)
    return {
        "window_latents": wl,
        "log_probs": lp,
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "cond.embeds": embeds,
        "cond.mask": mask,
    }


def _select(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    return {k: v[rows].clone() for k, v in batch.items()}


def _states_differ(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def rollout():
    return make_rollout(_cfg())


@pytest.fixture(scope="module")
def trained(pg, rollout):
    """One step of a 1-rank trainer on the whole rollout batch."""
    cfg = _cfg()
    tr = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    before = tr.full_state_dict()
    metrics = tr.train_step(rollout, ROLLOUT_MBS, iteration=0)
    after = tr.full_state_dict()
    return {"trainer": tr, "before": before, "after": after, "metrics": metrics, "cfg": cfg}


def test_first_pass_ratio_is_exactly_one_and_weights_change(trained, rollout):
    m = trained["metrics"]
    assert m["train/ratio_max_dev"] == 0.0
    assert m["train/ratio_mean"] == 1.0
    assert m["train/clipfrac"] == 0.0
    assert m["train/approx_kl"] == 0.0
    assert m["train/kl"] == 0.0
    assert m["train/num_samples"] == len(SEEDS)
    assert m["train/grad_norm"] > 0
    assert _states_differ(trained["before"], trained["after"])

    # Full state dict: same keys as an unwrapped model, and it loads strictly.
    fresh = build_transformer(trained["cfg"].model, TEXT_DIM)
    assert set(trained["after"]) == set(fresh.state_dict())
    fresh.load_state_dict(trained["after"], strict=True)
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in trained["after"].values())

    # After the update the same samples are off-policy: the ratio moves away from 1.
    m2 = trained["trainer"].train_step(rollout, ROLLOUT_MBS, iteration=1)
    assert m2["train/ratio_max_dev"] > 0.0


def _window_log_likelihood(tr: FlowGRPOTrainer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B]`` log-likelihood of each stored window trajectory under the trainer's current
    weights, through the trainer's own model, velocity function and sampler."""
    cond = Conditioning.from_tensors(batch)
    with torch.no_grad():
        lp, _ = tr.sampler.window_log_probs(tr.velocity_fn, batch["window_latents"], cond)
    return lp.sum(1)


@pytest.mark.parametrize("train", [{}, {"lora_rank": 4}], ids=["full", "lora"])
def test_a_step_raises_the_advantage_weighted_log_likelihood_of_its_batch(pg, rollout, train):
    """The direction of a Flow-GRPO step, end to end: after one optimizer step on a batch,
    the trajectories with positive advantages became more likely and those with negative ones
    less, in sum ``Σ A_i · Δ log p_i > 0`` (first order: the step follows the surrogate's
    gradient). A sign error anywhere (loss, log-prob, advantages, the stored window's order)
    makes it negative; the same batch with its advantages negated moves the other way."""
    moved = {}
    for sign in (1.0, -1.0):
        tr = FlowGRPOTrainer(_cfg(**train), rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
        batch = dict(rollout, advantages=sign * rollout["advantages"])
        before = _window_log_likelihood(tr, batch)
        assert torch.equal(before, rollout["log_probs"].sum(1))  # the rollout's own weights
        tr.train_step(batch, ROLLOUT_MBS, iteration=0)
        moved[sign] = _window_log_likelihood(tr, batch) - before
    adv = rollout["advantages"]
    assert float((adv * moved[1.0]).sum()) > 0
    assert float((adv * moved[-1.0]).sum()) < 0


def test_zero_advantages_leave_weights_unchanged(pg, rollout):
    cfg = _cfg(weight_decay=0.0)
    tr = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    before = tr.full_state_dict()
    batch = dict(rollout, advantages=torch.zeros(len(SEEDS)))
    m = tr.train_step(batch, ROLLOUT_MBS, iteration=0)
    assert m["train/grad_norm"] == 0.0
    assert m["train/loss"] == 0.0
    assert not _states_differ(before, tr.full_state_dict())


def test_kl_reference(pg):
    cfg = _cfg(kl_beta=0.5)
    batch = _select(make_rollout(cfg), [3, 4, 5])
    tr = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    assert tr.reference is not None
    m1 = tr.train_step(batch, [[0, 1, 2]], iteration=0)
    assert m1["train/kl"] == 0.0 and m1["train/ratio_max_dev"] == 0.0
    m2 = tr.train_step(batch, [[0, 1, 2]], iteration=1)
    assert m2["train/kl"] > 0.0


def _two_rank_worker(rank: int, world: int, store_path: str, out_dir: str, batch: dict) -> None:
    """Spawned rank: (A) halves with 3 vs 1 micro-batches; (B) rank 1 has zero samples."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        cfg = _cfg()
        scenarios = {
            # rank 0: rows 0,1,2 in three micro-batches; rank 1: rows 3,4,5 in one.
            "halves": ([0, 1, 2], [[0], [1], [2]]) if rank == 0 else ([3, 4, 5], [[0, 1, 2]]),
            # rank 0: every row in the rollout micro-batches; rank 1: nothing at all.
            "empty_rank": (list(range(6)), ROLLOUT_MBS) if rank == 0 else ([], []),
        }
        for name, (rows, mbs) in scenarios.items():
            tr = FlowGRPOTrainer(cfg, rank=rank, world_size=world, device=torch.device("cpu"), text_dim=TEXT_DIM)
            metrics = tr.train_step(_select(batch, rows), mbs, iteration=0)
            sd = tr.full_state_dict()
            if rank == 0:
                save_file(sd, os.path.join(out_dir, f"{name}.safetensors"))
                with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                    json.dump(metrics, f)
            else:
                assert sd == {}
        exit_together()
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_rank(trained, rollout, tmp_path):
    store = str(tmp_path / "store")
    mp.spawn(_two_rank_worker, args=(2, store, str(tmp_path), rollout), nprocs=2, join=True)
    ref = trained["after"]
    ref_m = trained["metrics"]
    for name in ("halves", "empty_rank"):
        sd = load_file(str(tmp_path / f"{name}.safetensors"))
        assert set(sd) == set(ref)
        worst = max((sd[k] - ref[k]).abs().max().item() for k in ref)
        assert worst < 1e-6, (name, worst)
        m = json.loads((tmp_path / f"{name}.json").read_text())
        assert m["train/ratio_max_dev"] == 0.0
        assert m["train/num_samples"] == len(SEEDS)
        assert m["train/grad_norm"] == pytest.approx(ref_m["train/grad_norm"], rel=1e-5)
        assert m["train/loss"] == pytest.approx(ref_m["train/loss"], abs=1e-9)


def test_save_pretrained_roundtrip(pg, trained, tmp_path):
    from diffusers import QwenImageTransformer2DModel

    cfg = trained["cfg"]
    tr = FlowGRPOTrainer(
        cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM, initial_state_dict=trained["after"]
    )
    tr.save_pretrained(tmp_path / "ckpt")
    loaded = QwenImageTransformer2DModel.from_pretrained(str(tmp_path / "ckpt")).float().eval()
    expected = build_transformer(cfg.model, TEXT_DIM)
    expected.load_state_dict(trained["after"])
    base = build_transformer(cfg.model, TEXT_DIM)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, *token_shape(cfg.model), generator=g)
    cond = Conditioning(torch.randn(2, T_TOKENS, TEXT_DIM, generator=g), torch.ones(2, T_TOKENS, dtype=torch.int64))
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        out = make_velocity_fn(loaded, cfg.model)(x, sigma, cond)
        want = make_velocity_fn(expected, cfg.model)(x, sigma, cond)
        old = make_velocity_fn(base, cfg.model)(x, sigma, cond)
    assert torch.equal(out, want)
    assert not torch.equal(out, old)  # the trained weights, not the initial ones


def test_a_final_save_cut_short_leaves_no_final_folder_and_an_earlier_one_intact(pg, trained, tmp_path, monkeypatch):
    """A crash or a full disk inside the final save leaves no partial ``final/``: ``up --resume``
    counts a run with ``final/`` as finished, so a partial one would be the run's result."""
    from diffusers import ModelMixin

    cfg = trained["cfg"]
    tr = FlowGRPOTrainer(
        cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM, initial_state_dict=trained["after"]
    )

    def cut_short(self, directory, **kwargs):
        (pathlib.Path(directory) / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ModelMixin, "save_pretrained", cut_short)
    with pytest.raises(OSError, match="No space left"):
        tr.save_pretrained(tmp_path / "final")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "config.json").write_text('{"kept": true}')
    with pytest.raises(OSError, match="No space left"):
        tr.save_pretrained(tmp_path / "best")
    assert [p.name for p in tmp_path.iterdir()] == ["best"]
    assert (tmp_path / "best" / "config.json").read_text() == '{"kept": true}'


def _free_port() -> int:
    from tests.factories import free_port

    return free_port()


def recv_version(recv, header) -> dict[str, torch.Tensor]:
    """The state dict of a version streamed by a trainer: ``header`` (a WEIGHTS body) then its
    WEIGHTS_CHUNK messages from ``recv()`` (``(mtype, body, payload)``), in order, digest checked."""
    from spotlight import protocol as P
    from spotlight.store import tensor_wire
    from spotlight.store.weight_sync import new_hasher, parse_digest

    algo, want = parse_digest(header.digest)
    h, blob = new_hasher(algo), bytearray()
    for i in range(header.num_chunks):
        mtype, body, payload = recv()
        assert mtype == P.MsgType.WEIGHTS_CHUNK and (body.version, body.index, body.offset) == (
            header.version,
            i,
            i * header.chunk_bytes,
        )
        assert len(payload[0]) == body.size_bytes <= header.chunk_bytes
        h.update(payload[0])
        blob += payload[0]
    assert len(blob) == header.size_bytes and h.hexdigest() == want
    return tensor_wire.bytes_to_state_dict(bytes(blob))


def test_process_protocol(trained, rollout, tmp_path):
    """The ``main()`` process against a fake coordinator ROUTER (world size 1)."""
    import zmq

    from spotlight import protocol as P
    from spotlight.config import config_to_dict
    from spotlight.net.security import (
        Authenticator,
        apply_server,
        ephemeral_client,
        init_keys,
        load_server_keys,
        write_client_file,
    )
    from spotlight.store import tensor_wire

    init_keys(tmp_path / "keys")
    ctx = zmq.Context()
    auth = Authenticator(ctx, load_server_keys(tmp_path / "keys"))
    auth.start()
    write_client_file(tmp_path / "trainer.json", ephemeral_client(auth.keys, "trainer", "test"))
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    apply_server(router, auth.keys)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conf = config_to_dict(trained["cfg"])
    conf["cluster"]["weight_chunk_bytes"] = 64 * 1024  # several chunks per version
    cmd = [
        sys.executable,
        "-m",
        "spotlight.workers.train.train_worker",
        "--coordinator",
        f"tcp://127.0.0.1:{port}",
        "--keys-file",
        str(tmp_path / "trainer.json"),
        "--rank",
        "0",
        "--world-size",
        "1",
        "--config-json",
        json.dumps(conf),
        "--master-port",
        str(_free_port()),
        "--text-dim",
        str(TEXT_DIM),
        "--spool-dir",
        str(tmp_path / "spool"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)

    def recv():
        if not poller.poll(120_000):
            proc.kill()
            pytest.fail("trainer process went silent:\n" + proc.communicate()[0].decode(errors="replace"))
        frames = router.recv_multipart(copy=False)
        assert frames[1].get("User-Id") == "trainer.test"  # authenticated with the run's trainer key
        peer["id"] = bytes(frames[0])
        return P.decode([bytes(f) for f in frames[1:]])

    peer = {}

    try:
        mtype, body, _ = recv()
        assert mtype == P.MsgType.TRAIN_READY and (body.rank, body.world_size, body.version) == (0, 1, 0)
        mtype, body, payload = recv()
        assert mtype == P.MsgType.WEIGHTS and body.version == 0 and not payload and body.chunk_bytes == 64 * 1024
        assert body.num_chunks == -(-body.size_bytes // body.chunk_bytes) > 1  # a version in several chunks
        v0 = recv_version(recv, body)
        assert not _states_differ(v0, trained["before"])

        router.send_multipart([peer["id"], b"\xff", b"junk"])  # malformed: logged and ignored
        metas, frames = tensor_wire.pack_tensors(rollout)
        batch = P.TrainBatch(iteration=3, version=0, micro_batches=ROLLOUT_MBS, tensors=metas)
        router.send_multipart([peer["id"], *P.encode(batch, frames)])
        mtype, body, payload = recv()
        assert mtype == P.MsgType.WEIGHTS and body.version == 1
        v1 = recv_version(recv, body)
        assert max((v1[k] - trained["after"][k]).abs().max().item() for k in v1) < 1e-6
        mtype, body, _ = recv()
        assert mtype == P.MsgType.TRAIN_DONE and (body.rank, body.iteration, body.new_version) == (0, 3, 1)
        assert body.metrics["train/ratio_max_dev"] == 0.0

        # a rank that got no rollout batch receives only one padding row of conditioning
        pad = {"pad.cond.embeds": rollout["cond.embeds"][:1], "pad.cond.mask": rollout["cond.mask"][:1]}
        metas, frames = tensor_wire.pack_tensors(pad)
        router.send_multipart(
            [peer["id"], *P.encode(P.TrainBatch(iteration=4, version=1, micro_batches=[], tensors=metas), frames)]
        )
        mtype, body, payload = recv()
        assert mtype == P.MsgType.WEIGHTS and body.version == 2
        v2 = recv_version(recv, body)
        assert not _states_differ(v1, v2)  # nothing to train on: weights unchanged
        mtype, body, _ = recv()
        assert mtype == P.MsgType.TRAIN_DONE and (body.iteration, body.new_version) == (4, 2)
        assert body.metrics["train/num_samples"] == 0.0

        router.send_multipart([peer["id"], *P.encode(P.Shutdown(reason=f"save:{tmp_path / 'final'}"))])
        mtype, body, _ = recv()
        assert mtype == P.MsgType.TRAIN_DONE and (body.iteration, body.new_version) == (-1, -1)
        assert (tmp_path / "final" / "config.json").is_file()

        router.send_multipart([peer["id"], *P.encode(P.Shutdown(reason="done"))])
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode(errors="replace")
        assert b"dropping malformed message" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        router.close()
        auth.stop()
        ctx.term()


def _two_rank_lora_worker(rank: int, world: int, store_path: str, out_dir: str, batch: dict) -> None:
    """Spawned rank of a LoRA trainer: rank 0 rows 0-2 (three micro-batches), rank 1 rows 3-5."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        tr = FlowGRPOTrainer(
            _cfg(lora_rank=4, kl_beta=0.1), rank=rank, world_size=world, device=torch.device("cpu"), text_dim=TEXT_DIM
        )
        rows, mbs = ([0, 1, 2], [[0], [1], [2]]) if rank == 0 else ([3, 4, 5], [[0, 1, 2]])
        tr.train_step(_select(batch, rows), mbs, iteration=0)
        sd = tr.version_state_dict()  # collective: gathers the adapter shards
        if rank == 0:
            save_file(sd, os.path.join(out_dir, "lora2.safetensors"))
        else:
            assert sd == {}
        exit_together()
    finally:
        dist.destroy_process_group()


def test_lora_under_fsdp2_two_ranks_match_one_rank(pg, rollout, tmp_path):
    """LoRA on FSDP2 (frozen base and trainable adapter in the same sharded blocks): the
    published version is the adapter alone, and 2 ranks give the 1-rank update."""
    tr = FlowGRPOTrainer(
        _cfg(lora_rank=4, kl_beta=0.1), rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM
    )
    v0 = tr.version_state_dict()
    assert v0 and all("lora_" in k for k in v0)
    assert len(tr.params) == len(v0)  # the optimizer holds the adapter only
    m = tr.train_step(rollout, ROLLOUT_MBS, iteration=0)
    assert m["train/ratio_max_dev"] == 0.0 and m["train/optimizer_steps"] == 1
    v1 = tr.version_state_dict()
    assert any(not torch.equal(v0[k], v1[k]) for k in v0 if "lora_B" in k)
    mp.spawn(_two_rank_lora_worker, args=(2, str(tmp_path / "store"), str(tmp_path), rollout), nprocs=2, join=True)
    two = load_file(str(tmp_path / "lora2.safetensors"))
    assert set(two) == set(v1)
    worst = max((two[k] - v1[k]).abs().max().item() for k in v1)
    assert worst < 1e-6, worst
