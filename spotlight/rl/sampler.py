"""Flow-GRPO SDE sampler on a flow-matching schedule, with seeded, resumable noise.

Shapes (legend used throughout this file):
    B  batch (samples denoised together)        L  image tokens (packed latent sequence)
    C  latent channels per token                 T  text tokens
    D  text embedding width                      W  SDE window size (steps with log-probs)

What this module owns:
    * the sigma schedule, taken from diffusers' ``FlowMatchEulerDiscreteScheduler``;
    * the Flow-GRPO "sde" step with its per-step Gaussian log-prob (Liu et al. 2025,
      Flow-GRPO, reference implementation ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``;
      maths in ``docs/flow-grpo.md`` §1.2), computed in float32;
    * the SDE window (Flow-GRPO-Fast): steps inside it use noise level η and record a
      log-prob, steps outside it are plain Euler (η = 0) and never produce a log-prob;
    * seed-keyed noise: the initial latent and every SDE draw come from a CPU
      ``torch.Generator`` keyed by ``(seed, step)``, so a seed gives bit-identical noise on
      any worker, device, batch composition or resume point (docs/architecture.md §3 "Seeds are the unit
      of exploration");
    * :class:`DenoiseState`, the resumable per-batch state that a worker commits to the
      Tensor Store on preemption (latent, step index, window tensors so far).

It holds no sockets, threads or processes; workers and the trainer call it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch

from spotlight.config import SamplerConfig
from spotlight.core.seed_bank import MASK64 as _MASK64
from spotlight.core.seed_bank import splitmix64 as _splitmix64

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def noise_key(seed: int, step: int) -> int:
    """Generator seed for one noise draw.

    Args:
        seed: the sample's seed (any Python int; taken modulo 2**64).
        step: ``-1`` for the initial latent, else the denoising step index whose SDE
            noise is drawn.

    Returns:
        A 63-bit integer for ``torch.Generator.manual_seed``.
    """
    return _splitmix64((_splitmix64(seed & _MASK64) ^ ((step + 2) & _MASK64))) >> 1


def seeded_noise(seeds: Sequence[int], step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal noise, one independent stream per seed, drawn on the CPU.

    Args:
        seeds: B seeds.
        step: ``-1`` (initial latent) or the denoising step index.
        shape: per-sample shape, e.g. ``(L, C)``.

    Returns:
        ``[B, *shape] float32`` on the CPU. Row ``i`` depends only on ``(seeds[i], step)``.
    """
    out = torch.empty((len(seeds), *shape), dtype=torch.float32)
    gen = torch.Generator(device="cpu")
    for i, seed in enumerate(seeds):
        gen.manual_seed(noise_key(int(seed), step))
        out[i] = torch.randn(shape, generator=gen, dtype=torch.float32)
    return out


def make_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """The sigma schedule of diffusers' ``FlowMatchEulerDiscreteScheduler``.

    Args:
        num_steps: number of denoising steps T.
        shift: the scheduler's static timestep shift (1.0 = none).

    Returns:
        ``[T + 1] float32``: ``sigmas[0] == 1`` (pure noise) decreasing to ``sigmas[T] == 0``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps, device="cpu")
    return scheduler.sigmas.to(torch.float32).clone()


def window_steps(cfg: SamplerConfig) -> range:
    """Step indices inside the SDE window (the only steps with log-probs)."""
    return range(cfg.sde_window_start, cfg.sde_window_start + cfg.sde_window_size)


@dataclasses.dataclass
class StepResult:
    """Output of :func:`sde_step` (all float32, ``[B, L, C]`` unless noted)."""

    prev_sample: torch.Tensor
    """x at the next (less noisy) sigma."""
    mean: torch.Tensor
    """Mean μ of the step's Gaussian."""
    std: float
    """Per-element standard deviation ``std_dev_t * sqrt(-dt)`` (0 for an Euler step)."""
    log_prob: torch.Tensor | None
    """``[B]`` element-mean Gaussian log-density of ``prev_sample``; None when η = 0."""
    std_dev_t: float = 0.0
    """The SDE diffusion coefficient ``η·sqrt(σ/(1−σ̃))`` alone (no ``sqrt(−dt)``); Flow-GRPO's KL
    divides by its square."""


