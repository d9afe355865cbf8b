"""Run modes: Spotlight and the paper's baselines as configurations of the same code (§6.1).

One table, :data:`POLICIES`, says what each mode changes; ``spotlight simulate`` runs its
:class:`Policy` objects directly, and the real system turns the same objects into config
settings with :func:`mode_overrides` (applied by :func:`spotlight.config.config_from_dict`
when ``run.mode`` names a baseline). Pure data and functions: no torch, no I/O.

==================  ========  ==============  ==============  ================
mode                spot      exploration     reuse as        reconfiguration
                    GPUs                      rollout
==================  ========  ==============  ==============  ================
spotlight           yes       stale (bandit)  no              elastic SP
rlboost             yes       off             no              engine restart
rlboost+explore     yes       stale (bandit)  no              engine restart
verl-omni-spot      yes       critical path,  yes (N gens     engine restart
                              fixed best-of-N per prompt)
reserved-only       no        off             no              (no spot GPUs)
==================  ========  ==============  ==============  ================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MODE_NAMES", "POLICIES", "Policy", "mode_overrides"]


@dataclass(frozen=True)
class Policy:
    """One way of running the job (the baselines of paper §6.1 as configurations).

    use_spot: spot GPUs take part (False: ``reserved_only_gpus`` reserved GPUs do everything).
    explore_mode: "stale" (during training, on spot), "critical_path" (before the rollout) or "off".
    reuse_exploration: critical_path: the selected candidates are the rollout (best-of-N).
    planner: "bandit" (UCB over (d, s), §4.3) or "fixed" (d = best_of_n, all steps).
    elastic: reconfigure SP groups in place (§4.4) instead of restarting the node's engine.
    live_migration: commit in-flight work on a preemption notice (§4.5) instead of losing it.
    stream_extra: keep spot workers busy with extra candidates while training runs.
    """

    name: str
    use_spot: bool = True
    explore_mode: str = "stale"
    reuse_exploration: bool = False
    planner: str = "bandit"
    elastic: bool = True
    live_migration: bool = True
    stream_extra: bool = True


POLICIES: dict[str, Policy] = {
    "spotlight": Policy("spotlight"),
    "rlboost": Policy("rlboost", explore_mode="off", elastic=False, stream_extra=False),
    "rlboost+explore": Policy("rlboost+explore", elastic=False, stream_extra=False),
    "verl-omni-spot": Policy(
        "verl-omni-spot",
        explore_mode="critical_path",
        reuse_exploration=True,
        planner="fixed",
        elastic=False,
        stream_extra=False,
    ),
    "reserved-only": Policy("reserved-only", use_spot=False, explore_mode="off", elastic=False, stream_extra=False),
}
"""The modes ``spotlight simulate`` compares and ``run.mode`` / ``spotlight up --mode`` select.
RLBoost keeps live migration (its rollouts migrate too); what it lacks is exploration and
in-place SP reconfiguration. Live migration is its own switch (``cluster.live_migration``)."""

MODE_NAMES: tuple[str, ...] = tuple(POLICIES)


def mode_overrides(name: str) -> dict[str, Any]:
    """Config settings (dotted keys, as ``load_config(overrides=...)`` takes them) that make
    a run behave as mode ``name``.

    ``"spotlight"`` returns ``{}``: the config's own fields are Spotlight's settings. For a
    baseline, the returned keys replace whatever the config file says about them:
    ``explore.mode``, ``explore.planner``, ``explore.stream_extra``,
    ``explore.reuse_as_rollout`` (with ``explore.num_steps = 0`` and
    ``explore.cache_threshold = 0``, so the reused candidates are full-fidelity rollouts, and
    ``data.num_control_prompts = 0``, since an unexplored prompt would get no rollout),
    ``cluster.reconfiguration`` ("elastic" | "restart") and ``cluster.use_spot``.
    ``cluster.live_migration`` is only set (to False) by a policy without it.

    Raises:
        ValueError: ``name`` is not a mode (the message lists them).
    """
    if name not in POLICIES:
        raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODE_NAMES)}")
    if name == "spotlight":
        return {}
    p = POLICIES[name]
    out: dict[str, Any] = {
        "explore.mode": p.explore_mode,
        "explore.stream_extra": p.stream_extra,
        "explore.reuse_as_rollout": p.reuse_exploration,
        "cluster.reconfiguration": "elastic" if p.elastic else "restart",
        "cluster.use_spot": p.use_spot,
    }
    if p.explore_mode != "off":
        out["explore.enabled"] = True
        out["explore.planner"] = p.planner
    if p.reuse_exploration:
        out.update({"explore.num_steps": 0, "explore.cache_threshold": 0.0, "data.num_control_prompts": 0})
    if not p.live_migration:
        out["cluster.live_migration"] = False
    return out
