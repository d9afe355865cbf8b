"""Discrete-event simulation of a whole post-training job on reserved + spot GPUs.

The simulation drives the *real* pure cores -- :class:`~spotlight.core.iteration.IterationCore`
(the coordinator's phase machine, with its exploration streaming),
:class:`~spotlight.core.request_scheduler.RequestScheduler`, :class:`~spotlight.core.planner.Planner`,
:class:`~spotlight.core.instance_manager.InstanceManager` (the cost meter) and
:class:`~spotlight.core.seed_bank.SeedBank` -- with simulated Rollout Workers, Train Workers
and rewards on a virtual clock. Spot capacity follows a trace (any format ``--trace``
reads), placed onto nodes at random as the paper does (§6.1, ``spotlight.traces.formats``).

What is simulated, and how (costs from a :class:`~spotlight.sim.profile.SimProfile`):

* a worker is an SP group of ``sp`` GPUs; a batch of b sequences takes
  ``b × Σ steps × step_gpu_s / (sp × efficiency[sp])`` seconds; exploration steps skipped
  by First Block Cache cost ``cached_step_cost`` of a step; a spot worker that lacks the
  version a request needs first pays ``weight_sync_s``;
* training takes ``train_time_s`` on the reserved GPUs, which do no rollout meanwhile;
* **elastic** policies (Spotlight, paper §4.4): a revoked GPU's group commits its batch
  (live migration) and the survivor serves at SP 1 after ``elastic_revoke_s``; an added
  GPU is usable after ``elastic_join_s`` and merges with an SP-1 survivor when that one
  is between batches; **restart** policies (RLBoost, veRL-omni): any change on a node
  stops the node's engine (in-flight work committed when live migration is on, else
  lost) for ``engine_restart_s``, and a GPU without an SP partner idles;
* rewards: a deterministic synthetic model, ``clip(mu_p + sigma_p·z(seed), 0, 1)``, in
  which exploration on stale weights sees the same seed ranking up to a small noise
  (paper §3.2.1); it gives the Planner a real variance signal.

Cost: the reserved node's GPUs -- the Train Workers' GPUs, which also
roll out between updates (colocated, paper §6.1) -- are billed from ``t = 0`` to the end,
spot GPUs while they are held; rows carry the real coordinator's ``cost/*`` and
``throughput/requests_per_s`` columns (:func:`spotlight.core.instance_manager.cost_metrics`).

Convergence is an input (iterations to target per policy, from the profile): the
simulator measures what one iteration costs in time and money under each policy.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from spotlight.core.instance_manager import InstanceManager, NodeStatus, cost_metrics
from spotlight.core.iteration import (
    CoreObservation,
    IterationDone,
    IterationSettings,
    Phase,
    StartSaving,
    StartTraining,
    build_iteration_core,
)
from spotlight.core.modes import POLICIES, Policy
from spotlight.core.planner import Action, PlannerConfig, min_selective_sequences
from spotlight.core.request_scheduler import Lease, Request, RequestKind, RequestScheduler
from spotlight.core.seed_bank import MASK64, SeedBank, splitmix64
from spotlight.sim.profile import SimProfile
from spotlight.traces.formats import ReplayAction

__all__ = ["POLICIES", "Policy", "SimResult", "Simulator", "simulate"]


# the mode table is shared with the real system's run.mode (spotlight.core.modes)


def _uniforms(*parts: int) -> tuple[float, float]:
    """Two deterministic U(0, 1) draws from integer ``parts`` (SplitMix64 chained over them;
    no ``hash()``, so results do not depend on the interpreter)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = splitmix64(h ^ (p & MASK64))
    a = splitmix64(h)
    return ((a >> 11) + 0.5) / 2**53, ((splitmix64(a) >> 11) + 0.5) / 2**53


