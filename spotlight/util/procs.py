"""Child-process helpers shared by the coordinator, the agent and the CLI (torch-free)."""

from __future__ import annotations

import dataclasses
import os
import re

SECRET_ENV = ("SPOTLIGHT_SECRET", "SPOTLIGHT_KEYS")
"""Environment variables that name or hold credentials; children that do not need them never see them."""


def scrubbed_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) without credentials, plus ``extra``.

    Drops :data:`SECRET_ENV` and any variable whose name ends in ``_SECRET``, ``_TOKEN``,
    ``_PASSWORD`` or ``_KEY`` (cloud credentials a worker never needs).
    """
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k in SECRET_ENV or k.endswith(("_SECRET", "_TOKEN", "_PASSWORD", "_SECRET_KEY", "_ACCESS_KEY")):
            del env[k]
    env.update(extra)
    return env


LOG_DIR_ENV = "SPOTLIGHT_LOG_DIR"
"""Directory of the run's log files (``<run_dir>/logs``); set by ``spotlight up`` for its children."""
LOG_ECHO_ENV = "SPOTLIGHT_LOG_ECHO"
"""``1``: children keep the parent's terminal and also write their log file (``spotlight up --verbose``)."""
LOG_LEVEL_ENV = "SPOTLIGHT_LOG_LEVEL"
"""Log level of child processes (``INFO`` unless ``spotlight up --log-level DEBUG``)."""
LOG_FORMAT = "%(asctime)s {tag} %(levelname)s %(message)s"


def log_file_name(name: str) -> str:
    """``name`` (a node or worker id such as ``spot-0/gpu0``) as a log file name: every
    character other than letters, digits, ``.``, ``_``, ``+`` and ``-`` becomes ``-``."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", name) + ".log"


def log_path(name: str, env: dict[str, str] | None = None) -> str | None:
    """The log file of child ``name`` under ``$SPOTLIGHT_LOG_DIR`` (None when it is unset)."""
    d = (os.environ if env is None else env).get(LOG_DIR_ENV)
    return os.path.join(d, log_file_name(name)) if d else None


def _ignoring_sigint(preexec_fn=None):
    def run() -> None:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # stays ignored across exec
        if preexec_fn is not None:
            preexec_fn()

    return run


PARENT_PID_ENV = "SPOTLIGHT_PARENT_PID"
"""Set by :func:`spawn_logged` to the spawning process's pid (see :func:`spawned_by`)."""


def spawned_by() -> int:
    """The pid of the process that started this one: ``$SPOTLIGHT_PARENT_PID`` when
    :func:`spawn_logged` started it (removed from the environment, so this process's own
    children do not inherit it), else ``os.getppid()``.

    A child that watches for its parent's death (``os.getppid() != spawned_by()``) must not take
    ``os.getppid()`` at an arbitrary moment: a parent killed while the child was still importing
    torch leaves it re-parented already, and it would then wait for a dead parent forever."""
    global _spawned_by
    if _spawned_by is None:
        value = os.environ.pop(PARENT_PID_ENV, "")
        _spawned_by = int(value) if value.isdigit() else os.getppid()
    return _spawned_by


_spawned_by: int | None = None


def spawn_logged(cmd: list[str], name: str, *, env: dict[str, str], preexec_fn=None, **popen_kwargs):
    """``subprocess.Popen(cmd, env=env, **popen_kwargs)`` whose output goes to its log file, told
    this process's pid (:func:`spawned_by`), started with SIGINT ignored: a Ctrl-C in the
    terminal reaches the whole process group, but only the parent acts on it (it stops its
    children in order, without their tracebacks).

    With ``$SPOTLIGHT_LOG_DIR`` set in ``env`` and no echo (``$SPOTLIGHT_LOG_ECHO`` != ``1``),
    the child's stdout and stderr (log records, and tracebacks a crash prints) are appended to
    ``$SPOTLIGHT_LOG_DIR/<name>.log``; otherwise the child inherits this process's terminal
    (and, with echo, its own logging also writes that file: :func:`configure_logging`).

    Raises:
        OSError: the log file cannot be opened, or the process cannot start.
    """
    import subprocess

    env = {**env, PARENT_PID_ENV: str(os.getpid())}
    path = log_path(name, env)
    if path is None or env.get(LOG_ECHO_ENV) == "1":
        return subprocess.Popen(cmd, env=env, preexec_fn=_ignoring_sigint(preexec_fn), **popen_kwargs)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_ignoring_sigint(preexec_fn), **popen_kwargs
        )


