"""The coordinator's server shell: sockets, keys, framing and limits — no run logic.

Split the way vLLM V1 separates its engine core from its ZeroMQ I/O: this module owns
the two ROUTER sockets and the ZAP authenticator; the coordinator receives
:class:`Inbound` messages (already authenticated, size-checked and decoded) and sends
replies through :meth:`ControlServer.send`, which never blocks.

Sockets (both CURVE servers, docs/architecture.md §9):

* **public** — ``bind`` (e.g. ``tcp://0.0.0.0:7400``): agents and ``spotlight status``.
  ``ZMQ_MAXMSGSIZE`` (``max_message_bytes``) makes libzmq drop a connection that sends a
  larger frame before the frame is allocated; the msgpack body is bounded again by
  :data:`spotlight.protocol.MAX_BODY_BYTES` before it is parsed.
* **trainer** — loopback ``tcp://127.0.0.1:<random>``: the run's own Train Workers (only
  ``trainer`` keys are served on it); with ``trainer_bind`` (``spotlight up --external-trainers``)
  a routable address instead, with ZeroMQ heartbeats, for ranks that torchrun or srun started
  on other nodes. A weight version arrives on it in WEIGHTS_CHUNK frames of at most
  ``trainer_max_message_bytes``; its receive queue holds only :data:`TRAINER_RCVHWM` messages,
  so a trainer streaming a 40 GB version faster than the coordinator writes it is held back by
  TCP instead of filling the coordinator's memory.

Peers are addressed by the routing id libzmq assigns to each connection (clients never
choose their identity), so a client cannot take over another's replies, and a restarted
agent's new connection simply gets a new routing id (the coordinator then replaces the
old session: the equivalent of ROUTER_HANDOVER without its takeover risk).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import zmq

from spotlight import protocol as P
from spotlight.errors import SpotlightError
from spotlight.net.security import Authenticator, Principal, ServerKeys, apply_server

log = logging.getLogger("spotlight.coordinator.server")

PUBLIC, TRAINER = "public", "trainer"
TRAINER_RCVHWM = 8
"""Messages queued from one trainer before ZeroMQ stops reading its connection."""
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 2000, 30000
"""ZeroMQ (ZMTP) heartbeats of the connections between the coordinator and trainers on other
nodes: a peer that answers no ping for the timeout is disconnected (a host that vanished
without closing its sockets), which a rank's connection monitor sees (the coordinator lost)."""


