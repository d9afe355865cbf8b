"""Train Worker: the Flow-GRPO update of the DiT under FSDP2, and its process entry.

:class:`FlowGRPOTrainer` is the compute (usable in-process, tests drive it directly);
:func:`main` is the process (``python -m spotlight.workers.train.train_worker ...``) that talks
to the coordinator over a CURVE-encrypted ZeroMQ DEALER (the coordinator's loopback trainer socket)::

    → TRAIN_READY(rank, world_size, version=0)      (rank 0 also → version v0, see below)
                  (with --resume-version N: load the trainer checkpoint, version=N, publish vN)
    ← TRAIN_BATCH  → [rank 0: retention of DIR] → train_step → [checkpointed iteration: save DIR/v{v+1:06d}]
                   → full state dict → (rank 0) publish v+1
                                                   → TRAIN_DONE(rank, iteration, v+1)

Publishing a version (rank 0): the state dict is written to ``--spool-dir`` as a safetensors
file (:func:`spotlight.store.tensor_wire.save_version`, digested on the way), then streamed as a
WEIGHTS header and ``cluster.weight_chunk_bytes`` WEIGHTS_CHUNK messages, zero-copy from a
memory map of the file (:func:`spotlight.store.weight_sync.send_version`); the file is unlinked
as soon as it is mapped. No whole-version byte string is ever built.
    ← SHUTDOWN("save:<path>") → save_pretrained(path) → TRAIN_DONE(rank, -1, -1) (ack)
    ← SHUTDOWN                → exit

One ``train_step`` is one optimizer step over the rank's samples (Flow-GRPO,
docs/flow-grpo.md §1.5): every micro-batch is recomputed with the *current* weights and the
same batch composition as the rollout, so on fresh samples the policy ratio is exactly
1 (the Flow-GRPO debug check, reported as ``train/ratio_max_dev == 0.0``).

Collective rules (FSDP2 issues one all-gather / reduce-scatter per block per
forward/backward, so every rank must run the same number of them):

* a micro-batch is a rollout batch, cut into pieces of at most ``train.micro_batch_size``
  rows; each runs one forward/backward pass per SDE window step (backward of step j before
  the forward of step j + 1, as Flow-GRPO does), so a rank runs micro-batches × window steps
  passes, with gradients accumulated into the minibatch's one optimizer step;
* the local micro-batch count is all-reduced with MAX (the window size is the same on every
  rank); a rank with fewer runs extra passes on its first micro-batch with the loss
  multiplied by 0;
* a rank with ZERO samples runs the same number of passes on a one-row dummy
  micro-batch of zeros (text mask of ones so attention stays finite) with weight 0;
* the loss of every rank is divided by the element count (samples × window steps) of
  the whole update summed over ALL ranks, and multiplied by ``world_size`` because FSDP2
  averages gradients over ranks; the gradient therefore equals the one-big-batch
  gradient whatever the split of samples between ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import pathlib
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from spotlight.config import SpotlightConfig, config_from_dict, load_config
from spotlight.models.families import get_family, torch_dtype
from spotlight.models.lora import adapter_metadata, add_lora, lora_spec
from spotlight.rl.grpo import clipped_policy_loss, kl_to_reference
from spotlight.rl.sampler import Conditioning, Sampler
from spotlight.util.procs import spawned_by

log = logging.getLogger("spotlight.train")

# diffusers returns ``(sample,)``; FSDP2 warns that the output is a view. The sampler never
# modifies it in place, so the warning is noise.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

BATCH_KEYS = ("window_latents", "log_probs", "advantages", "cond.embeds", "cond.mask")
"""Tensors every TRAIN_BATCH carries; also ``cond.<extra>`` (pooled, neg.*), optional
``window_start [N] int64`` (random SDE window) and ``pad.cond.*`` (one row of conditioning for
a rank that got no samples)."""


def _shard(model: torch.nn.Module, mesh, block_names: tuple[str, ...], mp_policy=None) -> torch.nn.Module:
    """FSDP2: one ``fully_shard`` per transformer block (each list in ``block_names``), then the root."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for name in block_names:
        for block in getattr(model, name, []):
            fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _split_micro_batches(micro_batches: list[list[int]], size: int | None) -> list[list[int]]:
    """Cut every micro-batch longer than ``size`` rows into consecutive pieces of ``size``
    (the last may be shorter); None keeps the rollout micro-batches as they are. Rollout
    micro-batches are never merged: a forward of the rollout's own batch reproduces its
    log-probs bit for bit."""
    if size is None:
        return micro_batches
    return [mb[i : i + size] for mb in micro_batches for i in range(0, len(mb), size)]


def _is_meta(t: torch.Tensor) -> bool:
    return (t.to_local() if hasattr(t, "to_local") else t).is_meta


def _checkpoint_blocks(model: torch.nn.Module, block_names: tuple[str, ...]) -> None:
    """Activation checkpointing per transformer block: each block's ``forward`` runs under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, so the backward recomputes the
    block's activations from its inputs instead of keeping them (docs/memory.md).

    Applied before ``fully_shard`` (the torchtitan order): FSDP2's hooks stay outside the
    checkpointed region, so the recompute runs on the parameters FSDP2 unshards for the
    block's backward. The block's ``forward`` is wrapped in place rather than the block in a
    ``CheckpointWrapper``: parameter names (state dicts, published versions, DCP checkpoints)
    stay those of the diffusers model.
    """
    import functools

    from torch.utils.checkpoint import checkpoint

    for name in block_names:
        for block in getattr(model, name, []):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _cast_params(model: torch.nn.Module, dtype_of) -> None:
    """Give each (meta) parameter the dtype ``dtype_of(name)`` (buffers untouched)."""
    for name, p in model.named_parameters():
        p.data = p.data.to(dtype_of(name))


