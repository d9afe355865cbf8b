"""Small builders shared by many tests: configs from the example files with
overrides, keys directories, tiny conditioning tensors, leases, free loopback ports.

Every builder returns plain product objects and writes nothing outside the path it is given;
defaults are the values most tests use, so a call names only what a test is about.
Torch is imported inside the tensor builders, so a module that uses only the others stays light.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from spotlight import protocol as P
from spotlight.config import EXAMPLES_DIR, SpotlightConfig, dump_config, load_config
from spotlight.net.ports import listen_ports
from spotlight.net.security import add_client, init_keys

if TYPE_CHECKING:
    import torch

    from spotlight.rl.sampler import Conditioning

# ---------------------------------------------------------------- benchmark scripts

BENCHMARKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (registered in ``sys.modules`` under ``name``, so the
    script's dataclasses and pickles resolve); nothing of it runs but its imports."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, BENCHMARKS_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- configs

LAB_SMALL = {
    "data.prompts_per_iteration": 3,
    "data.num_control_prompts": 1,
    "data.group_size": 4,
    "cluster.worker_batch_size": 4,
    "sampler.num_steps": 4,
    "sampler.sde_window_size": 2,
}
"""Overrides of the embedded default for RL-lab tests: 3 prompts (one control) × 4 seeds, 4
sampler steps with a 2-step SDE window."""


def example_config(example: str | None = "jpeg-toy", overrides: Mapping[str, Any] | None = None) -> SpotlightConfig:
    """``examples/<example>/config.toml`` (``None``: the embedded default) with dotted-key
    ``overrides``, loaded and checked exactly as ``spotlight up --config`` loads it."""
    path = None if example is None else EXAMPLES_DIR / example / "config.toml"
    return load_config(path, dict(overrides or {}))


def write_config(
    path: pathlib.Path, example: str | None = "jpeg-toy", overrides: Mapping[str, Any] | None = None
) -> pathlib.Path:
    """:func:`example_config` written to ``path`` (a file for ``--config``); returns ``path``."""
    dump_config(example_config(example, overrides), path)
    return path


# ---------------------------------------------------------------- keys


def deep_dir(root: pathlib.Path, length: int = 180) -> pathlib.Path:
    """A directory below ``root`` whose path is at least ``length`` characters (created): longer
    than a Unix socket address allows (107 bytes on Linux)."""
    d = root
    while len(str(d)) < length:
        d = d / "a-rather-long-directory-name"
    d.mkdir(parents=True)
    return d


def make_keys(keys_dir: pathlib.Path, *, agents: Iterable[str] = (), status: Iterable[str] = ()) -> pathlib.Path:
    """A coordinator keys directory (``spotlight keys init``) with one client key per agent name
    and per status name (``spotlight keys add``); returns ``keys_dir``."""
    init_keys(keys_dir)
    for name in agents:
        add_client(keys_dir, "agent", name)
    for name in status:
        add_client(keys_dir, "status", name)
    return keys_dir


# ---------------------------------------------------------------- tensors and leases


def make_conditioning(
    batch: int, *, tokens: int = 5, dim: int = 16, seed: int = 0, pad_row: int = 1, pad_from: int = 3
) -> Conditioning:
    """Seeded random prompt embeddings ``[batch, tokens, dim]`` with an all-ones mask, except row
    ``pad_row`` (when the batch has it), padded from token ``pad_from`` on."""
    import torch

    from spotlight.rl.sampler import Conditioning

    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, tokens, dim, generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.int64)
    if batch > pad_row:
        mask[pad_row, pad_from:] = 0
    return Conditioning(embeds, mask)


def cond_tensors(cond: Conditioning, rows: list[int] | slice | None = None) -> dict[str, torch.Tensor]:
    """The ``cond.embeds`` / ``cond.mask`` tensors a LEASES message carries (optionally ``rows``)."""
    if rows is None:
        return {"cond.embeds": cond.embeds, "cond.mask": cond.mask}
    return {"cond.embeds": cond.embeds[rows], "cond.mask": cond.mask[rows]}


def make_lease_item(
    request_id: str = "r0",
    *,
    lease_id: int = 0,
    kind: str = "rollout",
    iteration: int = 0,
    prompt_index: int = 0,
    seed: int = 0,
    weight_version: int = 0,
    **kw: Any,
) -> P.LeaseItem:
    """One leased request (``params``/``resume_step`` through ``kw``)."""
    return P.LeaseItem(
        lease_id=lease_id,
        request_id=request_id,
        kind=kind,
        iteration=iteration,
        prompt_index=prompt_index,
        seed=seed,
        weight_version=weight_version,
        **kw,
    )


def make_leases(
    kind: str,
    seeds: Iterable[int],
    *,
    worker_id: str = "w0",
    weight_version: int = 3,
    first_lease_id: int = 10,
    params: Mapping[str, Any] | None = None,
    resume_step: int | None = None,
) -> P.Leases:
    """A LEASES message for ``worker_id``: request ``r<i>`` (prompt ``i``, lease
    ``first_lease_id + i``) with the i-th seed, all of one kind and weights version."""
    return P.Leases(
        worker_id=worker_id,
        items=[
            make_lease_item(
                f"r{i}",
                lease_id=first_lease_id + i,
                kind=kind,
                prompt_index=i,
                seed=s,
                weight_version=weight_version,
                params=dict(params or {}),
                resume_step=resume_step,
            )
            for i, s in enumerate(seeds)
        ],
    )


# ---------------------------------------------------------------- ports


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback TCP ports that were free a moment ago, chosen where no outgoing
    connection can take them before the test binds them (:mod:`spotlight.net.ports`)."""
    return listen_ports(n)


