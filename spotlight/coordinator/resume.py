"""Run checkpoints of the coordinator: what is saved after every iteration, and the restore.

A checkpoint is taken between iterations (no sample, lease or reward job outstanding) by
:func:`write_run_checkpoint`; the Train Workers saved theirs (v_{n+1}) before their TRAIN_DONE.
A resumed coordinator (:func:`restore`) continues the run from the last complete one: the
iteration in flight when the previous coordinator died is run again, with lease ids that
never repeat (a new epoch), the metrics and request logs cut back to the checkpoint's
length, and the run's time and events continued (docs/architecture.md, "Crash and resume").
"""

from __future__ import annotations

import logging
import time

from spotlight.coordinator.recorder import earlier_sessions, unfinite

log = logging.getLogger("spotlight.coordinator")

__all__ = ["checkpoint_state", "restore", "write_run_checkpoint"]


def damaged_final(run_dir) -> str | None:
    """Why the ``final/`` a finished run left in ``run_dir`` cannot be loaded (a file truncated
    or removed after the save), or None when it is whole or absent: a resume saves it again."""
    import pathlib

    from spotlight.util.weights_file import WeightsFileError, check_weights_dir

    final = pathlib.Path(run_dir) / "final"
    if not final.exists():
        return None
    try:
        check_weights_dir(final)
    except WeightsFileError as exc:
        return f"final/ is damaged ({exc})"
    return None


def checkpoint_state(coord) -> dict:
    """Everything the iteration machine of ``coord`` (a Coordinator) needs to continue after
    the iteration that just ended."""
    return {
        "iteration": coord.core.iteration,
        "version": coord.store.latest_version,
        "metrics_bytes": coord.recorder.metrics_bytes(),
        "requests_bytes": coord.recorder.requests_bytes(),
        "scheduler": coord.sched.state_dict(),
        "seed_bank": coord.seed_bank.state_dict(),
        "planner": coord.core.planner.state_dict() if coord.core.planner is not None else None,
        "instances": coord.instances.state_dict(),
        "core": coord.core.state_dict(),
        "t_step_s": coord.step_times.t_step_s,
        "version_bytes": coord.trainers.version_bytes,
        "epoch": coord.recorder.epoch,
        "elapsed_s": coord.clock.elapsed_before_s + time.monotonic() - coord.clock.t_start,
        "events": coord.events.to_list(),
    }


def write_run_checkpoint(coord, n: int, *, pending_row: dict | None = None) -> bool:
    """Iteration ``n``'s run checkpoint, if ``run.checkpoint_every`` asks for one (returns whether
    it was written). ``pending_row``: the last iteration's metrics row, not yet in
    ``metrics.jsonl`` because it waits for the evaluation of the final weights; the checkpoint
    holds it, so a run stopped during that evaluation resumes to the evaluation, the row and the
    final save without training again (docs/architecture.md §13). The terminal requests of
    iterations before ``n`` first move out of memory (the Request Scheduler, the prompt-slot
    map) into ``requests.jsonl``, every iteration: a long run's memory and checkpoints then hold
    about two iterations of requests (a resume cuts the log back to the length its checkpoint
    recorded, so a request retired after it is not logged twice)."""
    from spotlight.store.checkpoint import is_checkpoint_iteration

    dropped = coord.sched.take_terminal(before_iteration=n)
    coord.recorder.append_requests(dropped)
    coord.core.forget_requests(r.request_id for r in dropped)
    run = coord.cfg.run
    if not is_checkpoint_iteration(n, run.checkpoint_every, run.iterations):
        return False
    state = checkpoint_state(coord)
    if pending_row is not None:
        state["pending_row"] = pending_row
    coord.recorder.checkpoint(n, state)
    coord.checkpoint_version = int(state["version"])
    return True


def restore(coord, now: float) -> None:
    """Continue ``coord``'s run from its last complete checkpoint (or, without one, restart it at
    iteration 0 in the same directory).

    Raises:
        CheckpointError: the newest checkpoint is unreadable.
    """
    recorder = coord.recorder
    got = recorder.latest()
    if got is None:
        log.warning("resume: %s has no complete checkpoint; restarting the run at iteration 0", coord.run_dir)
        coord.sched.start_epoch(recorder.epoch)
        recorder.truncate_metrics(0)
        recorder.truncate_requests(0)
        return
    n, st = got
    legacy = {  # checkpoints written before the iteration core keep loading
        "version": 1,
        "iteration": st["iteration"],
        "explore_action": st.get("explore_action", {}),
        "plan_logs": st.get("plan_logs", {}),
        "last_train_s": st.get("last_train_s"),
    }
    coord.core.load_state_dict(st.get("core") or legacy)
    coord.sched.load_state_dict(st["scheduler"], epoch=recorder.epoch, now=now)
    coord.core.adopt_restored_requests()
    # committed states no restored request resumes from (released after the checkpoint, or
    # before it by a coordinator that stopped before deleting them) would stay on disk for good
    keep = coord.sched.commit_keys()
    coord.sched.take_released_commits()
    for key in coord.store.state_keys():
        if key not in keep:
            coord.store.delete_state(key)
    coord.seed_bank.load_state_dict(st["seed_bank"])
    if coord.core.planner is not None and st.get("planner"):
        coord.core.planner.load_state_dict(st["planner"])
    coord.instances.load_state_dict(st["instances"])
    coord.step_times.t_step_s = st["t_step_s"]
    coord.trainers.version_bytes = st["version_bytes"]
    coord.history = recorder.truncate_metrics(int(st["metrics_bytes"]))
    # the last iteration's row, written after the evaluation of the final weights: the resumed
    # coordinator joins that evaluation (queued again if it never finished) and writes the row
    coord.pending_row = unfinite(st["pending_row"]) if st.get("pending_row") else None
    coord.clock.iterations_before_start = len(coord.history)  # done by earlier coordinators: not in the ETA
    # checkpoints from before requests were retired hold every request: start the log empty
    recorder.truncate_requests(int(st.get("requests_bytes", 0)))
    version = int(st["version"])
    coord.store.latest_version = version
    coord.checkpoint_version = version
    coord.trainers.resume_version = version
    # status keeps the whole run's time and events
    coord.clock.elapsed_before_s, earlier = earlier_sessions(coord.run_dir, st)
    coord.events.continue_from(coord.clock.t_start - coord.clock.elapsed_before_s, earlier)
    total, nxt = coord.cfg.run.iterations, coord.core.iteration + 1
    log.info(
        "resumed from the checkpoint of iteration %d: continuing at iteration %d with weights v%d "
        "(coordinator start #%d)",
        n + 1,
        nxt,
        version,
        recorder.epoch + 1,
    )
    if nxt > total:  # the last iteration is done: what is left is its evaluation and the final save
        going_on = f"every iteration is done; finishing the run (weights v{version})"
        if (why := damaged_final(coord.run_dir)) is not None:
            going_on += f"; {why}: saving it again"
        elif not (coord.run_dir / "final").is_dir():
            going_on += "; final/ is missing: saving it"
    else:
        going_on = f"continuing with iteration {nxt} (weights v{version})"
    coord.events.append(now, "resume", "", f"after iteration {n + 1}/{total}: {going_on}")
    coord.progress(f"resumed {coord.run_dir} after iteration {n + 1}/{total}: {going_on}")
