"""Replays a spot-availability trace onto local agents (``spotlight up --local --trace``).

The pure part (parsing, slicing, seeded placement of trace nodes onto agent GPU slots,
paper §6.1) is :mod:`spotlight.traces.formats`; this module is its thin shell: a thread that, at
each action's (scaled) time, acts on real processes through the real interfaces:

* ``start_node``   — a new spot VM joins: start a ``spotlight-agent join`` process
  (with its own mock metadata server) owning the arriving GPU;
* ``add_gpu``      — the agent's control socket: ``add`` (a new Rollout Worker starts);
* ``revoke_gpu``   — the agent's control socket: ``revoke`` (a per-GPU revocation by the
  cluster scheduler: that worker commits its in-flight state and exits);
* ``preempt_node`` — a real cloud preemption notice served by the node's mock metadata
  server (AWS ``spot/instance-action`` by default); the agent's detector sees it,
  workers commit, the agent leaves.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from typing import Callable

from spotlight.util.atomic_file import write_text_atomic

log = logging.getLogger("spotlight.traces.driver")


class TraceDriver(threading.Thread):
    """Args:
    actions: :class:`spotlight.traces.formats.ReplayAction` list (times already scaled).
    coordinator: endpoint agents join.
    keys_dir: the run's keys directory (agents use its ``agent.local`` key).
    cloud: mock metadata personality for spot nodes ("aws", "gcp", "azure").
    grace_s: commit grace of revocations / notice lead time.
    listing: dict updated in place with the live agents (written to ``local_agents.json``).
    listing_path: where to write it after each change.
    nice: CPU niceness of the spot agents' workers.
    warm_spare: spot agents keep a warm spare worker process (``cluster.warm_spare``).
    node_ready: ``node_ready(node_id)`` is True once that agent registered with the
        coordinator. An action on a node that started but has not registered yet waits
        for it, and so do the later actions on the same agent (their order is kept):
        the trace describes nodes that are up, and an agent slow to start on a loaded
        machine would otherwise get its revocation before it has a worker, or its
        preemption notice before it joins (it then refuses to join). None: never wait.
    """

    def __init__(
        self,
        actions,
        *,
        coordinator: str,
        keys_dir,
        cloud: str,
        grace_s: float,
        listing: dict,
        listing_path,
        nice: int = 5,
        warm_spare: bool = True,
        node_ready: Callable[[str], bool] | None = None,
    ):
        super().__init__(daemon=True, name="trace-driver")
        from spotlight.traces.formats import TraceReplayer

        self.replayer = TraceReplayer(actions)
        self.coordinator = coordinator
        self.keys_dir = str(keys_dir)
        self.cloud = cloud
        self.grace_s = grace_s
        self.nice = nice
        self.warm_spare = warm_spare
        self.listing = listing
        self.listing_path = listing_path
        self.stop_event = threading.Event()
        self.procs: list[subprocess.Popen] = []
        self.mocks = []
        self.node_of_agent: dict[int, str] = {}
        self.restarts: dict[int, int] = {}
        self.applied: list[dict] = []
        self.node_ready = node_ready
        self._waiting: list = []  # due actions not applied yet (their agent has not registered), in order
        self._announced: set = set()  # waiting actions already logged (dropped once applied)

    def _node_id(self, agent: int) -> str:
        k = self.restarts.get(agent, 0)
        return f"spot-{agent}" if k == 0 else f"spot-{agent}-r{k}"

    def _start_node(self, agent: int, gpus: list[int]) -> None:
        from spotlight.cloud.mock_metadata import MockMetadataServer

        node_id = self._node_id(agent)
        self.restarts[agent] = self.restarts.get(agent, 0) + 1
        mock = MockMetadataServer(self.cloud, vm_name=node_id).start()
        self.mocks.append(mock)
        from spotlight.util.procs import scrubbed_env, spawn_logged

        env = scrubbed_env()
        cmd = [
            sys.executable,
            "-m",
            "agent.main",
            "join",
            "--coordinator",
            self.coordinator,
            "--gpus",
            ",".join(map(str, gpus)),
            "--node-id",
            node_id,
            "--cloud",
            self.cloud,
            "--metadata-url",
            mock.url,
            "--poll-interval-s",
            "0.5",
            "--grace-s",
            str(self.grace_s),
            "--nice",
            str(self.nice),
            "--keys",
            self.keys_dir,
            "--key",
            "local",
            "--warm-spare" if self.warm_spare else "--no-warm-spare",
        ]
        proc = spawn_logged(cmd, f"agent-{node_id}", env=env)
        self.procs.append(proc)
        self.node_of_agent[agent] = node_id
        self.listing["agents"][node_id] = {
            "spot": True,
            "gpus": list(gpus),
            "pid": proc.pid,
            "cloud": self.cloud,
            "metadata_url": mock.url,
            "control_url": mock.control_url,
        }

    def _control(self, node_id: str, request: dict, timeout_s: float = 10.0) -> dict:
        import zmq

        from spotlight.net.agent_paths import control_endpoint

        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(control_endpoint(node_id))
        try:
            sock.send(json.dumps(request).encode())
            if not sock.poll(int(timeout_s * 1000)):
                return {"ok": False, "error": f"agent {node_id} did not answer"}
            return json.loads(sock.recv())
        finally:
            sock.close()

    def apply(self, action) -> None:
        agent, gpu = action.agent, action.gpu
        node_id = self.node_of_agent.get(agent)
        if action.kind == "start_node":
            self._start_node(agent, [gpu])
            result = {"started": self.node_of_agent[agent]}
        elif action.kind == "add_gpu":
            result = (
                self._control(node_id, {"cmd": "add", "gpus": [gpu]}) if node_id else {"ok": False, "error": "no node"}
            )
        elif action.kind == "revoke_gpu":
            result = (
                self._control(node_id, {"cmd": "revoke", "gpus": [gpu], "grace_s": self.grace_s})
                if node_id
                else {"ok": False, "error": "no node"}
            )
        elif action.kind == "preempt_node":
            from spotlight.cloud.mock_metadata import control

            entry = self.listing["agents"].get(node_id or "", {})
            result = control(entry["control_url"], "notice", lead_time_s=self.grace_s) if entry else {"ok": False}
            self.node_of_agent.pop(agent, None)
        else:
            result = {"ok": False, "error": f"unknown action {action.kind}"}
        rec = {
            "t_s": action.t_s,
            "kind": action.kind,
            "agent": agent,
            "gpu": gpu,
            "node": node_id or self.node_of_agent.get(agent),
            "trace_node": action.trace_node,
        }
        self.applied.append(rec)
        log.info("trace: %s agent %d gpu %s (%s)", action.kind, agent, gpu, rec["node"])
        if result.get("ok") is False:
            log.warning(
                "trace: %s on agent %d gpu %s did not apply: %s", action.kind, agent, gpu, result.get("error", result)
            )
        self.listing["trace_actions"] = self.applied
        write_text_atomic(self.listing_path, json.dumps(self.listing, indent=2))

    def _ready(self, agent: int) -> bool:
        node_id = self.node_of_agent.get(agent)
        return self.node_ready is None or node_id is None or bool(self.node_ready(node_id))

    def step(self, elapsed_s: float) -> None:
        """Apply the actions due at ``elapsed_s`` (seconds since the replay started), each
        once its agent is ready (see ``node_ready``), in trace order per agent."""
        self._waiting.extend(self.replayer.due(elapsed_s))
        held: set[int] = set()  # agents with an action still waiting: their later ones wait too
        waiting = []
        for action in self._waiting:
            if action.agent in held or not self._ready(action.agent):
                if action.agent not in held and action not in self._announced:
                    self._announced.add(action)
                    log.info(
                        "trace: %s on agent %d waits until %s registers",
                        action.kind,
                        action.agent,
                        self.node_of_agent.get(action.agent),
                    )
                held.add(action.agent)
                waiting.append(action)
                continue
            self._announced.discard(action)
            try:
                self.apply(action)
            except Exception as exc:  # keep replaying; the run must not die on one action
                log.error("trace action %s failed: %s", action, exc)
        self._waiting = waiting

    @property
    def done(self) -> bool:
        return self.replayer.done and not self._waiting

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop_event.is_set() and not self.done:
            self.step(time.monotonic() - t0)
            self.stop_event.wait(0.2)

    def close(self) -> None:
        self.stop_event.set()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for m in self.mocks:
            m.stop()