def set_heartbeats(sock: zmq.Socket) -> None:
    """ZMTP heartbeats on ``sock`` (before connect or bind): :data:`HEARTBEAT_IVL_MS`, :data:`HEARTBEAT_TIMEOUT_MS`."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class Rejected(SpotlightError):
    """A message refused by validation or authorization: the handler raises it before it
    changes anything, and it becomes one ERROR reply with ``code`` (and one log line)."""

    def __init__(self, code: str, message: str, *, retry_after_s: float = 0.0):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclasses.dataclass
class Inbound:
    """One message from an authenticated peer.

    ``error`` is set (and ``mtype``/``body`` are None) when the frames could not be
    decoded; the caller answers it with an ERROR and changes nothing.
    """

    channel: str
    routing_id: bytes
    principal: Principal | None
    mtype: P.MsgType | None
    body: Any
    payload: list
    error: str | None = None
    size_bytes: int = 0


class ControlServer:
    """CURVE ROUTER sockets with an allow-list, bounded input and non-blocking output.

    Args:
        bind: public endpoint (``tcp://HOST:PORT``; port 0 = any free port).
        keys: coordinator key pair and allow-list (:mod:`spotlight.net.security`).
        max_message_bytes: largest frame a public peer may send (bytes).
        send_hwm: messages queued per peer before further replies to it are dropped.
        trainer_max_message_bytes: largest frame a trainer may send (bytes; -1 = no limit);
            the coordinator passes its weight chunk size.
        trainer_bind: where the trainer socket listens (``tcp://HOST:PORT``, port 0 = any free
            port) for ranks on other hosts; None = loopback, for the ranks the coordinator starts.

    Raises:
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(
        self,
        bind: str,
        keys: ServerKeys,
        *,
        max_message_bytes: int = 256 << 20,
        send_hwm: int = 256,
        trainer_max_message_bytes: int = -1,
        trainer_bind: str | None = None,
    ):
        self.keys = keys
        self.ctx = zmq.Context()
        self.auth = Authenticator(self.ctx, keys)
        self.auth.start()
        self.max_message_bytes = int(max_message_bytes)
        self.dropped_sends = 0
        self.describe_peer: Callable[[bytes], str] | None = None
        """Names a peer by its routing id for log lines (set by the control plane: node ids)."""
        self.public = self._router(send_hwm, self.max_message_bytes)
        try:
            if bind.endswith(":0"):
                port = self.public.bind_to_random_port(bind.rsplit(":", 1)[0])
                self.endpoint = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self.public.bind(bind)
                self.endpoint = bind
        except zmq.ZMQError:  # leave no ZAP thread or context behind
            self.public.close(linger=0)
            self.auth.stop()
            self.ctx.term()
            raise
        self.trainer = self._router(16, int(trainer_max_message_bytes))
        self.trainer.setsockopt(zmq.RCVHWM, TRAINER_RCVHWM)
        try:
            self.trainer_endpoint = self._bind_trainer(trainer_bind)
        except zmq.ZMQError:
            self.trainer.close(linger=0)
            self.public.close(linger=0)
            self.auth.stop()
            self.ctx.term()
            raise
        self.poller = zmq.Poller()
        self.poller.register(self.public, zmq.POLLIN)
        self.poller.register(self.trainer, zmq.POLLIN)

    def _bind_trainer(self, bind: str | None) -> str:
        """Bind the trainer socket: loopback on a free port, or ``bind`` with ZeroMQ heartbeats
        (ranks on other hosts; a vanished host's connection is dropped). Returns its endpoint."""
        if bind is None:
            port = self.trainer.bind_to_random_port("tcp://127.0.0.1")
            return f"tcp://127.0.0.1:{port}"
        set_heartbeats(self.trainer)
        host, _, port = bind.rpartition(":")
        if port == "0":
            return f"{host}:{self.trainer.bind_to_random_port(host)}"
        self.trainer.bind(bind)
        return bind

    def _router(self, hwm: int, maxmsg: int) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 1000)
        # a send to a vanished peer raises EHOSTUNREACH instead of vanishing silently; a
        # send to a full peer raises EAGAIN (NOBLOCK): both drop only that peer's reply
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.SNDHWM, hwm)
        s.setsockopt(zmq.MAXMSGSIZE, maxmsg)
        apply_server(s, self.keys)
        return s

    def poll(self, timeout_ms: int, max_messages: int = 256) -> list[Inbound]:
        """Up to ``max_messages`` inbound messages (waits at most ``timeout_ms`` for the first)."""
        out: list[Inbound] = []
        if not self.poller.poll(timeout_ms):
            return out
        for channel, sock in ((TRAINER, self.trainer), (PUBLIC, self.public)):
            for _ in range(max_messages):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                out.append(self._inbound(channel, frames))
        return out

    def _inbound(self, channel: str, frames: list) -> Inbound:
        rid = bytes(frames[0])
        size = sum(len(f) for f in frames[1:])
        principal = None
        if len(frames) > 1:
            try:
                principal = Principal.parse(frames[1].get("User-Id"))
            except Exception:
                principal = None
        try:
            mtype, body, payload = P.decode(frames[1:])
        except P.ProtocolError as exc:
            return Inbound(channel, rid, principal, None, None, [], error=str(exc), size_bytes=size)
        return Inbound(channel, rid, principal, mtype, body, payload, size_bytes=size)

    def send(self, channel: str, routing_id: bytes, msg, frames=None, msg_type=None) -> bool:
        """Queue ``msg`` for one peer without ever blocking.

        Returns:
            False when the reply was dropped: the peer is gone, or it does not read and its
            queue (``send_hwm``) is full. Nobody else's messages are affected.
        """
        sock = self.trainer if channel == TRAINER else self.public
        try:
            sock.send_multipart([routing_id, *P.encode(msg, frames, msg_type=msg_type)], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            self.dropped_sends += 1
            if self.dropped_sends <= 10 or self.dropped_sends % 1000 == 0:
                # a peer that left (a preempted agent) is expected on spot nodes; a full queue is not
                (log.info if exc.errno == zmq.EHOSTUNREACH else log.warning)(
                    "dropped %s to %s peer %s: %s (%d dropped so far)",
                    type(msg).__name__,
                    channel,
                    self.describe_peer(routing_id) if self.describe_peer is not None else "(unnamed)",
                    exc.strerror,
                    self.dropped_sends,
                )
            return False

    def close(self, linger_ms: int = 500) -> None:
        self.public.close(linger=linger_ms)
        self.trainer.close(linger=linger_ms)
        try:
            self.auth.stop()
        except Exception:
            pass
        self.ctx.term()