def _set_full_state(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """``set_model_state_dict`` of rank 0's full tensors (``{}`` elsewhere) into ``model``'s shards. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    with warnings.catch_warnings():
        # all-meta parameters make torch ask the process group for its device (its own deprecated call)
        warnings.filterwarnings("ignore", message=r"`_get_pg_default_device` will be deprecated")
        warnings.filterwarnings("ignore", message=r"Multiple backends are registered with this ProcessGroup")
        set_model_state_dict(model, state_dict, options=opts)


def _minibatches(micro_batches: list[list[int]], steps: int) -> list[list[list[int]]]:
    """Split the rank's rollout micro-batches into ``steps`` consecutive minibatches (some may be empty)."""
    n = len(micro_batches)
    bounds = [round(i * n / steps) for i in range(steps + 1)]
    return [micro_batches[bounds[i] : bounds[i + 1]] for i in range(steps)]


@dataclasses.dataclass
class _StepTally:
    """This rank's running totals over the minibatches of one :meth:`FlowGRPOTrainer.train_step`."""

    sums: dict[str, float] = dataclasses.field(
        default_factory=lambda: {
            "loss": 0.0,
            "ratio_sum": 0.0,
            "clipped": 0.0,
            "approx_kl": 0.0,
            "kl": 0.0,
            "count": 0.0,
        }
    )
    """Loss and ratio statistics summed over samples × window steps (``count`` is their number)."""
    first_dev: float = 0.0
    """Max ``|ratio - 1|`` of the first optimizer step (on-policy: 0 on fresh samples)."""
    later_dev: float = 0.0
    """Max ``|ratio - 1|`` of the later, slightly off-policy steps."""
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    """Gradient norm of every step taken."""
    steps: int = 0
    skipped: int = 0

    def record_ratio_dev(self, dev: float) -> None:
        """File the ratio deviation of the minibatch just stepped (or skipped) as first or later."""
        if self.steps + self.skipped == 1:
            self.first_dev = dev
        else:
            self.later_dev = max(self.later_dev, dev)


class FlowGRPOTrainer:
    """Flow-GRPO optimizer of one FSDP2 rank.

    Args:
        cfg: the run config (``model``, ``sampler``, ``train`` sections are used).
        rank, world_size: this process's place in the (already initialised) process group.
        device: ``cpu`` (gloo) or ``cuda:<i>`` (nccl).
        num_nodes: nodes the group spans (ranks laid out node by node). 1: FSDP2 over every
            rank (a 1-D mesh); more: HSDP, a 2-D mesh ``(num_nodes, ranks per node)`` named
            ``("replicate", "shard")``: parameters sharded over each node's GPUs, replicated
            across nodes (:func:`spotlight.workers.train.launch_env.mesh_shape`).
        text_dim: width D of the text embeddings (tiny family only; other families read it
            from their checkpoint).
        initial_state_dict: weights to start from instead of the family's (full fine-tuning).

    Build (the torchtitan way, docs/memory.md): the transformer is built from its config with
    every parameter on ``meta`` (:meth:`~spotlight.models.families.base.ModelFamily.build_empty_transformer`),
    LoRA is added to it, ``fully_shard`` wraps each transformer block then the root, and only
    then do the weights arrive, each rank receiving its own shards (:meth:`_load_weights`:
    rank 0 reads the checkpoint file by file and ``set_model_state_dict`` broadcasts it with
    ``broadcast_from_rank0``). No rank ever holds the whole model on its device.

    Gradient scale under HSDP: FSDP2 reduce-scatters (averages) each gradient over the ``shard``
    group and then all-reduces (averages) it over the ``replicate`` group, i.e. it averages over
    all ``world_size`` ranks exactly as the 1-D mesh does, so the loss scaling of
    :meth:`train_step` (× ``world_size`` / the global element count) gives the one-big-batch
    gradient on either mesh.

    Precision: the master weights and optimizer state are float32. On CUDA (``train.mixed_precision``
    auto/bf16) FSDP2's ``MixedPrecisionPolicy`` runs forward/backward in bfloat16 with float32
    gradient reduction. Log-probs, ratios, advantages, KL and the loss are float32 (the sampler
    casts inside each step).

    LoRA (``train.lora_rank > 0``): the base transformer is frozen (in the compute dtype: bf16
    on CUDA), only the adapter trains (float32) and is published; the KL reference is the same
    model with the adapter disabled (Flow-GRPO), no copy. Full fine-tuning with ``kl_beta > 0``:
    the reference is a second meta-built model, sharded and loaded the same way, frozen, in
    the compute dtype.

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
        num_nodes: int = 1,
    ):
        from torch.distributed.device_mesh import init_device_mesh

        from spotlight.workers.train.launch_env import MESH_DIM_NAMES, mesh_shape

        if not dist.is_initialized():
            raise RuntimeError("FlowGRPOTrainer needs torch.distributed initialised by the caller")
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.text_dim = text_dim
        self.family = get_family(cfg.model, text_dim=text_dim)
        self.lora = lora_spec(cfg.train)
        self.compute_dtype = self._compute_dtype()
        mp_policy = None
        if self.compute_dtype != torch.float32:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp_policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        # Explicit mesh: on a GPU host FSDP2 would otherwise move CPU params to CUDA (pytorch#132471).
        shape = mesh_shape(world_size, num_nodes)
        names = MESH_DIM_NAMES if len(shape) == 2 else None
        self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        self.num_nodes = num_nodes
        if names is not None:
            log.info("HSDP mesh: %d nodes × %d ranks per node %s", shape[0], shape[1], names)
        blocks = self.family.block_names
        # Build on meta, shard, then load the shards (class docstring): no rank ever holds
        # the whole model in device memory, only rank 0 one checkpoint file at a time on the host.
        model = self.family.build_empty_transformer()
        self._diffusers_config = dict(model.config)
        if self.lora:
            n = add_lora(model, self.lora, self.family.default_lora_targets, seed=cfg.model.init_seed)
            log.info("LoRA r=%d α=%g: %d trainable parameters", self.lora["rank"], self.lora["alpha"], n)
            # the frozen base in the compute dtype (bf16 on CUDA), the adapter in fp32
            _cast_params(model, lambda name: torch.float32 if "lora_" in name else self.compute_dtype)
        ac = cfg.train.activation_checkpointing
        self.activation_checkpointing = self.family.activation_checkpointing if ac is None else ac
        if self.activation_checkpointing:
            _checkpoint_blocks(model, blocks)
        self.reference = None
        targets = [(model, None)]
        if cfg.train.kl_beta > 0 and not self.lora:
            ref = self.family.build_empty_transformer().requires_grad_(False)
            _cast_params(ref, lambda name: self.compute_dtype)  # frozen: the compute dtype is enough
            self.reference = _shard(ref, self.mesh, blocks, mp_policy)
            targets.append((self.reference, self.compute_dtype))
        self.model = _shard(model, self.mesh, blocks, mp_policy)
        self.was_meta_before_load = all(_is_meta(p) for p in self.model.parameters())
        """Every parameter was on ``meta`` until :meth:`_load_weights` (tests check it)."""
        self._load_weights(targets, initial_state_dict)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.train.learning_rate,
            betas=tuple(cfg.train.adam_betas),
            weight_decay=cfg.train.weight_decay,
        )
        self.sampler = Sampler(
            cfg.sampler, self.family.latent_shape, self.family.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
        )
        self.velocity_fn = self.family.make_velocity_fn(self.model)
        self.steps_done = 0
        self.steps_skipped = 0

    # ------------------------------------------------------------------ weights in
    def _weight_chunks(self, initial_state_dict: dict[str, torch.Tensor] | None) -> list:
        """Rank 0: loaders of the starting weights, one full (unsharded) CPU state dict each:
        ``initial_state_dict``, else one per safetensors file of the checkpoint (a sharded
        checkpoint never has to fit in memory at once), else the family's own
        :meth:`~spotlight.models.families.base.ModelFamily.build_transformer` (the tiny family
        built from config: seeded init; ``.bin`` weights). Each loader comes with its key names."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        if initial_state_dict is not None:
            return [(lambda: initial_state_dict, set(initial_state_dict))]
        files = self.family.transformer_weight_files()
        if files:
            chunks = []
            for f in files:
                with safe_open(str(f), framework="pt") as fh:
                    keys = set(fh.keys())
                chunks.append((lambda f=f: load_file(str(f)), keys))
            return chunks
        sd = self.family.build_transformer(torch.float32).state_dict()
        return [(lambda: sd, set(sd))]

    def _load_weights(self, targets: list, initial_state_dict: dict[str, torch.Tensor] | None) -> None:
        """Fill the meta-built, already sharded ``targets`` (``(model, dtype or None)``: None =
        the model's own parameter dtypes) with the starting weights. Collective.

        Rank 0 reads the checkpoint, one safetensors file at a time, and
        ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
        broadcast_from_rank0=True))`` broadcasts it tensor by tensor; every rank keeps only its
        own slice (other ranks pass ``{}``). Chosen over each rank reading its slices with
        ``safe_open``: it needs no file system shared by the ranks, handles any sharding of the
        checkpoint into files and any placement FSDP2 picks (uneven, padded shards), and the
        key check and dtype cast happen once, on rank 0. Its cost is one full tensor at a time
        in flight per rank, and one checkpoint file in rank 0's host memory.

        LoRA: the adapter's initial weights (:func:`spotlight.models.lora.initial_adapter_state`:
        seeded ``lora_A``, zero ``lora_B``) go the same way, so they are identical on every rank
        and after a restart with the same ``model.init_seed``.

        Raises:
            ModelLoadError: the checkpoint's keys are not the transformer's (on every rank), or a
                parameter is still unloaded afterwards.
        """
        from spotlight.models.families import ModelLoadError
        from spotlight.models.lora import initial_adapter_state

        model = self.model
        names = list(model.state_dict())
        # peft renames an adapted Linear's weight to ``….base_layer.weight``; checkpoints have ``….weight``
        rename = {k.replace(".base_layer", ""): k for k in names if ".base_layer." in k}
        dtypes = {k: v.dtype for k, v in model.state_dict().items()}
        chunks, problem = [], ""
        if self.rank == 0:
            chunks = self._weight_chunks(initial_state_dict)
            have = set().union(*(keys for _, keys in chunks))
            want = {k.replace(".base_layer", "") for k in names if "lora_" not in k}
            missing, unknown = sorted(want - have), sorted(have - want)
            if missing or unknown:
                problem = (
                    f"{self.family.path}: the transformer's weights do not fit its config: "
                    f"{len(missing)} missing (e.g. {missing[:3]}), {len(unknown)} unknown (e.g. {unknown[:3]})"
                )
        num_chunks, problem = self._broadcast_from_rank0(len(chunks), problem)
        if problem:
            raise ModelLoadError(problem)
        for i in range(num_chunks):
            sd = chunks[i][0]() if self.rank == 0 else {}
            for target, dtype in targets:
                part = {}
                if self.rank == 0:
                    for k, v in sd.items():
                        key = rename.get(k, k) if target is model else k
                        part[key] = v.to(dtype or dtypes[key])
                _set_full_state(target, part)
            del sd
        if self.lora:
            adapter = initial_adapter_state(model, self.lora, seed=self.cfg.model.init_seed) if self.rank == 0 else {}
            _set_full_state(model, adapter)
        unloaded = [n for target, _ in targets for n, p in target.named_parameters() if _is_meta(p)]
        if unloaded:
            raise ModelLoadError(f"{len(unloaded)} transformer parameters were not loaded, e.g. {unloaded[:3]}")

    # ------------------------------------------------------------------ helpers
    def _broadcast_from_rank0(self, count: int, text: str) -> tuple[int, str]:
        """Rank 0's ``count`` and ``text`` on every rank, as tensors (no pickle crosses the
        process group: across nodes its transport is the network). Collective."""
        data = text.encode()
        head = torch.tensor([count, len(data)], dtype=torch.int64, device=self._comm_device())
        dist.broadcast(head, src=0)
        body = torch.zeros(int(head[1]), dtype=torch.uint8, device=self._comm_device())
        if self.rank == 0 and data:
            body.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if body.numel():
            dist.broadcast(body, src=0)
        return int(head[0]), bytes(body.cpu().tolist()).decode(errors="replace")

    def _compute_dtype(self) -> torch.dtype:
        """bfloat16 on CUDA (``train.mixed_precision`` auto follows ``model.dtype``), float32 on the CPU."""
        mp = self.cfg.train.mixed_precision
        if self.device.type != "cuda" or mp == "fp32":
            return torch.float32
        return torch.bfloat16 if mp == "bf16" else torch_dtype(self.cfg.model.dtype, self.device)

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _dummy_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One-row zero micro-batch for a rank without samples (its loss weight is 0).

        Conditioning comes from the batch's ``pad.cond.*`` row when the coordinator sent one
        (family extras have the right shapes), else zeros with a text mask of ones."""
        w = self.cfg.sampler.sde_window_size
        shape = tuple(self.family.latent_shape)
        out = {
            "window_latents": torch.zeros(1, w + 1, *shape),
            "log_probs": torch.zeros(1, w),
            "advantages": torch.zeros(1),
        }
        pad = {k[len("pad.") :]: v[:1] for k, v in batch.items() if k.startswith("pad.cond.")}
        if pad:
            out.update(pad)
        else:
            t = max(
                int(batch["cond.embeds"].shape[1]) if "cond.embeds" in batch and batch["cond.embeds"].ndim == 3 else 1,
                1,
            )
            out["cond.embeds"] = torch.zeros(1, t, self.text_dim)
            out["cond.mask"] = torch.ones(1, t, dtype=torch.int64)
        return out

    def _forward(self, mb: dict[str, torch.Tensor], pos: int):
        """Log-probs ``[B, 1]`` of SDE window step ``pos`` under the current weights (with grad)
        and, with ``kl_beta > 0``, the step's KL to the reference (scalar, summed over B)."""
        cond = Conditioning.from_tensors(mb).to(self.device)
        sampler = self.sampler.with_window(int(mb["window_start"][0]) if "window_start" in mb else None)
        log_probs, results = sampler.window_log_probs(self.velocity_fn, mb["window_latents"], cond, [pos])
        if self.cfg.train.kl_beta <= 0:
            return log_probs, None
        with torch.no_grad():
            if self.lora:  # the reference is the policy without its adapter (no copy)
                self.model.disable_adapters()
                try:
                    _, ref_results = sampler.window_log_probs(self.velocity_fn, mb["window_latents"], cond, [pos])
                finally:
                    self.model.enable_adapters()
            else:
                ref_vf = self.family.make_velocity_fn(self.reference)
                _, ref_results = sampler.window_log_probs(ref_vf, mb["window_latents"], cond, [pos])
        r, rr = results[0], ref_results[0]
        kl = kl_to_reference(r.mean, rr.mean.detach(), r.std_dev_t if self.cfg.train.kl_form == "flow_grpo" else r.std)
        return log_probs, kl

    # ------------------------------------------------------------------ training

    def train_step(
        self, batch: dict[str, torch.Tensor], micro_batches: list[list[int]], *, iteration: int
    ) -> dict[str, float]:
        """One iteration's update: ``train.steps_per_iteration`` optimizer steps over this rank's
        samples (collective: every rank calls it).

        The rollout micro-batches are split into consecutive minibatches, one optimizer step
        each (Flow-GRPO ``num_batches_per_epoch``). The first minibatch runs on the rollout
        weights, so its ratio is exactly 1 (``train/ratio_max_dev``); later ones are slightly
        off-policy (``train/offpolicy_ratio_max_dev``) and the clip can act on them.

        A step whose gradient norm is not finite is skipped (weights and optimizer state
        untouched) and counted in ``train/skipped_steps``.

        Args:
            batch: this rank's tensors (see :data:`BATCH_KEYS`), ``N`` rows (may be 0).
            micro_batches: row indices per micro-batch, the rollout batches.
            iteration: for logging only.

        Returns:
            Metrics reduced over all ranks (sums over all samples × window steps / count).
        """
        t0 = time.perf_counter()
        tensors = self._device_tensors(batch)
        micro_batches = [list(mb) for mb in micro_batches if len(mb) > 0]
        w = self.cfg.sampler.sde_window_size
        n_local = sum(len(mb) for mb in micro_batches)
        (total_samples,) = self._all_reduce([float(n_local)])
        if total_samples == 0:
            log.warning("iteration %d: empty update on every rank; skipping the optimizer step", iteration + 1)
            return {"train/num_samples": 0.0, "train/skipped_steps": 0.0, "train/optimizer_steps": 0.0}
        dummy = None
        tally = _StepTally()
        for k, chunk in enumerate(_minibatches(micro_batches, self.cfg.train.steps_per_iteration)):
            chunk = _split_micro_batches(chunk, self.cfg.train.micro_batch_size)
            local_count = sum(len(mb) for mb in chunk) * w
            (total_count,) = self._all_reduce([float(local_count)])
            (max_mbs,) = self._all_reduce([float(len(chunk))], op=dist.ReduceOp.MAX)
            if total_count == 0:
                continue  # every rank agrees: nothing in this minibatch
            scale = float(self.world_size) / total_count  # FSDP2 averages grads over ranks
            if chunk:
                real = [{key: v[torch.as_tensor(mb, device=v.device)] for key, v in tensors.items()} for mb in chunk]
            else:
                if dummy is None:
                    dummy = {key: v.to(self.device) for key, v in self._dummy_batch(batch).items()}
                real = [dummy]
            self.optimizer.zero_grad(set_to_none=True)
            dev_k = self._forward_backward(real, len(chunk), int(max_mbs), scale, tally.sums)
            self._optimizer_step(tally, iteration=iteration, minibatch=k)
            tally.record_ratio_dev(dev_k)
        self.steps_done += tally.steps
        self.steps_skipped += tally.skipped
        metrics = self._reduce_metrics(tally, total_samples)
        log.info(
            "iteration %d rank %d: %d local samples, %d optimizer steps (%d skipped), loss %.4g, "
            "ratio_max_dev %.3g, %.2fs",
            iteration + 1,
            self.rank,
            n_local,
            tally.steps,
            tally.skipped,
            metrics["train/loss"],
            metrics["train/ratio_max_dev"],
            time.perf_counter() - t0,
        )
        return metrics

    def _device_tensors(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch's rows on the training device (``pad.*`` dropped), trajectories and advantages in float32."""
        tensors = {k: v.to(self.device) for k, v in batch.items() if not k.startswith("pad.")}
        for k in ("window_latents", "log_probs", "advantages"):
            if k in tensors:
                tensors[k] = tensors[k].float()
        return tensors

    def _forward_backward(
        self, real: list[dict[str, torch.Tensor]], n_real: int, n_passes: int, scale: float, sums: dict[str, float]
    ) -> float:
        """Forward, loss and backward of one minibatch's micro-batches; returns their max ratio deviation.

        Runs ``n_passes`` micro-batches (the MAX over ranks of the micro-batch count): the
        first ``n_real`` are those in ``real``; the rest repeat ``real[0]`` with a zero loss so
        that every rank issues the same FSDP2 collectives. Each micro-batch goes one SDE window
        step at a time, as Flow-GRPO does: forward of step j, its loss, backward, the graph
        freed, then step j + 1 (so activations of one step of one micro-batch are alive at
        once; docs/memory.md). Every rank runs ``n_passes × sde_window_size`` forward/backward
        passes. Gradients accumulate (scaled by ``scale``) until the caller's optimizer step;
        the local loss and ratio statistics are added into ``sums``.
        """
        dev_k = 0.0
        for i in range(n_passes):
            padding = i >= n_real
            mb = real[0] if padding else real[i]
            for pos in range(self.cfg.sampler.sde_window_size):
                log_probs, kl = self._forward(mb, pos)
                if padding:
                    # Same collectives as a real pass, zero gradient (NaN-safe: no exp of garbage).
                    loss = torch.nan_to_num(log_probs).sum() * 0.0
                    if kl is not None:
                        loss = loss + torch.nan_to_num(kl) * 0.0
                else:
                    policy, stats = clipped_policy_loss(
                        log_probs,
                        mb["log_probs"][:, pos : pos + 1],
                        mb["advantages"],
                        clip_range=self.cfg.train.clip_range,
                        adv_clip_max=self.cfg.train.adv_clip_max,
                    )
                    loss = policy
                    if kl is not None:
                        loss = loss + self.cfg.train.kl_beta * kl
                        sums["kl"] += float(kl.detach())
                    sums["loss"] += float(loss.detach())
                    sums["ratio_sum"] += float(stats["ratio_sum"])
                    sums["clipped"] += float(stats["clipped"])
                    sums["approx_kl"] += float(stats["approx_kl"])
                    sums["count"] += float(stats["count"])
                    dev_k = max(dev_k, float(stats["ratio_max_dev"]))
                (loss * scale).backward()
                del loss, log_probs, kl
        return dev_k

    def _optimizer_step(self, tally: _StepTally, *, iteration: int, minibatch: int) -> None:
        """Clip the accumulated gradient and step, or skip the step if its norm is not finite; clear the gradient."""
        max_norm = self.cfg.train.max_grad_norm if self.cfg.train.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            tally.steps += 1
            tally.grad_norms.append(grad_norm)
        else:
            tally.skipped += 1
            log.error(
                "iteration %d minibatch %d: gradient norm is %s; optimizer step skipped (weights unchanged)",
                iteration + 1,
                minibatch,
                grad_norm,
            )
        self.optimizer.zero_grad(set_to_none=True)

    def _reduce_metrics(self, tally: _StepTally, total_samples: float) -> dict[str, float]:
        """The step's metrics: local sums all-reduced (SUM, ratio deviations MAX) and divided by the count."""
        keys = list(tally.sums)
        reduced = dict(zip(keys, self._all_reduce([tally.sums[k] for k in keys])))
        first_dev, later_dev = self._all_reduce([tally.first_dev, tally.later_dev], op=dist.ReduceOp.MAX)
        count = max(reduced["count"], 1.0)
        grad_norms = tally.grad_norms
        return {
            "train/loss": reduced["loss"] / count,
            "train/ratio_mean": reduced["ratio_sum"] / count,
            "train/ratio_max_dev": first_dev,
            "train/offpolicy_ratio_max_dev": later_dev,
            "train/clipfrac": reduced["clipped"] / count,
            "train/approx_kl": reduced["approx_kl"] / count,
            "train/grad_norm": float(sum(grad_norms) / len(grad_norms)) if grad_norms else float("nan"),
            "train/kl": reduced["kl"] / count,
            "train/num_samples": total_samples,
            "train/optimizer_steps": float(tally.steps),
            "train/skipped_steps": float(tally.skipped),
            "train/learning_rate": self.learning_rate,
        }

    # ------------------------------------------------------------------ learning rate, rollback

    @property
    def learning_rate(self) -> float:
        """The optimizer's learning rate now (``train.learning_rate``, unless a rollback lowered it)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)

    def roll_back(self, path: str | os.PathLike, lr_scale: float) -> float:
        """The collapse guard's rollback (docs/collapse-guard.md): restore the trainer checkpoint
        at ``path`` (weights, AdamW state, RNG: those of the best held-out version) and set the
        learning rate to ``lr_scale`` times the one in use now. Collective. Returns the new rate.

        Raises:
            FileNotFoundError, RuntimeError: as :meth:`load_checkpoint`.
        """
        lr = self.learning_rate * lr_scale
        self.load_checkpoint(path)
        self.set_learning_rate(lr)
        log.warning("rolled back to %s; learning rate now %.3g", path, lr)
        return lr

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

    def version_state_dict(self) -> dict[str, torch.Tensor]:
        """What a published weight version holds, on rank 0 (``{}`` elsewhere). Collective.

        Full fine-tuning: :meth:`full_state_dict`. LoRA: the adapter parameters alone
        (``…lora_A.default.weight`` names), gathered from their shards. Tensors are CPU, in the
        Rollout Workers' dtype (``model.dtype``: bfloat16 on CUDA, so a version is half the
        float32 master copy; float32 on the CPU).
        """
        dtype = torch_dtype(self.cfg.model.dtype, self.device)
        if not self.lora:
            sd = self.full_state_dict()
            return sd if dtype == torch.float32 else {k: v.to(dtype) for k, v in sd.items()}
        out = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.rank == 0:
                out[name] = t.detach().to("cpu", dtype, copy=True).contiguous()
        return out

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the result on rank 0. Collective.

        Full fine-tuning: an unwrapped diffusers transformer (``<Class>.from_pretrained(path)``).
        LoRA: the adapter in diffusers format (``pytorch_lora_weights.safetensors``; load with
        ``pipeline.load_lora_weights(path)`` or ``transformer.load_lora_adapter(path,
        prefix="transformer")``).
        """
        from spotlight.util.atomic_file import replace_dir_atomic
        from spotlight.util.disk import ensure_free_space
        from spotlight.util.weights_file import write_digests

        # saved in fp32; every rank checks, before any collective
        counted = self.params if self.lora else list(self.model.parameters())
        ensure_free_space(path, 4 * sum(p.numel() for p in counted), "the final model")
        # written beside ``path`` and swapped in: a crash in the save leaves no ``path`` (the run
        # is then not finished, and ``up --resume`` saves again), never a partial one; with the
        # files' SHA-256 (SHA256SUMS), so bytes changed later are found before a load
        if self.lora:
            sd = self.version_state_dict()
            if self.rank == 0:
                adapter = {k.replace(".default.", "."): v.float() for k, v in sd.items()}  # peft's saved naming
                with replace_dir_atomic(path) as tmp:
                    self.family.save_lora(tmp, adapter, adapter_metadata(self.model))
                    write_digests(tmp)
        else:
            sd = self.full_state_dict()
            if self.rank == 0:
                with torch.device("meta"):  # no second full-size allocation (20 B parameters = 80 GB fp32)
                    model = self.family.transformer_cls().from_config(self._diffusers_config)
                model.load_state_dict(sd, assign=True)
                with replace_dir_atomic(path) as tmp:
                    model.save_pretrained(str(tmp))
                    write_digests(tmp)
        if self.rank == 0:
            log.info("saved %s to %s", "LoRA adapter" if self.lora else "weights", path)
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints

    def _dcp_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # LoRA: the trainer's state is the adapter and its optimizer; the frozen base is
        # rebuilt from the model's own weights at start-up (loading then skips it).
        # strict=False: parameters that never had a gradient have no AdamW state; load_checkpoint
        # checks the model keys itself.
        return StateDictOptions(ignore_frozen_params=bool(self.lora), strict=False)

    def _rng_state(self) -> dict:
        import random

        import numpy as np

        np_state = np.random.get_state()
        py_state = random.getstate()
        out = {
            "format": 1,
            "rank": self.rank,
            "world_size": self.world_size,
            "steps_done": self.steps_done,
            "steps_skipped": self.steps_skipped,
            "learning_rate": self.learning_rate,  # a collapse-guard rollback may have lowered it
            "torch": torch.get_rng_state().numpy().tobytes().hex(),
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "python": [py_state[0], list(py_state[1]), py_state[2]],
        }
        if self.device.type == "cuda":
            out["cuda"] = torch.cuda.get_rng_state(self.device).numpy().tobytes().hex()
        return out

    def _set_rng_state(self, d: dict) -> None:
        import random

        import numpy as np

        torch.set_rng_state(torch.frombuffer(bytearray.fromhex(d["torch"]), dtype=torch.uint8))
        if self.device.type == "cuda" and "cuda" in d:
            torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(d["cuda"]), dtype=torch.uint8), self.device)
        name, keys, pos, has_gauss, gauss = d["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        version, internal, gauss = d["python"]
        random.setstate((version, tuple(internal), gauss))
        self.steps_done, self.steps_skipped = int(d["steps_done"]), int(d["steps_skipped"])
        if "learning_rate" in d:
            self.set_learning_rate(float(d["learning_rate"]))

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Atomically write this trainer's resumable state to directory ``path``. Collective.

        Contents: ``torch.distributed.checkpoint`` (DCP) of ``{"model", "optim"}`` from
        ``get_state_dict`` (FSDP2 DTensor shards, float32; one ``__<rank>_0.distcp`` per
        rank plus ``.metadata``) -- for LoRA only the trainable adapter and its AdamW state
        -- and ``rng_rank<r>.json`` per rank (torch CPU/CUDA, numpy and Python RNG states,
        optimizer step counters). Every rank writes into ``<parent>/.tmp-<name>``; after a
        barrier rank 0 renames it to ``path`` (replacing an older ``path``) and fsyncs the
        parent, then all ranks pass a second barrier. A crash before the rename leaves only
        the temp dir. ``path``'s parent must be one file system shared by all ranks.

        Raises:
            OSError: the file system failed (``path`` is then absent or the old one).
        """
        import shutil

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = pathlib.Path(path)
        tmp = path.parent / f".tmp-{path.name}"
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of the same version
            tmp.mkdir()
        dist.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._dcp_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        rng_file = tmp / f"rng_rank{self.rank}.json"
        with open(rng_file, "w") as f:
            json.dump(self._rng_state(), f)
            f.flush()
            os.fsync(f.fileno())
        dist.barrier()
        if self.rank == 0:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if path.exists():
                old = path.parent / f".tmp-old-{path.name}"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(path, old)
                os.rename(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, path)
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            log.info("saved trainer checkpoint %s", path)
        dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a :meth:`save_checkpoint` directory into this (freshly built) trainer. Collective.

        The trainer must be built with the same config (model, LoRA, optimizer) as the one
        that saved; the world size may differ only if DCP can reshard (it can for FSDP2),
        but each rank's RNG state is read from ``rng_rank<r>.json`` of the same rank.
        Weights and AdamW state are restored bit for bit.

        Raises:
            FileNotFoundError: ``path`` or this rank's RNG file is missing.
            RuntimeError: the checkpoint does not match the model (DCP / load_state_dict).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = pathlib.Path(path)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"no trainer checkpoint at {path} (missing .metadata)")
        rng = json.loads((path / f"rng_rank{self.rank}.json").read_text())
        opts = self._dcp_options()
        # The load replaces the optimizer state; start from none so that get_state_dict builds
        # a complete template (it initialises AdamW state only for an optimizer without any).
        self.optimizer.state.clear()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=opts)
        # get_state_dict gives a fresh optimizer state for every parameter; the saved one has
        # state only for parameters that ever had a gradient (AdamW skips the others), so load
        # exactly the saved entries and leave the others stateless, as they were.
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        optim_sd["state"] = {
            fqn: {k: v for k, v in st.items() if f"optim.state.{fqn}.{k}" in saved}
            for fqn, st in optim_sd["state"].items()
            if any(key.startswith(f"optim.state.{fqn}.") for key in saved)
        }
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except dcp.api.CheckpointException as exc:  # a BaseException: make it an ordinary error
            raise RuntimeError(f"trainer checkpoint {path} does not match this trainer: {exc}") from exc
        result = set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=opts,
        )
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        bad = [k for k in result.missing_keys if k in trainable or not self.lora] + list(result.unexpected_keys)
        if bad:
            raise RuntimeError(f"trainer checkpoint {path} does not match the model: {bad[:5]}")
        self._set_rng_state(rng)
        log.info("loaded trainer checkpoint %s (%d optimizer steps so far)", path, self.steps_done)


# ---------------------------------------------------------------------- process


def _load_cfg(text: str) -> SpotlightConfig:
    text = text.strip()
    if text.startswith("{"):
        return config_from_dict(json.loads(text))
    p = pathlib.Path(text)
    if p.suffix == ".toml":
        return load_config(p)
    return config_from_dict(json.loads(p.read_text()))


PEER_TIMEOUT_S = 60.0
"""Default seconds without a heartbeat after which a rank's peers take it as dead
(:mod:`spotlight.workers.train.peer_watch`): long enough for a rank's longest pause that holds
Python's lock (a host starved of CPU), far shorter than a collective's timeout."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="spotlight.workers.train.train_worker")
    ap.add_argument("--coordinator", required=True, help="tcp://host:port of the coordinator's trainer socket")
    ap.add_argument(
        "--keys-file",
        required=True,
        help="0600 JSON file with this run's trainer CURVE keys (written by the coordinator)",
    )
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--config-json", required=True, help="JSON text, a .json file or a .toml file")
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--text-dim", type=int, default=384)
    ap.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save the trainer state (DCP) of a checkpointed iteration's new version v into DIR/v{v:06d}, "
        "keeping run.keep_train_checkpoints of them (default: no checkpoints); the coordinator passes "
        "RUN_DIR/checkpoints/train",
    )
    ap.add_argument(
        "--spool-dir",
        default=None,
        help="directory where rank 0 writes each version's file before streaming it (default: the system temp "
        "directory); the coordinator passes RUN_DIR/tensor_store/spool",
    )
    ap.add_argument(
        "--resume-version",
        type=int,
        default=None,
        help="load DIR/v{N:06d} from --checkpoint-dir before TRAIN_READY and publish weights v_N instead of v_0",
    )
    ap.add_argument(
        "--peer-timeout-s",
        type=float,
        default=PEER_TIMEOUT_S,
        help="a rank silent this long is taken as dead: the others abort their communicator and exit",
    )
    ap.add_argument(
        "--checkpoint-initial",
        action="store_true",
        help="also save the trainer checkpoint of the starting weights v0 (a collapse-guard rollback "
        "may return to the base model); needs --checkpoint-dir",
    )
    args = ap.parse_args(argv)
    if args.checkpoint_initial and args.checkpoint_dir is None:
        ap.error("--checkpoint-initial needs --checkpoint-dir")
    if args.resume_version is not None and (args.checkpoint_dir is None or args.resume_version < 0):
        ap.error("--resume-version needs --checkpoint-dir and a version >= 0")
    return args


