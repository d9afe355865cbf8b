"""Train Worker checkpoints (DCP, FSDP2, gloo): an interrupted-and-resumed trainer matches an
uninterrupted one bit for bit, for full fine-tuning and LoRA, on 1 and 2 ranks."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spotlight.config import SpotlightConfig, TrainConfig
from spotlight.store.checkpoint import (
    prune_train_versions,
    retire_train_versions,
    train_version_path,
    train_versions,
)
from spotlight.workers.train.train_worker import FlowGRPOTrainer
from tests.unit.spawned import exit_together
from tests.unit.workers.train.test_train_worker import ROLLOUT_MBS, TEXT_DIM, _select, make_rollout

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")

VARIANTS = {"full": {}, "full_kl": {"kl_beta": 0.3}, "lora": {"lora_rank": 4, "kl_beta": 0.1}}


def _cfg(**train) -> SpotlightConfig:
    return SpotlightConfig(train=TrainConfig(**train))


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _trainer_state(tr: FlowGRPOTrainer) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter and every AdamW state tensor (copies)."""
    out = {f"param/{n}": _local(p) for n, p in tr.model.named_parameters()}
    for i, p in enumerate(tr.params):
        for k, v in tr.optimizer.state.get(p, {}).items():
            out[f"optim/{i}/{k}"] = _local(v) if torch.is_tensor(v) else torch.tensor(v)
    return out


def _diff(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b), set(a) ^ set(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


def _scenario(cfg, rank, world, batch, mbs, ckpt: str) -> tuple[list[str], list[str], int]:
    """(A) step, save, step; (B) fresh trainer, load, step; return the differing keys."""
    dev = torch.device("cpu")
    a = FlowGRPOTrainer(cfg, rank=rank, world_size=world, device=dev, text_dim=TEXT_DIM)
    a.train_step(batch, mbs, iteration=0)
    a.save_checkpoint(ckpt)
    torch.manual_seed(1234 + rank)  # disturb the RNG after the save: the load must restore it
    after_save = _trainer_state(a)
    a.train_step(batch, mbs, iteration=1)
    ref = _trainer_state(a)
    ref_rng = torch.get_rng_state()
    b = FlowGRPOTrainer(cfg, rank=rank, world_size=world, device=dev, text_dim=TEXT_DIM)
    b.load_checkpoint(ckpt)
    loaded_diff = _diff(after_save, _trainer_state(b))
    torch.manual_seed(1234 + rank)
    b.train_step(batch, mbs, iteration=1)
    assert torch.equal(torch.get_rng_state(), ref_rng)
    return loaded_diff, _diff(ref, _trainer_state(b)), b.steps_done


@pytest.fixture(scope="module")
def pg():
    torch.set_num_threads(1)
    fd, path = tempfile.mkstemp(prefix="spotlight-pg-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def rollout():
    return make_rollout(_cfg())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_matches_uninterrupted_one_rank(pg, rollout, tmp_path, variant):
    cfg = _cfg(**VARIANTS[variant])
    ckpt = train_version_path(tmp_path / "train", 1)
    loaded_diff, diff, steps = _scenario(cfg, 0, 1, rollout, ROLLOUT_MBS, str(ckpt))
    assert loaded_diff == [], loaded_diff  # the load restores exactly the saved state
    assert diff == [], diff  # and the next step equals the uninterrupted one
    assert steps == 2
    assert train_versions(tmp_path / "train") == [1]
    names = sorted(p.name for p in ckpt.iterdir())
    assert ".metadata" in names and "rng_rank0.json" in names
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "train").iterdir())