def free_port() -> int:
    """One loopback TCP port of :func:`free_ports`."""
    return listen_ports(1)[0]


# ---------------------------------------------------------------- coordinator parts


class PullingRun:
    """The run a control-plane test needs: it accepts pulls and sends no conditioning."""

    def accepts_pulls(self) -> bool:
        return True

    def conditioning(self, prompt_indices) -> dict:
        return {}


def control_plane(tmp_path: pathlib.Path, cfg: SpotlightConfig, *, run: Any, workers: Any, server: Any):
    """A real :class:`~spotlight.coordinator.control_plane.ControlPlane` of ``cfg`` (its own
    Request Scheduler, Instance Manager, a memory-less Tensor Store under ``tmp_path/store``
    and an event log) with the test's stand-ins for the run, the worker book and the server."""
    from spotlight.coordinator.control_plane import ControlPlane
    from spotlight.core.events import EventLog
    from spotlight.core.instance_manager import InstanceManager
    from spotlight.core.request_scheduler import RequestScheduler
    from spotlight.store.tensor_store import TensorStore

    cp = ControlPlane(
        cfg,
        RequestScheduler(cfg.cluster.lease_timeout_s),
        InstanceManager(cfg.cluster.heartbeat_timeout_s),
        TensorStore(tmp_path / "store", memory_max_bytes=0),
        EventLog(),
        run=run,
        workers=workers,
    )
    cp.attach(server)
    return cp


def toy_coordinator(run_dir: pathlib.Path, *, progress=None, num_prompts: int = 8, **overrides: Any):
    """A :class:`~spotlight.coordinator.coordinator.Coordinator` of the jpeg-toy example with
    ``overrides`` (dotted keys, ``**{"run.iterations": 2}``) on an ephemeral loopback port, with
    ``num_prompts`` prompts of zero embeddings."""
    import torch

    from spotlight.coordinator.coordinator import Coordinator

    n = num_prompts
    return Coordinator(
        example_config("jpeg-toy", overrides),
        run_dir,
        bind="tcp://127.0.0.1:0",
        prompts=[f"p{i}" for i in range(n)],
        embeds=torch.zeros(n, 16, 384),
        mask=torch.ones(n, 16, dtype=torch.long),
        progress=progress or (lambda s: None),
    )