def sde_step(
    velocity: torch.Tensor,
    latents: torch.Tensor,
    sigma: float,
    sigma_next: float,
    sigma_after_first: float,
    noise_level: float,
    *,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
) -> StepResult:
    """One Flow-GRPO "sde" step with its Gaussian log-prob (Flow-GRPO eq. for the SDE).

    ``std_dev_t = η·sqrt(σ / (1 − σ̃))`` with ``σ̃ = σ`` except at ``σ = 1`` where it is the
    second sigma of the schedule; ``μ = x·(1 + std²·dt/(2σ)) + v·(1 + std²·(1−σ)/(2σ))·dt``;
    ``x_next = μ + std·sqrt(−dt)·ε``. With η = 0 this is exactly the Euler step
    ``x + v·dt`` and no log-prob is produced (a log-prob there would be 0/0).

    Args:
        velocity: ``[B, L, C]`` transformer prediction v.
        latents: ``[B, L, C]`` current x at sigma.
        sigma, sigma_next: current and next sigma (``sigma_next < sigma``).
        sigma_after_first: ``sigmas[1]`` of the schedule (replaces σ at σ = 1).
        noise_level: η ≥ 0.
        noise: ``[B, L, C]`` standard normal ε for sampling; required when η > 0 and
            ``prev_sample`` is None.
        prev_sample: when given (training), the stored next latent whose log-prob is
            evaluated instead of sampling a new one.

    Returns:
        :class:`StepResult`; computed in float32 whatever the input dtype.

    Raises:
        ValueError: η > 0 with neither ``noise`` nor ``prev_sample``.
    """
    v = velocity.float()
    x = latents.float()
    dt = sigma_next - sigma
    if noise_level == 0.0:
        mean = x + v * dt
        out = mean if prev_sample is None else prev_sample.float()
        return StepResult(prev_sample=out, mean=mean, std=0.0, log_prob=None)
    sigma_tilde = sigma_after_first if sigma >= 1.0 else sigma
    std_dev_t = noise_level * math.sqrt(sigma / (1.0 - sigma_tilde))
    mean = x * (1.0 + std_dev_t**2 * dt / (2.0 * sigma)) + v * (1.0 + std_dev_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt
    std = std_dev_t * math.sqrt(-dt)
    if prev_sample is None:
        if noise is None:
            raise ValueError("sde_step with noise_level > 0 needs `noise` or `prev_sample`")
        prev_sample = mean + std * noise.float()
    else:
        prev_sample = prev_sample.float()
    log_prob = -((prev_sample - mean) ** 2) / (2.0 * std**2) - math.log(std) - _LOG_SQRT_2PI
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return StepResult(prev_sample=prev_sample, mean=mean, std=std, log_prob=log_prob, std_dev_t=std_dev_t)


@dataclasses.dataclass
class Conditioning:
    """Text conditioning of a batch (every tensor batch-first, B rows).

    Attributes:
        embeds: ``[B, T, D] float32`` prompt token embeddings.
        mask: ``[B, T]`` 1 for real tokens, 0 for padding.
        extra: family-specific tensors, e.g. ``pooled [B, P]`` (SD3, FLUX) and the
            negative prompt's ``neg.embeds`` / ``neg.mask`` / ``neg.pooled`` for true CFG.

    An extra tensor with a leading dimension of 1 while there are several rows is *shared* by
    every row (the negative prompt: stored once per prompt set, not once per prompt) and is
    expanded by :meth:`index`.

    On the wire and in caches the tensors are named ``cond.embeds``, ``cond.mask``,
    ``cond.<extra name>`` (:meth:`to_tensors` / :meth:`from_tensors`).
    """

    embeds: torch.Tensor
    mask: torch.Tensor
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def index(self, idx: torch.Tensor | slice | list[int]) -> "Conditioning":
        """Rows ``idx`` of every tensor (shared one-row extras are expanded to those rows)."""
        embeds = self.embeds[idx]
        n, rows = len(self), embeds.shape[0]

        def pick(v: torch.Tensor) -> torch.Tensor:
            if v.shape[0] == 1 and n != 1:
                return v.expand(rows, *v.shape[1:]).contiguous()
            return v[idx]

        return Conditioning(embeds, self.mask[idx], {k: pick(v) for k, v in self.extra.items()})

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Conditioning":
        """Move every tensor to ``device``; floating tensors also to ``dtype`` when given."""

        def mv(t: torch.Tensor) -> torch.Tensor:
            if dtype is not None and t.is_floating_point():
                return t.to(device=device, dtype=dtype)
            return t.to(device)

        return Conditioning(mv(self.embeds), mv(self.mask), {k: mv(v) for k, v in self.extra.items()})

    def rows(self, name: str, n: int) -> torch.Tensor:
        """Extra tensor ``name`` with ``n`` rows (a shared one-row tensor is expanded).

        Raises:
            KeyError: no such extra tensor.
        """
        v = self.extra[name]
        return v.expand(n, *v.shape[1:]) if v.shape[0] == 1 and n != 1 else v

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    def to_tensors(self, prefix: str = "cond.") -> dict[str, torch.Tensor]:
        """Flat ``{prefix + name: tensor}`` map."""
        out = {f"{prefix}embeds": self.embeds, f"{prefix}mask": self.mask}
        out.update({f"{prefix}{k}": v for k, v in self.extra.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "cond.") -> "Conditioning":
        """Inverse of :meth:`to_tensors` (other keys are ignored); float tensors become float32.

        Raises:
            KeyError: ``<prefix>embeds`` is missing.
        """
        embeds = tensors[f"{prefix}embeds"].float()
        mask = tensors.get(f"{prefix}mask")
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.int64)
        extra = {
            k[len(prefix) :]: (v.float() if v.is_floating_point() else v)
            for k, v in tensors.items()
            if k.startswith(prefix) and k not in (f"{prefix}embeds", f"{prefix}mask")
        }
        return cls(embeds, mask, extra)


@dataclasses.dataclass
class DenoiseState:
    """Resumable state of B trajectories denoised in lockstep.

    Attributes:
        seeds: B seeds (fix the initial latent and every SDE draw).
        step: index of the next step to run (0 … T); ``step == T`` means finished.
        latents: ``[B, L, C] float32`` x at ``sigmas[step]``.
        window_latents: list of ``[B, L, C]`` latents recorded so far: the latent entering
            the window, then the output of every window step (W + 1 when complete).
        log_probs: list of ``[B]`` log-probs of the window steps run so far (W when complete).
        computed_steps: ``[B]`` number of steps whose transformer forward actually ran
            (differs from ``step`` only when a step cache skipped blocks).
    """

    seeds: list[int]
    step: int
    latents: torch.Tensor
    window_latents: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    computed_steps: torch.Tensor

    @classmethod
    def initial(cls, seeds: Sequence[int], token_shape: tuple[int, int]) -> "DenoiseState":
        """State at step 0: seed-keyed initial noise of shape ``[B, L, C]``."""
        return cls(
            seeds=[int(s) for s in seeds],
            step=0,
            latents=seeded_noise(seeds, -1, token_shape),
            window_latents=[],
            log_probs=[],
            computed_steps=torch.zeros(len(seeds), dtype=torch.int64),
        )

    def select(self, idx: list[int]) -> "DenoiseState":
        """Sub-batch with rows ``idx`` (used to commit or split individual requests)."""
        return DenoiseState(
            seeds=[self.seeds[i] for i in idx],
            step=self.step,
            latents=self.latents[idx].clone(),
            window_latents=[w[idx].clone() for w in self.window_latents],
            log_probs=[lp[idx].clone() for lp in self.log_probs],
            computed_steps=self.computed_steps[idx].clone(),
        )

    @staticmethod
    def concat(states: Sequence["DenoiseState"]) -> "DenoiseState":
        """Join states at the same step into one batch.

        Raises:
            ValueError: the states are at different steps.
        """
        steps = {s.step for s in states}
        if len(steps) != 1:
            raise ValueError(f"cannot batch states at different steps {sorted(steps)}")
        first = states[0]
        return DenoiseState(
            seeds=[seed for s in states for seed in s.seeds],
            step=first.step,
            latents=torch.cat([s.latents for s in states]),
            window_latents=[torch.cat([s.window_latents[i] for s in states]) for i in range(len(first.window_latents))],
            log_probs=[torch.cat([s.log_probs[i] for s in states]) for i in range(len(first.log_probs))],
            computed_steps=torch.cat([s.computed_steps for s in states]),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name → tensor map (for the Tensor Store / wire)."""
        out = {"latents": self.latents, "computed_steps": self.computed_steps}
        for i, w in enumerate(self.window_latents):
            out[f"window_latents.{i}"] = w
        for i, lp in enumerate(self.log_probs):
            out[f"log_probs.{i}"] = lp
        return out

    @classmethod
    def from_tensors(cls, seeds: Sequence[int], step: int, tensors: dict[str, torch.Tensor]) -> "DenoiseState":
        """Inverse of :meth:`tensors`.

        Raises:
            KeyError: ``latents`` is missing.
        """
        n_w = sum(1 for k in tensors if k.startswith("window_latents."))
        n_lp = sum(1 for k in tensors if k.startswith("log_probs."))
        return cls(
            seeds=[int(s) for s in seeds],
            step=int(step),
            latents=tensors["latents"].float(),
            window_latents=[tensors[f"window_latents.{i}"].float() for i in range(n_w)],
            log_probs=[tensors[f"log_probs.{i}"].float() for i in range(n_lp)],
            computed_steps=tensors.get("computed_steps", torch.zeros(len(seeds), dtype=torch.int64)).long(),
        )


VelocityFn = Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]
"""``velocity_fn(latents [B, L, C], sigma [B], cond) -> v [B, L, C]``."""


class Sampler:
    """Runs Flow-GRPO SDE denoising for one sampler configuration.

    Args:
        cfg: steps, shift, SDE window and noise level.
        token_shape: per-sample latent shape, e.g. ``(L, C)`` of one packed latent
            (``ModelFamily.latent_shape``).
        sigmas: ``[T + 1]`` schedule from the model family (its scheduler config and shift);
            default: :func:`make_sigmas` with ``cfg.shift``.
        window_start: first SDE step; default ``cfg.sde_window_start``.
    """

    def __init__(
        self,
        cfg: SamplerConfig,
        token_shape: tuple[int, ...],
        sigmas: torch.Tensor | None = None,
        *,
        window_start: int | None = None,
    ):
        self.cfg = cfg
        self.token_shape = tuple(token_shape)
        self.sigmas = make_sigmas(cfg.num_steps, cfg.shift) if sigmas is None else sigmas.to(torch.float32).clone()
        if self.sigmas.shape != (cfg.num_steps + 1,):
            raise ValueError(
                f"sigmas must have num_steps + 1 = {cfg.num_steps + 1} entries, got {tuple(self.sigmas.shape)}"
            )
        start = cfg.sde_window_start if window_start is None else int(window_start)
        if start < 0 or start + cfg.sde_window_size > cfg.num_steps - 1:
            raise ValueError(
                f"SDE window [{start}, {start + cfg.sde_window_size}) must end before the last step {cfg.num_steps - 1}"
            )
        self._window = range(start, start + cfg.sde_window_size)

    @property
    def window_start(self) -> int:
        return self._window.start

    def with_window(self, start: int | None) -> "Sampler":
        """The same sampler with the SDE window starting at ``start`` (None = unchanged)."""
        if start is None or start == self._window.start:
            return self
        return Sampler(self.cfg, self.token_shape, self.sigmas, window_start=start)

    def eta(self, step: int) -> float:
        """Noise level used at ``step``: η inside the SDE window, 0 outside."""
        return self.cfg.noise_level if step in self._window else 0.0

    def initial_state(self, seeds: Sequence[int]) -> DenoiseState:
        return DenoiseState.initial(seeds, self.token_shape)

    def advance(
        self, state: DenoiseState, velocity_fn: VelocityFn, cond: Conditioning, *, computed: torch.Tensor | None = None
    ) -> DenoiseState:
        """Run one denoising step in place on ``state`` and return it.

        Args:
            state: batch state; ``state.step`` must be < T.
            velocity_fn: transformer wrapper.
            cond: conditioning for the same B rows.
            computed: optional ``[B]`` bool telling whether the transformer really ran
                (reported by a step cache); defaults to all True.

        Raises:
            ValueError: the state is already finished.
        """
        j = state.step
        if j >= self.cfg.num_steps:
            raise ValueError("state is already at the last step")
        sigma = float(self.sigmas[j])
        sigma_next = float(self.sigmas[j + 1])
        batch = state.latents.shape[0]
        if j == self._window.start and self._window:
            state.window_latents.append(state.latents.clone())
        device = state.latents.device
        sig = torch.full((batch,), sigma, dtype=torch.float32, device=device)
        v = velocity_fn(state.latents, sig, cond)
        eta = self.eta(j)
        # noise is drawn on the CPU (device-independent streams) and then moved
        noise = seeded_noise(state.seeds, j, self.token_shape).to(device) if eta > 0 else None
        res = sde_step(v, state.latents, sigma, sigma_next, float(self.sigmas[1]), eta, noise=noise)
        state.latents = res.prev_sample
        if res.log_prob is not None:
            state.log_probs.append(res.log_prob)
            state.window_latents.append(res.prev_sample.clone())
        state.computed_steps += 1 if computed is None else computed.long().cpu()
        state.step = j + 1
        return state

    def run(
        self,
        state: DenoiseState,
        velocity_fn: VelocityFn,
        cond: Conditioning,
        *,
        should_stop: Callable[[DenoiseState], bool] | None = None,
    ) -> DenoiseState:
        """Denoise until the last step, or until ``should_stop(state)`` is True between steps.

        Returns:
            The state (finished when ``state.step == cfg.num_steps``).
        """
        while state.step < self.cfg.num_steps:
            if should_stop is not None and should_stop(state):
                break
            self.advance(state, velocity_fn, cond)
        return state

    def window_log_probs(
        self,
        velocity_fn: VelocityFn,
        window_latents: torch.Tensor,
        cond: Conditioning,
        step_indices: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, list[StepResult]]:
        """Recompute window log-probs of stored trajectories under the current weights.

        Args:
            velocity_fn: transformer wrapper (with grad, when training).
            window_latents: ``[B, W + 1, L, C]`` stored window latents.
            cond: conditioning for the B rows.
            step_indices: positions 0 … W−1 inside the window to evaluate (default all).

        Returns:
            ``([B, len(step_indices)] log-probs, step results)``, same maths as sampling.
        """
        positions = list(range(self.cfg.sde_window_size)) if step_indices is None else list(step_indices)
        out, results = [], []
        for pos in positions:
            j = self._window.start + pos
            x = window_latents[:, pos]
            sigma = float(self.sigmas[j])
            sig = torch.full((x.shape[0],), sigma, dtype=torch.float32, device=x.device)
            v = velocity_fn(x, sig, cond)
            res = sde_step(
                v,
                x,
                sigma,
                float(self.sigmas[j + 1]),
                float(self.sigmas[1]),
                self.eta(j),
                prev_sample=window_latents[:, pos + 1],
            )
            out.append(res.log_prob)
            results.append(res)
        return torch.stack(out, dim=1), results