def _redirect_output(path: str) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at ``path`` (appending),
    unless they already write there."""
    import sys

    try:
        if os.path.samestat(os.fstat(2), os.stat(path)):
            return
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def configure_logging(
    tag: str, name: str | None = None, *, level: str | None = None, log_file: str | None = None
) -> None:
    """Logging of one Spotlight process: records at ``level`` (default ``$SPOTLIGHT_LOG_LEVEL``,
    else ``INFO``) to stderr, each line ``<time> <tag> <LEVEL> <message>``.

    Under ``spotlight up`` (``$SPOTLIGHT_LOG_DIR`` set) a process with a ``name`` writes
    ``$SPOTLIGHT_LOG_DIR/<name>.log``: without echo its stdout and stderr are moved onto that
    file; with echo (``$SPOTLIGHT_LOG_ECHO=1``) a second handler writes the records there and
    the terminal keeps them too. ``log_file`` adds such a handler explicitly
    (``spotlight-agent join --log-file``).

    Raises:
        ValueError: ``level`` is not a logging level name.
        OSError: the log file cannot be opened.
    """
    import logging

    lvl = (level or os.environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    if not isinstance(logging.getLevelName(lvl), int):
        raise ValueError(f"unknown log level {lvl!r}: expected DEBUG, INFO, WARNING or ERROR")
    fmt = logging.Formatter(LOG_FORMAT.format(tag=tag))
    own = log_path(name) if name else None
    if own and os.environ.get(LOG_ECHO_ENV) != "1":
        _redirect_output(own)  # e.g. a warm spare that became worker <name>: its own file from now on
        own = None
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    path = log_file or own
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        handlers.append(logging.FileHandler(path))
    for h in handlers:
        h.setFormatter(fmt)
    logging.basicConfig(level=lvl, handlers=handlers, force=True)


# ---------------------------------------------------------------- why a child stopped

TAIL_LINES = 12
"""Lines of a failed child's log shown on the console."""
_TAIL_BYTES = 64 * 1024
"""How much of the end of a log is read for its tail."""
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:(?: |$)")
_ERROR_LINE = re.compile(r"(^|\s)error:", re.IGNORECASE)
_ENOSPC_PATH = re.compile(r"No space left on device: '([^']+)'")


@dataclasses.dataclass(frozen=True)
class LogMark:
    """Where a child's output goes: its log file and that file's size when the child started
    (what it wrote is what follows ``offset``)."""

    path: str
    offset: int


def log_mark(name: str, env: dict[str, str] | None = None) -> LogMark | None:
    """The :class:`LogMark` of child ``name`` started now with ``env`` (default
    ``os.environ``) by :func:`spawn_logged` (or a warm spare that becomes ``name``); None when
    its output is not in a log file: no ``$SPOTLIGHT_LOG_DIR``, or echo, where the terminal has
    its traceback already."""
    env = os.environ if env is None else env
    path = log_path(name, env)
    if path is None or env.get(LOG_ECHO_ENV) == "1":
        return None
    try:
        return LogMark(path, os.path.getsize(path))
    except OSError:
        return LogMark(path, 0)


