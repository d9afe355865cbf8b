"""Held-out evaluation during training, as the coordinator runs it (docs/evaluation.md).

:func:`due` decides (pure) which iterations are evaluated; :class:`Evaluations` is the shell
that starts one Eval Worker process at a time (``python -m spotlight.workers.eval``) on a
published version, queues the others, and hands back each finished evaluation's scores
(``eval/iter_NNNN.json``). A failed evaluation is logged with the last lines of its log and
the run goes on: evaluation never stops training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import subprocess
import sys
from collections.abc import Iterable

from spotlight.util.procs import log_mark, log_tail, scrubbed_env, spawn_logged

log = logging.getLogger("spotlight.coordinator")


def due(n: int, every: int, total: int) -> bool:
    """True when the version trained by iteration ``n`` (0-based) is evaluated: every
    ``every`` iterations and the last (``every`` = 0: never)."""
    return every > 0 and ((n + 1) % every == 0 or n + 1 == total)


@dataclasses.dataclass(frozen=True)
class CatchUp:
    """What a resumed run does about the evaluations due before its checkpoint
    (:func:`catch_up`); each entry is ``(iteration, version)``, 0-based iteration, -1 = the base model.

    Attributes:
        record: the result file is written but not in ``eval.jsonl`` (the coordinator stopped
            before it read it): record it as it is.
        evaluate: no result, and the version is in the Tensor Store: evaluate it again.
        gone: no result, and the version was deleted (``run.keep_weight_versions``): skipped.
    """

    record: tuple[tuple[int, int], ...] = ()
    evaluate: tuple[tuple[int, int], ...] = ()
    gone: tuple[tuple[int, int], ...] = ()


def catch_up(
    every: int,
    total: int,
    done: int,
    *,
    recorded: Iterable[int],
    written: Iterable[int],
    available: Iterable[int],
) -> CatchUp:
    """The held-out evaluations a run resumed after ``done`` iterations (of ``total``) owes:
    the base model v0 (due once iteration 1 ended) and the version each iteration ``n < done``
    trained (v(n+1)) where :func:`due` says so, the last included, less those with a result.
    A run stopped while an evaluation ran or waited in the queue never got its result, and
    evaluations are only requested when an iteration ends, so the resumed run asks again
    (docs/evaluation.md, "Versions"; docs/architecture.md §13). Pure.

    Args:
        every: ``eval.every`` (0: never evaluated: nothing is owed).
        total: ``run.iterations``.
        done: iterations the restored checkpoint holds.
        recorded: iterations with a row in ``eval.jsonl``.
        written: iterations with a result file ``eval/iter_NNNN.json``.
        available: versions in the Tensor Store.
    """
    if every <= 0 or done <= 0:
        return CatchUp()
    recorded, written, available = set(recorded), set(written), set(available)
    owed = [-1] + [n for n in range(min(done, total)) if due(n, every, total)]
    record, evaluate, gone = [], [], []
    for n in owed:
        if n in recorded:
            continue
        pair = (n, n + 1)
        if n in written:
            record.append(pair)
        elif pair[1] in available:
            evaluate.append(pair)
        else:
            gone.append(pair)
    return CatchUp(tuple(record), tuple(evaluate), tuple(gone))


def discarded(done: int, iterations: Iterable[int]) -> list[int]:
    """The iterations among ``iterations`` (0-based, -1 = the base model) whose held-out results
    are of weights a run resumed after ``done`` checkpointed iterations throws away: it trains
    iteration ``done`` and those after it again, so an evaluation an earlier coordinator ran of
    them scored weights no longer in the run (docs/evaluation.md, "Versions"). Pure."""
    return sorted(n for n in set(iterations) if n >= done >= 0)


def drop_discarded(run_dir: pathlib.Path, done: int) -> list[int]:
    """Remove the results :func:`discarded` names from ``run_dir``: their ``eval/iter_NNNN.json``
    and ``.png``, and their lines of ``eval.jsonl`` (rewritten atomically; a line that is not
    JSON is kept as it is). Returns those iterations. Without this, the re-trained iteration's
    evaluation would be taken as done (its result file exists) and the old score reported."""
    from spotlight.util.atomic_file import write_text_atomic

    run_dir = pathlib.Path(run_dir)
    path = run_dir / "eval.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []

    def iteration_of(line: str) -> int | None:
        try:
            return int(json.loads(line)["iteration"])
        except (ValueError, KeyError, TypeError):
            return None

    its = [iteration_of(line) for line in lines]
    in_log = [n for n in its if n is not None]
    stale = discarded(done, [*in_log, *written_iterations(run_dir)])
    if not stale:
        return []
    for n in stale:
        result_path(run_dir, n).unlink(missing_ok=True)
        result_path(run_dir, n).with_suffix(".png").unlink(missing_ok=True)
    if any(n in stale for n in in_log):
        kept = [line for line, n in zip(lines, its) if n not in stale]
        write_text_atomic(path, "".join(line + "\n" for line in kept))
    return stale


def drop_stale_best(run_dir: pathlib.Path, stale: Iterable[int]) -> dict | None:
    """Remove ``best/`` when it holds the weights of an iteration in ``stale`` (see
    :func:`drop_discarded`): those weights are no longer the run's, and ``best/best.json``'s score
    would keep every later version out of ``best/``. Returns the removed ``best.json``, or None
    when ``best/`` is absent, unreadable as to its iteration, or of weights the run keeps. The next
    evaluation that scores above every result still on disk writes ``best/`` again
    (:func:`score_to_beat`)."""
    import shutil

    best = pathlib.Path(run_dir) / "best"
    try:
        held = json.loads((best / "best.json").read_text())
        iteration = int(held["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if iteration not in set(stale):
        return None
    shutil.rmtree(best)
    return held


def score_to_beat(run_dir: pathlib.Path, iteration: int) -> float:
    """The ``eval/score`` the evaluation of ``iteration`` must beat to replace ``best/``:
    ``best/best.json``'s, or, where ``best/`` is absent (a resume removed it with
    :func:`drop_stale_best`), the highest of the other result files ``eval/iter_NNNN.json``
    (``-inf`` when there is none: the first evaluation of a run writes ``best/``)."""
    run_dir = pathlib.Path(run_dir)
    try:
        return float(json.loads((run_dir / "best" / "best.json").read_text())["eval/score"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    scores = [-math.inf]
    for n in written_iterations(run_dir):
        if n == iteration:
            continue
        try:
            score = float(json.loads(result_path(run_dir, n).read_text())["eval/score"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not math.isnan(score):
            scores.append(score)
    return max(scores)


def cache_dir() -> pathlib.Path:
    """The prompt-embedding cache: ``$XDG_CACHE_HOME/spotlight`` (default ``~/.cache/spotlight``)."""
    import os

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "spotlight"


def result_path(run_dir: pathlib.Path, iteration: int) -> pathlib.Path:
    """``eval/iter_NNNN.json`` of 0-based ``iteration`` (numbered from 1; the base model is 0000)."""
    return pathlib.Path(run_dir) / "eval" / f"iter_{max(iteration + 1, 0):04d}.json"


def written_iterations(run_dir: pathlib.Path) -> set[int]:
    """0-based iterations with a result file ``eval/iter_NNNN.json`` (-1: the base model)."""
    out = set()
    for path in (pathlib.Path(run_dir) / "eval").glob("iter_*.json"):
        head = path.stem.removeprefix("iter_")
        if head.isdigit():
            out.add(int(head) - 1)
    return out


def result_line(result: dict, base: dict | None = None) -> str:
    """The console line for one held-out evaluation: the GenEval strict and partial scores where
    the task has them, else the panel's mean reward, and the base model's for comparison. Pure."""
    it = int(result["iteration"])
    keys = ("eval/strict", "eval/partial") if "eval/strict" in result else ("eval/score",)

    def scores(r: dict) -> str:
        return " ".join(f"{k.removeprefix('eval/')} {float(r.get(k, math.nan)):.3f}" for k in keys)

    if it < 0:
        return f"held-out panel, base model: {scores(result)}"
    line = f"held-out panel after iteration {it + 1}: {scores(result)}"
    if base is not None and int(base["iteration"]) < 0:
        line += f" (base {scores(base)})"
    return line


def row_scores(result: dict) -> dict:
    """An evaluation's ``eval/*`` for a metrics row, with ``eval/iteration`` (1-based). Pure."""
    return {k: v for k, v in result.items() if k.startswith("eval/")} | {"eval/iteration": result["iteration"] + 1}