def _leave_together(timeout_s: float = 10.0) -> None:
    """Wait (bounded) for every rank before the process group is destroyed.

    A gloo rank tearing its pairs down while a peer is still inside a collective can abort
    the peer ("terminate called without an active exception"). On a clean shutdown all
    ranks get SHUTDOWN, so a bounded ``monitored_barrier`` lines them up; a peer that
    died (preempted, killed) only costs the timeout.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    try:
        if dist.get_backend() == "gloo":  # NCCL has no bounded barrier; its teardown is safe
            from datetime import timedelta

            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # a missing peer must not turn a clean exit into a crash
        log.info("ranks did not all reach shutdown together: %s", exc)


def _init_process_group(args: argparse.Namespace) -> torch.device:
    """Pick this rank's device (``cuda:<rank mod GPUs>``, else the CPU) and join the process group.

    NCCL on CUDA, gloo on the CPU; rank 0's TCP store listens on 127.0.0.1 only. On CUDA the
    group is bound to this rank's GPU (``device_id``): NCCL then creates its communicator on
    that device at once instead of guessing one at the first collective. The NCCL watchdog
    settings of :data:`~spotlight.workers.train.launch_env.NCCL_ENV` are the spawning
    coordinator's (``TrainerGroup.start``).
    """
    from spotlight.workers.sp.rendezvous import bound_store

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local = args.rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        store=bound_store("127.0.0.1", args.master_port, args.rank, args.world_size, dist.constants.default_pg_timeout),
        rank=args.rank,
        world_size=args.world_size,
        device_id=device if use_cuda else None,
    )
    return device


def start_peer_watch(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """This rank's :class:`~spotlight.workers.train.peer_watch.PeerWatch` on its own client of the
    group's rendezvous store at ``host:port`` (None for a group of one rank)."""
    import datetime

    from spotlight.workers.train.peer_watch import PeerWatch

    if world_size <= 1:
        return None
    store = dist.TCPStore(
        host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return PeerWatch(dist.PrefixStore("spotlight", store), rank, world_size, timeout_s=timeout_s).start()


def is_peer_failure(exc: BaseException) -> bool:
    """True for the error a collective raises when a peer of the group is gone: torch's
    distributed errors (an aborted NCCL communicator, a closed store) and gloo's closed pairs."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        m in text for m in ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
    )


class _TrainerProcess:
    """The shell around one rank's :class:`FlowGRPOTrainer`: the coordinator's DEALER socket,
    the trainer checkpoints and the published versions (the exchange in the module docstring).

    Args:
        args: the rank's settings (``rank``, ``world_size``, ``checkpoint_dir``, ``spool_dir``).
        cfg: the run config.
        trainer: this rank's trainer, already built (and resumed).
        sock: a DEALER connected to the coordinator's trainer socket.
        alive: whether the coordinator can still be reached (default: the parent process that
            spawned this rank is still this rank's parent).
        watch: this rank's :class:`~spotlight.workers.train.peer_watch.PeerWatch` (None: a group
            of one rank).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        cfg: SpotlightConfig,
        trainer: FlowGRPOTrainer,
        sock,
        *,
        alive=None,
        watch=None,
    ):
        self.args = args
        self.cfg = cfg
        self.trainer = trainer
        self.sock = sock
        self.spool = pathlib.Path(args.spool_dir) if args.spool_dir else pathlib.Path(tempfile.gettempdir())
        self.parent = spawned_by()  # the coordinator, even if it died while we started
        self.alive = alive if alive is not None else self._parent_alive
        self.watch = watch
        self.keep_versions: set[int] = set()
        """Versions whose checkpoints retention keeps (the coordinator's latest TRAIN_BATCH says:
        the base model, the best held-out version and those being evaluated, for a rollback)."""
        self.version = 0
        """The newest weight version this trainer holds (published or being published)."""

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def _peer_lost(self, exc: BaseException | None = None) -> int:
        """Another rank of the group is gone: say why (one ERROR line, which the coordinator
        shows), unless a SHUTDOWN is already waiting (the run ended and a peer left first), and
        return the exit status (:data:`~spotlight.workers.train.peer_watch.EXIT_PEER_LOST`, or 0)."""
        from spotlight import protocol as P
        from spotlight.workers.train.peer_watch import EXIT_PEER_LOST

        if exc is None and self.sock.poll(2000):  # the coordinator's SHUTDOWN to every rank may be queued
            message = self._receive()
            if message is not None and message[0] == P.MsgType.SHUTDOWN and not message[1].reason.startswith("save:"):
                log.info("shutdown: %s", message[1].reason or "(no reason)")
                return 0
        reason = self.watch.lost if self.watch is not None and self.watch.lost else None
        if reason is None and exc is not None:
            reason = f"a collective failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.error("rank %d stops: another rank of the trainer group is gone (%s)", self.args.rank, reason)
        return EXIT_PEER_LOST

    def checkpoint(self, ver: int) -> None:
        """Trainer state for weights v_ver, before TRAIN_DONE: a run checkpoint naming v_ver finds it."""
        from spotlight.store.checkpoint import train_version_path

        if self.args.checkpoint_dir is None:
            return
        from spotlight.util.disk import ensure_free_space

        # fp32 weights and two fp32 Adam moments of what trains (docs/planning.md); every rank checks
        need = 12 * sum(p.numel() for p in self.trainer.params)
        ensure_free_space(self.args.checkpoint_dir, need, f"the trainer checkpoint of v{ver}")
        self.trainer.save_checkpoint(train_version_path(self.args.checkpoint_dir, ver))

    def retire_checkpoints(self, committed: int) -> None:
        """Rank 0: trainer checkpoint retention (``run.keep_train_checkpoints``), given that the
        coordinator's run checkpoints name versions up to ``committed``
        (:func:`~spotlight.store.checkpoint.retire_train_versions`). Called when a TRAIN_BATCH
        arrives (the coordinator wrote its run checkpoint of the previous iteration before
        sending it) and before the final save, never during a save."""
        if self.args.checkpoint_dir is None or self.args.rank != 0:
            return
        from spotlight.store.checkpoint import retire_train_versions

        keep = self.cfg.run.keep_train_checkpoints
        dropped = retire_train_versions(self.args.checkpoint_dir, keep, committed=committed, protect=self.keep_versions)
        if dropped:
            log.info(
                "deleted trainer checkpoints %s (run.keep_train_checkpoints = %d)",
                ", ".join(f"v{v}" for v in dropped),
                keep,
            )

    def publish(self, ver: int) -> None:
        """Rank 0: write version ``ver`` to a spool file and stream it in chunks (module docstring)."""
        sd = self.trainer.version_state_dict()
        if self.args.rank != 0:
            return
        from spotlight.store import tensor_wire
        from spotlight.store.weight_sync import send_version

        self.spool.mkdir(parents=True, exist_ok=True)
        path = self.spool / f"v{ver}-{os.getpid()}.safetensors"
        t0 = time.perf_counter()
        try:
            size, digest = tensor_wire.save_version(sd, path)
            del sd
            n = send_version(
                self.sock,
                ver,
                path,
                digest,
                self.cfg.cluster.weight_chunk_bytes,
                alive=self.alive,
                unlink=True,
            )
        finally:
            path.unlink(missing_ok=True)
        log.info("published v%d: %d bytes in %d chunks (%.2fs)", ver, size, n, time.perf_counter() - t0)

    def start(self, version: int) -> None:
        """TRAIN_READY, then publish the starting weights ``version``."""
        from spotlight import protocol as P

        args = self.args
        self.version = version
        if args.checkpoint_initial and version == 0:
            from spotlight.store.checkpoint import train_version_path

            if not (train_version_path(args.checkpoint_dir, 0) / ".metadata").is_file():
                self.checkpoint(0)  # the base model, for a rollback to it
        self.sock.send_multipart(P.encode(P.TrainReady(rank=args.rank, world_size=args.world_size, version=version)))
        self.publish(version)
        log.info("ready (world %d, device %s)", args.world_size, self.trainer.device)

    def serve(self) -> int:
        """Answer the coordinator until SHUTDOWN (returns 0) or until it dies (returns 3)."""
        from spotlight import protocol as P

        while True:
            if self.watch is not None and self.watch.lost:  # a peer died while this rank was idle
                return self._peer_lost()
            if not self.sock.poll(1000):
                if not self.alive():  # the coordinator died: nothing will ever come
                    log.error("coordinator is gone; train worker exiting")
                    return 3
                continue
            message = self._receive()
            if message is None:
                continue
            mtype, body, tensors = message
            try:
                if mtype == P.MsgType.TRAIN_BATCH:
                    self.keep_versions = set(body.keep_versions)
                    self.retire_checkpoints(committed=body.version)
                    self._train(body, tensors)
                elif mtype == P.MsgType.SHUTDOWN and body.reason.startswith("save:"):
                    # the coordinator checkpointed the last iteration before it asked for the final save
                    self.retire_checkpoints(committed=self.version)
                    self.trainer.save_pretrained(body.reason[len("save:") :])
                    self.sock.send_multipart(P.encode(P.TrainDone(rank=self.args.rank, iteration=-1, new_version=-1)))
                    continue
            except Exception as exc:
                if (self.watch is not None and self.watch.lost) or is_peer_failure(exc):
                    log.debug("collective failed", exc_info=True)
                    return self._peer_lost(exc)
                raise
            if mtype == P.MsgType.SHUTDOWN:
                log.info("shutdown: %s", body.reason or "(no reason)")
                if self.watch is not None:
                    self.watch.stop()  # peers leave from here on
                _leave_together()
                return 0
            elif mtype == P.MsgType.ERROR:
                log.error("coordinator refused a message: %s: %s", body.code, body.message)
            elif mtype != P.MsgType.TRAIN_BATCH:
                log.warning("ignoring unexpected %s", mtype.name)

    def _receive(self):
        """The next message as ``(type, body, tensors)`` (tensors of a TRAIN_BATCH, else None);
        None for a malformed one, which is logged and dropped."""
        from spotlight import protocol as P
        from spotlight.store import tensor_wire

        frames = self.sock.recv_multipart(copy=True)
        tensors = None
        try:
            mtype, body, payload = P.decode(frames)
            if mtype == P.MsgType.TRAIN_BATCH:
                tensors = tensor_wire.unpack_tensors(body.tensors, payload)
                # a rank that got no rollout batch (fewer batches than ranks) has only pad.cond.*
                has_rows = any(len(mb) for mb in body.micro_batches)
                missing = [k for k in BATCH_KEYS if k not in tensors] if has_rows else []
                if missing:
                    raise P.ProtocolError(f"TRAIN_BATCH lacks tensors {missing}")
        except P.ProtocolError as exc:
            log.warning("dropping malformed message: %s", exc)
            return None
        return mtype, body, tensors

    def _train(self, body, tensors: dict[str, torch.Tensor]) -> None:
        """TRAIN_BATCH: one train step, then checkpoint and publish v+1, then TRAIN_DONE."""
        from spotlight import protocol as P

        t0 = time.perf_counter()
        _reset_peak_memory(self.trainer.device)
        self.keep_versions = set(body.keep_versions)
        if body.rollback_version >= 0:  # the collapse guard: no step on this batch (made by the weights left behind)
            from spotlight.store.checkpoint import train_version_path

            if self.args.checkpoint_dir is None:
                raise RuntimeError("a rollback needs the trainer checkpoints (--checkpoint-dir)")
            lr = self.trainer.roll_back(
                train_version_path(self.args.checkpoint_dir, body.rollback_version), body.lr_scale
            )
            metrics = {
                "train/rolled_back_to": float(body.rollback_version),
                "train/learning_rate": lr,
                "train/optimizer_steps": 0.0,
                "train/skipped_steps": 0.0,
                "train/num_samples": 0.0,
            }
        else:
            if body.lr_scale != 1.0:  # lowered without a rollback (the current version was the best)
                self.trainer.set_learning_rate(self.trainer.learning_rate * body.lr_scale)
            metrics = self.trainer.train_step(tensors, body.micro_batches, iteration=body.iteration)
        metrics.update(_step_memory_metrics(self.trainer.device, time.perf_counter() - t0))
        version = body.version + 1
        self.version = version
        if body.checkpoint:  # run.checkpoint_every: no wait on a save the run does not need
            self.checkpoint(version)
        self.publish(version)
        done = P.TrainDone(
            rank=self.args.rank,
            iteration=body.iteration,
            new_version=version,
            metrics=metrics,
            train_s=time.perf_counter() - t0,
        )
        self.sock.send_multipart(P.encode(done))


