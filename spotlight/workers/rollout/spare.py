"""Warm spare Rollout Worker: a pre-started process that becomes the next worker of its node
(paper §4.4.1-§4.4.2: a reconfiguration should cost "a small number of Workers", not an
engine start).

Starting a worker process costs a Python start plus the torch and diffusers imports
(seconds on a CPU, the largest part of adding a GPU to a group). The node Scheduler
(``spotlight-agent``, ``agent/main.py``) therefore keeps one spare per node, started in the
background before it is needed::

    agent                                   spare (this module)
      Popen(stdin=PIPE, pass_fds=[ready])   prctl(PR_SET_PDEATHSIG, SIGKILL): dies with the agent
                                            import torch, diffusers, the worker modules
                                            prepare (SP > 1): tensor layout from a weightless
                                              skeleton, pre-faulted receive buffers (CPU)
      ◀───────────────────── "ready\\n" on the ready pipe
      … a GPU is granted (or a worker must be replaced) …
      {"worker_id", "gpus",                 refuse (exit 76) if CUDA was initialised already;
       "cuda_visible_devices"}\\n ────────▶   set CUDA_VISIBLE_DEVICES, become the worker:
                                            WORKER_HELLO, GROUP_FORM, weights by broadcast
                                            from the co-located peer, GROUP_FORMED, serve
      start the next spare (once that group serves, so its imports do not slow the join)

While it waits, the spare never initialises CUDA: it makes no CUDA call (whether to prepare a
host receive buffer is read from torch's build), torch is imported with
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (an availability check some import might make asks NVML,
not the driver), and the device is chosen only after ``CUDA_VISIBLE_DEVICES`` is set at
assignment. If the driver
was nevertheless loaded before the assignment (checked in ``/proc/self/maps``), the spare
exits with :data:`EXIT_SPARE_UNUSABLE` and the agent starts the worker cold and stops
using spares.

It dies with the agent: ``PR_SET_PDEATHSIG`` (Linux) kills it when the agent goes, and an
end-of-file on stdin (the agent closed the pipe or died) ends a waiting spare on any OS.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys

EXIT_SPARE_UNUSABLE = 76
"""Exit status of a spare that cannot become a worker (CUDA was initialised before its
assignment); the agent then starts the worker cold and stops using spares."""

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux ``prctl``).

    Returns False where ``prctl`` is unavailable (other OSes: the stdin end-of-file still ends
    a waiting spare). Exits at once (status 0) if the parent ``parent_pid`` is already gone
    (it died before the request took effect).
    """
    ok = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            ok = False
    if os.getppid() != parent_pid:
        os._exit(0)
    return ok


def cuda_driver_loaded() -> bool:
    """True if this process has loaded the CUDA driver library (``libcuda.so``), i.e. something
    initialised CUDA; after that ``CUDA_VISIBLE_DEVICES`` would no longer take effect. False
    where ``/proc/self/maps`` cannot be read (not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def warm_up(conf: dict):
    """Import everything a worker needs and prepare what needs no GPU and no identity.

    Returns the prepared :class:`~spotlight.workers.sp.group.SPGroupMember` when
    ``conf["sp_degree"] > 1`` (else None). Raises what the config validation raises
    (``msgspec.ValidationError``) for a bad ``conf``.
    """
    import diffusers  # noqa: F401  (the import is the point)
    import msgspec
    import torch
    from diffusers import ContextParallelConfig  # noqa: F401
    from diffusers.hooks import FirstBlockCacheConfig  # noqa: F401

    from spotlight.config import ModelConfig
    from spotlight.models.families import get_family
    from spotlight.workers.rollout import worker  # noqa: F401  (warm: the assignment finds it imported)

    torch.set_num_threads(int(conf.get("torch_threads", 1)))
    model_cfg = msgspec.convert(conf["model"], ModelConfig)
    get_family(model_cfg)  # imports the family's module
    if conf.get("lora"):
        import peft  # noqa: F401
    if int(conf.get("sp_degree", 1)) <= 1:
        return None
    import torch.distributed  # noqa: F401

    from spotlight.workers.sp import group_worker  # noqa: F401
    from spotlight.workers.sp.group import SPGroupMember

    member = SPGroupMember(
        model_cfg,
        "spare",
        torch.device("cpu"),
        lora=conf.get("lora") or {},
        cfg_parallel=bool(conf.get("sp_cfg_parallel", False)),
        backend=str(conf.get("sp_backend", "diffusers")),
    )
    # A CUDA build receives the weights in device memory (a host receive buffer would only cost
    # memory). Asked of the build, not the driver: no CUDA call at all before the assignment.
    member.prewarm(preallocate=not torch.backends.cuda.is_built())
    return member


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Spotlight warm spare Rollout Worker (started by spotlight-agent; "
        "becomes a worker when assigned on stdin)"
    )
    ap.add_argument("--agent", required=True, help="agent endpoint the worker will connect to")
    ap.add_argument(
        "--config-json", required=True, help="the worker configuration (as the rollout worker's --config-json)"
    )
    ap.add_argument("--ready-fd", type=int, default=-1, help="pipe to write 'ready' to once warm")
    ap.add_argument(
        "--parent-pid", type=int, required=True, help="the agent's pid (the spare exits if it is not its parent)"
    )
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    conf = json.loads(args.config_json)
    member = warm_up(conf)

    from spotlight.workers.rollout.worker import exit_fast, make_worker, setup_process, worker_event

    worker_event("spare_ready")
    if args.ready_fd >= 0:
        try:
            os.write(args.ready_fd, b"ready\n")
            os.close(args.ready_fd)
        except OSError:
            pass
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0  # the agent closed the pipe (shutdown) or died: nothing to become
    job = json.loads(line)
    worker_id = str(job["worker_id"])
    setup_process(worker_id, conf)
    import logging

    import torch

    log = logging.getLogger("spotlight.worker")
    if cuda_driver_loaded() or torch.cuda.is_initialized():
        log.error(
            "spare: CUDA was initialised before the assignment; CUDA_VISIBLE_DEVICES would not apply: exiting (%d) "
            "so the agent starts %s cold",
            EXIT_SPARE_UNUSABLE,
            worker_id,
        )
        return EXIT_SPARE_UNUSABLE
    if job.get("cuda_visible_devices") is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(job["cuda_visible_devices"])
    worker_event("assigned", worker=worker_id)
    gpus = [int(g) for g in job["gpus"]]
    log.info("spare (pid %d) becomes worker %s on GPUs %s", os.getpid(), worker_id, gpus)
    proc = make_worker(args.agent, worker_id, gpus, conf, member=member)
    rc = proc.run()
    proc.close()
    exit_fast(0 if rc is None else rc)


if __name__ == "__main__":
    sys.exit(main())
