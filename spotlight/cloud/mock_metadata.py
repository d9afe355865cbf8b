"""Loopback mock of the cloud metadata endpoints the agent polls for preemption notices.

One server has one personality (``aws``, ``gcp`` or ``azure``) and speaks the real formats and
header rules, following the contract in ``docs/preemption-notices.md`` §5.4:

* AWS IMDSv2 (§1): ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` in
  1..21600 (else 400; versioned path or ``X-Forwarded-For`` 403); GETs need a known token when
  ``imdsv2_required`` (else 401).  ``spot/instance-action`` (404 or tab-indented JSON served as
  ``text/plain``), ``spot/termination-time``, ``events/recommendations/rebalance``.
* GCP (§2): ``Metadata-Flavor: Google`` required (else 403) and echoed; per-key ``ETag``
  header; ``instance/preempted`` and ``instance/maintenance-event`` (``NONE``,
  ``MIGRATE_ON_HOST_MAINTENANCE``, ``TERMINATE_ON_HOST_MAINTENANCE``, §2.3) both support
  ``wait_for_change``/``last_etag``/``timeout_sec``.
* Azure (§3): ``/metadata/scheduledevents`` needs ``Metadata: true`` and ``api-version`` (else
  400); POST ``StartRequests`` approves events (recorded in :attr:`MockMetadataServer.acknowledged`).
  ``/metadata/instance/compute/name`` (same header rules) answers the VM name: plain text with
  ``format=text``, else a JSON string.

Control API (no auth, no faults), for ``curl`` or a trace replayer: ``POST /_spotlight/notice``
(JSON body optional: ``lead_time_s``, ``action``, ``event_id``, ``resources``, ``pinned``),
``POST /_spotlight/rebalance``, ``POST /_spotlight/maintenance`` (GCP, ``{"value"}``),
``POST /_spotlight/cancel``, ``POST /_spotlight/fault`` (``{"kind", "count"}``),
``GET /_spotlight/state``.  Every control call answers with the state.
No torch here.
"""

from __future__ import annotations

import email.utils
import json
import secrets
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

import requests

CLOUDS = ("aws", "gcp", "azure")
DEFAULT_LEAD_S = {"aws": 120.0, "gcp": 0.0, "azure": 30.0}
# "401": AWS invalidates every issued token (clients must fetch a new one); other clouds: next
# `count` reads get 401.  "401-always": next `count` reads get 401 whatever the token.
# "token-hang": the next `count` token PUTs hang (IMDSv2 hop-limit emulation, §1.1).
# "drop": close the connection without answering.  "trickle": answer 200 with a large
# Content-Length, then send one byte every `trickle_interval_s` until the client hangs up or the
# server stops.  Others: next `count` reads get that answer.
FAULT_KINDS = ("400", "401", "401-always", "403", "429", "503", "hang", "malformed", "drop", "token-hang", "trickle")
GCP_MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
CONTROL_PREFIX = "/_spotlight/"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    mock: "MockMetadataServer"

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up (an agent stopped mid-poll) is routine: no traceback on the
        console of ``spotlight up --mock-cloud``; anything else is reported as before."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60  # idle keep-alive connections end after this (seconds)
    disable_nagle_algorithm = True  # no 40 ms delayed-ACK stalls between header and body writes
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.server.mock._handle(self, "GET")

    def do_PUT(self) -> None:
        self.server.mock._handle(self, "PUT")

    def do_POST(self) -> None:
        self.server.mock._handle(self, "POST")


class _Reply(Exception):
    def __init__(self, code: int, body: str = "", ctype: str = "text/plain", headers: dict | None = None):
        super().__init__(code)
        self.code, self.body, self.ctype, self.headers = code, body, ctype, headers or {}


