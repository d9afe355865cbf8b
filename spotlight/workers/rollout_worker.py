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
from spotlight.workers.common import (  # noqa: F401  (re-exported)
    MAX_CACHED_VERSIONS,
    BatchOutcome,
    RolloutExecutor,
    StepCounter,
    WorkerProcess,
    worker_device,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Spotlight Rollout Worker (started by spotlight-agent)")
    ap.add_argument("--agent", required=True, help="agent endpoint, e.g. ipc:///tmp/x or tcp://127.0.0.1:5555")
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--gpus", default="0", help="comma-separated GPU indices of this worker")
    ap.add_argument("--config-json", required=True, help="JSON with 'model', 'sampler', 'worker_batch_size', 'torch_threads', 'sp_degree', 'lora', 'weights_dir'")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SPOTLIGHT_LOG_LEVEL", "INFO"), format=f"%(asctime)s worker[{args.worker_id}] %(levelname)s %(message)s")
    import faulthandler
    import signal as _signal

    faulthandler.register(_signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack (debugging hangs)
    conf = json.loads(args.config_json)
    torch.set_num_threads(int(conf.get("torch_threads", 1)))
    model_cfg = msgspec.convert(conf["model"], ModelConfig)
    sampler_cfg = msgspec.convert(conf["sampler"], SamplerConfig)
    gpus = [int(g) for g in args.gpus.split(",") if g != ""]
    if int(conf.get("sp_degree", 1)) > 1:
        from spotlight.workers.group_worker import GroupWorkerProcess

        proc = GroupWorkerProcess(args.agent, args.worker_id, gpus, model_cfg, sampler_cfg, int(conf.get("worker_batch_size", 8)), weights_dir=conf.get("weights_dir"))
    else:
        proc = WorkerProcess(args.agent, args.worker_id, gpus, model_cfg, sampler_cfg, int(conf.get("worker_batch_size", 8)), lora=conf.get("lora") or {}, weights_dir=conf.get("weights_dir"))
    rc = proc.run()
    return 0 if rc is None else rc


if __name__ == "__main__":
    sys.exit(main())
