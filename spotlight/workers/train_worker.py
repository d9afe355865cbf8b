"""Train Worker: the Flow-GRPO update of the DiT under FSDP2, and its process entry.

:class:`FlowGRPOTrainer` is the compute (usable in-process, tests drive it directly);
:func:`main` is the process (``python -m spotlight.workers.train_worker ...``) that talks
to the coordinator over a ZeroMQ DEALER (identity ``trainer-<rank>``)::

    → TRAIN_READY(rank, world_size, version=0)      (rank 0 also → WEIGHTS v0 + blob)
    ← TRAIN_BATCH  → train_step → full state dict → (rank 0) WEIGHTS v+1 + blob
                                                   → TRAIN_DONE(rank, iteration, v+1)
    ← SHUTDOWN("save:<path>") → save_pretrained(path) → TRAIN_DONE(rank, -1, -1) (ack)
    ← SHUTDOWN                → exit

One ``train_step`` is one optimizer step over the rank's samples (Flow-GRPO,
algorithms.md §1.5): every micro-batch is recomputed with the *current* weights and the
same batch composition as the rollout, so on fresh samples the policy ratio is exactly
1 (the Flow-GRPO debug check, reported as ``train/ratio_max_dev == 0.0``).

Collective rules (FSDP2 issues one all-gather / reduce-scatter per block per
forward/backward, so every rank must run the same number of them):

* the local micro-batch count is all-reduced with MAX; a rank with fewer runs extra
  forward/backward passes on its first micro-batch with the loss multiplied by 0;
* a rank with ZERO samples runs the same number of passes on a one-row dummy
  micro-batch of zeros (text mask of ones so attention stays finite) with weight 0;
* the loss of every rank is divided by the element count (samples × window steps) of
  the whole update summed over ALL ranks, and multiplied by ``world_size`` because FSDP2
  averages gradients over ranks; the gradient therefore equals the one-big-batch
  gradient whatever the split of samples between ranks.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import pathlib
import sys
import time
import warnings

import torch
import torch.distributed as dist

from spotlight.config import SpotlightConfig, config_from_dict, load_config
from spotlight.models.dit import build_transformer, make_velocity_fn, token_shape
from spotlight.rl.grpo import clipped_policy_loss, kl_to_reference
from spotlight.rl.sampler import Conditioning, Sampler

log = logging.getLogger("spotlight.train")

# diffusers returns ``(sample,)``; FSDP2 warns that the output is a view. The sampler never
# modifies it in place, so the warning is noise.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

BATCH_KEYS = ("window_latents", "log_probs", "advantages", "cond.embeds", "cond.mask")


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer_blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class FlowGRPOTrainer:
    """Flow-GRPO optimizer of one FSDP2 rank.

    Args:
        cfg: the run config (``model``, ``sampler``, ``train`` sections are used).
        rank, world_size: this process's place in the (already initialised) process group.
        device: ``cpu`` (gloo) or ``cuda:<i>`` (nccl).
        text_dim: width D of the text embeddings.
        initial_state_dict: weights to start from instead of ``build_transformer``'s.

    The transformer stays in ``eval()`` mode (it has no dropout; this keeps the training
    forward bit-identical to the rollout forward).
    """

    def __init__(
        self,
        cfg: SpotlightConfig,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        text_dim: int = 384,
        initial_state_dict: dict[str, torch.Tensor] | None = None,
    ):
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("FlowGRPOTrainer needs torch.distributed initialised by the caller")
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.text_dim = text_dim
        model = build_transformer(cfg.model, text_dim)
        if initial_state_dict is not None:
            model.load_state_dict(initial_state_dict)
        self._diffusers_config = dict(model.config)
        model.to(self.device)
        # Explicit mesh: on a GPU host FSDP2 would otherwise move CPU params to CUDA (pytorch#132471).
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.reference = None
        if cfg.train.kl_beta > 0:
            ref = copy.deepcopy(model).requires_grad_(False)
            self.reference = _shard(ref, self.mesh)
        self.model = _shard(model, self.mesh)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.train.learning_rate,
            betas=tuple(cfg.train.adam_betas),
            weight_decay=cfg.train.weight_decay,
        )
        self.sampler = Sampler(cfg.sampler, token_shape(cfg.model))
        self.velocity_fn = self._on_device(make_velocity_fn(self.model, cfg.model))
        self.ref_velocity_fn = (
            self._on_device(make_velocity_fn(self.reference, cfg.model)) if self.reference is not None else None
        )
        self.steps_done = 0

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _on_device(fn):
        """The sampler builds ``sigma`` on the CPU; move it next to the latents (CUDA runs)."""

        def velocity_fn(latents, sigma, cond):
            return fn(latents, sigma.to(latents.device), cond)

        return velocity_fn

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _dummy_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One-row zero micro-batch for a rank without samples (its loss weight is 0)."""
        w = self.cfg.sampler.sde_window_size
        seq, ch = token_shape(self.cfg.model)
        t = batch["cond.embeds"].shape[1] if "cond.embeds" in batch and batch["cond.embeds"].ndim == 3 else 1
        t = max(int(t), 1)
        return {
            "window_latents": torch.zeros(1, w + 1, seq, ch),
            "log_probs": torch.zeros(1, w),
            "advantages": torch.zeros(1),
            "cond.embeds": torch.zeros(1, t, self.text_dim),
            "cond.mask": torch.ones(1, t, dtype=torch.int64),
        }

    def _forward(self, mb: dict[str, torch.Tensor]):
        cond = Conditioning(mb["cond.embeds"], mb["cond.mask"])
        log_probs, results = self.sampler.window_log_probs(self.velocity_fn, mb["window_latents"], cond)
        kl = None
        if self.reference is not None:
            with torch.no_grad():
                _, ref_results = self.sampler.window_log_probs(self.ref_velocity_fn, mb["window_latents"], cond)
            kl = sum(kl_to_reference(r.mean, rr.mean.detach(), r.std) for r, rr in zip(results, ref_results))
        return log_probs, kl

    # ------------------------------------------------------------------ training

    def train_step(self, batch: dict[str, torch.Tensor], micro_batches: list[list[int]], *, iteration: int) -> dict[str, float]:
        """One optimizer step over this rank's samples (collective: every rank calls it).

        Args:
            batch: this rank's tensors (see :data:`BATCH_KEYS`), ``N`` rows (may be 0).
            micro_batches: row indices per micro-batch, the rollout batches.
            iteration: for logging only.

        Returns:
            Metrics reduced over all ranks (sums over all samples × window steps / count).
        """
        t0 = time.perf_counter()
        dev = self.device
        tensors = {k: batch[k].to(dev) for k in BATCH_KEYS if k in batch}
        for k in ("window_latents", "log_probs", "advantages", "cond.embeds"):
            if k in tensors:
                tensors[k] = tensors[k].float()
        micro_batches = [list(mb) for mb in micro_batches if len(mb) > 0]
        w = self.cfg.sampler.sde_window_size
        local_count = sum(len(mb) for mb in micro_batches) * w
        n_local = sum(len(mb) for mb in micro_batches)
        total_count, total_samples, max_mbs = 0.0, 0.0, 0.0
        total_count, total_samples = self._all_reduce([float(local_count), float(n_local)])
        (max_mbs,) = self._all_reduce([float(len(micro_batches))], op=dist.ReduceOp.MAX)
        max_mbs = int(max_mbs)
        if total_count == 0:
            log.warning("iteration %d: empty update on every rank; skipping the optimizer step", iteration)
            return {"train/num_samples": 0.0}
        scale = float(self.world_size) / total_count  # FSDP2 averages grads over ranks

        if micro_batches:
            real = [{k: v[torch.as_tensor(mb, device=v.device)] for k, v in tensors.items()} for mb in micro_batches]
        else:
            real = [{k: v.to(dev) for k, v in self._dummy_batch(tensors).items()}]
        sums = {"loss": 0.0, "ratio_sum": 0.0, "clipped": 0.0, "approx_kl": 0.0, "kl": 0.0}
        max_dev = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for i in range(max_mbs):
            padding = i >= len(micro_batches)
            mb = real[0] if padding else real[i]
            log_probs, kl = self._forward(mb)
            if padding:
                # Same collectives as a real pass, zero gradient (NaN-safe: no exp of garbage).
                loss = log_probs.sum() * 0.0
                if kl is not None:
                    loss = loss + kl * 0.0
            else:
                policy, stats = clipped_policy_loss(
                    log_probs, mb["log_probs"], mb["advantages"],
                    clip_range=self.cfg.train.clip_range, adv_clip_max=self.cfg.train.adv_clip_max,
                )
                loss = policy
                if kl is not None:
                    loss = loss + self.cfg.train.kl_beta * kl
                    sums["kl"] += float(kl.detach())
                sums["loss"] += float(loss.detach())
                sums["ratio_sum"] += float(stats["ratio_sum"])
                sums["clipped"] += float(stats["clipped"])
                sums["approx_kl"] += float(stats["approx_kl"])
                max_dev = max(max_dev, float(stats["ratio_max_dev"]))
            (loss * scale).backward()

        max_norm = self.cfg.train.max_grad_norm if self.cfg.train.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1

        keys = list(sums)
        reduced = dict(zip(keys, self._all_reduce([sums[k] for k in keys])))
        (max_dev,) = self._all_reduce([max_dev], op=dist.ReduceOp.MAX)
        metrics = {
            "train/loss": reduced["loss"] / total_count,
            "train/ratio_mean": reduced["ratio_sum"] / total_count,
            "train/ratio_max_dev": max_dev,
            "train/clipfrac": reduced["clipped"] / total_count,
            "train/approx_kl": reduced["approx_kl"] / total_count,
            "train/grad_norm": float(grad_norm),
            "train/kl": reduced["kl"] / total_count,
            "train/num_samples": total_samples,
        }
        log.info(
            "iteration %d rank %d: %d local samples, %d passes (%d real), loss %.4g, ratio_max_dev %.3g, %.2fs",
            iteration, self.rank, n_local, max_mbs, len(micro_batches), metrics["train/loss"],
            max_dev, time.perf_counter() - t0,
        )
        return metrics

    # ------------------------------------------------------------------ weights

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 CPU state dict on rank 0 (unwrapped keys), ``{}`` elsewhere. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        # On a CPU mesh of one rank the "full" tensors alias the live parameters, which the
        # optimizer updates in place: copy them so the returned dict is a snapshot.
        copy_needed = self.device.type == "cpu"
        return {k: v.detach().to("cpu", torch.float32, copy=copy_needed) for k, v in sd.items()}

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write an unwrapped diffusers copy on rank 0 (loadable with ``from_pretrained``). Collective."""
        sd = self.full_state_dict()
        if self.rank == 0:
            from diffusers import QwenImageTransformer2DModel

            model = QwenImageTransformer2DModel.from_config(self._diffusers_config)
            model.load_state_dict(sd)
            pathlib.Path(path).mkdir(parents=True, exist_ok=True)
            model.save_pretrained(str(path))
            log.info("saved weights to %s", path)
        dist.barrier()


# ---------------------------------------------------------------------- process


def _load_cfg(text: str) -> SpotlightConfig:
    text = text.strip()
    if text.startswith("{"):
        return config_from_dict(json.loads(text))
    p = pathlib.Path(text)
    if p.suffix == ".toml":
        return load_config(p)
    return config_from_dict(json.loads(p.read_text()))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="spotlight.workers.train_worker")
    ap.add_argument("--coordinator", required=True, help="tcp://host:port of the coordinator ROUTER")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--config-json", required=True, help="JSON text, a .json file or a .toml file")
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--text-dim", type=int, default=384)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import zmq

    from spotlight import protocol as P
    from spotlight import tensor_wire

    args = _parse(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s trainer-{args.rank} %(levelname)s %(message)s")
    cfg = _load_cfg(args.config_json)
    torch.set_num_threads(max(1, cfg.cluster.torch_threads))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local = args.rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{args.master_port}",
        rank=args.rank,
        world_size=args.world_size,
    )
    trainer = FlowGRPOTrainer(cfg, rank=args.rank, world_size=args.world_size, device=device, text_dim=args.text_dim)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"trainer-{args.rank}".encode())
    sock.setsockopt(zmq.LINGER, 10_000)
    sock.connect(args.coordinator)
    version = 0

    def publish(ver: int) -> None:
        sd = trainer.full_state_dict()
        if args.rank == 0:
            blob = tensor_wire.state_dict_to_bytes(sd)
            sock.send_multipart(P.encode(P.Weights(version=ver, size_bytes=len(blob)), [blob]))

    sock.send_multipart(P.encode(P.TrainReady(rank=args.rank, world_size=args.world_size, version=version)))
    publish(version)
    log.info("ready (world %d, device %s)", args.world_size, device)
    parent = os.getppid()
    try:
        while True:
            if not sock.poll(1000):
                if os.getppid() != parent:  # the coordinator died: nothing will ever come
                    log.error("coordinator process is gone; train worker exiting")
                    return 3
                continue
            frames = sock.recv_multipart(copy=True)
            try:
                mtype, body, payload = P.decode(frames)
                if mtype == P.MsgType.TRAIN_BATCH:
                    tensors = tensor_wire.unpack_tensors(body.tensors, payload)
                    missing = [k for k in BATCH_KEYS if k not in tensors]
                    if missing:
                        raise P.ProtocolError(f"TRAIN_BATCH lacks tensors {missing}")
            except P.ProtocolError as exc:
                log.warning("dropping malformed message: %s", exc)
                continue
            if mtype == P.MsgType.TRAIN_BATCH:
                t0 = time.perf_counter()
                metrics = trainer.train_step(tensors, body.micro_batches, iteration=body.iteration)
                version = body.version + 1
                publish(version)
                sock.send_multipart(P.encode(P.TrainDone(
                    rank=args.rank, iteration=body.iteration, new_version=version,
                    metrics=metrics, train_s=time.perf_counter() - t0,
                )))
            elif mtype == P.MsgType.SHUTDOWN:
                if body.reason.startswith("save:"):
                    trainer.save_pretrained(body.reason[len("save:"):])
                    sock.send_multipart(P.encode(P.TrainDone(rank=args.rank, iteration=-1, new_version=-1)))
                    continue
                log.info("shutdown: %s", body.reason or "(no reason)")
                break
            else:
                log.warning("ignoring unexpected %s", mtype.name)
    finally:
        sock.close()
        ctx.term()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
