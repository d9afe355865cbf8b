"""Preemption detectors for ``spotlight-agent`` (docs/architecture.md §5).

Each detector polls one source of "this VM is about to go away" and turns it into a
:class:`PreemptionNotice` with an absolute wall-clock deadline.  The exact endpoints, headers,
bodies and pitfalls follow ``docs/preemption-notices.md`` (cited below as "docs/preemption-notices.md §N").

Rules every detector follows (docs/preemption-notices.md §0):

* An error (401 after one token refresh, 400, 403, 429, 503, timeout, refused connection,
  malformed body) is reported as ``PollResult(healthy=False, error=...)``; it is never a silent
  "no notice" (§0 item 2).
* One absolute deadline per notice, in wall-clock seconds since the epoch (§0 item 3).
* Notices are deduplicated by a per-notice key, and the keys are persisted in a
  :class:`NoticeLedger` so that a restarted agent does not commit twice (§0 item 4).  A key is
  written to the ledger when the detector hands the notice out (at-most-once delivery).
* ``poll()`` never sleeps, apart from the HTTP timeout (and the GCP long-poll, which is a
  hanging HTTP GET bounded by ``long_poll_s``).

This module must stay light: stdlib + ``requests`` only (no torch).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import email.utils
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import requests

from spotlight.net.http_limits import DeadlineExceeded, ResponseTooLarge, bounded_request

log = logging.getLogger(__name__)

AWS_NOTICE_LEAD_S = 120.0  # docs/preemption-notices.md §1.2: notice ~2 min before `time`
GCP_SHUTDOWN_S = 30.0  # docs/preemption-notices.md §2.2: 30 s best-effort shutdown after soft-off
# docs/preemption-notices.md §2.3: TERMINATE_ON_HOST_MAINTENANCE comes "about 1 hour" ahead for GPU VMs, but
# only 60 s ahead for other VMs (and the event may start at once if the key was not read since
# the last event).  The agent cannot tell which case it is in from the value alone, so it takes
# the shortest documented advance time: 60 s.
GCP_MAINTENANCE_NOTICE_S = 60.0
GCP_MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
AZURE_PREEMPT_MIN_NOTICE_S = 30.0  # docs/preemption-notices.md §3.2: Preempt minimum notice
AZURE_API_VERSION = "2020-07-01"  # docs/preemption-notices.md §3.1
AZURE_IMDS_API_VERSION = "2021-02-01"  # instance metadata (compute/name), docs/preemption-notices.md §3.1
_AZURE_VM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")  # Azure VM naming rules, with slack
METADATA_MAX_BYTES = 1 << 20  # largest metadata answer read (bytes); bigger = malformed
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
KINDS = ("terminate", "stop", "hibernate", "preempt", "revoke", "rebalance")


@dataclass(frozen=True)
class PreemptionNotice:
    """One upcoming loss of a node or of some of its GPUs.

    ``deadline_unix_s`` is absolute wall-clock time (seconds since the epoch) by which the
    commit must be done, computed per docs/preemption-notices.md §0 item 3.  ``scope`` is ``"node"`` for a VM
    notice or ``"gpu:0,1"`` for a per-GPU revocation (§6).  ``key`` is the dedup key (§0 item 4).
    ``is_hint`` marks advice (AWS rebalance recommendation, §1.3): stop taking new work, but it
    is not a deadline.
    """

    source: str
    scope: str
    deadline_unix_s: float
    key: str
    kind: str
    is_hint: bool = False
    detail: str = ""

    def seconds_left(self, now_unix_s: float) -> float:
        """Seconds until the deadline (negative when it has passed)."""
        return self.deadline_unix_s - now_unix_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict for the coordinator."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PreemptionNotice":
        """Inverse of :meth:`to_dict`; unknown keys are ignored, missing required ones raise."""
        return cls(
            source=str(d["source"]),
            scope=str(d["scope"]),
            deadline_unix_s=float(d["deadline_unix_s"]),
            key=str(d["key"]),
            kind=str(d["kind"]),
            is_hint=bool(d.get("is_hint", False)),
            detail=str(d.get("detail", "")),
        )


@dataclass(frozen=True)
class PollResult:
    """Outcome of one poll: NEW notices only, plus the detector's health.

    Notices found before an error are still returned alongside ``healthy=False``.
    ``known`` lists notices that are still visible at the source but were already handed out
    (by this detector, or by an earlier agent on this VM, per the :class:`NoticeLedger`); a
    restarted agent uses them to refuse to rejoin on a VM that is going away.
    """

    notices: list[PreemptionNotice] = field(default_factory=list)
    healthy: bool = True
    error: str | None = None
    known: list[PreemptionNotice] = field(default_factory=list)


class NoticeLedger:
    """Set of handled notice keys, persisted as JSON so a restarted agent skips them.

    ``path=None`` keeps the keys in memory only.  ``mark`` writes a temp file in the same
    directory, fsyncs it and ``os.replace``s it over the ledger (atomic on POSIX).  An unreadable
    ledger file is logged and treated as empty (starting the agent matters more).  At most
    ``max_keys`` keys are kept, oldest dropped first.
    """

    def __init__(self, path: pathlib.Path | str | None, *, max_keys: int = 4096) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self.max_keys = max_keys
        self._keys: dict[str, None] = {}
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            try:
                doc = json.loads(self.path.read_text(encoding="utf-8"))
                self._keys = dict.fromkeys(str(k) for k in doc["keys"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("notice ledger %s unreadable (%s); starting empty", self.path, e)

    def seen(self, key: str) -> bool:
        with self._lock:
            return key in self._keys

    def mark(self, key: str) -> None:
        """Record ``key`` as handled. Raises ``OSError`` if the file cannot be written."""
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self.max_keys:
                del self._keys[next(iter(self._keys))]
            if self.path is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"version": 1, "keys": list(self._keys)}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                pathlib.Path(tmp).unlink(missing_ok=True)
                raise


class Detector(Protocol):
    name: str

    def poll(self, now_unix_s: float) -> PollResult: ...

    def acknowledge(self, notice: PreemptionNotice) -> None: ...


class _DetectorError(Exception):
    """Internal: becomes ``PollResult(healthy=False, error=str(e))``."""


def _session(session: requests.Session | None) -> requests.Session:
    if session is not None:
        return session
    s = requests.Session()
    s.trust_env = False  # bypass proxies for link-local metadata (docs/preemption-notices.md §2.1, §3.1)
    return s


def _send(
    session: requests.Session,
    cloud: str,
    method: str,
    url: str,
    what: str,
    *,
    timeout: float | tuple[float, float],
    **kw: Any,
) -> requests.Response:
    """One HTTP request, whole answer within ``timeout`` seconds overall (the second element of
    a tuple: the long-poll bound), body at most :data:`METADATA_MAX_BYTES`; a server that
    trickles its answer is cut off at that deadline (``spotlight.net.http_limits``).  Transport
    failures, the deadline and the size cap become :class:`_DetectorError`."""
    total = timeout if isinstance(timeout, (int, float)) else timeout[1]
    try:
        return bounded_request(session, method, url, deadline_s=total, max_bytes=METADATA_MAX_BYTES, **kw)
    except DeadlineExceeded:
        raise _DetectorError(f"{cloud}: answer on {what} not complete within {total:g}s (server trickles)") from None
    except ResponseTooLarge:
        raise _DetectorError(f"{cloud}: answer on {what} exceeds {METADATA_MAX_BYTES} bytes") from None
    except requests.Timeout:
        raise _DetectorError(f"{cloud}: timeout after {total:g}s on {what}") from None
    except requests.ConnectionError as e:
        if "timed out" in str(e):
            raise _DetectorError(f"{cloud}: timeout after {total:g}s on {what}") from None
        raise _DetectorError(f"{cloud}: connection failed on {what}: {type(e).__name__}") from None
    except requests.RequestException as e:
        raise _DetectorError(f"{cloud}: request failed on {what}: {e}") from None


def _http_error(cloud: str, resp: Any, what: str) -> _DetectorError:
    return _DetectorError(f"{cloud}: HTTP {resp.status_code} on {what}")


def _loads(text: str, cloud: str, what: str) -> Any:
    """Lenient JSON (tabs, BOM, any Content-Type: docs/preemption-notices.md §1.2, §5.1 quirk 3)."""
    try:
        return json.loads(text.lstrip("\ufeff").strip())
    except ValueError:
        raise _DetectorError(f"{cloud}: malformed body on {what}: {text[:60]!r}") from None


def _parse_iso_utc(s: Any) -> float | None:
    """``YYYY-MM-DDThh:mm:ssZ`` (AWS, docs/preemption-notices.md §1.2) to unix seconds; None if unparsable."""
    try:
        t = _dt.datetime.fromisoformat(str(s).strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return t.timestamp()


def _parse_rfc1123(s: Any) -> float | None:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` (Azure NotBefore, §3.2) to unix seconds; None if bad."""
    try:
        t = email.utils.parsedate_to_datetime(str(s))
    except (TypeError, ValueError, IndexError):
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return t.timestamp()


