"""Where and when a run explores seeds: the paper's system and its baselines as named strategies.

The iteration core (:class:`spotlight.core.iteration.IterationCore`) owns the phase machine and
every piece of bookkeeping; at five points of an iteration it asks its strategy what to do.
A strategy holds no state of its own (the core passes itself in), so one object serves a run,
and a new baseline is one class plus one entry in :data:`STRATEGIES`, selected by
``explore_mode`` (the column of :data:`spotlight.core.modes.POLICIES`, ``explore.mode`` in a
config). What each one does, by example (iteration n, batch n+1 next)::

    stale (Spotlight, RLBoost+explore; paper §4.2)
        ROLLOUT n → TRAIN n: the Planner picks (d, s), d candidates per explored prompt of
        batch n+1 run on the spot GPUs on the stale v_n, extras stream while training lasts
        → DRAIN waits for the planned candidates of n+1 → seed bank → ROLLOUT n+1 ...
        critical path = exploration that outlasts training.
    critical_path (veRL-omni(spot) best-of-N, paper §6.1)
        EXPLORE_FIRST n (d candidates of batch n on v_n, before its rollout) → ROLLOUT n (or,
        reusing the candidates as the rollout, straight to TRAIN n) → DRAIN (nothing) ...
        critical path = the whole exploration.
    off (RLBoost, reserved-only)
        ROLLOUT n → TRAIN n → DRAIN (nothing) ...

Pure: no sockets, threads, clocks or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # the core imports this module; the type is only for annotations
    from spotlight.core.iteration import CoreObservation, IterationCore

__all__ = ["STRATEGIES", "CriticalPathExploration", "ExplorationStrategy", "NoExploration", "StaleExploration"]


class ExplorationStrategy:
    """The hooks the iteration core calls; the base class explores nothing.

    Every hook takes the core and mutates only through its methods (``submit_*``,
    ``choose_action``, the streaming helpers); ``now`` is seconds on the shell's clock.
    """

    name: ClassVar[str] = "off"
    credits_planner: ClassVar[bool] = False
    """The Planner is told the feedback of the arm it chose (only when exploration runs in
    the training window, where the Planner's budget applies)."""
    explores_next_batch: ClassVar[bool] = False
    """Spot GPUs explore batch n+1 while iteration n trains (so the last iteration, with no
    next batch, leaves them idle by design: its ``spot/busy_fraction`` is NaN)."""

    def begin_iteration(self, core: IterationCore, n: int, now: float) -> str:
        """Queue iteration ``n``'s first work; returns the phase it starts in."""
        core.submit_rollout(n, now)
        return "rollout"

    def training_started(self, core: IterationCore, n: int, now: float, obs: CoreObservation) -> None:
        """Iteration ``n``'s update was sent to the Train Workers."""

    def while_training(self, core: IterationCore, now: float, obs: CoreObservation) -> None:
        """Called on every ``advance`` while the update runs."""

    def training_ended(self, core: IterationCore, now: float) -> None:
        """The update finished (v_{n+1} is published)."""

    def drained_batch(self, core: IterationCore, n: int) -> int | None:
        """The batch whose exploration DRAIN waits for (None: nothing to wait for)."""
        return None

    def metrics_batch(self, core: IterationCore, n: int) -> int | None:
        """The batch whose exploration iteration ``n``'s metrics row describes."""
        return None

    def critical_path_s(self, t: dict[str, float], train_end: float) -> float:
        """Seconds of iteration time spent exploring on the critical path (``t``: the
        iteration's timestamps, ``explore_start``/``explore_end`` when it explored)."""
        return 0.0

    def fallback_action(self, core: IterationCore) -> Any:
        """The action a metrics row reports when none was recorded for its batch."""
        return None


class NoExploration(ExplorationStrategy):
    """RLBoost and reserved-only: roll out with default seeds, never explore."""

    name = "off"


class StaleExploration(ExplorationStrategy):
    """Spotlight (paper §4.2-§4.3): explore batch n+1 on the stale v_n while v_n trains."""

    name = "stale"
    credits_planner = True
    explores_next_batch = True

    def training_started(self, core: IterationCore, n: int, now: float, obs: CoreObservation) -> None:
        if n + 1 >= core.settings.iterations:
            return
        action = core.choose_action(n + 1, now, obs)
        if action is not None:
            core.submit_exploration(n + 1, n, action, now)
        elif core.planner is not None and core.settings.stream_extra and obs.spot_slots > 0:
            # no arm fits the window: plan nothing (nothing may reach the critical path) but
            # still give the spot GPUs the cheapest arm's candidates to stream while it lasts
            core.submit_exploration(n + 1, n, core.cheapest_action(), now, planned=False)

    def while_training(self, core: IterationCore, now: float, obs: CoreObservation) -> None:
        core.stream_extra(now, obs)

    def training_ended(self, core: IterationCore, now: float) -> None:
        core.stop_streaming(now)

    def drained_batch(self, core: IterationCore, n: int) -> int | None:
        return core.explore_iter

    def metrics_batch(self, core: IterationCore, n: int) -> int | None:
        return core.explore_iter

    def critical_path_s(self, t: dict[str, float], train_end: float) -> float:
        return max(0.0, t["explore_end"] - train_end) if "explore_end" in t else 0.0


class CriticalPathExploration(ExplorationStrategy):
    """veRL-omni(spot)'s best-of-N: explore batch n on v_n before its rollout, on the critical path."""

    name = "critical_path"

    def begin_iteration(self, core: IterationCore, n: int, now: float) -> str:
        core.submit_exploration(n, n, core.fixed_action, now)
        return "explore_first"

    def metrics_batch(self, core: IterationCore, n: int) -> int | None:
        return n

    def critical_path_s(self, t: dict[str, float], train_end: float) -> float:
        return t["explore_end"] - t["explore_start"]

    def fallback_action(self, core: IterationCore) -> Any:
        return core.fixed_action


STRATEGIES: dict[str, ExplorationStrategy] = {
    s.name: s for s in (StaleExploration(), CriticalPathExploration(), NoExploration())
}
"""Strategy per ``explore_mode`` (``explore.mode`` in a config; ``"off"`` when a run explores
nothing); :data:`spotlight.core.modes.POLICIES` names the mode of each of the paper's systems."""