def _reset_peak_memory(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _step_memory_metrics(device: torch.device | str, step_s: float) -> dict[str, float]:
    """``train/step_s`` (seconds of the update's optimizer steps, before checkpoint and publish)
    and ``train/peak_memory_bytes``: on CUDA ``torch.cuda.max_memory_allocated`` during the update
    (what ``spotlight plan`` estimates per trainer GPU, its CUDA reserve aside), on the CPU the
    process's resident-set high-water mark since it started. On CUDA the allocator's cached
    blocks are then given back, so a Rollout Worker sharing the GPU can take its weights back
    while this rank waits for the next update (docs/memory.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device))
        torch.cuda.empty_cache()
    else:
        import resource

        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"train/step_s": float(step_s), "train/peak_memory_bytes": peak}


def main(argv: list[str] | None = None) -> int:
    """The train worker process: join the process group, build (or resume) the trainer, serve the coordinator."""
    import zmq

    from spotlight.net.security import apply_client, read_client_file

    args = _parse(argv)
    if not logging.getLogger().handlers:
        from spotlight.util.procs import configure_logging

        configure_logging(f"trainer-{args.rank}", f"trainer-{args.rank}")
    cfg = _load_cfg(args.config_json)
    torch.set_num_threads(max(1, cfg.cluster.torch_threads))
    device = _init_process_group(args)
    watch = start_peer_watch("127.0.0.1", args.master_port, args.rank, args.world_size, args.peer_timeout_s)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 10_000)
    apply_client(sock, read_client_file(args.keys_file))
    sock.connect(args.coordinator)
    try:
        return run_rank(args, cfg, device, sock, watch=watch)
    finally:
        if watch is not None:
            watch.stop()
        sock.close()
        ctx.term()
        destroy_process_group()


def run_rank(args: argparse.Namespace, cfg: SpotlightConfig, device: torch.device, sock, *, watch=None, alive=None):
    """Build (or resume) this rank's trainer in the joined process group and serve the
    coordinator on ``sock`` until SHUTDOWN; returns the exit status. A peer lost while the
    trainer is built (a collective of the sharded load raises) is :data:`EXIT_PEER_LOST`.

    ``args``: ``rank``, ``world_size``, ``text_dim``, ``checkpoint_dir``, ``resume_version``,
    ``spool_dir`` and ``num_nodes`` (1 if absent)."""
    from spotlight.store.checkpoint import train_version_path

    try:
        trainer = FlowGRPOTrainer(
            cfg,
            rank=args.rank,
            world_size=args.world_size,
            device=device,
            text_dim=args.text_dim,
            num_nodes=getattr(args, "num_nodes", 1),
        )
        version = 0
        if args.resume_version is not None:
            trainer.load_checkpoint(train_version_path(args.checkpoint_dir, args.resume_version))
            version = args.resume_version
    except Exception as exc:
        if (watch is not None and watch.lost) or is_peer_failure(exc):
            log.error("rank %d stops while loading: another rank of the trainer group is gone (%s)", args.rank, exc)
            from spotlight.workers.train.peer_watch import EXIT_PEER_LOST

            return EXIT_PEER_LOST
        raise
    process = _TrainerProcess(args, cfg, trainer, sock, alive=alive, watch=watch)
    process.start(version)
    return process.serve()


def destroy_process_group() -> None:
    """Leave the process group; after an abort (a lost peer) there may be nothing left to destroy."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:
            log.info("process group teardown: %s: %s", type(exc).__name__, exc)


if __name__ == "__main__":
    sys.exit(main())
