"""xfuser (xDiT) as the SP groups' optional GPU backend (``cluster.sp_backend = "xfuser"``,
docs/architecture.md §6).

xfuser keeps its own process groups (world, classifier-free-guidance, sequence-parallel…) in
module globals of ``xfuser.core.distributed`` and ships model wrappers whose forward splits the
sequence over its SP group and runs its USP attention (Ulysses/ring, with flash-attention kernels
on GPUs). An elastic group re-forms at every GPU change, so the adapter follows the member's
life exactly:

1. our rendezvous first: :meth:`SPGroupMember.form` creates the torch default process group as
   for the diffusers backend (bound store, ``device_id``, timeout);
2. then :meth:`XfuserAdapter.setup`: ``init_distributed_environment(rank, world_size,
   local_rank=0)`` (every worker sees only its own GPU, so its local rank is 0; xfuser adopts the
   already initialised default group instead of creating one) and
   ``initialize_model_parallel(classifier_free_guidance_degree=c, sequence_parallel_degree=u,
   ulysses_degree=u)`` with ``c = 2`` under CFG-parallel (``cluster.sp_cfg_parallel``: the
   positive rows on the first half of the ranks, the negative on the second, exactly xfuser's
   rank order ``tp-sp-pp-cfg-dp``), else 1;
3. the model object is xfuser's wrapper class of the family (a subclass of the diffusers class:
   same config and weights names, so it is built on ``meta`` and takes the member's kept weights
   like any other); it reads xfuser's groups at every forward, so ONE object survives re-forms
   while the weights stay the same (diffusers' ``enable_parallelism`` binds a model to one mesh,
   so that backend builds a fresh object per generation);
4. :meth:`XfuserAdapter.teardown` on every re-form and exit: ``destroy_model_parallel()`` and
   ``destroy_distributed_environment()`` (which also destroys the default group; a broken NCCL
   group is aborted before, :func:`~spotlight.workers.sp.group.abort_communicator`).

xfuser refuses to import without an accelerator, so it is imported here, lazily, and only where
CUDA is present: ``spotlight up`` refuses ``sp_backend = "xfuser"`` on a local run without CUDA
and a member asked for it on a machine without CUDA raises :class:`XfuserUnavailable` before
anything starts. Install it with ``pip install 'spotlight-rl[xdit]'``.
"""

from __future__ import annotations

import importlib
import logging

import torch

from spotlight.errors import SpotlightError
from spotlight.workers.sp.degrees import XFUSER_FAMILIES

log = logging.getLogger("spotlight.sp_group")

DISTRIBUTED_MODULE = "xfuser.core.distributed"
"""Where xfuser keeps ``init_distributed_environment`` / ``initialize_model_parallel`` and their
``destroy_*`` counterparts."""

XFUSER_WRAPPERS = {
    # the tiny family is the same diffusers class as Qwen-Image
    "tiny": ("xfuser.model_executor.models.transformers.transformer_qwen", "xFuserQwenImageTransformerWrapper"),
    "qwen-image": ("xfuser.model_executor.models.transformers.transformer_qwen", "xFuserQwenImageTransformerWrapper"),
}
"""Family → (module, class) of xfuser's model wrapper. FLUX.1's and SD3's wrappers need xfuser's
pipeline runtime state (an engine config per pipeline call), which an elastic group that re-forms
under a running batch does not have; they run on the diffusers backend (FLUX) or at SP 1 (SD3)."""

assert set(XFUSER_WRAPPERS) == XFUSER_FAMILIES


class XfuserUnavailable(SpotlightError):
    """xfuser cannot run here (no CUDA, not installed, or no wrapper for the family)."""


def xfuser_problem(device: torch.device) -> str | None:
    """Why xfuser cannot serve a member on ``device``, or None."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return (
            "cluster.sp_backend = 'xfuser' needs CUDA (xfuser refuses to import without an accelerator); "
            "use 'diffusers' on this machine"
        )
    return None


class XfuserAdapter:
    """One member's xfuser process groups and model class (module docstring).

    Raises:
        XfuserUnavailable: no CUDA on ``device``, xfuser is not installed, or it has no wrapper
            for ``family``.
    """

    def __init__(self, family: str, device: torch.device):
        problem = xfuser_problem(device)
        if problem:
            raise XfuserUnavailable(problem)
        if family not in XFUSER_WRAPPERS:
            raise XfuserUnavailable(
                f"cluster.sp_backend = 'xfuser' serves {sorted(XFUSER_FAMILIES)}, not {family!r}; use 'diffusers'"
            )
        try:
            self.dist = importlib.import_module(DISTRIBUTED_MODULE)
        except ImportError as exc:
            raise XfuserUnavailable(
                f"cluster.sp_backend = 'xfuser' but xfuser does not import ({exc}); pip install 'spotlight-rl[xdit]'"
            ) from None
        self.family = family
        self.active = False

    def setup(self, rank: int, world_size: int, *, ulysses_degree: int, cfg_degree: int) -> None:
        """After our rendezvous (the default process group is up): xfuser's groups over it."""
        if not torch.distributed.is_initialized():
            raise RuntimeError("xfuser's groups are built over our process group: form it first")
        self.dist.init_distributed_environment(rank=rank, world_size=world_size, local_rank=0)
        self.dist.initialize_model_parallel(
            classifier_free_guidance_degree=cfg_degree,
            sequence_parallel_degree=ulysses_degree,
            ulysses_degree=ulysses_degree,
        )
        self.active = True

    def teardown(self) -> None:
        """Drop xfuser's groups (and the default group with them); safe to call when none are up."""
        if not self.active:
            return
        self.active = False
        for name in ("destroy_model_parallel", "destroy_distributed_environment"):
            try:
                getattr(self.dist, name)()
            except Exception as exc:  # a broken group: its communicators were aborted already
                log.warning("xfuser %s after a broken group: %s", name, exc)

    def model_class(self):
        """xfuser's wrapper class of the family (a subclass of the diffusers transformer class).

        Raises:
            XfuserUnavailable: the installed xfuser has no such class.
        """
        module, name = XFUSER_WRAPPERS[self.family]
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise XfuserUnavailable(
                f"the installed xfuser has no {name} ({exc}); use cluster.sp_backend = 'diffusers'"
            ) from None
