"""The status snapshot: what ``spotlight status`` shows, the STATUS message and ``status.json``.

Built from the coordinator's parts on request (:func:`snapshot`); the rendering is
:mod:`spotlight.cli.status`. The format:

* Iteration numbers are 1-based as everywhere a person reads them: ``iteration`` is the one
  under way (or the last, once finished), ``iterations_done`` how many have ended
  (``metrics.jsonl`` rows keep their 0-based ``iteration`` index = number - 1).
* Times are seconds: ``elapsed_s`` is the run's, earlier coordinators of a resumed run included
  (event ``t_s`` likewise); ``session_elapsed_s`` is since this coordinator started; ``eta_s``
  is None before anything tells how long an iteration takes.
* ``version`` is -1 until the first weights are published; costs are USD (``cost``, see
  :func:`spotlight.core.events.cost_summary`); ``gpus`` counts what the cost meter bills, the
  Train Workers' GPUs included.
"""

from __future__ import annotations

import dataclasses
import math

from spotlight.core.events import cost_summary, eta_s
from spotlight.core.request_scheduler import RequestKind

__all__ = ["RunClock", "snapshot"]


@dataclasses.dataclass
class RunClock:
    """The run's time line on this coordinator's monotonic clock.

    ``t_start``: when this coordinator started; ``started_unix_s``: the same moment in unix time;
    ``elapsed_before_s``: run time of earlier coordinators of this run (resume);
    ``iterations_before_start``: iterations they finished (not in this coordinator's ETA)."""

    t_start: float
    started_unix_s: float
    elapsed_before_s: float = 0.0
    iterations_before_start: int = 0

    def eta_s(self, session_elapsed_s: float, history: list[dict], total: int) -> float | None:
        """Seconds left: from this coordinator's own iterations once one has ended; before that,
        on a resumed run, from the earlier coordinators' iteration times (``time/iteration_s``
        of the metrics rows it continued); None when neither exists."""
        done_n = len(history)
        if done_n >= total:
            return 0.0
        mine = done_n - self.iterations_before_start
        if mine <= 0:
            times = [
                h["time/iteration_s"]
                for h in history
                if isinstance(h.get("time/iteration_s"), (int, float)) and math.isfinite(h["time/iteration_s"])
            ]
            return sum(times) / len(times) * (total - done_n) if times else None
        return eta_s(session_elapsed_s, mine, total - self.iterations_before_start)


def _node(r, now: float) -> dict:
    return {
        "node_id": r.node_id,
        "status": r.status.value,
        "why": r.history[-1][2] if r.history else "",
        "spot": r.is_spot,
        "num_gpus": r.num_gpus,
        "gpus": r.gpus,
        "workers": sorted(r.workers),
        "detector_healthy": r.detector_healthy,
        "detector_error": r.detector_error,
        "workers_error": r.workers_error,
        "gpus_given_up": r.gpus_given_up,
        "last_seen_s_ago": round(now - r.last_seen, 1),
    }


def snapshot(coord, now: float) -> dict:
    """The snapshot of ``coord`` (a :class:`~spotlight.coordinator.coordinator.Coordinator`:
    its config, iteration core, Request Scheduler, Instance Manager, Tensor Store, event log,
    metrics history, clock, ``done`` and ``error``) at ``now`` (its monotonic clock). JSON-able."""
    cfg, clock, history, instances = coord.cfg, coord.clock, coord.history, coord.instances
    counts = {kind.value: {k.value: v for k, v in coord.sched.counts(kind=kind).items()} for kind in RequestKind}
    # the last iteration's row waits for the evaluation of the final weights (pending_row after a
    # resume; the core has ended the iteration): it is done all the same
    total, done_n = cfg.run.iterations, max(len(history), min(coord.core.iteration, cfg.run.iterations))
    elapsed_s = now - clock.t_start  # this coordinator's
    instances.integrate(now)
    cost = cost_summary(
        instances.gpu_seconds(spot=True),
        instances.gpu_seconds(spot=False),
        cfg.cost.spot_usd_per_gpu_hour,
        cfg.cost.reserved_usd_per_gpu_hour,
    )
    return {
        "run_dir": str(coord.run_dir.resolve()),
        "phase": coord.core.phase.value,
        "iteration": min(done_n + 1, total),
        "iterations_done": done_n,
        "iterations": total,
        "finished": coord.done,
        "error": coord.error,
        "version": coord.store.latest_version,  # -1: none published yet (the screen says so)
        "started_unix_s": clock.started_unix_s,
        "elapsed_s": round(clock.elapsed_before_s + elapsed_s, 1),  # the whole run's: earlier coordinators' too
        "session_elapsed_s": round(elapsed_s, 1),
        "eta_s": clock.eta_s(elapsed_s, history, total),
        "gpus": instances.gpu_counts(),
        "cost": cost,
        "nodes": [_node(r, now) for r in instances.nodes.values()],
        "requests": counts,
        "last_metrics": history[-1] if history else {},
        "reward_curve": [h["reward/mean"] for h in history],
        "tensor_store": coord.store.stats(),
        "events": coord.events.to_list(),
        "eval_results": [  # held-out evaluations of this coordinator (docs/evaluation.md)
            {k: v for k, v in e.items() if k in ("iteration", "version", "eval/score", "eval/strict")}
            for e in getattr(coord, "eval_results", [])
        ],
        "waiting": coord.waiting_for_spot_nodes() if hasattr(coord, "waiting_for_spot_nodes") else None,
        "guard_alerts": [  # the collapse guard's alerts (docs/collapse-guard.md), oldest first
            {"kind": a.kind, "iteration": a.iteration + 1, "metric": a.metric, "message": a.message}
            for a in getattr(coord, "guard_alerts", [])
        ],
    }
