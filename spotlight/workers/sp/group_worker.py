"""Rollout Worker in an elastic sequence-parallel group (paper §4.4; docs/architecture.md §5–§6).

Used when the node's ``sp_degree > 1``. Every GPU runs one of these processes; the
agent's node Scheduler decides group membership and sends ``GROUP_FORM`` to the members
of each generation. A member's life::

    WORKER_HELLO → wait GROUP_FORM ─▶ form (torch.distributed group, weights from memory,
                                       or broadcast from the leader) ─▶ GROUP_FORMED
        leader  (members[0]): pull leases from the agent, denoise over the group
                              (``sp_group.run_group_batch``); between denoising steps (alone:
                              between transformer blocks, abandoning the step in progress)
                              it checks for a new GROUP_FORM (a GPU left or joined) — it then
                              releases the followers, re-forms at the new degree with the
                              weights it keeps in memory, and CONTINUES the same in-flight
                              batch; on STOP it commits the batch to the Tensor Store.
        follower:             mirror the leader's forwards until released, then wait for
                              the next GROUP_FORM (it may become the leader) or STOP.

The in-flight denoising state never leaves the node during a reconfiguration: it stays
in the leader process, so a shrink (2 → 1) or a grow (1 → 2) costs one group rebuild,
not a restart. If the leader itself is revoked it commits its batch (the request
resumes elsewhere from the committed step) and a survivor becomes the next leader.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from spotlight import protocol as P
from spotlight.rl.sampler import Conditioning, DenoiseState
from spotlight.store.tensor_wire import unpack_tensors
from spotlight.workers.rollout.worker import (
    PULL_TIMEOUT_S,
    RolloutExecutor,
    WorkerProcess,
    events_enabled,
    worker_event,
)
from spotlight.workers.sp import group as G

log = logging.getLogger("spotlight.worker")

OP_WEIGHTS = G.OP_WEIGHTS
"""Leader → followers: a new weight version follows (tensors in sorted-name order)."""

REFORM_WAIT_S = 60.0
"""A member whose group broke waits this long for the node Scheduler's next GROUP_FORM (sent
when the dead peer's exit is seen); without one (the peer hangs instead of dying) it exits, so
the agent replaces it and the group re-forms."""


class _JoinPending(Exception):
    """Raised between transformer blocks of a group of one when a new generation is pending."""


class GroupExecutor(RolloutExecutor):
    """:class:`RolloutExecutor` whose transformer forward runs over an SP group.

    Alone (SP 1) the leader does not finish the step in progress when a new generation
    arrives (a GPU was granted): it checks between transformer blocks, abandons the step
    (``run_group_batch`` rolls the state back to the step's start) and redoes it in the new
    group, so the granted GPU waits for at most one block, not one step. A group of two or more
    always finishes its step (every member is inside the same collectives).

    Args:
        member: this process's :class:`~spotlight.workers.sp.group.SPGroupMember` (leader).
        reform: called at a step boundary when a new generation is pending; it re-forms the
            group (the state being denoised stays in memory) and returns True to continue.
    """

    def __init__(self, member: G.SPGroupMember, sampler_cfg, reform):
        super().__init__(member.model_cfg, sampler_cfg, member.text_dim, lora=member.lora, device=member.device)
        self.member = member
        self.broken: G.SPGroupError | None = None
        """Set when the group broke under a batch (a peer died): the batch's state was rolled
        back to its last completed step and is committed, not lost."""
        self.reform = reform
        self.pending_form: P.GroupForm | None = None
        self.batch_cache_threshold = 0.0
        self._degree_s = 0.0  # sum of (denoising seconds x SP degree) of the current batch
        self._denoise_s = 0.0

    def _watch_blocks(self, should_stop) -> list:
        """Forward pre-hooks on the model's blocks raising :class:`_JoinPending` (SP 1 only)."""
        hook = _pending_check(self, should_stop)
        return [b.register_forward_pre_hook(hook) for b in self.member.blocks()]

    def _prepare(self, version: int, threshold: float) -> None:
        self.broken = None
        if self.member.weights_version != version:
            self.member.broadcast_weights(self.versions[version], version)
            # the member's kept tensors are this version from now on (the same tensors when
            # they were handed in: a memory-mapped file of the node's weight cache)
            self.versions[version] = self.member.state_dict()
            self._drop_device_versions()
        # First Block Cache runs on the group itself (sp_group module docstring): the leader
        # sends the threshold with every batch; RolloutExecutor.run passes 0 for rollouts.
        self.batch_cache_threshold = float(threshold)
        self._degree_s = self._denoise_s = 0.0

    def _drop_device_versions(self) -> None:
        """On a GPU, forget kept versions other than the current one whose tensors live in device
        memory (received by broadcast): they would hold a second device copy of the model. The
        agent's weight cache still has them (:meth:`WorkerProcess._ensure_version`)."""
        current = self.member.weights_version
        for v, sd in list(self.versions.items()):
            if v != current and any(t.device.type != "cpu" for t in sd.values()):
                del self.versions[v]

    def _batch_num_gpus(self) -> float:
        """The batch's SP degree, time-averaged over its denoising (re-forms change it)."""
        if self._denoise_s <= 0:
            return float(max(1, self.member.sp_degree))
        return max(1.0, self._degree_s / self._denoise_s)

    def _denoise(self, sampler, state: DenoiseState, cond: Conditioning, should_stop) -> DenoiseState:
        on_step = None
        if events_enabled():

            def on_step(st):
                worker_event("step", worker=self.member.worker_id, sp=self.member.sp_degree, step=st.step)

        while True:
            if self.broken is not None:
                return state  # the group broke under an earlier part of this batch: commit this part too
            degree, t0 = self.member.sp_degree, time.monotonic()
            hooks = self._watch_blocks(should_stop) if degree == 1 else []
            try:
                G.run_group_batch(
                    self.member,
                    sampler,
                    state,
                    cond,
                    should_stop=lambda _s: should_stop() or self.pending_form is not None,
                    cache_threshold=self.batch_cache_threshold,
                    on_step=on_step,
                )
            except _JoinPending:
                pass  # state is back at the start of the abandoned step
            except G.SPGroupError as exc:
                # a peer died: the state is back at its last completed step; it is committed
                # (run() sees it unfinished) and resumes there, here or elsewhere
                log.warning("worker %s: %s; committing the batch at step %d", self.member.worker_id, exc, state.step)
                self.broken = exc
                return state
            finally:
                for h in hooks:
                    h.remove()
                dt = time.monotonic() - t0
                self._degree_s += dt * degree
                self._denoise_s += dt
            if state.step >= sampler.cfg.num_steps or self.pending_form is None:
                return state
            form, self.pending_form = self.pending_form, None
            if not self.reform(form):
                return state


def _pending_check(executor: "GroupExecutor", should_stop):
    def hook(_module, _args):
        should_stop()  # reads the agent socket: a GROUP_FORM becomes executor.pending_form
        if executor.pending_form is not None:
            raise _JoinPending()

    return hook


def broadcast_weights(member: G.SPGroupMember, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
    """Collective: the leader sends weight ``version`` to every follower, all load it
    (:meth:`~spotlight.workers.sp.group.SPGroupMember.broadcast_weights`; followers in
    :func:`serve` receive it on the ``OP_WEIGHTS`` header)."""
    member.broadcast_weights(state_dict, version)


def serve(member: G.SPGroupMember) -> None:
    """Follower loop: mirror batches and weight updates until the leader releases the group."""
    G.serve_until_released(member)


class GroupWorkerProcess(WorkerProcess):
    """Socket loop of one member of an elastic SP group."""

    def __init__(
        self,
        agent_endpoint,
        worker_id,
        gpus,
        model_cfg,
        sampler_cfg,
        batch_size,
        *,
        member: G.SPGroupMember | None = None,
        lora: dict | None = None,
        weights_dir: str | None = None,
        cfg_parallel: bool = False,
        backend: str = "diffusers",
    ):
        """``member``: a prepared, unused member (a warm spare's, see
        :meth:`~spotlight.workers.sp.group.SPGroupMember.prewarm`); it is reassigned to this
        worker id and device. Default: a new one. ``lora``: the run's LoRA settings (versions
        are adapters over one frozen base). ``weights_dir``: the agent's weight-version cache
        (versions are memory-mapped from it). ``cfg_parallel``, ``backend``:
        ``cluster.sp_cfg_parallel`` and ``cluster.sp_backend``."""
        if member is not None and (member.lora, member.cfg_parallel, member.sp_backend) != (
            dict(lora or {}),
            cfg_parallel,
            backend,
        ):
            raise ValueError("the warm spare's member was prepared for another SP configuration")
        super().__init__(
            agent_endpoint, worker_id, gpus, model_cfg, sampler_cfg, batch_size, lora=lora, weights_dir=weights_dir
        )
        device = torch.device(f"cuda:{0}") if torch.cuda.is_available() else torch.device("cpu")
        if member is None:
            member = G.SPGroupMember(
                model_cfg, worker_id, device, lora=lora, cfg_parallel=cfg_parallel, backend=backend
            )
        else:
            member.reassign(worker_id, device)
        self.member = member
        self.executor = GroupExecutor(self.member, sampler_cfg, self._reform)

    # ------------------------------------------------------------ membership
    def _wait_form_or_stop(self, timeout_s: float | None = None):
        """The next GROUP_FORM or STOP; None when the agent died; ``False`` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            got = self._recv(500)
            if got is None:
                if not self.agent_alive():
                    return None
                if deadline is not None and time.monotonic() > deadline:
                    return False
                continue
            mtype, body, payload = got
            if mtype in (P.MsgType.GROUP_FORM, P.MsgType.STOP):
                return body
            log.warning("worker %s: ignoring %s while outside a group", self.worker_id, mtype.name)

    def _weights(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.executor.versions:
            self._ensure_version(version)
        return self.executor.versions[version]

    def _form(self, form: P.GroupForm) -> None:
        pids = tuple(form.pids) if len(form.pids) == len(form.members) else ()
        spec = G.GroupSpec(tuple(form.members), form.master_addr, form.master_port, form.generation, pids)
        sd, ver = None, None
        if spec.members[0] == self.worker_id and self.member._state is None:
            ver = max(0, form.version)  # -1: nothing published when the agent registered
            sd = self._weights(ver)
        t0 = time.monotonic()
        self.member.form(spec, state_dict=sd, version=ver)
        took = time.monotonic() - t0
        timings = " ".join(f"{k} {v:.2f}" for k, v in self.member.form_timings_s.items())
        log.info(
            "worker %s: generation %d SP=%d formed in %.2fs (weights: %s; %s)",
            self.worker_id,
            spec.generation,
            spec.world_size,
            took,
            self.member.weights_source,
            timings,
        )
        worker_event(
            "formed",
            worker=self.worker_id,
            generation=spec.generation,
            sp=spec.world_size,
            source=self.member.weights_source,
            took_s=took,
            timings_s=self.member.form_timings_s,
        )
        self.send(P.GroupFormed(worker_id=self.worker_id, generation=spec.generation, sp=spec.world_size, took_s=took))
        if self.member.weights_version is not None:
            # the member's kept tensors are this version from now on
            self.executor.add_version(self.member.weights_version, self.member.state_dict())

    def _reform(self, form: P.GroupForm) -> bool:
        """Leader, at a step boundary: release followers and join the next generation."""
        G.release_followers(self.member)
        if self.worker_id not in form.members:
            return False
        self._form(form)
        return self.member.is_leader

    def _recv_socket(self, timeout_ms: int):
        """As :meth:`WorkerProcess._recv_socket`; a leader waiting on its agent first keeps its
        idle group alive (:func:`~spotlight.workers.sp.group.keepalive`)."""
        if self.member.model is not None:
            try:
                G.keepalive(self.member)
            except G.SPGroupError as exc:
                log.error("worker %s: %s", self.worker_id, exc)
        return super()._recv_socket(timeout_ms)

    def _check_stop(self) -> bool:
        if self.stop_requested is not None:
            return True
        if not self.agent_alive():
            os._exit(3)
        while self.sock.poll(0):
            got = self._recv_socket(0)
            if got is None:
                break
            mtype, body, payload = got
            if mtype == P.MsgType.STOP:
                self.stop_requested = body
                return True
            if mtype == P.MsgType.GROUP_FORM:
                self.executor.pending_form = body
                return False
            self._backlog.append((mtype, body, payload))
        return False

    # ------------------------------------------------------------ main loop
    def run(self) -> int:
        self.send(P.WorkerHello(worker_id=self.worker_id, gpus=self.gpus, pid=os.getpid()))
        worker_event("hello", worker=self.worker_id)
        form, wait_s = None, None
        while True:
            msg = form or self._wait_form_or_stop(wait_s)
            form, wait_s = None, None
            if msg is False:
                log.error(
                    "worker %s: the group broke and no new generation came in %.0f s; exiting so the agent replaces "
                    "this worker",
                    self.worker_id,
                    REFORM_WAIT_S,
                )
                self.member.leave()
                return 4
            if msg is None or isinstance(msg, P.Stop):
                self.member.leave()
                return 0
            try:
                self._form(msg)
            except Exception as exc:  # a form that cannot work must not loop: wait for the next one
                log.error("worker %s: could not form generation %d: %s", self.worker_id, msg.generation, exc)
                self.member.mark_broken()
                self.member.leave()
                continue
            if not self.member.is_leader:
                try:
                    serve(self.member)
                except Exception as exc:
                    log.error("worker %s: group broke: %s", self.worker_id, exc)
                    self.member.mark_broken()
                    wait_s = REFORM_WAIT_S
                self.member.leave()
                continue
            form = self._lead()
            if form is False:
                return 0
            if form == "broken":
                form, wait_s = None, REFORM_WAIT_S

    def _lead(self):
        """Pull and run batches as leader. Returns a pending GroupForm, ``"broken"`` when the
        group broke (the batch was committed; wait for the next generation), None when demoted,
        or False to exit."""
        pulled = False
        idle_wait_ms = 20
        while True:
            if self.stop_requested is not None:
                G.release_followers(self.member)
                return False
            if self.executor.pending_form is not None:
                form, self.executor.pending_form = self.executor.pending_form, None
                G.release_followers(self.member)
                self.member.leave()
                return form
            if not pulled:
                self.send(
                    P.Pull(
                        worker_id=self.worker_id, max_requests=self.batch_size, versions=sorted(self.executor.versions)
                    )
                )
                pulled, pulled_at = True, time.monotonic()
            got = self._recv(200)
            if got is None:
                self._check_stop()
                if not self.agent_alive():
                    return False
                if time.monotonic() - pulled_at > PULL_TIMEOUT_S:  # a pull lost with a dying coordinator
                    pulled = False
                continue
            mtype, body, payload = got
            if mtype == P.MsgType.STOP:
                self.stop_requested = body
                continue
            if mtype == P.MsgType.GROUP_FORM:
                self.executor.pending_form = body
                continue
            if mtype != P.MsgType.LEASES:
                continue
            pulled = False
            if not body.items:
                time.sleep(idle_wait_ms / 1000.0)
                idle_wait_ms = min(200, idle_wait_ms * 2)
                continue
            idle_wait_ms = 20
            tensors = unpack_tensors(body.tensors, payload)
            self._ensure_version(body.items[0].weight_version)
            if self.stop_requested is not None:  # stopped before starting: give the leases back untouched
                self.give_back(body, "worker stopping")
                continue
            try:
                outcome = self.executor.run(self.worker_id, body, tensors, should_stop=self._check_stop)
            except G.SPGroupError as exc:  # the group broke outside the denoising loop: nothing to commit
                log.error("worker %s: the group broke: %s", self.worker_id, exc)
                self.give_back(body, f"SP group broke: {exc}")
                self.member.mark_broken()
                self.member.leave()
                return "broken"
            except Exception as exc:  # the batch failed, the group stands: report, keep leading
                log.exception("worker %s: batch failed on the group", self.worker_id)
                self.give_back(body, f"{type(exc).__name__}: {exc}", failed=True)
                self._back_off()
                continue
            if outcome.commit is not None:
                if self.executor.broken is not None:
                    # a peer died mid-batch: the state (rolled back to its last completed step)
                    # goes to the Tensor Store and resumes there; this member waits to re-form
                    self.send(*outcome.commit)
                    self.member.leave()
                    return "broken"
                G.release_followers(self.member)
                if self.stop_requested is not None and not self.stop_requested.commit:
                    self.give_back(body, "stopped without live migration (cluster.live_migration = false)")
                else:
                    self.send(*outcome.commit)
                return False
            self.send(*outcome.result)
            self.streak.succeeded()
            if not self.member.is_leader:  # demoted by a re-form during the batch
                return None
