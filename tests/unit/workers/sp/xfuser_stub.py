"""A stand-in for xfuser's distributed module and its Qwen-Image wrapper (xfuser cannot be
imported without an accelerator): :func:`install` puts fake ``xfuser.*`` modules in
``sys.modules``. The distributed module records every call (and whether torch's default process
group was up at the time) in :data:`CALLS`; the wrapper is the diffusers class itself, so every
rank computes the whole forward (the output is what one process computes)."""

from __future__ import annotations

import sys
import types

CALLS: list[tuple] = []


def install() -> None:
    import torch.distributed as dist
    from diffusers import QwenImageTransformer2DModel

    state = {"world": None, "groups": None}

    def init_distributed_environment(
        world_size=-1, rank=-1, distributed_init_method="env://", local_rank=-1, backend=None
    ):
        CALLS.append(("init_distributed_environment", rank, world_size, local_rank, dist.is_initialized()))
        if not dist.is_initialized():
            raise AssertionError("xfuser would create its own process group: ours must come first")
        state["world"] = (rank, world_size)

    def initialize_model_parallel(
        classifier_free_guidance_degree=1, sequence_parallel_degree=None, ulysses_degree=1, **kw
    ):
        CALLS.append(
            ("initialize_model_parallel", classifier_free_guidance_degree, sequence_parallel_degree, ulysses_degree)
        )
        if state["groups"] is not None:
            raise AssertionError("model parallel group is already initialized")  # as xfuser asserts
        state["groups"] = (classifier_free_guidance_degree, ulysses_degree)

    def destroy_model_parallel():
        CALLS.append(("destroy_model_parallel",))
        state["groups"] = None

    def destroy_distributed_environment():
        CALLS.append(("destroy_distributed_environment", dist.is_initialized()))
        state["world"] = None
        if dist.is_initialized():
            dist.destroy_process_group()

    class xFuserQwenImageTransformerWrapper(QwenImageTransformer2DModel):
        pass

    mods = {}
    for name in (
        "xfuser",
        "xfuser.core",
        "xfuser.core.distributed",
        "xfuser.model_executor",
        "xfuser.model_executor.models",
        "xfuser.model_executor.models.transformers",
        "xfuser.model_executor.models.transformers.transformer_qwen",
    ):
        mods[name] = sys.modules[name] = types.ModuleType(name)
    d = mods["xfuser.core.distributed"]
    d.init_distributed_environment = init_distributed_environment
    d.initialize_model_parallel = initialize_model_parallel
    d.destroy_model_parallel = destroy_model_parallel
    d.destroy_distributed_environment = destroy_distributed_environment
    mods[
        "xfuser.model_executor.models.transformers.transformer_qwen"
    ].xFuserQwenImageTransformerWrapper = xFuserQwenImageTransformerWrapper
