"""Train Worker memory options (docs/memory.md): activation checkpointing per transformer
block, backward per SDE window step and micro-batches with gradient accumulation. Each
changes what is kept in memory, never the gradient of the optimizer step."""

from __future__ import annotations

import pytest
import torch

from spotlight.config import SpotlightConfig, TrainConfig
from spotlight.workers.train.train_worker import FlowGRPOTrainer
from tests.unit.workers.train.test_train_worker import ROLLOUT_MBS, TEXT_DIM, make_rollout

pytestmark = [pytest.mark.procs, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]  # a gloo group


def _cfg(**train) -> SpotlightConfig:
    return SpotlightConfig(train=TrainConfig(max_grad_norm=1e9, **train))


@pytest.fixture(scope="module")
def rollout():
    return make_rollout(_cfg())


def _step(cfg: SpotlightConfig, batch, micro_batches) -> dict:
    """One train step; returns its metrics, the gradient the optimizer stepped with and how
    often the blocks' attention ran (forward and recompute)."""
    tr = FlowGRPOTrainer(cfg, rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    calls = [0]
    for block in tr.model.transformer_blocks:
        block.attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    grads = {}

    def keep(opt, args, kwargs):
        for name, p in tr.model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.full_tensor().clone()

    tr.optimizer.register_step_pre_hook(keep)
    metrics = tr.train_step(batch, micro_batches, iteration=0)
    return {"trainer": tr, "metrics": metrics, "grads": grads, "attn_calls": calls[0]}


def _worst(a: dict, b: dict) -> float:
    assert set(a) == set(b) and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_activation_checkpointing_recomputes_blocks_and_keeps_the_gradient(pg, rollout):
    off = _step(_cfg(activation_checkpointing=False), rollout, ROLLOUT_MBS)
    on = _step(_cfg(activation_checkpointing=True), rollout, ROLLOUT_MBS)
    assert not off["trainer"].activation_checkpointing and on["trainer"].activation_checkpointing
    # every block forward runs once more in the backward: the activations were not kept
    assert on["attn_calls"] == 2 * off["attn_calls"] > 0
    assert _worst(on["grads"], off["grads"]) < 1e-6
    assert on["metrics"]["train/ratio_max_dev"] == 0.0
    # parameter names stay the diffusers model's (state dicts, versions and checkpoints)
    assert set(on["trainer"].full_state_dict()) == set(off["trainer"].full_state_dict())


def test_activation_checkpointing_default_follows_the_family(pg):
    import importlib

    tr = FlowGRPOTrainer(_cfg(), rank=0, world_size=1, device=torch.device("cpu"), text_dim=TEXT_DIM)
    assert tr.activation_checkpointing is False  # tiny: off
    for module in ("qwen_image", "flux", "sd3"):
        assert importlib.import_module(f"spotlight.models.families.{module}").FAMILY.activation_checkpointing is True


def _count_backwards(monkeypatch) -> list[int]:
    calls = [0]
    backward = torch.Tensor.backward

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", counting)
    return calls


def test_micro_batches_accumulate_the_one_big_batch_gradient_and_stay_on_policy(pg, rollout, monkeypatch):
    cfg = _cfg(micro_batch_size=1)
    window = cfg.sampler.sde_window_size
    big = _step(_cfg(), rollout, [list(range(6))])  # the whole rank batch in one forward per window step
    backwards = _count_backwards(monkeypatch)
    small = _step(cfg, rollout, ROLLOUT_MBS)  # 6 forwards of one sample per window step
    # one backward per window step of every micro-batch: [3, 4, 5] was cut into three
    assert backwards[0] == 6 * window
    # the weights only change at the single optimizer step: every sample is on-policy, up to the
    # fp32 rounding of a forward of another batch shape (docs/memory.md: bit-exact on some BLAS
    # builds, 6e-8 on others)
    assert small["metrics"]["train/ratio_max_dev"] < 1e-6
    assert small["metrics"]["train/optimizer_steps"] == 1.0
    assert _worst(small["grads"], big["grads"]) < 1e-6
    assert small["metrics"]["train/loss"] == pytest.approx(big["metrics"]["train/loss"], abs=1e-7)


def test_micro_batch_size_must_be_positive():
    from spotlight.config import ConfigError

    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        TrainConfig(micro_batch_size=0)