def test_lora_checkpoint_holds_only_the_adapter(pg, rollout, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    tr = FlowGRPOTrainer(_cfg(**VARIANTS["lora"]), rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    tr.train_step(rollout, ROLLOUT_MBS, iteration=0)
    tr.save_checkpoint(tmp_path / "v000001")
    keys = FileSystemReader(str(tmp_path / "v000001")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)
    full = FlowGRPOTrainer(_cfg(), rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    full.save_checkpoint(tmp_path / "full")
    with pytest.raises(
        RuntimeError, match="does not match"
    ):  # a full fine-tuning checkpoint does not fit a LoRA trainer
        tr.load_checkpoint(tmp_path / "full")


def test_save_replaces_and_missing_checkpoint_raises(pg, rollout, tmp_path):
    cfg = _cfg()
    tr = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    path = tmp_path / "v000003"
    tr.save_checkpoint(path)
    first = _trainer_state(tr)
    tr.train_step(rollout, ROLLOUT_MBS, iteration=0)
    (tmp_path / ".tmp-v000003").mkdir()  # leftover of a crashed save of the same version
    tr.save_checkpoint(path)  # replaces the old one
    fresh = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    fresh.load_checkpoint(path)
    assert _diff(_trainer_state(tr), _trainer_state(fresh)) == []
    assert _diff(
        {k: v for k, v in first.items() if k.startswith("param/")},
        {k: v for k, v in _trainer_state(fresh).items() if k.startswith("param/")},
    )
    with pytest.raises(FileNotFoundError):
        fresh.load_checkpoint(tmp_path / "v000009")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003"]


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_roll_back_restores_the_best_version_and_lowers_the_learning_rate(pg, rollout, tmp_path, variant):
    """The collapse guard's rollback (docs/collapse-guard.md): the trainer returns to the
    checkpoint of an earlier version (weights and AdamW state exactly) with a lower learning rate,
    and that rate survives the next checkpoint and a resume."""
    cfg = _cfg(**VARIANTS[variant], learning_rate=1e-3)
    dev = torch.device("cpu")
    tr = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=dev, text_dim=TEXT_DIM)
    tr.train_step(rollout, ROLLOUT_MBS, iteration=0)
    tr.save_checkpoint(train_version_path(tmp_path, 1))
    best = _trainer_state(tr)
    tr.train_step(rollout, ROLLOUT_MBS, iteration=1)
    assert _diff(best, _trainer_state(tr))  # trained on: the state moved
    assert tr.roll_back(train_version_path(tmp_path, 1), 0.5) == pytest.approx(5e-4)
    assert _diff(best, _trainer_state(tr)) == [] and tr.learning_rate == pytest.approx(5e-4)
    tr.save_checkpoint(train_version_path(tmp_path, 3))
    again = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=dev, text_dim=TEXT_DIM)
    assert again.learning_rate == pytest.approx(1e-3)
    again.load_checkpoint(train_version_path(tmp_path, 3))
    assert again.learning_rate == pytest.approx(5e-4)  # resumed after a rollback: the lowered rate
    assert tr.roll_back(train_version_path(tmp_path, 1), 0.5) == pytest.approx(2.5e-4)  # compounds


def test_train_versions_and_retention(tmp_path):
    root = tmp_path / "train"
    for v in (1, 2, 3, 4):
        d = train_version_path(root, v)
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"x")
    train_version_path(root, 5).mkdir()  # no .metadata: incomplete
    (root / ".tmp-v000006").mkdir()  # crashed save
    assert train_versions(root) == [1, 2, 3, 4]
    assert prune_train_versions(root, keep=2, protect=1) == [2]
    assert train_versions(root) == [1, 3, 4]
    assert not (root / ".tmp-v000006").exists()
    assert prune_train_versions(root, keep=2) == [1]
    for v in (5, 6):
        (train_version_path(root, v)).mkdir(exist_ok=True)
        (train_version_path(root, v) / ".metadata").write_bytes(b"x")
    assert prune_train_versions(root, keep=1, protect={3, 5}) == [4]  # several kept: best and pending versions
    assert train_versions(root) == [3, 5, 6]
    with pytest.raises(ValueError):
        prune_train_versions(root, keep=0)
    assert train_versions(tmp_path / "nowhere") == []


def test_retention_keeps_the_resume_point_and_drops_a_rerun_iterations_leftovers(tmp_path):
    """run.keep_train_checkpoints: the newest K versions a run checkpoint can name (<= the
    committed version) stay; versions above it were written by an iteration a resume runs
    again and go."""
    root = tmp_path / "train"

    def make(*versions):
        for v in versions:
            d = train_version_path(root, v)
            d.mkdir(parents=True, exist_ok=True)
            (d / ".metadata").write_bytes(b"x")

    make(1, 2, 3)
    # TRAIN_BATCH of version 3 arrives: the run checkpoint naming v3 is written; keep 1
    assert retire_train_versions(root, 1, committed=3) == [1, 2]
    assert train_versions(root) == [3]
    make(4)  # saved during that iteration, before the coordinator's run checkpoint names it
    # a crash now: the resume starts from v3; its first TRAIN_BATCH (version 3) retires v4
    (root / ".tmp-v000005").mkdir()
    assert retire_train_versions(root, 1, committed=3) == [4]
    assert train_versions(root) == [3] and not (root / ".tmp-v000005").exists()
    make(4, 5)
    assert retire_train_versions(root, 2, committed=5) == [3]
    assert train_versions(root) == [4, 5]
    assert retire_train_versions(tmp_path / "nowhere", 1, committed=0) == []
    with pytest.raises(ValueError):
        retire_train_versions(root, 0, committed=5)