def log_tail(mark: LogMark, max_lines: int = TAIL_LINES) -> list[str]:
    """The lines that say why a child stopped: what it wrote to its log since ``mark``, from the
    last Python traceback's header to its exception line (a long one shortened in the middle),
    else its last ``max_lines`` non-empty lines. [] when the log cannot be read."""
    try:
        with open(mark.path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(mark.offset, size - _TAIL_BYTES) if size >= mark.offset else 0)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    # torch.distributed prefixes a rank's traceback lines with "[rank0]: "
    # (an empty line of such a traceback is the bare prefix "[rank0]:")
    lines = [_RANK_PREFIX.sub("", line.rstrip(), count=1) for line in text.splitlines()]
    lines = [line for line in lines if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return lines[-max_lines:]
    block = lines[starts[-1] :]
    end = next((i for i, line in enumerate(block) if i > 0 and not line.startswith((" ", "\t"))), len(block) - 1)
    block = block[: end + 1]
    if len(block) > max_lines:  # keep the innermost frames, cut at a frame's first line
        rest = block[-(max_lines - 2) :]
        while len(rest) > 2 and not rest[0].startswith("  File "):
            rest = rest[1:]
        block = [block[0], "  …", *rest]
    return block


def exit_description(returncode: int) -> str:
    """``exited with code N``, or for a signal ``was killed by SIGKILL`` (a negative code)."""
    if returncode < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclasses.dataclass(frozen=True)
class ChildExit:
    """A child process that stopped when it should not have: which, how, and its log's last words.

    Args:
        what: the child as a person calls it (``train worker rank 0``, ``agent spot-0``).
        returncode: its exit status (negative: the signal that killed it).
        log: its :class:`LogMark` (None: its output went to the terminal).
        tail: :func:`log_tail` of its log.
    """

    what: str
    returncode: int
    log: LogMark | None = None
    tail: tuple[str, ...] = ()
    disk: str = ""
    """Where the child writes (its run directory), named when its log says the disk is full without a path."""

    @classmethod
    def of(cls, what: str, returncode: int, log: LogMark | None, *, disk: str | os.PathLike = "") -> ChildExit:
        return cls(what, returncode, log, tuple(log_tail(log)) if log is not None else (), str(disk))

    @property
    def disk_full(self) -> str | None:
        """The path of a ``No space left on device`` in its log's last lines (the file the line
        names, else :attr:`disk`, else ""); None when the log says no such thing."""
        for line in reversed(self.tail):
            if "No space left on device" in line:
                named = _ENOSPC_PATH.search(line)
                return named.group(1) if named else self.disk
        return None

    @property
    def cause(self) -> str:
        """The exception line of its traceback (``OSError: [Errno 28] No space left on device``),
        else its last ERROR record's message, else its last line if that is an ``error:`` line
        (a command's refusal), else ""."""
        if self.tail and self.tail[0].startswith("Traceback"):
            return self.tail[-1].strip()
        for line in reversed(self.tail):
            for level in (" ERROR ", " CRITICAL "):
                if level in line:
                    return line.split(level, 1)[1].strip()
        return self.tail[-1].strip() if self.tail and _ERROR_LINE.search(self.tail[-1]) else ""

    @property
    def summary(self) -> str:
        """One line: ``train worker rank 0 exited with code 1: OSError: …``; with ``disk full at
        PATH: `` before the cause when its log says ``No space left on device``."""
        cause = self.cause
        full = self.disk_full
        if full is not None and "disk full" not in cause:
            cause = (f"disk full at {full}" if full else "disk full") + (f": {cause}" if cause else "")
        return f"{self.what} {exit_description(self.returncode)}" + (f": {cause}" if cause else "")

    def report(self, then: str = "") -> str:
        """:attr:`summary` and ``then`` (what follows, e.g. ``"; restarting it"``), then the last
        lines of its log (indented) and where the log is."""
        head = self.summary + then
        if self.log is None:
            return head
        if not self.tail:
            return f"{head} (its log {self.log.path} says nothing more)"
        return "\n".join([head, f"  last lines of {self.log.path}:", *(f"    {line}" for line in self.tail)])