class _Base:
    name = "base"

    def __init__(self, ledger: NoticeLedger) -> None:
        self.ledger = ledger
        self._emitted: set[str] = set()
        self._known: list[PreemptionNotice] = []  # visible but already handed out, this poll

    def _offer(self, notice: PreemptionNotice) -> PreemptionNotice | None:
        """``notice`` if it is new (claimed now), else None (recorded in ``_known``)."""
        if self._claim(notice.key):
            return notice
        self._known.append(notice)
        return None

    def _result(self, notices: list[PreemptionNotice], healthy: bool, error: str | None) -> PollResult:
        known, self._known = self._known, []
        return PollResult(notices, healthy, error, known)

    def _claim(self, key: str) -> bool:
        """True the first time ``key`` is seen (by this detector or, via the ledger, ever)."""
        if key in self._emitted or self.ledger.seen(key):
            return False
        self._emitted.add(key)
        try:
            self.ledger.mark(key)
        except OSError as e:  # still deliver: losing the notice is worse than a double commit
            log.error("%s: could not persist notice key %s: %s", self.name, key, e)
        return True

    def acknowledge(self, notice: PreemptionNotice) -> None:
        """No acknowledgement exists for this source (docs/preemption-notices.md §0 table, row "Ack")."""


class AwsImdsDetector(_Base):
    """AWS EC2 Spot via IMDSv2 (docs/preemption-notices.md §1; AWS "Spot Instance interruption notices").

    * Token: ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
      (``token_ttl_s``, 1..21600 s, else ``ValueError``); reused until 15 s (or a tenth of the
      TTL, if smaller) before expiry.  A 401 drops the token, fetches a new one and retries once
      (NTH behaviour, §1.6).  No IMDSv1 fallback: a token PUT that times out (hop limit, §1.1)
      is reported as unhealthy.
    * ``GET /latest/meta-data/spot/instance-action``: 404 = no notice; 200 JSON
      ``{"action", "time"}``.  Deadline ``min(parse(time), received + 120 s)``; ``hibernate``
      has no lead time, so its deadline is ``received``.  Key: sha256 of ``action\\ntime``.
      While the endpoint keeps answering 200 with the same action, further bodies are the same
      notice even if ``time`` moves (the unpinned metadata mock, §5.1 quirk 1).
    * ``GET /latest/meta-data/events/recommendations/rebalance`` (``check_rebalance``): a hint
      (``is_hint=True``, ``kind="rebalance"``), deadline ``received + 120 s`` (earliest plausible
      interruption, not a real deadline).
    """

    name = "aws"

    def __init__(
        self,
        base_url: str = "http://169.254.169.254",
        *,
        ledger: NoticeLedger,
        timeout_s: float = 2.0,
        token_ttl_s: int = 21600,
        session: requests.Session | None = None,
        check_rebalance: bool = True,
    ) -> None:
        super().__init__(ledger)
        if not 1 <= int(token_ttl_s) <= 21600:
            raise ValueError(f"token_ttl_s must be 1..21600 s (docs/preemption-notices.md §1.1), got {token_ttl_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.token_ttl_s = int(token_ttl_s)
        self.check_rebalance = check_rebalance
        self.session = _session(session)
        self.tokens_fetched = 0
        self._token: str | None = None
        self._token_expiry = 0.0  # time.monotonic()
        self._action_run: str | None = None  # action of the 200 run in progress
        self._rebalance_run = False

    def _ensure_token(self) -> str:
        margin = min(15.0, self.token_ttl_s / 10.0)
        if self._token is not None and time.monotonic() < self._token_expiry - margin:
            return self._token
        self._token = None
        t0 = time.monotonic()
        resp = _send(
            self.session,
            "aws",
            "PUT",
            self.base_url + "/latest/api/token",
            "PUT api/token",
            timeout=self.timeout_s,
            headers={AWS_TTL_HEADER: str(self.token_ttl_s)},
        )
        token = resp.text.strip()
        if resp.status_code != 200 or not token:
            raise _http_error("aws", resp, "PUT api/token")
        self.tokens_fetched += 1
        self._token, self._token_expiry = token, t0 + self.token_ttl_s
        return token

    def _get(self, path: str) -> Any:
        for attempt in (0, 1):
            token = self._ensure_token()
            resp = _send(
                self.session,
                "aws",
                "GET",
                f"{self.base_url}/latest/meta-data/{path}",
                path,
                timeout=self.timeout_s,
                headers={AWS_TOKEN_HEADER: token},
            )
            if resp.status_code != 401:
                return resp
            self._token = None  # expired or unknown token: refetch and retry once (§1.6)
        raise _DetectorError(f"aws: HTTP 401 on {path} (token rejected after refresh)")

    def poll(self, now_unix_s: float) -> PollResult:
        t0 = time.monotonic()
        notices: list[PreemptionNotice] = []
        try:
            resp = self._get("spot/instance-action")
            received = now_unix_s + (time.monotonic() - t0)
            if resp.status_code == 404:
                self._action_run = None
            elif resp.status_code == 200:
                n = self._instance_action(resp.text, received)
                if n is not None:
                    notices.append(n)
            else:
                raise _http_error("aws", resp, "spot/instance-action")
            if self.check_rebalance:
                resp = self._get("events/recommendations/rebalance")
                received = now_unix_s + (time.monotonic() - t0)
                if resp.status_code == 404:
                    self._rebalance_run = False
                elif resp.status_code == 200:
                    n = self._rebalance(resp.text, received)
                    if n is not None:
                        notices.append(n)
                else:
                    raise _http_error("aws", resp, "events/recommendations/rebalance")
        except _DetectorError as e:
            return self._result(notices, False, str(e))
        return self._result(notices, True, None)

    def _instance_action(self, body: str, received: float) -> PreemptionNotice | None:
        doc = _loads(body, "aws", "spot/instance-action")
        if not isinstance(doc, dict):
            raise _DetectorError(f"aws: malformed body on spot/instance-action: {body[:60]!r}")
        action = str(doc.get("action", "")).strip().lower()
        raw_time = doc.get("time")
        if self._action_run == action:
            return None  # same notice; body may differ only by an unpinned `time`
        self._action_run = action
        key = hashlib.sha256(f"{action}\n{raw_time}".encode()).hexdigest()
        deadline = received + AWS_NOTICE_LEAD_S
        t = _parse_iso_utc(raw_time)
        if t is not None:
            deadline = min(deadline, t)
        if action == "hibernate":
            deadline = received  # no 2-minute warning for hibernate (§1.2)
        kind = action if action in ("terminate", "stop", "hibernate") else "terminate"
        return self._offer(
            PreemptionNotice(
                "aws", "node", deadline, key, kind, detail=f"instance-action action={action!r} time={raw_time!r}"
            )
        )

    def _rebalance(self, body: str, received: float) -> PreemptionNotice | None:
        doc = _loads(body, "aws", "events/recommendations/rebalance")
        if not isinstance(doc, dict):
            raise _DetectorError(f"aws: malformed body on events/recommendations/rebalance: {body[:60]!r}")
        if self._rebalance_run:
            return None
        self._rebalance_run = True
        raw = doc.get("noticeTime")
        key = "aws-rebalance-" + hashlib.sha256(str(raw).encode()).hexdigest()[:16]
        return self._offer(
            PreemptionNotice(
                "aws",
                "node",
                received + AWS_NOTICE_LEAD_S,
                key,
                "rebalance",
                is_hint=True,
                detail=f"rebalance recommendation noticeTime={raw!r}",
            )
        )


class GcpMetadataDetector(_Base):
    """GCP Spot/preemptible VMs via ``instance/preempted`` and ``instance/maintenance-event``
    (docs/preemption-notices.md §2.1-2.3; Google "Query the metadata server for maintenance event notices").

    Sends ``Metadata-Flavor: Google`` and requires it back (a proxy or a non-GCE server answering
    is an error).  ``base_url=None`` uses ``$GCE_METADATA_HOST`` (``host[:port]``), else
    ``http://metadata.google.internal``.

    * ``instance/preempted``: body ``FALSE`` = no notice, ``TRUE`` = preempted; anything else is
      malformed.  Deadline ``received + 30 s`` (the best-effort shutdown period, §2.2).  Key
      ``gcp-preempted-<ETag>``.  With ``long_poll_s > 0`` every poll after the first is a
      hanging GET ``?wait_for_change=true&last_etag=E&timeout_sec=ceil(long_poll_s)`` (overall
      bound ``timeout_s + long_poll_s``), which returns at once if the ETag moved.
    * ``instance/maintenance-event`` (read with a plain GET on every poll, from boot, since the
      warning is only given if the key was read since the last event, §2.3):
      ``TERMINATE_ON_HOST_MAINTENANCE`` is a node notice (kind ``terminate``) with deadline
      ``received + 60 s`` (:data:`GCP_MAINTENANCE_NOTICE_S`: GPU VMs get about 1 h, other VMs
      60 s; the shorter one is assumed).  Key ``gcp-maintenance-<ETag>``.  ``NONE`` and
      ``MIGRATE_ON_HOST_MAINTENANCE`` (live migration: the VM survives) are not notices; 404
      (the key is only populated for live-migrating and GPU VMs, §2.3) means no event; any other
      value is malformed.  With long-polling this key is read once per poll, so keep
      ``long_poll_s`` well below 60 s.
    """

    name = "gcp"
    PATH = "/computeMetadata/v1/instance/preempted"
    MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"

    def __init__(
        self,
        base_url: str | None = None,
        *,
        ledger: NoticeLedger,
        timeout_s: float = 2.0,
        long_poll_s: float = 0.0,
        session: requests.Session | None = None,
    ) -> None:
        super().__init__(ledger)
        if base_url is None:
            host = os.environ.get("GCE_METADATA_HOST", "").strip()
            base_url = host if host else "http://metadata.google.internal"
        if "://" not in base_url:
            base_url = "http://" + base_url
        base_url = base_url.rstrip("/")
        if base_url.endswith("/computeMetadata/v1"):
            base_url = base_url[: -len("/computeMetadata/v1")]
        self.base_url = base_url
        self.timeout_s = float(timeout_s)
        self.long_poll_s = max(0.0, float(long_poll_s))
        self.session = _session(session)
        self._etag: str | None = None

    def _get(
        self, path: str, what: str, *, timeout: float | tuple[float, float], params: dict[str, str] | None = None
    ) -> Any:
        resp = _send(
            self.session,
            "gcp",
            "GET",
            self.base_url + path,
            what,
            timeout=timeout,
            params=params,
            headers={"Metadata-Flavor": "Google"},
        )
        if resp.status_code == 404 and path == self.MAINTENANCE_PATH:
            return resp
        if resp.status_code != 200:
            raise _http_error("gcp", resp, what)
        if resp.headers.get("Metadata-Flavor") != "Google":
            raise _DetectorError(
                "gcp: response lacks 'Metadata-Flavor: Google' (not a GCE metadata server, or a proxy answered)"
            )
        return resp

    def poll(self, now_unix_s: float) -> PollResult:
        t0 = time.monotonic()
        params: dict[str, str] | None = None
        timeout: float | tuple[float, float] = self.timeout_s
        if self.long_poll_s > 0 and self._etag is not None:
            wait = max(1, math.ceil(self.long_poll_s))
            params = {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": str(wait)}
            timeout = (self.timeout_s, self.timeout_s + wait)
        notices: list[PreemptionNotice] = []
        try:
            resp = self._get(self.PATH, "instance/preempted", timeout=timeout, params=params)
            value = resp.text.strip().upper()
            if value not in ("TRUE", "FALSE"):
                raise _DetectorError(f"gcp: malformed body on instance/preempted: {resp.text[:60]!r}")
            received = now_unix_s + (time.monotonic() - t0)
            etag = resp.headers.get("ETag")
            self._etag = etag
            if value == "TRUE":
                n = self._offer(
                    PreemptionNotice(
                        "gcp",
                        "node",
                        received + GCP_SHUTDOWN_S,
                        f"gcp-preempted-{etag or 'noetag'}",
                        "preempt",
                        detail=f"instance/preempted=TRUE etag={etag}",
                    )
                )
                if n is not None:
                    notices.append(n)
            t1 = time.monotonic()
            resp = self._get(self.MAINTENANCE_PATH, "instance/maintenance-event", timeout=self.timeout_s)
            if resp.status_code == 200:
                value = resp.text.strip().upper()
                if value not in GCP_MAINTENANCE_VALUES:
                    raise _DetectorError(f"gcp: malformed body on instance/maintenance-event: {resp.text[:60]!r}")
                if value == "TERMINATE_ON_HOST_MAINTENANCE":
                    received = now_unix_s + (t1 - t0)  # when asked: the earlier, safer origin
                    etag = resp.headers.get("ETag")
                    n = self._offer(
                        PreemptionNotice(
                            "gcp",
                            "node",
                            received + GCP_MAINTENANCE_NOTICE_S,
                            f"gcp-maintenance-{etag or 'noetag'}",
                            "terminate",
                            detail=f"instance/maintenance-event={value} etag={etag}",
                        )
                    )
                    if n is not None:
                        notices.append(n)
        except _DetectorError as e:
            self._etag = None  # next poll re-reads plainly before long-polling again
            return self._result(notices, False, str(e))
        return self._result(notices, True, None)


class AzureScheduledEventsDetector(_Base):
    """Azure Spot via Scheduled Events (docs/preemption-notices.md §3; Microsoft "Scheduled Events for Linux VMs").

    ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``.  Events
    of type ``Preempt`` and ``Terminate`` become notices keyed by ``EventId`` (other types are
    maintenance and ignored).  Events whose ``Resources`` do not list this VM's name are
    skipped: events for an availability set or scale-set placement group go to every VM in it
    (§3.2).  The name is ``vm_name`` if given, else learnt once from IMDS
    ``GET /metadata/instance/compute/name?api-version=2021-02-01&format=text`` (same
    ``Metadata: true`` header; Microsoft "Azure Instance Metadata Service", the ``compute``
    category, docs/preemption-notices.md §3.1 sources).  Until the name is known every poll is unhealthy
    and reports no events (a neighbour's eviction must not drain this node).  Deadline: ``Preempt``
    ``min(parse(NotBefore), received + 30 s)``;
    ``Terminate`` ``parse(NotBefore)``; ``EventStatus == "Started"`` or an empty/unparsable
    ``NotBefore`` means now.  :meth:`acknowledge` POSTs ``{"StartRequests":[{"EventId":...}]}``
    (§3.3); call it only after the commit.
    """

    name = "azure"

    def __init__(
        self,
        base_url: str = "http://169.254.169.254",
        *,
        ledger: NoticeLedger,
        vm_name: str | None = None,
        timeout_s: float = 2.0,
        session: requests.Session | None = None,
    ) -> None:
        super().__init__(ledger)
        self.base_url = base_url.rstrip("/")
        self.vm_name = vm_name
        self.timeout_s = float(timeout_s)
        self.session = _session(session)
        self.document_incarnation: int | None = None

    @property
    def url(self) -> str:
        return self.base_url + "/metadata/scheduledevents"

    def _learn_vm_name(self) -> str:
        resp = _send(
            self.session,
            "azure",
            "GET",
            self.base_url + "/metadata/instance/compute/name",
            "instance/compute/name",
            timeout=self.timeout_s,
            params={"api-version": AZURE_IMDS_API_VERSION, "format": "text"},
            headers={"Metadata": "true"},
        )
        if resp.status_code != 200:
            raise _http_error("azure", resp, "instance/compute/name")
        name = resp.text.strip()
        if not _AZURE_VM_NAME.fullmatch(name):
            raise _DetectorError(f"azure: malformed body on instance/compute/name: {resp.text[:60]!r}")
        self.vm_name = name
        log.info("azure: this VM is %r (IMDS compute/name)", name)
        return name

    def poll(self, now_unix_s: float) -> PollResult:
        t0 = time.monotonic()
        notices: list[PreemptionNotice] = []
        try:
            if self.vm_name is None:
                self._learn_vm_name()
            resp = _send(
                self.session,
                "azure",
                "GET",
                self.url,
                "scheduledevents",
                timeout=self.timeout_s,
                params={"api-version": AZURE_API_VERSION},
                headers={"Metadata": "true"},
            )
            if resp.status_code != 200:
                raise _http_error("azure", resp, "scheduledevents")
            received = now_unix_s + (time.monotonic() - t0)
            doc = _loads(resp.text, "azure", "scheduledevents")
            events = doc.get("Events") if isinstance(doc, dict) else None
            if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
                raise _DetectorError(f"azure: malformed body on scheduledevents: {resp.text[:60]!r}")
            self.document_incarnation = doc.get("DocumentIncarnation")
            for ev in events:
                n = self._event(ev, received)
                if n is not None:
                    notices.append(n)
        except _DetectorError as e:
            return self._result(notices, False, str(e))
        return self._result(notices, True, None)

    def _event(self, ev: dict[str, Any], received: float) -> PreemptionNotice | None:
        etype = str(ev.get("EventType", ""))
        if etype not in ("Preempt", "Terminate"):
            return None
        resources = ev.get("Resources") or []
        if not isinstance(resources, list) or str(self.vm_name).lower() not in [str(r).lower() for r in resources]:
            return None
        event_id = str(ev.get("EventId") or "")
        if not event_id:
            raise _DetectorError("azure: malformed body on scheduledevents: event without EventId")
        status = str(ev.get("EventStatus", ""))
        not_before = _parse_rfc1123(ev.get("NotBefore")) if ev.get("NotBefore") else None
        if status == "Started" or not_before is None:
            deadline = received
        elif etype == "Preempt":
            deadline = min(not_before, received + AZURE_PREEMPT_MIN_NOTICE_S)
        else:
            deadline = not_before
        return self._offer(
            PreemptionNotice(
                "azure",
                "node",
                deadline,
                event_id,
                etype.lower(),
                detail=f"{etype} status={status} NotBefore={ev.get('NotBefore')!r}",
            )
        )

    def acknowledge(self, notice: PreemptionNotice) -> None:
        """Approve the event (§3.3). Failures are logged, not raised (the commit is done anyway)."""
        if notice.source != "azure":
            return
        try:
            resp = _send(
                self.session,
                "azure",
                "POST",
                self.url,
                "scheduledevents POST",
                timeout=self.timeout_s,
                params={"api-version": AZURE_API_VERSION},
                headers={"Metadata": "true", "Content-Type": "application/json"},
                data=json.dumps({"StartRequests": [{"EventId": notice.key}]}),
            )
            if resp.status_code != 200:
                raise _http_error("azure", resp, "scheduledevents POST")
        except _DetectorError as e:
            log.warning("azure: acknowledging %s failed: %s", notice.key, e)


class NullDetector(_Base):
    """Cloud ``none`` (reserved nodes, local runs): always healthy, never a notice."""

    name = "none"

    def __init__(self, *, ledger: NoticeLedger | None = None) -> None:
        super().__init__(ledger or NoticeLedger(None))

    def poll(self, now_unix_s: float) -> PollResult:
        return PollResult([], True, None)


def make_detector(
    cloud: str,
    metadata_url: str | None,
    *,
    ledger: NoticeLedger,
    timeout_s: float = 2.0,
    vm_name: str | None = None,
    long_poll_s: float = 0.0,
) -> Detector:
    """Build the detector for ``cloud`` (``aws|gcp|azure|none``); ``metadata_url=None`` = default.

    Raises ``ValueError`` for any other cloud name.
    """
    c = (cloud or "").strip().lower()
    if c == "aws":
        return AwsImdsDetector(metadata_url or "http://169.254.169.254", ledger=ledger, timeout_s=timeout_s)
    if c == "gcp":
        return GcpMetadataDetector(metadata_url, ledger=ledger, timeout_s=timeout_s, long_poll_s=long_poll_s)
    if c == "azure":
        return AzureScheduledEventsDetector(
            metadata_url or "http://169.254.169.254", ledger=ledger, vm_name=vm_name, timeout_s=timeout_s
        )
    if c == "none":
        return NullDetector(ledger=ledger)
    raise ValueError(f"unknown cloud {cloud!r}: expected one of aws, gcp, azure, none")


def sigterm_notice(grace_s: float, now_unix_s: float, *, key: str | None = None) -> PreemptionNotice:
    """SIGTERM to the agent (docs/preemption-notices.md §6): deadline ``now + grace_s`` (pod grace period or
    Slurm GraceTime from config; the signal carries none). ``ValueError`` if ``grace_s`` is not a
    finite number >= 0."""
    if not (math.isfinite(grace_s) and grace_s >= 0):
        raise ValueError(f"grace_s must be a finite number >= 0, got {grace_s}")
    return PreemptionNotice(
        "sigterm",
        "node",
        now_unix_s + grace_s,
        key or f"sigterm-{int(now_unix_s * 1000)}",
        "terminate",
        detail=f"SIGTERM, grace {grace_s:g}s",
    )


def revoke_notice(gpus: list[int], grace_s: float, now_unix_s: float, *, key: str | None = None) -> PreemptionNotice:
    """Per-GPU revocation by a cluster scheduler (docs/preemption-notices.md §6): scope ``gpu:<ids>``
    (sorted, unique), deadline ``now + grace_s``. ``ValueError`` on no GPUs, a negative id or
    a ``grace_s`` that is not a finite number >= 0."""
    ids = sorted({int(g) for g in gpus})
    if not ids or ids[0] < 0:
        raise ValueError(f"gpus must be a non-empty list of GPU indices >= 0, got {gpus!r}")
    if not (math.isfinite(grace_s) and grace_s >= 0):
        raise ValueError(f"grace_s must be a finite number >= 0, got {grace_s}")
    scope = "gpu:" + ",".join(map(str, ids))
    return PreemptionNotice(
        "revoke",
        scope,
        now_unix_s + grace_s,
        key or f"revoke-{scope}-{int(now_unix_s * 1000)}",
        "revoke",
        detail=f"GPU revocation, grace {grace_s:g}s",
    )


NOTICE_STALE_AFTER_S = 30.0


def active_node_notice(
    result: PollResult, now_unix_s: float, *, stale_after_s: float = NOTICE_STALE_AFTER_S
) -> PreemptionNotice | None:
    """The first node-scope, non-hint notice in ``result`` (new or already handled, see
    :attr:`PollResult.known`) that is still active at ``now_unix_s`` (unix seconds), else None.

    A notice is active until ``stale_after_s`` seconds after its deadline: deadlines of
    "now" (AWS ``hibernate``, Azure ``Started``) must still count a moment later, while a
    deadline long past on a VM that still runs is stale (an AWS ``time`` that stays after a
    failed termination, docs/preemption-notices.md §1.2; an action that did not happen).
    """
    for n in [*result.notices, *result.known]:
        if n.scope == "node" and not n.is_hint and now_unix_s <= n.deadline_unix_s + stale_after_s:
            return n
    return None
