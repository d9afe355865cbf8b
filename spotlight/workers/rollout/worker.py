"""Rollout Worker: one GPU worker process that denoises batches of leased requests.

:class:`RolloutExecutor` (denoising of leased batches) and :class:`WorkerProcess` (the
worker's ZeroMQ loop with its agent) are shared with the sequence-parallel
:mod:`spotlight.workers.sp.group_worker`, which subclasses them and is imported lazily by
:func:`make_worker` (SP degree > 1); ``python -m spotlight.workers.rollout.worker`` is the
process entry point the agent spawns.

A worker is a child of its node's ``spotlight-agent`` (the node Scheduler) and talks
only to it, over a ZeroMQ DEALER socket (identity = worker id)::

    worker                         agent (node Scheduler)             coordinator
      WORKER_HELLO ─────────────▶
      PULL(max) ────────────────▶  PULL ──────────────────────────▶  Request Scheduler
      ◀──────────────── LEASES     ◀───────────────────────── LEASES (+ text conditioning)
      FETCH_WEIGHTS(v) ─────────▶  (cache hit, or FETCH_WEIGHTS ──▶  Tensor Store,
      ◀──────────────── WEIGHTS     in chunks, into the node's file <weights_dir>/v<v>.safetensors)
      (maps that file: the version's tensors live in the page cache, not in the worker's heap)
      … denoise (SDE window, seeded noise; exploration may use a step cache) …
      RESULT (images, window latents, log-probs) ─▶ RESULT ───────▶ rewards, trainer
      ◀── STOP(commit)  → COMMIT (latent, step, window so far) ───▶ Tensor Store

Rollout requests always run at full fidelity (no cache): their log-probs feed the
policy gradient (docs/architecture.md §3 "On-policy training"). Exploration requests may run with
diffusers' First Block Cache at the threshold in their params; the number of steps
whose transformer actually ran is reported per request.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import uuid
from typing import Callable

import msgspec
import torch
import zmq

from spotlight import protocol as P
from spotlight.config import ModelConfig, SamplerConfig
from spotlight.core.offload import Move, Residency, next_move, offload_enabled
from spotlight.models.alignment import realign_
from spotlight.models.families import get_family, torch_dtype
from spotlight.models.lora import add_lora, load_version
from spotlight.rl.sampler import Conditioning, DenoiseState, Sampler
from spotlight.store.tensor_wire import bytes_to_state_dict, mmap_state_dict, pack_tensors, unpack_tensors
from spotlight.util.procs import configure_logging, spawned_by
from spotlight.workers.rollout.offload import ModelOffloader, MoveStats

EVENTS_ENV = "SPOTLIGHT_WORKER_EVENTS"
"""Environment variable naming a file to which workers append timing events (one JSON object
per line: ``t_unix_s``, ``pid``, ``event`` and fields); unset = no events. Used by
``benchmarks/reconfig.py`` to see when a reconfigured group serves again."""

_events_fd: int | None = None


def worker_event(event: str, **fields) -> None:
    """Append one timing event to ``$SPOTLIGHT_WORKER_EVENTS`` (no-op when unset).

    Events: ``spare_ready`` (a warm spare finished importing), ``assigned`` (a spare became
    worker ``worker``), ``hello``, ``formed`` (``generation``, ``sp``, ``source``,
    ``timings_s``), ``step`` (a denoising step finished: ``sp``, ``step``), ``offload`` /
    ``reload`` (the weights moved off / back onto the device: ``seconds``, ``size_bytes``). One ``write`` of
    one line to a file opened with ``O_APPEND``, so lines of concurrent workers do not mix.
    """
    global _events_fd
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    if _events_fd is None:
        _events_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    line = json.dumps({"t_unix_s": time.time(), "pid": os.getpid(), "event": event, **fields}, default=str)
    os.write(_events_fd, (line + "\n").encode())


def events_enabled() -> bool:
    """True when :func:`worker_event` writes (``$SPOTLIGHT_WORKER_EVENTS`` is set)."""
    return bool(os.environ.get(EVENTS_ENV))


FAIL_PROMPTS_ENV = "SPOTLIGHT_TEST_FAIL_PROMPTS"
"""Test hook: comma-separated prompt indices (``*``: every prompt), each optionally ``rollout:``
or ``explore:`` prefixed; a batch holding a request of such a prompt (and kind) raises ``RuntimeError`` before
it denoises. Unset (always, outside tests) = no planted failures."""


def planted_failure(items: list[P.LeaseItem], spec: str | None = None) -> None:
    """Raise the failure :data:`FAIL_PROMPTS_ENV` plants for one of ``items`` (no-op when unset).

    Raises:
        RuntimeError: an item's prompt index (and kind) is listed.
    """
    spec = os.environ.get(FAIL_PROMPTS_ENV, "") if spec is None else spec
    if not spec:
        return
    wanted = set()
    for part in spec.split(","):
        kind, _, index = part.strip().rpartition(":")
        wanted.add((kind or "*", index if index == "*" else int(index)))
    for it in items:
        if {(k, i) for k in ("*", it.kind) for i in ("*", it.prompt_index)} & wanted:
            raise RuntimeError(f"planted failure for prompt {it.prompt_index} ({FAIL_PROMPTS_ENV})")


class FailureStreak:
    """A worker's batches in a row that failed, and how long it backs off after them.

    After :attr:`unhealthy_after` failed batches in a row the worker is unhealthy: it says so
    in its FAIL (``Fail.unhealthy``) and waits :meth:`backoff_s` before it pulls again (doubling
    from ``base_s`` up to ``max_s``), instead of failing as fast as it can pull. A batch that
    succeeds ends the streak. Pure: the process loop sleeps."""

    def __init__(self, unhealthy_after: int = 3, base_s: float = 0.5, max_s: float = 5.0):
        self.unhealthy_after, self.base_s, self.max_s = unhealthy_after, base_s, max_s
        self.count = 0

    def failed(self) -> int:
        """One more failed batch; returns the streak's length."""
        self.count += 1
        return self.count

    def succeeded(self) -> None:
        self.count = 0

    @property
    def unhealthy(self) -> bool:
        return self.count >= self.unhealthy_after

    def backoff_s(self) -> float:
        """Seconds to wait before the next pull (0 while healthy)."""
        if not self.unhealthy:
            return 0.0
        return min(self.max_s, self.base_s * 2.0 ** (self.count - self.unhealthy_after))


