"""Test doubles shared by several tests. The fake cloud (the mock metadata server) and the fake run
of the control plane ship in the package; these are test-only.

* :class:`FakeClock`: a clock the test moves (``now``), or one that moves on every reading
  (``step``), for code that takes a ``clock`` callable;
* :class:`CoordinatorSocket`: the coordinator's side of the control plane as an agent sees it:
  a CURVE ROUTER on a random loopback port, allow-listing the keys directory's clients, that
  the test reads and answers frame by frame;
* :func:`reward_service`: an HTTP reward service (the ``reward.kind = "http"`` format) that
  answers a given number of requests and then fails with HTTP 500.
* :func:`marked_sleeper`: a live process whose command line holds a marker (``spotlight``,
  ``agent.main``), as a coordinator's or an agent's does, and its start time.

The real control plane against a run that never ends (one weight version, fresh rollout requests
whenever a worker pulls) is :class:`spotlight.coordinator.fixed_run.FixedRun`, in the package because
the reconfiguration benchmark uses it too.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import pathlib
import threading

import zmq

from spotlight import protocol as P
from spotlight.net.security import Authenticator, apply_server, load_server_keys


class FakeClock:
    """A clock that only moves when told to.

    ``clock()`` returns the current time and then adds ``step`` (0: reading never moves it);
    ``advance(dt)`` (or ``sleep(dt)``, for code that takes a sleep function) moves it by ``dt``.

    >>> c = FakeClock(100.0, step=7.0)
    >>> c(), c(), c.now
    (100.0, 107.0, 114.0)
    """

    def __init__(self, start: float = 0.0, *, step: float = 0.0):
        self.now = float(start)
        self.step = float(step)

    def __call__(self) -> float:
        t = self.now
        self.now += self.step
        return t

    def advance(self, dt: float) -> float:
        assert dt >= 0, "a clock does not go back"
        self.now += dt
        return self.now

    sleep = advance


class CoordinatorSocket:
    """A CURVE ROUTER bound to ``127.0.0.1:<random port>`` with the coordinator's keys from
    ``keys_dir`` (``spotlight keys init``): only the directory's allow-listed clients connect.

    ``endpoint`` is the ``HOST:PORT`` an agent joins; ``recv()`` returns ``(identity, mtype,
    body, payload)``; ``send(identity, msg)`` answers one peer. Use as a context manager or
    call ``close()``.
    """

    def __init__(self, keys_dir: pathlib.Path):
        self.ctx = zmq.Context()
        self.auth = Authenticator(self.ctx, load_server_keys(keys_dir))
        self.auth.start()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        apply_server(self.sock, self.auth.keys)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"127.0.0.1:{self.port}"

    def recv(self, timeout_s: float = 10.0):
        """The next message: ``(identity, mtype, body, payload)``; AssertionError after ``timeout_s``."""
        assert self.sock.poll(int(timeout_s * 1000)), f"nothing arrived within {timeout_s} s"
        ident, *frames = self.sock.recv_multipart()
        return (ident, *P.decode(frames))

    def send(self, ident: bytes, msg, frames=None) -> None:
        self.sock.send_multipart([ident, *P.encode(msg, frames)])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()

    def __enter__(self) -> CoordinatorSocket:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def reward_service(answers: int | None = None):
    """A local HTTP reward service that scores every image 0.5 for its first ``answers`` requests
    (None: all of them), then answers HTTP 500; yields ``(url, requests)``, ``requests["n"]``
    the number of requests it has had."""
    requests = {"n": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the stdlib's name)
            n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["images"])
            requests["n"] += 1
            ok = answers is None or requests["n"] <= answers
            body = json.dumps({"rewards": [0.5] * n}).encode() if ok else b"scorer crashed"
            self.send_response(200 if ok else 500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", requests
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def marked_sleeper(marker: str):
    """``(pid, start time)`` of a sleeping process whose command line holds ``marker``; killed
    after the block. Yields once the child has exec'ed: between fork and exec its command line
    is still pytest's, which a pid check would rightly not take for a Spotlight process."""
    import subprocess
    import sys
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        for _ in range(2000):  # a bound on a wait for a condition, not a timed assertion
            if marker in " ".join(psutil.Process(proc.pid).cmdline()[1:]):
                break
            time.sleep(0.01)
        yield proc.pid, psutil.Process(proc.pid).create_time()
    finally:
        proc.kill()
        proc.wait()