def _two_rank(rank: int, world: int, store_path: str, out_dir: str, batch: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        rows, mbs = ([0, 1, 2], [[0], [1], [2]]) if rank == 0 else ([3, 4, 5], [[0, 1, 2]])
        result = {}
        for name in ("full", "lora"):
            ckpt = os.path.join(out_dir, name, "v000001")
            loaded_diff, diff, steps = _scenario(_cfg(**VARIANTS[name]), rank, world, _select(batch, rows), mbs, ckpt)
            result[name] = {"loaded_diff": loaded_diff, "diff": diff, "steps": steps, "files": sorted(os.listdir(ckpt))}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        exit_together()
    finally:
        dist.destroy_process_group()


def test_resume_matches_uninterrupted_two_ranks(rollout, tmp_path):
    mp.spawn(_two_rank, args=(2, str(tmp_path / "store"), str(tmp_path), rollout), nprocs=2, join=True)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("full", "lora"):
            r = res[name]
            assert r["loaded_diff"] == [] and r["diff"] == [] and r["steps"] == 2, (rank, name, r)
            assert {"rng_rank0.json", "rng_rank1.json", ".metadata"} <= set(r["files"])
            assert sum(f.endswith(".distcp") for f in r["files"]) == 2  # one shard file per rank


def test_process_checkpoints_and_resumes(rollout, tmp_path):
    """``main()`` with --checkpoint-dir saves v1 after a TRAIN_BATCH; a new process with
    --resume-version 1 reports version 1 and publishes the same v1 weights."""
    import subprocess
    import sys

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
    from tests.unit.workers.train.test_train_worker import _free_port, recv_version

    init_keys(tmp_path / "keys")
    ctx = zmq.Context()
    auth = Authenticator(ctx, load_server_keys(tmp_path / "keys"))
    auth.start()
    write_client_file(tmp_path / "trainer.json", ephemeral_client(auth.keys, "trainer", "test"))
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    apply_server(router, auth.keys)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peer = {}
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    ckdir = tmp_path / "train"

    def start(*extra):
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
            json.dumps(config_to_dict(_cfg())),
            "--master-port",
            str(_free_port()),
            "--text-dim",
            str(TEXT_DIM),
            "--checkpoint-dir",
            str(ckdir),
            *extra,
        ]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def recv(proc):
        if not poller.poll(120_000):
            proc.kill()
            pytest.fail("trainer process went silent:\n" + proc.communicate()[0].decode(errors="replace"))
        peer["id"], *frames = router.recv_multipart()
        return P.decode(frames)

    def stop(proc):
        router.send_multipart([peer["id"], *P.encode(P.Shutdown(reason="done"))])
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode(errors="replace")

    procs = []
    try:
        procs.append(p1 := start())
        assert recv(p1)[0] == P.MsgType.TRAIN_READY
        mtype, body, _ = recv(p1)
        assert mtype == P.MsgType.WEIGHTS and body.version == 0
        recv_version(lambda: recv(p1), body)
        metas, frames = tensor_wire.pack_tensors(rollout)
        router.send_multipart(
            [
                peer["id"],
                *P.encode(P.TrainBatch(iteration=0, version=0, micro_batches=ROLLOUT_MBS, tensors=metas), frames),
            ]
        )
        mtype, body, payload = recv(p1)
        assert mtype == P.MsgType.WEIGHTS and body.version == 1
        v1 = recv_version(lambda: recv(p1), body)
        assert recv(p1)[0] == P.MsgType.TRAIN_DONE
        assert train_versions(ckdir) == [1]  # saved before TRAIN_DONE
        stop(p1)

        procs.append(p2 := start("--resume-version", "1"))
        mtype, body, _ = recv(p2)
        assert mtype == P.MsgType.TRAIN_READY and body.version == 1
        mtype, body, payload = recv(p2)
        assert mtype == P.MsgType.WEIGHTS and body.version == 1
        again = recv_version(lambda: recv(p2), body)
        assert set(again) == set(v1) and all(torch.equal(again[k], v1[k]) for k in v1)
        stop(p2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        router.close()
        auth.stop()
        ctx.term()