class MockMetadataServer:
    """Mock metadata server on ``host:port`` (``port=0`` picks a free one); see module doc.

    Use as a context manager or call :meth:`start`/:meth:`stop`.  :attr:`url` is the base URL to
    give the detector.  Thread-safe: tests drive it from any thread.
    """

    def __init__(
        self,
        cloud: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        vm_name: str = "spot-vm-0",
        imdsv2_required: bool = True,
    ) -> None:
        if cloud not in CLOUDS:
            raise ValueError(f"unknown cloud {cloud!r}: expected one of {', '.join(CLOUDS)}")
        self.cloud, self.host, self.port = cloud, host, port
        self.vm_name, self.imdsv2_required = vm_name, imdsv2_required
        self.hang_s = 30.0  # how long a "hang" fault holds a request (or until stop)
        self.trickle_interval_s = 1.0  # seconds between the bytes of a "trickle" fault
        self.clock: Callable[[], float] = time.time  # wall clock for notice times; tests may replace
        self.acknowledged: list[str] = []
        self.requests_seen = 0
        self.tokens_issued = 0
        self.long_poll_waiting = threading.Event()  # set when a GCP hanging GET starts waiting
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._faults: list[list[Any]] = []  # [kind, remaining]
        self._tokens: dict[str, float] = {}  # token -> monotonic expiry
        # AWS
        self._action: dict[str, Any] | None = None  # {"action", "time" (unix) or None=unpinned, "lead"}
        self._rebalance_time: float | None = None
        # GCP
        self._preempted = False
        self._etag = secrets.token_hex(8)
        self._maintenance = "NONE"
        self._maint_etag = secrets.token_hex(8)
        # Azure
        self._incarnation = 1
        self._events: list[dict[str, Any]] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("server not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def control_url(self) -> str:
        return self.url + CONTROL_PREFIX.rstrip("/")

    def start(self) -> "MockMetadataServer":
        self._server = _Server((self.host, self.port), _Handler)
        self._server.mock = self
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"mock-metadata-{self.cloud}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; releases hanging requests. Idempotent."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> "MockMetadataServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- scenario controls -----------------------------------------------------------------
    def issue_notice(
        self,
        *,
        lead_time_s: float | None = None,
        action: str | None = None,
        event_id: str | None = None,
        resources: list[str] | None = None,
        pinned: bool = True,
    ) -> None:
        """Start a preemption notice, ``lead_time_s`` (seconds) before the action.

        AWS: instance-action ``{"action": action or "terminate", "time": now + lead}`` (default
        lead 120 s); ``pinned=False`` recomputes ``time`` on every request like the unpinned
        AEMM (§5.1 quirk 1).  GCP: ``preempted`` -> TRUE with a new ETag (lead ignored).  Azure:
        adds an event (``EventType`` = ``action`` or ``Preempt``, ``NotBefore`` = now + lead,
        default 30 s, ``Resources`` = ``resources`` or ``[vm_name]``); DocumentIncarnation += 1.
        """
        lead = DEFAULT_LEAD_S[self.cloud] if lead_time_s is None else float(lead_time_s)
        now = self.clock()
        with self._cond:
            if self.cloud == "aws":
                self._action = {"action": action or "terminate", "lead": lead, "time": (now + lead) if pinned else None}
            elif self.cloud == "gcp":
                if not self._preempted:
                    self._preempted, self._etag = True, secrets.token_hex(8)
            else:
                self._events.append(
                    {
                        "EventId": event_id or str(uuid.uuid4()).upper(),
                        "EventType": action or "Preempt",
                        "ResourceType": "VirtualMachine",
                        "Resources": list(resources) if resources is not None else [self.vm_name],
                        "EventStatus": "Scheduled",
                        "NotBefore": email.utils.formatdate(now + lead, usegmt=True),
                        "Description": "Spot eviction (spotlight mock)",
                        "EventSource": "Platform",
                        "DurationInSeconds": -1,
                    }
                )
                self._incarnation += 1
            self._cond.notify_all()

    def set_maintenance(self, value: str = "TERMINATE_ON_HOST_MAINTENANCE") -> None:
        """GCP only: set ``instance/maintenance-event`` to ``value`` (one of
        ``GCP_MAINTENANCE_VALUES``, docs/preemption-notices.md §2.3) with a new ETag if it changed.

        Raises ``ValueError`` on another cloud or value.
        """
        if self.cloud != "gcp":
            raise ValueError("instance/maintenance-event exists only on gcp")
        if value not in GCP_MAINTENANCE_VALUES:
            raise ValueError(
                f"unknown maintenance-event {value!r}: expected one of {', '.join(GCP_MAINTENANCE_VALUES)}"
            )
        with self._cond:
            if value != self._maintenance:
                self._maintenance, self._maint_etag = value, secrets.token_hex(8)
            self._cond.notify_all()

    def issue_rebalance(self) -> None:
        """AWS only: rebalance recommendation with ``noticeTime`` = now (pinned)."""
        if self.cloud != "aws":
            raise ValueError("rebalance recommendations exist only on aws")
        with self._cond:
            self._rebalance_time = self.clock()

    def cancel_notice(self) -> None:
        """Azure: remove all events (incarnation +1). AWS: clear notice and rebalance. GCP:
        ``preempted`` FALSE and ``maintenance-event`` NONE."""
        with self._cond:
            if self.cloud == "aws":
                self._action, self._rebalance_time = None, None
            elif self.cloud == "gcp":
                if self._preempted:
                    self._preempted, self._etag = False, secrets.token_hex(8)
                if self._maintenance != "NONE":
                    self._maintenance, self._maint_etag = "NONE", secrets.token_hex(8)
            elif self._events:
                self._events.clear()
                self._incarnation += 1
            self._cond.notify_all()

    def inject_fault(self, kind: str, count: int = 1) -> None:
        """Make the next ``count`` metadata requests fail as ``kind`` (see ``FAULT_KINDS``)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}: expected one of {', '.join(FAULT_KINDS)}")
        if int(count) < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._cond:
            if kind == "401" and self.cloud == "aws":
                self._tokens.clear()  # token expired: next GETs get 401 until a new PUT
            else:
                self._faults.append([kind, int(count)])

    def state(self) -> dict[str, Any]:
        with self._cond:
            return {
                "cloud": self.cloud,
                "requests_seen": self.requests_seen,
                "tokens_issued": self.tokens_issued,
                "acknowledged": list(self.acknowledged),
                "aws_action": dict(self._action) if self._action else None,
                "aws_rebalance_time": self._rebalance_time,
                "gcp_preempted": self._preempted,
                "gcp_etag": self._etag,
                "gcp_maintenance_event": self._maintenance,
                "azure_incarnation": self._incarnation,
                "azure_events": [dict(e) for e in self._events],
                "pending_faults": [list(f) for f in self._faults],
            }

    # -- request handling ------------------------------------------------------------------
    def _take_fault(self, token_put: bool) -> str | None:
        with self._cond:
            for f in self._faults:
                if (f[0] == "token-hang") == token_put:
                    f[1] -= 1
                    if f[1] <= 0:
                        self._faults.remove(f)
                    return f[0]
        return None

    def _handle(self, h: _Handler, method: str) -> None:
        parts = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length).decode("utf-8", "replace") if length else ""
        fault: str | None = None
        try:
            if parts.path.startswith(CONTROL_PREFIX):
                raise self._control(method, parts.path[len(CONTROL_PREFIX) :], body)
            with self._cond:
                self.requests_seen += 1
            is_put = self.cloud == "aws" and method == "PUT"
            fault = self._take_fault(token_put=is_put)
            if fault in ("hang", "token-hang"):
                self._stopping.wait(self.hang_s)
                raise _Reply(503, "hung request released")
            if fault == "trickle":
                self._trickle(h)
                return
            if fault == "drop":
                h.close_connection = True
                h.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault in ("400", "401", "401-always", "403", "429", "503"):
                raise _Reply(int(fault[:3]), f"injected {fault}")
            if self.cloud == "aws":
                self._aws(h, method, parts.path)
            elif self.cloud == "gcp":
                self._gcp(h, method, parts.path, query)
            else:
                self._azure(h, method, parts.path, query, body)
            raise _Reply(404, "not found")
        except _Reply as r:
            if fault == "malformed":  # a 200 with a garbage body
                r = _Reply(200, "\x00<html>garbage{{{", headers=r.headers)
            self._send(h, r)

    def _trickle(self, h: _Handler) -> None:
        """Headers of a 200 with a 1 MB body, then one byte per ``trickle_interval_s``."""
        h.close_connection = True
        try:
            h.send_response(200)
            h.send_header("Content-Type", "text/plain")
            h.send_header("Content-Length", str(1_000_000))
            if self.cloud == "gcp":
                h.send_header("Metadata-Flavor", "Google")
            h.end_headers()
            h.wfile.flush()
            for _ in range(1_000_000):
                if self._stopping.wait(self.trickle_interval_s):
                    return
                h.wfile.write(b" ")
                h.wfile.flush()
        except OSError:  # the client gave up
            pass

    @staticmethod
    def _send(h: _Handler, r: _Reply) -> None:
        data = r.body.encode()
        try:
            h.send_response(r.code)
            h.send_header("Content-Type", r.ctype)
            h.send_header("Content-Length", str(len(data)))
            for k, v in r.headers.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data)
        except OSError:  # client went away (timed out)
            h.close_connection = True

    def _control(self, method: str, cmd: str, body: str) -> _Reply:
        try:
            args = json.loads(body) if body.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("body must be a JSON object")
            if method == "GET" and cmd == "state":
                pass
            elif method == "POST" and cmd == "notice":
                self.issue_notice(
                    **{k: args[k] for k in ("lead_time_s", "action", "event_id", "resources", "pinned") if k in args}
                )
            elif method == "POST" and cmd == "maintenance":
                self.set_maintenance(str(args.get("value", "TERMINATE_ON_HOST_MAINTENANCE")))
            elif method == "POST" and cmd == "rebalance":
                self.issue_rebalance()
            elif method == "POST" and cmd == "cancel":
                self.cancel_notice()
            elif method == "POST" and cmd == "fault":
                self.inject_fault(str(args.get("kind")), int(args.get("count", 1)))
            else:
                return _Reply(404, json.dumps({"error": f"no control {method} {cmd}"}), "application/json")
        except (ValueError, TypeError) as e:
            return _Reply(400, json.dumps({"error": str(e)}), "application/json")
        return _Reply(200, json.dumps(self.state()), "application/json")

    def _aws(self, h: _Handler, method: str, path: str) -> None:
        if method == "PUT":
            if path != "/latest/api/token" or h.headers.get("X-Forwarded-For"):
                raise _Reply(403, "Forbidden")
            try:
                ttl = int(h.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                ttl = 0
            if not 1 <= ttl <= 21600:
                raise _Reply(400, "<html><body>Bad Request: missing or invalid TTL</body></html>", "text/html")
            token = secrets.token_urlsafe(32)
            with self._cond:
                self._tokens[token] = time.monotonic() + ttl
                self.tokens_issued += 1
            raise _Reply(200, token, headers={"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})
        if method != "GET":
            raise _Reply(405, "Method Not Allowed")
        token = h.headers.get("X-aws-ec2-metadata-token")
        with self._cond:
            valid = token is not None and self._tokens.get(token, 0.0) > time.monotonic()
            action = dict(self._action) if self._action else None
            rebalance = self._rebalance_time
        if (self.imdsv2_required or token is not None) and not valid:
            raise _Reply(401, "Unauthorized")
        iso = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
        if path == "/latest/meta-data/spot/instance-action" and action:
            t = action["time"] if action["time"] is not None else self.clock() + action["lead"]
            raise _Reply(200, json.dumps({"action": action["action"], "time": iso(t)}, indent="\t"))
        if path == "/latest/meta-data/spot/termination-time" and action:
            t = action["time"] if action["time"] is not None else self.clock() + action["lead"]
            raise _Reply(200, iso(t))
        if path == "/latest/meta-data/events/recommendations/rebalance" and rebalance is not None:
            raise _Reply(200, json.dumps({"noticeTime": iso(rebalance)}, indent="\t"))

    def _gcp(self, h: _Handler, method: str, path: str, query: dict[str, str]) -> None:
        hdrs = {"Metadata-Flavor": "Google"}
        if h.headers.get("Metadata-Flavor") != "Google" or h.headers.get("X-Forwarded-For"):
            raise _Reply(403, "Missing Metadata-Flavor: Google header", headers=hdrs)
        if method != "GET":
            raise _Reply(405, "Method Not Allowed", headers=hdrs)
        keys = {
            "/computeMetadata/v1/instance/preempted": lambda: ("TRUE" if self._preempted else "FALSE", self._etag),
            "/computeMetadata/v1/instance/maintenance-event": lambda: (self._maintenance, self._maint_etag),
        }
        read = keys.get(path)
        if read is None:
            raise _Reply(404, "not found", headers=hdrs)
        with self._cond:
            if query.get("wait_for_change", "").lower() == "true":
                start_etag = query.get("last_etag") or read()[1]
                deadline = time.monotonic() + min(float(query.get("timeout_sec") or 3600), 3600)
                self.long_poll_waiting.set()
                while read()[1] == start_etag and not self._stopping.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            value, etag = read()
        raise _Reply(200, value, "application/text", {**hdrs, "ETag": etag})

    def _azure(self, h: _Handler, method: str, path: str, query: dict[str, str], body: str) -> None:
        if path == "/metadata/instance/compute/name":
            if h.headers.get("Metadata") != "true" or h.headers.get("X-Forwarded-For"):
                raise _Reply(
                    400,
                    json.dumps({"error": "Bad request. Required metadata header not specified"}),
                    "application/json",
                )
            if not query.get("api-version"):
                raise _Reply(
                    400, json.dumps({"error": "Bad request. api-version was not specified"}), "application/json"
                )
            if method != "GET":
                raise _Reply(405, "Method Not Allowed")
            if query.get("format") == "text":
                raise _Reply(200, self.vm_name)
            raise _Reply(200, json.dumps(self.vm_name), "application/json")
        if path != "/metadata/scheduledevents":
            return
        if h.headers.get("Metadata") != "true" or h.headers.get("X-Forwarded-For"):
            raise _Reply(
                400, json.dumps({"error": "Bad request. Required metadata header not specified"}), "application/json"
            )
        if not query.get("api-version"):
            raise _Reply(400, json.dumps({"error": "Bad request. api-version was not specified"}), "application/json")
        if method == "POST":
            try:
                ids = [str(r["EventId"]) for r in json.loads(body)["StartRequests"]]
            except (ValueError, KeyError, TypeError):
                raise _Reply(
                    400, json.dumps({"error": "Bad request. Invalid StartRequests"}), "application/json"
                ) from None
            with self._cond:
                self.acknowledged.extend(ids)
                for ev in self._events:
                    if ev["EventId"] in ids and ev["EventStatus"] != "Started":
                        ev["EventStatus"], ev["NotBefore"] = "Started", ""
                        self._incarnation += 1
            raise _Reply(200, "")
        if method != "GET":
            raise _Reply(405, "Method Not Allowed")
        with self._cond:
            doc = {"DocumentIncarnation": self._incarnation, "Events": [dict(e) for e in self._events]}
        raise _Reply(200, json.dumps(doc), "application/json")


_control_session: requests.Session | None = None


def control(url: str, command: str, **body: Any) -> dict[str, Any]:
    """Drive a running mock over HTTP: ``command`` in notice|rebalance|maintenance|cancel|fault|state.

    ``url`` is the mock's base URL or its :attr:`MockMetadataServer.control_url` (what
    ``local_agents.json`` lists); ``body`` becomes the JSON body.  Returns the mock's state.
    Raises ``requests.HTTPError`` on a 4xx/5xx answer.
    """
    global _control_session
    if _control_session is None:
        _control_session = requests.Session()
        _control_session.trust_env = False  # loopback: never through a proxy
    base = url.rstrip("/")
    if base.endswith(CONTROL_PREFIX.rstrip("/")):
        base = base[: -len(CONTROL_PREFIX.rstrip("/"))]
    target = base + CONTROL_PREFIX + command
    if command == "state":
        resp = _control_session.get(target, timeout=10)
    else:
        resp = _control_session.post(target, json=body, timeout=10)
    resp.raise_for_status()
    return resp.json()