class SyntheticReward:
    """``reward(prompt, seed) = clip(mu_p + sigma_p · z(seed), 0, 1)`` with per-prompt mu_p ~
    U(0.2, 0.8) and sigma_p ~ U(0.05, 0.25); a stale-weight exploration adds
    ``stale_noise · N(0, 1)`` to z, keeping the seed ranking mostly (paper §3.2.1)."""

    def __init__(self, seed: int, *, stale_noise: float = 0.3) -> None:
        self.seed = seed
        self.stale_noise = stale_noise
        # per prompt: (mu, sigma, SplitMix64 state of _uniforms after (seed, prompt))
        self._prompt: dict[int, tuple[float, float, int]] = {}
        self._h_seed = splitmix64(0x243F6A8885A308D3 ^ (seed & MASK64))  # _uniforms' state after (seed,)
        # the same per-prompt state as numpy rows, for ``many``: prompt -> row of _table
        # (mu, sigma, unused) and of _table_h (the SplitMix64 state)
        self._rows: dict[int, int] = {}
        self._table = np.zeros((0, 3))
        self._table_h = np.zeros(0, dtype=np.uint64)

    def _prompt_state(self, prompt: int) -> tuple[float, float, int]:
        ms = self._prompt.get(prompt)
        if ms is None:
            a, b = _uniforms(self.seed, -1, prompt)
            ms = self._prompt[prompt] = (0.2 + 0.6 * a, 0.05 + 0.2 * b, splitmix64(self._h_seed ^ (prompt & MASK64)))
        return ms

    def __call__(self, prompt: int, seed: int, *, stale: bool) -> float:
        ms = self._prompt.get(prompt)
        if ms is None:
            ms = self._prompt_state(prompt)
        mu, sigma, h = ms
        # = _uniforms(self.seed, prompt, seed), continuing from the prompt's cached state,
        # with the three SplitMix64 rounds left written out (identical numbers)
        x = ((h ^ (seed & _M64)) + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        x ^= x >> 31
        x = (x + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        a = x ^ (x >> 31)
        x = (a + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        u1 = ((a >> 11) + 0.5) / 2**53
        u2 = (((x ^ (x >> 31)) >> 11) + 0.5) / 2**53
        r = _sqrt(-2.0 * _log(u1))
        z = r * _cos(_TWO_PI * u2)
        if stale:  # the second Box-Muller draw of the same pair: independent of z
            z += self.stale_noise * r * _sin(_TWO_PI * u2)
        return min(1.0, max(0.0, mu + sigma * z))

    def many(self, prompts: Sequence[int], seeds: Sequence[int], stale: Sequence[bool]) -> list[float]:
        """``[self(p, s, stale=t) for p, s, t in zip(prompts, seeds, stale)]``: the same
        numbers, computed for many requests at once. The SplitMix64 rounds run in numpy
        uint64 arithmetic (exact: it wraps mod 2**64 as the masked Python ints do); the
        arithmetic around log/cos/sin in numpy float64 operations, one IEEE rounding per
        operation in the order ``__call__`` does them; log, cos and sin themselves come
        from ``math`` as in ``__call__`` (numpy's own may differ in the last bit by CPU).
        Seeds outside [0, 2**64) take the one-at-a-time path."""
        n = len(prompts)
        if n == 0:
            return []
        try:
            s = np.fromiter(seeds, dtype=np.uint64, count=n)
        except OverflowError:
            return [self(p, sd, stale=t) for p, sd, t in zip(prompts, seeds, stale)]
        rows = self._rows
        for p in set(prompts).difference(rows):  # per-prompt state, one numpy row per prompt
            mu, sigma, h = self._prompt_state(p)
            rows[p] = len(rows)
            self._table = np.concatenate([self._table, np.array([(mu, sigma, 0.0)])])
            self._table_h = np.append(self._table_h, np.uint64(h))
        i = np.fromiter(map(rows.__getitem__, prompts), dtype=np.intp, count=n)
        x = _np_splitmix64(self._table_h[i] ^ s)
        a = _np_splitmix64(x)
        b = _np_splitmix64(a)
        u1 = ((a >> 11) + 0.5) / 2**53  # exact integers below 2**53, then IEEE + and /
        u2 = ((b >> 11) + 0.5) / 2**53
        r = np.sqrt(
            -2.0 * np.fromiter(map(_log, u1.tolist()), dtype=np.float64, count=n)
        )  # sqrt: correctly rounded in both
        angle = _TWO_PI * u2
        z = r * np.fromiter(map(_cos, angle.tolist()), dtype=np.float64, count=n)
        st = np.flatnonzero(np.fromiter(stale, dtype=bool, count=n))
        if st.size:
            z[st] += (
                self.stale_noise * r[st] * np.fromiter(map(_sin, angle[st].tolist()), dtype=np.float64, count=st.size)
            )
        mu_sigma = self._table[i]
        v = mu_sigma[:, 0] + mu_sigma[:, 1] * z
        # = min(1.0, max(0.0, v)) element-wise (v is finite: u1 is in (0, 1))
        return np.minimum(1.0, np.maximum(0.0, v)).tolist()


def _np_splitmix64(x: np.ndarray) -> np.ndarray:
    """:func:`spotlight.core.seed_bank.splitmix64` of every element of a uint64 array."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_M64 = MASK64
_EXPLORE = RequestKind.EXPLORE  # a global: ``RequestKind.X`` goes through the enum metaclass's ``__getattr__``
_sqrt, _log, _cos, _sin = math.sqrt, math.log, math.cos, math.sin
_TWO_PI = 2 * math.pi


@dataclass
class _Worker:
    wid: str
    node: "_Node"
    gpus: tuple[int, ...]
    sp: int
    version: int
    ready_at: float
    leases: list[Lease] | None = None
    pulled_at: float = 0.0  # when the batch was leased
    work_start: float = 0.0  # when denoising started (after any weight sync)
    end: float = 0.0
    token: int = 0
    steps: list[float] = field(default_factory=list)  # full-step cost per leased request
    nominal: list[int] = field(default_factory=list)  # nominal steps left per leased request
    resume: list[int] = field(default_factory=list)


@dataclass
class _Node:
    node_id: str
    is_spot: bool
    gpus: set[int] = field(default_factory=set)  # GPUs the job holds (billed)
    usable_at: dict[int, float] = field(default_factory=dict)  # GPU -> when it may serve
    workers: dict[str, _Worker] = field(default_factory=dict)
    down_until: float = 0.0  # engine restarting (restart policies)
    next_worker: int = 0


@dataclass
class SimResult:
    """What one simulated job cost (units in the names)."""

    policy: str
    iterations: int
    wall_s: float
    cost_usd: float
    spot_cost_usd: float
    reserved_cost_usd: float
    spot_gpu_hours: float
    reserved_gpu_hours: float
    spot_utilisation: float  # busy spot GPU-seconds / held spot GPU-seconds, whole run
    spot_busy_training: float  # mean over iterations of spot busy share of the training window
    critical_path_share: float  # exploration on the critical path / iteration time, whole run
    preemptions: int  # GPU revocations and node preemptions applied
    additions: int
    work_lost_steps: float  # denoising steps (× sequences) computed and then lost
    requests_done: int
    sim_elapsed_s: float  # real seconds the simulation took
    rows: list[dict] = field(default_factory=list)
    finished: bool = True
    stopped_because: str = ""  # why it did not finish, in words ("" when it finished)

    @property
    def speedup_vs_real_time(self) -> float:
        return self.wall_s / self.sim_elapsed_s if self.sim_elapsed_s > 0 else math.inf

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("rows")
        d["speedup_vs_real_time"] = self.speedup_vs_real_time
        return d


class Simulator:
    """One policy on one trace: build, :meth:`run`, read the :class:`SimResult`.

    Args:
        profile: costs, workload and cluster (:mod:`spotlight.sim.profile`).
        policy: a :class:`Policy`.
        actions: spot capacity changes (``spotlight.traces.formats.TracePlacement.plan`` output,
            agents = spot nodes), times in seconds from the start; None = a static pool of
            ``spot_nodes × gpus_per_spot_node`` GPUs.
        iterations: iterations to run (default: the profile's iterations to target).
        seed: seeds the rewards and the Planner.
        max_candidates_per_prompt: cap on planned + streamed candidates per prompt
            (large = the uncapped exploration of paper §6.6).
        max_sim_s: give up (``finished=False``) past this virtual time.

    Raises:
        ValueError: an unknown setting (policy explore mode, no iterations to target).
    """

    def __init__(
        self,
        profile: SimProfile,
        policy: Policy,
        actions: Sequence[ReplayAction] | None,
        *,
        iterations: int | None = None,
        seed: int = 0,
        max_candidates_per_prompt: int = 256,
        max_sim_s: float = 30 * 24 * 3600.0,
    ) -> None:
        p = profile
        self.profile, self.policy = p, policy
        if iterations is None:
            if policy.name not in p.iterations_to_target:
                raise ValueError(f"profile {p.source} has no iterations_to_target for policy {policy.name!r}")
            iterations = p.iterations_to_target[policy.name]
        self.iterations = iterations
        self.max_sim_s = max_sim_s
        self.stopped_because = ""
        self.now = 0.0
        self._heap: list[tuple[float, int, str, object]] = []
        self._seq = 0
        self.sched = RequestScheduler(lease_timeout_s=1e12)
        self.instances = InstanceManager(heartbeat_timeout_s=1e12)
        self.seed_bank = SeedBank(seed, p.group_size)
        self.reward = SyntheticReward(seed)
        control = 0 if policy.reuse_exploration else p.num_control_prompts
        options = [dataclasses.replace(o, cost_steps=p.sequence_cost_steps(o.effective_steps)) for o in p.step_options]
        bandit = policy.planner == "bandit"
        self.core = build_iteration_core(
            IterationSettings(
                iterations=iterations,
                prompts_per_iteration=p.prompts_per_iteration,
                num_control_prompts=control,
                group_size=p.group_size,
                run_seed=seed,
                num_steps=p.num_steps,
                explore_mode=policy.explore_mode,
                reuse_exploration=policy.reuse_exploration,
                stream_extra=policy.stream_extra,
                max_candidates_per_prompt=max_candidates_per_prompt,
            ),
            self.sched,
            self.seed_bank,
            list(range(max(p.prompts_per_iteration * 4, 128))),
            planner_config=PlannerConfig(
                max_sequences=p.max_sequences,
                min_sequences=min_selective_sequences(p.group_size, p.sequence_step, p.max_sequences),
                group_size=p.group_size,
                sequence_step=p.sequence_step,
                min_effective_steps=p.min_effective_steps,
                min_exploration_accuracy=p.min_exploration_accuracy,
                beta=p.beta,
            )
            if bandit
            else None,
            step_options=options,
            planner_seed=seed,
            fixed_action=None if bandit else Action(p.best_of_n, float(p.num_steps), 0.0, float(p.num_steps)),
        )
        self._options = {o.cache_threshold: o for o in options}
        self.nodes: dict[str, _Node] = {}
        self.workers: dict[str, _Worker] = {}
        self.idle: dict[str, None] = {}  # insertion-ordered set of idle worker ids
        self._spot_workers = 0
        self._spot_gpus: int | None = None  # cached InstanceManager.num_spot_gpus()
        self.version = 0  # latest published weights
        self._train_done_iter: int | None = None
        self.reserved_gpus = p.reserved_gpus if policy.use_spot else p.reserved_only_gpus
        self.train_s = p.train_s(self.reserved_gpus)
        self.actions = list(actions) if actions is not None else None
        self.rows: list[dict] = []
        self.preemptions = self.additions = 0
        self.work_lost_steps = 0.0
        self.requests_done = 0
        self._busy_spot_gpu_s = 0.0
        self._iter_counts = {"preemptions": 0, "additions": 0, "work_lost_steps": 0.0}
        self._step_s_cache: dict[int, float] = {}
        self._rewards_ahead: dict[str, float] = {}  # request id -> its reward, computed ahead (see _reward)
        self._meta_seen = 0  # request_meta entries whose rewards were computed ahead
        self._obs_key: tuple | None = None
        self._final_saved = False
        self._obs: CoreObservation | None = None

    # ------------------------------------------------------------------ event queue
    def _at(self, t: float, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        p = self.profile
        res = _Node("reserved-0", False)
        self.nodes[res.node_id] = res
        res.gpus = set(range(self.reserved_gpus))
        res.usable_at = dict.fromkeys(res.gpus, 0.0)
        self.instances.register(res.node_id, "sim", sorted(res.gpus), False, 0.0)
        self._rebalance(res)
        if not self.policy.use_spot:
            return
        if self.actions is None:
            for a in range(p.spot_nodes):
                for g in range(p.gpus_per_spot_node):
                    self._at(
                        0.0, "trace", ReplayAction(0.0, "start_node" if g == 0 else "add_gpu", a, g, f"static{a}.{g}")
                    )
        else:
            for act in self.actions:
                self._at(act.t_s, "trace", act)

    # ------------------------------------------------------------------ workers
    def _new_worker(self, node: _Node, gpus: tuple[int, ...], ready_at: float) -> None:
        wid = f"{node.node_id}/w{node.next_worker}"
        node.next_worker += 1
        w = _Worker(wid, node, gpus, len(gpus), self.version, ready_at)
        node.workers[wid] = w
        self.workers[wid] = w
        self._spot_workers += node.is_spot
        self.core.worker_seen(wid, node.is_spot, self.now)  # alive (and idle) from its creation
        self.idle[wid] = None
        if ready_at > self.now:
            self._at(ready_at, "wake", wid)

    def _drop_worker(self, w: _Worker, *, commit: bool) -> None:
        """Remove a worker; its batch is committed (live migration) or lost."""
        if w.leases:
            self._interrupt(w, commit=commit)
        self.idle.pop(w.wid, None)
        w.node.workers.pop(w.wid, None)
        if self.workers.pop(w.wid, None) is not None:
            self._spot_workers -= w.node.is_spot
        self.core.worker_gone(w.wid, self.now)

    def _interrupt(self, w: _Worker, *, commit: bool) -> None:
        now = self.now
        total = w.end - w.work_start
        frac = 0.0 if total <= 0 else min(1.0, max(0.0, (now - w.work_start) / total))
        if w.node.is_spot:
            self._busy_spot_gpu_s += (now - w.pulled_at) * len(w.gpus)
        for lease, cost, nominal, resume in zip(w.leases, w.steps, w.nominal, w.resume):
            done_steps = int(frac * nominal)
            if commit and done_steps > 0:
                self.sched.commit(
                    lease.request_id,
                    lease.lease_id,
                    committed_step=resume + done_steps,
                    commit_key=f"sim.{lease.request_id}.L{lease.lease_id}",
                    now=now,
                    worker_id=w.wid,
                )
            else:
                self.work_lost_steps += frac * cost
                self._iter_counts["work_lost_steps"] += frac * cost
        self.sched.release_worker(w.wid, reason="preempted", now=now)  # anything not committed
        self.core.lease_ended(w.wid, now)
        w.leases = None
        w.token += 1

    def _rebalance(self, node: _Node) -> None:
        """Form workers from the node's usable GPUs that no worker holds (and, elastic, from
        idle SP-1 survivors that can be merged into a full group)."""
        if node.down_until > self.now:
            return
        sp = self.profile.spot_sp if node.is_spot else self.profile.reserved_sp
        held = {g for w in node.workers.values() for g in w.gpus}
        free = sorted(g for g in node.gpus if g not in held and node.usable_at.get(g, math.inf) <= self.now)
        elastic = self.policy.elastic and node.is_spot
        if elastic and sp > 1:
            frags = [w for w in node.workers.values() if w.sp < sp and w.leases is None]
            while frags and len(free) + sum(len(w.gpus) for w in frags) >= sp:
                group: list[int] = []
                while frags and len(group) < sp and len(group) + len(frags[0].gpus) <= sp:
                    w = frags.pop(0)
                    group += w.gpus
                    self._drop_worker(w, commit=True)
                while len(group) < sp and free:
                    group.append(free.pop(0))
                if len(group) < sp:  # could not complete: give the GPUs back as fragments
                    free = sorted(free + group)
                    break
                self._new_worker(node, tuple(sorted(group)), self.now)
        while len(free) >= sp:
            self._new_worker(node, tuple(free[:sp]), self.now)
            free = free[sp:]
        if elastic:
            for g in free:  # a GPU without a partner serves alone (SP 1, offloading)
                self._new_worker(node, (g,), self.now)

    # ------------------------------------------------------------------ trace
    def _apply(self, act: ReplayAction) -> None:
        """Carry out one trace action, and keep the cached N_spot by the change of this node's
        serving GPUs: only the acting node's registration changes, and a recount of every node
        after each action made starting 10 000 nodes O(nodes²) (over a minute)."""
        node_id = f"spot-{act.agent}"
        before = self._serving_spot_gpus(node_id)
        self._apply_action(act, node_id)
        if self._spot_gpus is not None:
            self._spot_gpus += self._serving_spot_gpus(node_id) - before

    def _serving_spot_gpus(self, node_id: str) -> int:
        """This spot node's part of :meth:`InstanceManager.num_spot_gpus`."""
        rec = self.instances.nodes.get(node_id)
        return rec.num_serving_gpus if rec is not None and rec.is_spot and rec.status is NodeStatus.ALIVE else 0

    def _apply_action(self, act: ReplayAction, node_id: str) -> None:
        p, now = self.profile, self.now
        node = self.nodes.get(node_id)
        gpu = act.gpu if act.gpu is not None else 0
        if act.kind in ("start_node", "add_gpu"):
            self.additions += 1
            self._iter_counts["additions"] += 1
            if node is None or not node.gpus:
                node = _Node(node_id, True)
                self.nodes[node_id] = node
                node.gpus = {gpu}
                node.usable_at = {gpu: now + p.node_start_s}
                self.instances.register(node_id, "sim", [gpu], True, now)
                self._at(now + p.node_start_s, "rebalance", node_id)
                return
            node.gpus.add(gpu)
            self.instances.heartbeat(node_id, now, gpus=sorted(node.gpus))
            if self.policy.elastic:
                node.usable_at[gpu] = now + p.elastic_join_s
                self._at(now + p.elastic_join_s, "rebalance", node_id)
            else:
                self._restart(node)
            return
        # a GPU (or the node's last GPU) is taken away
        if node is None or gpu not in node.gpus:
            return
        self.preemptions += 1
        self._iter_counts["preemptions"] += 1
        node.gpus.discard(gpu)
        node.usable_at.pop(gpu, None)
        if not node.gpus:
            for w in list(node.workers.values()):
                self._drop_worker(w, commit=self.policy.live_migration)
            self.instances.goodbye(node_id, now, "preempted")
            del self.nodes[node_id]
            return
        self.instances.heartbeat(node_id, now, gpus=sorted(node.gpus))
        if self.policy.elastic:
            for w in [w for w in node.workers.values() if gpu in w.gpus]:
                survivors = [g for g in w.gpus if g != gpu]
                self._drop_worker(w, commit=self.policy.live_migration)
                for g in survivors:  # the survivor re-forms from its memory
                    node.usable_at[g] = now + p.elastic_revoke_s
            self._at(now + p.elastic_revoke_s, "rebalance", node_id)
        else:
            self._restart(node)

    def _restart(self, node: _Node) -> None:
        """A restart policy's reconfiguration: stop every worker of the node, restart the engine."""
        for w in list(node.workers.values()):
            self._drop_worker(w, commit=self.policy.live_migration)
        node.down_until = self.now + self.profile.engine_restart_s
        node.usable_at = dict.fromkeys(node.gpus, node.down_until)
        self._at(node.down_until, "rebalance", node.node_id)

    # ------------------------------------------------------------------ work
    def _batch_cost(self, w: _Worker, leases: list[Lease]) -> tuple[Request, bool]:
        """Per leased request: full-step equivalents left, nominal steps left, resume step.
        A batch shares one batch key, so its first request's params price every request.
        Returns that request (its weight version is the batch's) and whether any request
        of the batch resumes committed work."""
        T = self.profile.num_steps
        req = self.sched.get(leases[0].request_id)
        full = float(T)
        if req.kind is _EXPLORE and "cache_threshold" in req.params:
            opt = self._options.get(float(req.params["cache_threshold"]))
            if opt is not None:
                full = opt.cost_steps
        for lease in leases:
            if lease.resume_step:
                break
        else:  # nothing to resume (the common case): the same numbers, computed once
            n = len(leases)
            w.resume = [0] * n
            w.nominal = [T] * n
            w.steps = [full * T / T] * n
            return req, False
        w.resume = resume = [lease.resume_step or 0 for lease in leases]
        w.nominal = [max(0, T - r) for r in resume]
        w.steps = [full * n / T for n in w.nominal]
        return req, True

    def _step_s(self, sp: int) -> float:
        """``profile.step_s(sp)``, cached."""
        s = self._step_s_cache.get(sp)
        if s is None:
            s = self._step_s_cache[sp] = self.profile.step_s(sp)
        return s

    def _dispatch(self) -> None:
        idle = self.idle
        if not idle:
            return
        sched = self.sched
        if sched.num_ready() == 0:
            return
        now = self.now
        training = self.core.phase is Phase.TRAIN
        p = self.profile
        bs = p.batch_size
        workers, pull = self.workers, sched.pull
        worker_seen, lease_started = self.core.worker_seen, self.core.lease_started
        for wid in list(idle):
            w = workers.get(wid)
            if w is None or w.ready_at > now:
                continue
            is_spot = w.node.is_spot
            if not is_spot and training:
                continue  # the reserved GPUs are training
            leases = pull(wid, is_spot=is_spot, max_requests=bs, now=now)
            if not leases:
                continue
            del idle[wid]
            first, resuming = self._batch_cost(w, leases)
            need = first.weight_version
            sync = p.weight_sync_s if (is_spot and w.version < need) else 0.0
            w.version = max(w.version, need)
            step_s = self._step_s(w.sp)
            # live migration's price: resuming committed requests first fetches their latents
            # from the Tensor Store (commit + restore, profile ``commit_s``)
            restore = p.commit_s if resuming else 0.0
            w.leases = leases
            w.pulled_at = now
            w.work_start = now + sync + restore
            w.end = w.work_start + sum(w.steps) * step_s
            w.token += 1
            worker_seen(wid, is_spot, now)
            lease_started(wid, now)
            self._at(w.end, "done", (wid, w.token))
            if sched.num_ready() == 0:
                break

    def _finish(self, wid: str, token: int) -> None:
        w = self.workers.get(wid)
        if w is None or w.token != token or not w.leases:
            return
        now = self.now
        if w.node.is_spot:
            self._busy_spot_gpu_s += (now - w.pulled_at) * len(w.gpus)
        sched, core, ahead = self.sched, self.core, self._rewards_ahead
        complete, get = sched.complete, sched.get
        record_result, record_reward = core.record_result, core.record_reward
        done = 0
        for lease in w.leases:
            rid = lease.request_id
            if complete(rid, lease.lease_id, now, worker_id=wid):
                done += 1
                record_result(rid, now)
                reward = ahead.pop(rid, None)
                if reward is None:
                    reward = self._reward(rid, get(rid))
                record_reward(rid, reward)
        self.requests_done += done
        w.leases = None
        core.lease_ended(wid, now)
        self.idle[wid] = None
        if w.node.is_spot and self.policy.elastic and w.sp < self.profile.spot_sp:
            self._rebalance(w.node)  # an SP-1 survivor may merge with a GPU that joined

    def _reward(self, rid: str, req: Request) -> float:
        """The synthetic reward of a request that was just completed: computed ahead, with
        every request submitted since the last call (:meth:`SyntheticReward.many`), and
        kept in ``_rewards_ahead`` until its result comes; one at a time if it was not."""
        meta = self.core.request_meta
        new = len(meta) - self._meta_seen  # request_meta only grows, in submission order
        if new > 0:
            self._meta_seen = len(meta)
            get, ahead = self.sched.get, self._rewards_ahead
            rids, prompts, seeds, stale = [], [], [], []
            for r in itertools.islice(reversed(meta), new):
                if r in ahead:
                    continue
                try:
                    q = get(r)
                except KeyError:  # forgotten already
                    continue
                rids.append(r)
                prompts.append(meta[r][1])
                seeds.append(q.seed)
                stale.append(q.kind is _EXPLORE and q.weight_version < q.iteration)
            self._rewards_ahead.update(zip(rids, self.reward.many(prompts, seeds, stale)))
            v = self._rewards_ahead.pop(rid, None)
            if v is not None:
                return v
        stale = req.kind is _EXPLORE and req.weight_version < req.iteration
        return self.reward(meta[rid][1], req.seed, stale=stale)

    def _outstanding(self, rid: str) -> bool:
        """True if the scheduler still has ``rid`` and it is not DONE or CANCELLED."""
        try:
            return not self.sched.get(rid).status.is_terminal()
        except KeyError:
            return False

    # ------------------------------------------------------------------ the loop
    def _observation(self) -> CoreObservation:
        """What the core sees now; the previous (frozen) observation when nothing in it changed."""
        p = self.profile
        if self._spot_gpus is None:
            self._spot_gpus = self.instances.num_spot_gpus()
        train_done = self.core.phase is Phase.TRAIN and self._train_done_iter == self.core.iteration
        key = (train_done, self._final_saved, self._spot_gpus, self._spot_workers)
        if key != self._obs_key:
            self._obs_key = key
            self._obs = CoreObservation(
                trainers_ready=True,
                any_worker_node=True,
                train_done=train_done,
                final_saved=self._final_saved,
                num_spot_gpus=self._spot_gpus,
                step_time_s=self._step_s(p.spot_sp) * p.spot_sp,
                spot_slots=self._spot_workers * p.batch_size,
            )
        return self._obs

    def _pump(self) -> None:
        for _ in range(4):
            ready_before = self.sched.num_ready()
            for d in self.core.advance(self.now, self._observation()):
                if isinstance(d, StartTraining):
                    self._at(self.now + self.train_s, "train_done", d.iteration)
                elif isinstance(d, IterationDone):
                    self._record(d)
                elif isinstance(d, StartSaving):
                    self._final_saved = True  # the simulated trainers save the final model at once
                    self.core.advance(self.now, self._observation())
            self._dispatch()
            if self.core.done or (self.sched.num_ready() >= ready_before and self.core.phase is not Phase.ENDED):
                break

    def _loop(self) -> bool:
        """The event loop; False if it stopped early (no events left, or past ``max_sim_s``)."""
        self._setup()
        self._pump()
        heap, heappop, core = self._heap, heapq.heappop, self.core
        while not core.done:
            if not heap:
                self.stopped_because = "nothing was left to happen (no GPU to roll out or train on?)"
                return False
            t, _, kind, payload = heappop(heap)
            if t > self.max_sim_s:
                self.stopped_because = (
                    f"its next event ({kind.replace('_', ' ')} at {t / 3600:,.1f} h) lies past the simulated time "
                    f"limit of {self.max_sim_s / 86400:g} days"
                )
                return False
            self.now = max(self.now, t)
            if kind == "done":
                self._finish(*payload)
            elif kind == "trace":
                self._apply(payload)
            elif kind == "rebalance":
                node = self.nodes.get(payload)
                if node is not None:
                    self._rebalance(node)
            elif kind == "train_done":
                self._train_done_iter = payload
                self.version = max(self.version, payload + 1)
            elif kind == "wake":
                pass
            self._pump()
        return True

    def _record(self, d: IterationDone) -> None:
        row = dict(d.metrics)
        row.pop("planner", None)
        self.instances.integrate(self.now)
        p = self.profile
        row.update(
            {
                "t_s": self.now,
                "spot/num_gpus": self.instances.num_spot_gpus(),
                "spot/preemptions": self._iter_counts["preemptions"],
                "spot/additions": self._iter_counts["additions"],
                "spot/work_lost_steps": self._iter_counts["work_lost_steps"],
                "sim/requests_done": self.requests_done,
            }
        )
        # the same cost and throughput columns as the real coordinator's rows; the reserved
        # node's GPUs train and, between updates, roll out (colocated, paper §6.1), so its
        # GPU-seconds already bill the Train Workers' GPUs, once, from t = 0
        in_iteration = self.requests_done - int(sum(r.get("requests/completed", 0.0) for r in self.rows))
        row.update(
            cost_metrics(
                self.instances.gpu_seconds(spot=True),
                self.instances.gpu_seconds(spot=False),
                p.spot_usd_per_gpu_hour,
                p.reserved_usd_per_gpu_hour,
                requests_total=self.requests_done,
                requests_in_iteration=in_iteration,
                iteration_s=float(row.get("time/iteration_s", 0.0)),
            )
        )
        self._iter_counts = {"preemptions": 0, "additions": 0, "work_lost_steps": 0.0}
        self.rows.append(row)
        self.sched.forget(before_iteration=d.iteration)
        # drop rewards computed ahead for requests that will not complete (cancelled, forgotten)
        self._rewards_ahead = {rid: v for rid, v in self._rewards_ahead.items() if self._outstanding(rid)}

    def run(self) -> SimResult:
        """Simulate until every iteration is done (or ``max_sim_s``).

        Python's automatic cyclic garbage collection is paused while the event loop runs
        (and restored after): the loop creates several container objects per request --
        hundreds of thousands alive at once at 1,000 GPUs -- that reference counting frees
        (they form no cycles), and the collector's repeated full scans of them were about
        a third of the run's time. What little cyclic garbage the loop leaves (dropped
        workers and their nodes) is collected by the next collection after it.
        """
        t0 = time.perf_counter()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            finished = self._loop()
        finally:
            if gc_was_enabled:
                gc.enable()
        self.instances.integrate(self.now)
        p = self.profile
        spot_s = self.instances.gpu_seconds(spot=True)
        busy = [
            r["spot/busy_fraction"]
            for r in self.rows
            if isinstance(r.get("spot/busy_fraction"), float) and math.isfinite(r["spot/busy_fraction"])
        ]
        crit = sum(r["time/explore_critical_path_s"] for r in self.rows)
        total = sum(r["time/iteration_s"] for r in self.rows)
        return SimResult(
            policy=self.policy.name,
            iterations=len(self.rows),
            wall_s=self.now,
            cost_usd=self.instances.cost_usd(p.spot_usd_per_gpu_hour, p.reserved_usd_per_gpu_hour),
            spot_cost_usd=spot_s / 3600 * p.spot_usd_per_gpu_hour,
            reserved_cost_usd=self.instances.gpu_seconds(spot=False) / 3600 * p.reserved_usd_per_gpu_hour,
            spot_gpu_hours=spot_s / 3600,
            reserved_gpu_hours=self.instances.gpu_seconds(spot=False) / 3600,
            spot_utilisation=min(1.0, self._busy_spot_gpu_s / spot_s) if spot_s > 0 else math.nan,
            spot_busy_training=sum(busy) / len(busy) if busy else math.nan,
            critical_path_share=crit / total if total > 0 else 0.0,
            preemptions=self.preemptions,
            additions=self.additions,
            work_lost_steps=self.work_lost_steps,
            requests_done=self.requests_done,
            sim_elapsed_s=time.perf_counter() - t0,
            rows=self.rows,
            finished=finished,
            stopped_because="" if finished else self.stopped_because,
        )


def simulate(profile: SimProfile, policy: str | Policy, actions: Sequence[ReplayAction] | None, **kwargs) -> SimResult:
    """Run one policy (a name from :data:`POLICIES` or a :class:`Policy`); see :class:`Simulator`.

    Raises:
        ValueError: unknown policy name.
    """
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        policy = POLICIES[policy]
    return Simulator(profile, policy, actions, **kwargs).run()