def best_evaluation(results: list[dict]) -> dict | None:
    """The evaluation with the highest ``eval/score`` (the earliest of equals, as ``best/`` keeps
    it), or None. Pure."""
    best = None
    for r in results:
        score = r.get("eval/score")
        if isinstance(score, (int, float)) and score == score and (best is None or score > best["eval/score"]):
            best = r
    return best


def read_results(run_dir: pathlib.Path) -> list[dict]:
    """Every evaluation of the run so far (``eval.jsonl``, earlier coordinators' too); a line that
    is not JSON (one torn by a crash mid-write) is skipped with a warning naming it."""
    path = pathlib.Path(run_dir) / "eval.jsonl"
    out = []
    if path.is_file():
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                log.warning("%s line %d is not JSON (torn by a crash?); skipped", path, number)
    return out


def base_result(run_dir: pathlib.Path, results: list[dict]) -> dict | None:
    """The base model's evaluation: from ``results`` (this coordinator's), else from ``eval.jsonl``
    (a resumed run evaluated the base model in an earlier session); None when there is none."""
    base = next((e for e in results if int(e["iteration"]) < 0), None)
    if base is None:
        base = next((e for e in read_results(run_dir) if int(e["iteration"]) < 0), None)
    return base


class Evaluations:
    """The run's Eval Worker processes, one at a time, in request order.

    Args:
        run_dir: the run directory (its ``config.toml``, Tensor Store and ``eval/``).
        cache_dir: the prompt-embedding cache (the coordinator's).
        env: the child's environment (default: this process's, without credentials).
    """

    def __init__(self, run_dir: pathlib.Path, cache_dir: pathlib.Path, env: dict[str, str] | None = None):
        self.run_dir = pathlib.Path(run_dir)
        self.cache_dir = pathlib.Path(cache_dir)
        self.env = env if env is not None else scrubbed_env()
        self.queue: list[tuple[int, int]] = []  # (iteration, version) not started yet
        self.proc: subprocess.Popen | None = None
        self.running: tuple[int, int] | None = None
        self._mark = None

    @property
    def busy(self) -> bool:
        return self.proc is not None or bool(self.queue)

    @property
    def pending_versions(self) -> set[int]:
        """Versions queued or being evaluated now."""
        return {v for _, v in self.queue} | ({self.running[1]} if self.running else set())

    def request(self, iteration: int, version: int) -> None:
        """Evaluate ``version`` as the result of 0-based ``iteration`` (-1: the base model),
        unless its result is already written (a resumed run) or it is queued or running."""
        if (
            result_path(self.run_dir, iteration).is_file()
            or (iteration, version) in self.queue
            or self.running == (iteration, version)
        ):
            return
        self.queue.append((iteration, version))
        self._start_next()

    def _start_next(self) -> None:
        if self.proc is not None or not self.queue:
            return
        iteration, version = self.queue.pop(0)
        cmd = [
            sys.executable,
            "-m",
            "spotlight.workers.eval",
            "--run-dir",
            str(self.run_dir),
            "--version",
            str(version),
            "--iteration",
            str(iteration),
            "--cache-dir",
            str(self.cache_dir),
        ]
        self._mark = log_mark("eval", self.env)
        self.proc = spawn_logged(cmd, "eval", env=self.env)
        self.running = (iteration, version)
        log.info("evaluating v%d (held-out panel) in process %d", version, self.proc.pid)

    def poll(self) -> list[dict]:
        """The scores of every evaluation finished since the last call (then the next queued one starts)."""
        out = []
        while self.proc is not None and self.proc.poll() is not None:
            rc, (iteration, version) = self.proc.returncode, self.running
            self.proc = self.running = None
            path = result_path(self.run_dir, iteration)
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                tail = "\n".join(log_tail(self._mark)) if self._mark is not None else ""
                why = f":\n{tail}" if tail else ""
                log.warning("evaluation of v%d failed (exit code %s, %s)%s", version, rc, exc, why)
            self._start_next()
        return out

    def wait(self, timeout_s: float) -> list[dict]:
        """Finish the running and queued evaluations (up to ``timeout_s`` in all); their scores."""
        import time

        deadline, out = time.monotonic() + timeout_s, []
        while self.busy and time.monotonic() < deadline:
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
            out += self.poll()
        if self.busy:
            log.warning("held-out evaluation did not finish within %.0f s; stopped", timeout_s)
        return out

    def close(self) -> None:
        """Stop a running evaluation (the run is stopping) and drop the queue."""
        self.queue.clear()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = self.running = None


def first_vs_last(run_dir: pathlib.Path) -> pathlib.Path | None:
    """``eval/first_vs_last.png``: the base model's panel grid and the last evaluation's side
    by side (same prompts, same seeds); None when fewer than two grids exist."""
    from PIL import Image

    grids = sorted((pathlib.Path(run_dir) / "eval").glob("iter_*.png"))
    if len(grids) < 2:
        return None
    first, last = Image.open(grids[0]).convert("RGB"), Image.open(grids[-1]).convert("RGB")
    gap = 12
    out = Image.new("RGB", (first.width + gap + last.width, max(first.height, last.height)), (235, 235, 235))
    out.paste(first, (0, 0))
    out.paste(last, (first.width + gap, 0))
    path = pathlib.Path(run_dir) / "eval" / "first_vs_last.png"
    out.save(path)
    return path
