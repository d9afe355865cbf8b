"""Rollout Worker: one GPU worker process that denoises batches of leased requests.

The message flow with the agent and the coordinator is drawn in
:mod:`spotlight.workers.common`.

The execution classes live in :mod:`spotlight.workers.common` (shared with the
sequence-parallel :mod:`spotlight.workers.group_worker`); this module is the process
entry point and re-exports them for existing importers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import msgspec
import torch

from spotlight.config import ModelConfig, SamplerConfig
from spotlight.procs import configure_logging
from spotlight.workers.common import (  # noqa: F401  (re-exported)
    MAX_CACHED_VERSIONS,
    BatchOutcome,
    RolloutExecutor,
    StepCounter,
    WorkerProcess,
    exit_fast,
    worker_device,
)


def make_worker(agent_endpoint: str, worker_id: str, gpus: list[int], conf: dict, *, member=None) -> WorkerProcess:
    """The worker process object for ``conf`` (the agent's ``--config-json``): a
    :class:`~spotlight.workers.group_worker.GroupWorkerProcess` when ``sp_degree > 1``, else a
    :class:`WorkerProcess`. ``member``: a warm spare's prepared SP group member (SP > 1 only).

    Raises:
        msgspec.ValidationError: ``conf["model"]`` / ``conf["sampler"]`` are not valid sections.
    """
    model_cfg = msgspec.convert(conf["model"], ModelConfig)
    sampler_cfg = msgspec.convert(conf["sampler"], SamplerConfig)
    if int(conf.get("sp_degree", 1)) > 1:
        from spotlight.workers.group_worker import GroupWorkerProcess

        return GroupWorkerProcess(agent_endpoint, worker_id, gpus, model_cfg, sampler_cfg, int(conf.get("worker_batch_size", 8)), member=member, weights_dir=conf.get("weights_dir"))
    return WorkerProcess(agent_endpoint, worker_id, gpus, model_cfg, sampler_cfg, int(conf.get("worker_batch_size", 8)), lora=conf.get("lora") or {}, weights_dir=conf.get("weights_dir"))


def setup_process(worker_id: str, conf: dict) -> None:
    """Logging (``worker[<id>]`` prefix), the ``SIGUSR1`` stack dump and torch's thread count."""
    import faulthandler
    import signal as _signal

    configure_logging(f"worker[{worker_id}]", f"worker-{worker_id}")
    faulthandler.register(_signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack (debugging hangs)
    torch.set_num_threads(int(conf.get("torch_threads", 1)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Spotlight Rollout Worker (started by spotlight-agent)")
    ap.add_argument("--agent", required=True, help="agent endpoint, e.g. ipc:///tmp/x or tcp://127.0.0.1:5555")
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--gpus", default="0", help="comma-separated GPU indices of this worker")
    ap.add_argument("--config-json", required=True, help="JSON with 'model', 'sampler', 'worker_batch_size', 'torch_threads', 'sp_degree', 'lora', 'weights_dir'")
    args = ap.parse_args(argv)
    conf = json.loads(args.config_json)
    setup_process(args.worker_id, conf)
    gpus = [int(g) for g in args.gpus.split(",") if g != ""]
    proc = make_worker(args.agent, args.worker_id, gpus, conf)
    rc = proc.run()
    proc.close()
    exit_fast(0 if rc is None else rc)


if __name__ == "__main__":
    sys.exit(main())