PULL_TIMEOUT_S = 30.0
"""Pull again when a PULL got no LEASES for this long (lost while the coordinator restarted);
a late answer to the first pull is still served when it arrives."""

log = logging.getLogger("spotlight.worker")

MAX_CACHED_VERSIONS = 2


@dataclasses.dataclass
class BatchOutcome:
    """What one leased batch produced.

    Exactly one of ``result`` / ``commit`` is set: ``result`` when every request
    finished, ``commit`` when ``should_stop`` interrupted it (preemption).
    """

    result: tuple[P.Result, list[bytes]] | None = None
    commit: tuple[P.Commit, list[bytes]] | None = None


class StepCounter:
    """Counts transformer forwards whose tail blocks really ran (First Block Cache may skip them).

    Hooks the first ``Linear`` inside the last block of the transformer's last block list:
    it runs only when that block's own forward runs, not when the cache returns its output.
    """

    def __init__(self, transformer, block_names: tuple[str, ...] = ("transformer_blocks",)):
        self.count = 0
        blocks = [b for name in block_names for b in getattr(transformer, name, [])]
        tail = blocks[-1]
        linear = next(m for m in tail.modules() if isinstance(m, torch.nn.Linear))
        self._handle = linear.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.count += 1


class RolloutExecutor:
    """Holds the transformer and up to :data:`MAX_CACHED_VERSIONS` weight versions, and
    runs batches. Pure compute: no sockets (the process loop below owns those).

    Args:
        model_cfg, sampler_cfg: the run's ``[model]`` and ``[sampler]`` sections.
        text_dim: width D of the tiny family's text embeddings (other families read it from the checkpoint).
        lora: LoRA settings (:func:`spotlight.models.lora.lora_spec`); ``{}`` = full weights.
            With LoRA the worker keeps ONE frozen base transformer and a version is an adapter.
        device: where the transformer runs (default: CUDA ``cuda:<gpu>`` when available, else CPU).
        init_seed: seed of the LoRA adapter's initialisation (overwritten by every version).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        sampler_cfg: SamplerConfig,
        text_dim: int = 384,
        *,
        lora: dict | None = None,
        device: torch.device | str | None = None,
    ):
        self.model_cfg = model_cfg
        self.family = get_family(model_cfg, text_dim=text_dim)
        self.sampler = Sampler(
            sampler_cfg, self.family.latent_shape, self.family.sigmas(sampler_cfg.num_steps, sampler_cfg.shift)
        )
        self.text_dim = text_dim
        self.lora = dict(lora or {})
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = torch_dtype(model_cfg.dtype, self.device)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.transformer = None
        self.loaded_version: int | None = None
        self._counter: StepCounter | None = None
        self._cache_threshold: float = 0.0
        self._decoder_ready = False
        self.offloader = ModelOffloader(self.device)
        """Moves the transformer to host memory while a Train Worker uses this GPU (``offload.py``)."""

    # ------------------------------------------------------------ device memory
    @property
    def released(self) -> bool:
        """True while the transformer's weights are in host memory (:meth:`release_device`)."""
        return self.offloader.offloaded

    def release_device(self) -> MoveStats:
        """Move the transformer's weights to host memory and give its device memory back (a
        model not built yet moves nothing). The decoder (a VAE of a few hundred MB) stays."""
        if self.transformer is None:
            self.offloader.offloaded = True
            return MoveStats(0, 0.0)
        return self.offloader.offload(self.transformer)

    def reclaim_device(self) -> MoveStats:
        """Bring the transformer's weights back onto the device (:meth:`release_device` undone)."""
        if self.transformer is None:
            self.offloader.offloaded = False
            return MoveStats(0, 0.0)
        return self.offloader.reload(self.transformer)

    # ------------------------------------------------------------ weights
    def add_version(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Keep ``state_dict`` as ``version``; drops the oldest beyond the cap."""
        self.versions[version] = state_dict
        for v in sorted(self.versions)[:-MAX_CACHED_VERSIONS]:
            if v != self.loaded_version:
                del self.versions[v]

    def _use(self, version: int) -> None:
        if self.released:  # never denoise from host memory (the process loop reloads first)
            self.reclaim_device()
        if self.transformer is None:
            model = self.family.build_transformer(self.dtype)
            if self.lora:
                add_lora(model, self.lora, self.family.default_lora_targets, seed=self.model_cfg.init_seed)
                if self.dtype != torch.float32:
                    model.to(self.dtype)
            # on the CPU every weight on a 64-byte boundary, as in an SP group (models/alignment.py)
            self.transformer = realign_(model.to(self.device).eval())
            self._counter = StepCounter(self.transformer, self.family.block_names)
        if self.loaded_version != version:
            load_version(self.transformer, self.versions[version])
            self.loaded_version = version

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents → ``[B, 3, H, W] uint8`` CPU images (the family's VAE, loaded once)."""
        if not self._decoder_ready:
            self.family.load_decoder(self.device, self.dtype)
            self._decoder_ready = True
        with torch.no_grad():
            return self.family.decode(latents.to(self.device))

    def _set_cache(self, threshold: float) -> None:
        if threshold == self._cache_threshold:
            return
        from diffusers.hooks import FirstBlockCacheConfig

        if self._cache_threshold > 0:
            self.transformer.disable_cache()
        if threshold > 0:
            self.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        self._cache_threshold = threshold

    # ------------------------------------------------------------ compute
    def run(
        self,
        worker_id: str,
        leases: P.Leases,
        tensors: dict[str, torch.Tensor],
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> BatchOutcome:
        """Denoise one leased batch.

        All items share kind, weight version and params (the Request Scheduler batches
        them that way). Items resuming from a committed state are denoised in sub-batches
        by their resume step, then joined with the rest.

        Raises:
            KeyError: the needed weight version was never added.
        """
        items = leases.items
        planted_failure(items)
        kind = items[0].kind
        version = items[0].weight_version
        as_rollout = kind == "rollout" or bool(items[0].params.get("as_rollout"))  # verl-omni-spot reuses candidates
        threshold = float(items[0].params.get("cache_threshold", 0.0)) if not as_rollout else 0.0
        window = items[0].params.get("sde_window_start")
        sampler = self.sampler.with_window(None if window is None else int(window))
        self._prepare(version, threshold)
        cond_all = Conditioning.from_tensors(tensors).to(self.device)
        t0 = time.monotonic()

        # Group rows by starting step (fresh rows start at 0).
        starts: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            starts.setdefault(it.resume_step or 0, []).append(i)
        finished: dict[int, DenoiseState] = {}
        stopped: dict[int, DenoiseState] = {}
        for step0 in sorted(starts):
            rows = starts[step0]
            state = _starting_state(sampler, items, rows, step0, tensors)
            state = self._denoise(sampler, _to_device(state, self.device), cond_all.index(rows), should_stop)
            state = _to_device(state, torch.device("cpu"))
            for k, i in enumerate(rows):
                (finished if state.step >= sampler.cfg.num_steps else stopped)[i] = state.select([k])
        elapsed = time.monotonic() - t0

        if stopped:
            return BatchOutcome(commit=self._commit(worker_id, items, finished, stopped))
        return BatchOutcome(result=self._result(worker_id, items, finished, as_rollout, elapsed))

    def _result(
        self,
        worker_id: str,
        items: list[P.LeaseItem],
        finished: dict[int, DenoiseState],
        as_rollout: bool,
        elapsed: float,
    ) -> tuple[P.Result, list]:
        """The RESULT of a batch whose every row finished: decoded images and computed steps,
        plus the SDE window trajectories and log-probs of a rollout."""
        order = list(range(len(items)))
        full = DenoiseState.concat([finished[i] for i in order])
        out = {"images": self.decode(full.latents), "computed_steps": full.computed_steps}
        if as_rollout:
            out["window_latents"] = torch.stack(full.window_latents, dim=1)
            out["log_probs"] = torch.stack(full.log_probs, dim=1)
        metas, frames = pack_tensors(out)
        msg = P.Result(
            worker_id=worker_id,
            batch_id=uuid.uuid4().hex[:12],
            items=[
                P.ResultItem(request_id=it.request_id, lease_id=it.lease_id, computed_steps=int(full.computed_steps[i]))
                for i, it in enumerate(items)
            ],
            tensors=metas,
            elapsed_s=elapsed,
            num_gpus=self._batch_num_gpus(),
        )
        return msg, frames

    def _batch_num_gpus(self) -> float:
        """GPUs the last batch occupied (``Result.num_gpus``): one for this executor."""
        return 1.0

    def _prepare(self, version: int, threshold: float) -> None:
        """Load weight ``version`` and set the exploration cache before a batch."""
        self._use(version)
        self._set_cache(threshold)

    def _denoise(
        self, sampler: Sampler, state: DenoiseState, cond: Conditioning, should_stop: Callable[[], bool]
    ) -> DenoiseState:
        """Advance ``state`` to the last step, or until ``should_stop()`` between steps."""
        velocity_fn = self.family.make_velocity_fn(self.transformer)
        events = events_enabled()
        with torch.no_grad(), self._cache_context():
            while state.step < sampler.cfg.num_steps:
                if should_stop():
                    break
                before = self._counter.count
                sampler.advance(state, velocity_fn, cond)
                if self._counter.count == before:  # the step cache skipped the tail blocks
                    state.computed_steps -= 1
                if events:
                    worker_event("step", sp=1, step=state.step)
        return state

    def _cache_context(self):
        import contextlib

        if self._cache_threshold > 0:
            self.transformer._reset_stateful_cache()
            return self.transformer.cache_context("explore")
        return contextlib.nullcontext()

    def _commit(self, worker_id, items, finished, stopped) -> tuple[P.Commit, list[bytes]]:
        """Commit every unfinished row (and finished ones as step-T states) for resumption."""
        tensors, commit_items = {}, []
        for i, it in enumerate(items):
            st = stopped.get(i) or finished[i]
            for name, t in st.tensors().items():
                tensors[f"state.{i}.{name}"] = t[0]
            commit_items.append(
                P.CommitItem(
                    request_id=it.request_id,
                    lease_id=it.lease_id,
                    step=st.step,
                    seed=it.seed,
                    weight_version=it.weight_version,
                )
            )
        metas, frames = pack_tensors(tensors)
        return P.Commit(worker_id=worker_id, items=commit_items, tensors=metas), frames


def _starting_state(
    sampler: Sampler, items: list[P.LeaseItem], rows: list[int], step0: int, tensors: dict[str, torch.Tensor]
) -> DenoiseState:
    """The state that ``rows`` of a batch start from: fresh noise from their seeds at step 0,
    else their committed ``state.<row>.*`` tensors resumed at ``step0``."""
    if step0 == 0:
        return sampler.initial_state([items[i].seed for i in rows])
    return DenoiseState.concat(
        [
            DenoiseState.from_tensors(
                [items[i].seed],
                step0,
                # committed per-row tensors carry no batch dim (see _commit): add it back
                {k[len(f"state.{i}.") :]: v.unsqueeze(0) for k, v in tensors.items() if k.startswith(f"state.{i}.")},
            )
            for i in rows
        ]
    )


def _to_device(state: DenoiseState, device: torch.device) -> DenoiseState:
    """``state`` with its float tensors on ``device`` (step counters stay on the CPU)."""
    if state.latents.device == device:
        return state
    state.latents = state.latents.to(device)
    state.window_latents = [w.to(device) for w in state.window_latents]
    state.log_probs = [lp.to(device) for lp in state.log_probs]
    return state


def exit_fast(rc: int):
    """End the worker process now, skipping interpreter teardown: torch / gloo destructors
    can take seconds, and a revoked GPU must be free (and the node's CPU for the survivors)
    at once. Call after :meth:`WorkerProcess.close` delivered the last messages."""
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def worker_device(gpus: list[int]) -> torch.device:
    """``cuda:<first gpu>`` when CUDA is available, else the CPU (local mode's "GPUs"). The agent gives
    each worker exactly its own device as ``CUDA_VISIBLE_DEVICES`` (``agent/visibility.py``), so this is
    ``cuda:0`` there."""
    if torch.cuda.is_available() and gpus:
        return torch.device("cuda", gpus[0] % torch.cuda.device_count())
    return torch.device("cpu")


# ---------------------------------------------------------------- process shell


class WorkerProcess:
    """The socket loop around :class:`RolloutExecutor` (one per GPU worker process).

    Args:
        weights_dir: the agent's weight cache (``agent.weight_cache``): a WEIGHTS reply
            without a frame means ``<weights_dir>/v<version>.safetensors`` is complete there.
    """

    def __init__(
        self,
        agent_endpoint: str,
        worker_id: str,
        gpus: list[int],
        model_cfg: ModelConfig,
        sampler_cfg: SamplerConfig,
        batch_size: int,
        *,
        lora: dict | None = None,
        weights_dir: str | None = None,
        offload_while_training: bool | None = None,
    ):
        self.worker_id = worker_id
        self.weights_dir = weights_dir
        self.gpus = gpus
        self.batch_size = batch_size
        self.executor = RolloutExecutor(model_cfg, sampler_cfg, lora=lora, device=worker_device(gpus))
        self.manages_residency = offload_enabled(
            offload_while_training, device_type=self.executor.device.type, family=model_cfg.family
        )
        """Whether this worker gives its device memory back when the coordinator says so
        (``cluster.offload_rollout_while_training``, ``spotlight/core/offload.py``)."""
        self._moves: list[P.DeviceMove] = []  # moves not reported yet (the next PULL carries them)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(agent_endpoint)
        self.stop_requested: P.Stop | None = None
        self._backlog: list[tuple[P.MsgType, object, list]] = []
        self._parent = spawned_by()  # the agent, even if it died while we started
        self.streak = FailureStreak()

    @property
    def residency(self) -> Residency:
        """Where the weights are, as this worker's PULL reports it (an executor that cannot
        release its device, an SP group's, is unmanaged)."""
        released = getattr(self.executor, "released", None)
        if not self.manages_residency or released is None:
            return Residency.UNMANAGED
        return Residency.RELEASED if released else Residency.RESIDENT

    def follow_device_word(self, word: str, *, has_work: bool) -> Move | None:
        """Carry out the move :func:`spotlight.core.offload.next_move` decides for a LEASES reply
        (``Leases.device``, whether it carries work); the move is reported in the next PULL."""
        move = next_move(self.residency, word, has_work=has_work)
        if move is None:
            return None
        try:
            stats = self.executor.release_device() if move is Move.OFFLOAD else self.executor.reclaim_device()
        except Exception:
            if move is Move.OFFLOAD:  # no host memory for the copy: keep it on the device from now on
                self.manages_residency = False
                log.exception(
                    "worker %s: cannot move the weights to host memory; they stay on the device (the update "
                    "no longer waits for this worker)",
                    self.worker_id,
                )
                return None
            raise  # the caller gives the work back (the device is still busy) and tries again later
        self._moves.append(P.DeviceMove(kind=move.value, seconds=stats.seconds, size_bytes=stats.size_bytes))
        log.info(
            "worker %s: weights %s (%.2f GiB in %.2f s%s)",
            self.worker_id,
            "to host memory while a Train Worker uses this GPU" if move is Move.OFFLOAD else "back on the device",
            stats.size_bytes / 2**30,
            stats.seconds,
            "; nothing moves on the CPU" if self.executor.device.type == "cpu" else "",
        )
        worker_event(move.value, worker=self.worker_id, seconds=stats.seconds, size_bytes=stats.size_bytes)
        return move

    def _pull(self) -> P.Pull:
        """The next PULL: the versions held, where the weights are and the moves made since the last one."""
        moves, self._moves = self._moves, []
        return P.Pull(
            worker_id=self.worker_id,
            max_requests=self.batch_size,
            versions=sorted(self.executor.versions),
            residency=self.residency.value,
            moves=moves[-16:],  # at most one per PULL in practice; the wire takes 16
        )

    def agent_alive(self) -> bool:
        """False once the agent that spawned us died (we were re-parented)."""
        return os.getppid() == self._parent

    def close(self, linger_s: float = 2.0) -> None:
        """Close the agent socket, delivering what is still queued (a commit, a result) for at
        most ``linger_s`` seconds."""
        self.sock.close(linger=int(linger_s * 1000))
        self.ctx.term()

    def send(self, msg, frames=None, msg_type=None):
        self.sock.send_multipart(P.encode(msg, frames, msg_type=msg_type), copy=False)

    def give_back(self, leases: P.Leases, reason: str, *, failed: bool = False) -> None:
        """Return leased requests untouched (the coordinator re-enqueues them for full re-execution).
        ``failed``: the batch raised (``reason`` is its exception line): the streak grows and the
        FAIL says how long it is and whether this worker is now unhealthy."""
        n = self.streak.failed() if failed else 0
        self.send(
            P.Fail(
                worker_id=self.worker_id,
                request_ids=[i.request_id for i in leases.items],
                lease_ids=[i.lease_id for i in leases.items],
                reason=reason[: P.MAX_REASON_CHARS],
                consecutive_failures=n,
                unhealthy=failed and self.streak.unhealthy,
            )
        )

    def _back_off(self) -> None:
        """While unhealthy, wait :meth:`FailureStreak.backoff_s` before the next pull (a STOP or
        the agent's death ends the wait)."""
        wait_s = self.streak.backoff_s()
        if wait_s <= 0:
            return
        log.warning(
            "worker %s: %d batches in a row failed; unhealthy, waiting %.0f s before the next pull",
            self.worker_id,
            self.streak.count,
            wait_s,
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self._check_stop():
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _recv(self, timeout_ms: int):
        """Next message: a deferred one first, else from the socket (None on timeout)."""
        if self._backlog:
            return self._backlog.pop(0)
        return self._recv_socket(timeout_ms)

    def _recv_socket(self, timeout_ms: int):
        """Next message from the socket only. Loops that defer unrelated messages to the
        backlog must use this, or they would pop their own deferred message forever."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart()
        try:
            return P.decode(frames)
        except P.ProtocolError as exc:
            log.error("worker %s: dropped malformed frame: %s", self.worker_id, exc)
            return None

    def _check_stop(self) -> bool:
        if self.stop_requested is not None:
            return True
        if not self.agent_alive():
            log.error(
                "worker %s: agent died; exiting without commit (the coordinator re-enqueues our leases)", self.worker_id
            )
            os._exit(3)
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            try:
                mtype, body, payload = P.decode(frames)
            except P.ProtocolError as exc:
                log.error("worker %s: dropped malformed frame: %s", self.worker_id, exc)
                continue
            if mtype == P.MsgType.STOP:
                self.stop_requested = body
                return True
            self._backlog.append((mtype, body, payload))
        return False

    def _ensure_version(self, version: int, timeout_s: float = 600.0) -> None:
        """Get weight ``version`` from the agent (its cache, a local peer's copy, or the
        coordinator's Tensor Store); waits while it is not published yet.

        Raises:
            RuntimeError: still not published after ``timeout_s``.
        """
        if version in self.executor.versions:
            return
        deadline = time.monotonic() + timeout_s
        self.send(P.FetchWeights(worker_id=self.worker_id, version=version))
        asked = time.monotonic()
        while True:
            got = self._recv_socket(1000)
            if got is None:
                if not self.agent_alive():
                    os._exit(3)
                if time.monotonic() - asked > 15.0:  # a lost reply must not wedge the worker
                    self.send(P.FetchWeights(worker_id=self.worker_id, version=version))
                    asked = time.monotonic()
                continue
            mtype, body, payload = got
            if mtype == P.MsgType.WEIGHTS and body.version == version:
                sd = self._load_version(body, payload) if body.found else None
                if sd is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"weight version {version} is not available")
                    time.sleep(0.5)
                    self.send(P.FetchWeights(worker_id=self.worker_id, version=version))
                    continue
                self.executor.add_version(version, sd)
                return
            if mtype == P.MsgType.STOP:
                self.stop_requested = body
                return
            self._backlog.append(got)

    def _load_version(self, body: P.Weights, payload: list) -> dict[str, torch.Tensor] | None:
        """The state dict a WEIGHTS reply points at: the node cache's file, memory-mapped
        (:func:`spotlight.store.tensor_wire.mmap_state_dict`), or a frame carrying the whole file
        (small versions from older agents). None when the file is gone (the agent evicted it
        before we opened it): the caller asks again.

        Raises:
            WeightSyncError: the cached file is not a well-formed safetensors file.
        """
        if payload:
            return bytes_to_state_dict(payload[0])
        if self.weights_dir is None:
            raise RuntimeError(
                "the agent answered with its weight cache, but this worker was not told where it is (weights_dir)"
            )
        try:
            return mmap_state_dict(os.path.join(self.weights_dir, f"v{int(body.version)}.safetensors"))
        except FileNotFoundError:
            log.warning(
                "worker %s: weights v%d left the node cache before we mapped them; asking again",
                self.worker_id,
                body.version,
            )
            return None

    def run(self) -> int:
        self.send(P.WorkerHello(worker_id=self.worker_id, gpus=self.gpus, pid=os.getpid()))
        worker_event("hello", worker=self.worker_id)
        idle_wait_ms = 20
        pulled = False
        while True:
            if self.stop_requested is not None:
                return 0
            if not pulled:
                self.send(self._pull())
                pulled, pulled_at = True, time.monotonic()
            got = self._recv(500)
            if got is None:
                if not self.agent_alive():
                    log.error("worker %s: agent died; exiting", self.worker_id)
                    return 3
                if time.monotonic() - pulled_at > PULL_TIMEOUT_S:  # a pull lost with a dying coordinator
                    pulled = False
                continue
            mtype, body, payload = got
            if mtype == P.MsgType.STOP:
                return 0
            if mtype != P.MsgType.LEASES:
                log.warning("worker %s: unexpected %s while idle", self.worker_id, mtype.name)
                continue
            pulled = False
            try:
                if self.follow_device_word(body.device, has_work=bool(body.items)) is Move.OFFLOAD:
                    idle_wait_ms = 20  # report the release at once: an update waits for it
            except Exception as exc:  # the weights could not come back onto the device (yet)
                log.exception("worker %s: cannot bring the weights back onto the device", self.worker_id)
                if body.items:
                    self.give_back(body, f"{type(exc).__name__}: {exc}", failed=True)
                    self._back_off()
                else:
                    time.sleep(idle_wait_ms / 1000.0)
                    idle_wait_ms = min(200, idle_wait_ms * 2)
                continue
            if not body.items:
                time.sleep(idle_wait_ms / 1000.0)
                idle_wait_ms = min(200, idle_wait_ms * 2)
                continue
            idle_wait_ms = 20
            tensors = unpack_tensors(body.tensors, payload)
            self._ensure_version(body.items[0].weight_version)
            if self.stop_requested is not None:
                # Stopped before starting: give the leases back untouched (full re-execution).
                self.give_back(body, "worker stopping")
                return 0
            try:
                outcome = self.executor.run(self.worker_id, body, tensors, should_stop=self._check_stop)
            except Exception as exc:  # report, keep serving (after a back-off once unhealthy)
                log.exception("worker %s: batch failed", self.worker_id)
                self.give_back(body, f"{type(exc).__name__}: {exc}", failed=True)
                self._back_off()
                continue
            self.streak.succeeded()
            if outcome.commit is not None:
                if self.stop_requested is not None and not self.stop_requested.commit:
                    self.give_back(body, "stopped without live migration (cluster.live_migration = false)")
                else:
                    self.send(*outcome.commit)
                return 0
            self.send(*outcome.result)


def make_worker(agent_endpoint: str, worker_id: str, gpus: list[int], conf: dict, *, member=None) -> WorkerProcess:
    """The worker process object for ``conf`` (the agent's ``--config-json``): a
    :class:`~spotlight.workers.sp.group_worker.GroupWorkerProcess` when ``sp_degree > 1``, else a
    :class:`WorkerProcess`. ``member``: a warm spare's prepared SP group member (SP > 1 only).

    Raises:
        msgspec.ValidationError: ``conf["model"]`` / ``conf["sampler"]`` are not valid sections.
    """
    model_cfg = msgspec.convert(conf["model"], ModelConfig)
    sampler_cfg = msgspec.convert(conf["sampler"], SamplerConfig)
    if int(conf.get("sp_degree", 1)) > 1:
        from spotlight.workers.sp.group_worker import GroupWorkerProcess

        return GroupWorkerProcess(
            agent_endpoint,
            worker_id,
            gpus,
            model_cfg,
            sampler_cfg,
            int(conf.get("worker_batch_size", 8)),
            member=member,
            lora=conf.get("lora") or {},
            weights_dir=conf.get("weights_dir"),
            cfg_parallel=bool(conf.get("sp_cfg_parallel", False)),
            backend=str(conf.get("sp_backend", "diffusers")),
        )
    return WorkerProcess(
        agent_endpoint,
        worker_id,
        gpus,
        model_cfg,
        sampler_cfg,
        int(conf.get("worker_batch_size", 8)),
        lora=conf.get("lora") or {},
        weights_dir=conf.get("weights_dir"),
        offload_while_training=conf.get("offload_rollout_while_training"),
    )


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
    ap.add_argument(
        "--config-json",
        required=True,
        help="JSON with 'model', 'sampler', 'worker_batch_size', 'torch_threads', 'sp_degree', 'lora', 'weights_dir', "
        "'offload_rollout_while_training'",
    )
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
