"""A run that never ends, served by the real control plane: for tests and benchmarks of nodes.

The agents, workers, warm spares and weight transfers of a node are exercised against the very
:class:`~spotlight.coordinator.control_plane.ControlPlane` that a coordinator runs (CURVE,
registration, sessions, heartbeats, leases, chunked weights, commits), without a training run
around it: one weight version (v0) is published in a Tensor Store, every pull finds rollout
requests of iteration 0 with fresh seeds (prompt 0, one conditioning row), and every result is
kept by seed in :attr:`FixedRun.results`. There is no trainer and no reward.

    run = FixedRun(cfg, work_dir, keys=server_keys, weights=path_to_v0, cond=Conditioning(...))
    run.start()            # binds 127.0.0.1:<free port>; serves on a thread
    ...                    # spotlight-agent join --coordinator 127.0.0.1:<run.port> ...
    run.stop()
"""

from __future__ import annotations

import pathlib
import threading
import time

import torch

from spotlight.config import SpotlightConfig
from spotlight.coordinator.control_plane import ControlPlane
from spotlight.coordinator.server import ControlServer
from spotlight.core.events import EventLog
from spotlight.core.instance_manager import InstanceManager
from spotlight.core.request_scheduler import RequestKind, RequestScheduler
from spotlight.net.security import ServerKeys
from spotlight.rl.sampler import Conditioning
from spotlight.store.tensor_store import TensorStore

__all__ = ["FixedRun"]

REFILL = 4
"""Rollout requests queued whenever none is ready."""


class FixedRun:
    """Args:
    cfg: the config whose cluster, model, sampler and LoRA sections the agents receive.
    work_dir: where the Tensor Store keeps v0 (``work_dir/tensor_store``).
    keys: the server keys and allow-list the agents authenticate against.
    weights: v0, a safetensors file (:func:`spotlight.store.tensor_wire.save_version`).
    cond: the conditioning of the one prompt (one row).
    bind: the public endpoint (default: a free loopback port).
    """

    def __init__(
        self,
        cfg: SpotlightConfig,
        work_dir: pathlib.Path,
        *,
        keys: ServerKeys,
        weights: pathlib.Path,
        cond: Conditioning,
        bind: str = "tcp://127.0.0.1:0",
    ):
        self.cfg, self.keys, self.weights, self.cond, self.bind = cfg, keys, pathlib.Path(weights), cond, bind
        self.sched = RequestScheduler(cfg.cluster.lease_timeout_s, max_failures=cfg.cluster.max_request_failures)
        self.sched.start_epoch(0)
        self.instances = InstanceManager(cfg.cluster.heartbeat_timeout_s)
        self.store = TensorStore(pathlib.Path(work_dir) / "tensor_store", memory_max_bytes=0)
        self.events = EventLog()
        self.control = ControlPlane(cfg, self.sched, self.instances, self.store, self.events, self, self, keys=keys)
        self.results: dict[int, dict[str, torch.Tensor]] = {}  # seed -> that request's result rows
        self.num_results = 0  # results accepted (a seed re-run after a revocation counts again)
        self._next_seed = 100
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.server: ControlServer | None = None
        self.endpoint = ""
        self.port = 0

    def start(self) -> FixedRun:
        """Publish v0, bind the sockets and serve on a thread. Returns self."""
        self.store.open()
        self.store.put_weights(0, self.weights.read_bytes())
        self.server = ControlServer(self.bind, self.keys, max_message_bytes=self.cfg.cluster.max_message_bytes)
        self.endpoint = self.server.endpoint
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.control.attach(self.server)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fixed-run")
        self._thread.start()
        return self

    def _serve(self) -> None:
        last_house = 0.0
        while not self._stop.is_set():
            self.control.serve_once(50)
            now = time.monotonic()
            if now - last_house > 0.5:
                self.control.housekeeping(now)
                last_house = now
        self.server.close(linger_ms=0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    @property
    def weight_chunks_served(self) -> int:
        return self.control.weight_chunks_served

    # ------------------------------------------------------------ the run port
    def accepts_pulls(self) -> bool:
        """Always: and before a pull finds the queue empty, it is refilled with fresh seeds."""
        if self.sched.num_ready() == 0:
            seeds = range(self._next_seed, self._next_seed + REFILL)
            self._next_seed += REFILL
            items = [(0, seed, 0) for seed in seeds]
            self.sched.submit(RequestKind.ROLLOUT, 0, items, weight_version=0, params={}, now=time.monotonic())
        return True

    def conditioning(self, prompt_indices: list[int]) -> dict[str, torch.Tensor]:
        return self.cond.index(prompt_indices).to_tensors()

    def on_results(self, body, completed: list, tensors: dict, now: float) -> None:
        for i, req in completed:
            self.results[req.seed] = {name: t[i : i + 1] for name, t in tensors.items()}
            self.num_results += 1

    def snapshot(self) -> dict:
        return {"phase": "serving", "requests": {k.value: v for k, v in self.sched.counts().items()}}

    # ------------------------------------------------------------ worker events: not metered here
    def worker_seen(self, worker_id: str, is_spot: bool, now: float) -> None:
        pass

    def worker_gone(self, worker_id: str, now: float) -> None:
        pass

    def lease_started(self, worker_id: str, now: float) -> None:
        pass

    def lease_ended(self, worker_id: str, now: float) -> None:
        pass
