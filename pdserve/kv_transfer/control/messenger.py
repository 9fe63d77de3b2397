"""ZeroMQ control plane: one ROUTER listener per rank, DEALER sockets towards peers.

Threads:
* the listener thread owns the ROUTER socket. It decodes a frame, hands the typed message to the
  handler (which only updates session state or enqueues work, never waits on a transfer) and, if
  the handler returns a message, sends it back to the asker. A malformed frame or a handler
  exception is logged and dropped; the listener keeps running.
* any thread may `send` (one DEALER per peer endpoint, guarded by a lock) or `request` (a one-off
  DEALER that waits for the single reply, used for the cached RankInfo exchange). `send` never
  blocks: a DEALER whose connection dropped, or that cannot queue another message, is replaced.
  libzmq does not reconnect a connecting socket after a protocol error (a frame over MAXMSGSIZE, a
  refused handshake); the old socket would swallow or block on every later message.
* `unreachable_for(endpoint)` says how long the DEALER towards a peer has gone without a connection
  (its monitor's HANDSHAKE_SUCCEEDED and DISCONNECTED events): a killed peer's port refuses every
  reconnect, so the receiver learns within peer_lost_ms that a writer it waits on is gone.
* with `heartbeat_ms`, every DEALER pings its peer (ZMTP heartbeats, every heartbeat_ms / 4) and
  drops a connection that answers nothing for heartbeat_ms. Without it, a peer that stopped (a
  frozen process or host, a network cut without a reset) keeps its TCP connection up in the kernel's
  eyes and looks connected; with it, the link drops, and the reconnect never completes a handshake
  (a stopped process's kernel still accepts the TCP connection, but nobody answers the greeting).

Every socket is made by `_socket`, which sets, before it binds or connects:
* MAXMSGSIZE = `max_message_bytes`. libzmq reads a frame's length first and disconnects a peer that
  announces more, so an oversized frame is never buffered. Our own messages over the bound fail at
  the sender, naming the key to raise.
* with a `cluster_token`, CURVE: every member derives the same keypair from the token
  (`CurveKeys.from_token`). The ROUTER is a CURVE server whose ZAP handler accepts only that public
  key; every DEALER is a CURVE client of it. A peer without the token never completes the
  handshake, so none of its frames reach the handler; the listener logs that a peer failed
  authentication (at most once per `_AUTH_LOG_INTERVAL_S`: a refused peer reconnects every 100 ms).
  Without a token the sockets keep ZeroMQ's NULL mechanism.

KV bytes never travel here.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from pdserve.kv_transfer.control.messages import Message, ProtocolError, decode
from pdserve.kv_transfer.errors import KVTransferError

logger = logging.getLogger(__name__)

Handler = Callable[[Message], "Message | None"]

# The largest legitimate messages are a RankInfoReply (every rank's RankInfo: ~8.5 MB for 128 ranks
# with 64 KiB agent descriptors) and a REQUEST_DATA (8 bytes per block: ~8.4 MB for a 1M-token
# prompt at one token per block). Typical ones are a few KB (the tests' largest: ~1.2 KB).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20

_POLL_MS = 50
_AUTH_LOG_INTERVAL_S = 10.0
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_KEY_DOMAIN = b"pdserve kv control plane curve key v1\0"


@dataclass(frozen=True)
class CurveKeys:
    """The one CURVE keypair (z85) of a cluster: server key and every client key alike, so holding
    the token is holding the key."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def from_token(cls, token: str) -> CurveKeys:
        if not token:
            raise ValueError("cache_transceiver_config.cluster_token must not be empty")
        if not zmq.has("curve"):
            raise ValueError("cache_transceiver_config.cluster_token needs libzmq with CURVE, and this one has none "
                             "(zmq.has('curve') is False): install pyzmq's wheel, which bundles it")
        secret = z85.encode(hashlib.sha256(_KEY_DOMAIN + token.encode()).digest())
        return cls(zmq.curve_public(secret), secret)


class _OnlyClusterKey:
    """ZAP credentials provider: a CURVE client is let in only with the cluster's public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


def _handshake_failure(event: dict, secured: bool) -> str | None:
    """Why a peer failed the handshake, said from this side; None when that says nothing about
    tokens (without one, a port scan or an HTTP probe also breaks off the ZMTP handshake)."""
    kind, value = event["event"], event["value"]
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"its CURVE key is not the cluster_token's (ZAP status {int(value)})"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "it has no cluster_token" if secured else "it has a cluster_token and this side has none"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "its cluster_token is not this side's"
    if not secured:
        return None
    return (f"it broke off the handshake ({zmq.Event(kind).name}, {int(value)}): "
            "it has no or another cluster_token, or is no pdserve peer")


_monitor_ids = itertools.count()


def _monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A socket monitor on an address of its own: pyzmq's default names it after the socket's file
    descriptor, which a closed socket may hand to a new one before its monitor's address is free."""
    return sock.get_monitor_socket(events, addr=f"inproc://pdserve-kv-monitor-{next(_monitor_ids)}")


class _Link:
    """A DEALER towards one peer, its monitor, and what the monitor has told about the connection."""

    EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.monitor = _monitor(sock, self.EVENTS)
        self.connected = False  # a ZMTP handshake succeeded, and no disconnect since
        self.since = time.monotonic()  # when `connected` last changed (or the link opened)
        self.dropped = False  # lost a connection: replaced before the next send

    def update(self) -> None:
        """Read the monitor's events (never waits)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.since = True, time.monotonic()
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected, self.since, self.dropped = False, time.monotonic(), True

    def close(self) -> None:
        _close_monitored(self.sock, self.monitor)


def _close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    sock.disable_monitor()  # frees the monitor's inproc address, which a later socket may reuse
    monitor.close()
    sock.close()


class Messenger:
    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0, name: str = "kv", *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, cluster_token: str | None = None,
                 heartbeat_ms: int | None = None) -> None:
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
        if heartbeat_ms is not None and heartbeat_ms < 1:
            raise ValueError(f"heartbeat_ms must be > 0, got {heartbeat_ms}")
        self.max_message_bytes = max_message_bytes
        self.heartbeat_ms = heartbeat_ms
        self._keys = CurveKeys.from_token(cluster_token) if cluster_token is not None else None
        self._handler = handler
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        if self._keys is not None:  # the ZAP handler must be up before the first handshake
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", _OnlyClusterKey(self._keys.public))
        try:
            self._router = self._socket(zmq.ROUTER)
            self._monitor = _monitor(self._router, _HANDSHAKE_FAILED)
            self._router.bind(f"tcp://{host}:{port if port else '*'}")
        except zmq.ZMQError:
            self._release_context()
            raise
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dealers: dict[str, _Link] = {}  # endpoint -> the DEALER towards it
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self.dropped_messages = 0
        self.auth_failures = 0
        self._auth_unreported = 0
        self._auth_log_after = 0.0
        self._thread = threading.Thread(target=self._listen, name=f"{name}-control", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, endpoint: str, message: Message) -> None:
        """Queue `message` to the peer listening at `endpoint` (fire-and-forget, ordered per endpoint)."""
        data = self._checked(message)
        with self._send_lock:
            link = self._dealers.get(endpoint)
            if link is not None:
                link.update()
            if link is None or link.dropped:
                link = self._open_dealer(endpoint)
            try:
                link.sock.send(data, zmq.NOBLOCK)
            except zmq.Again:  # no connection left, or SNDHWM messages queued that the peer never took
                logger.warning("control messages to %s are not being taken; reconnecting", endpoint)
                self._open_dealer(endpoint).sock.send(data, zmq.NOBLOCK)

    def unreachable_for(self, endpoint: str) -> float:
        """Seconds the DEALER towards `endpoint` has gone without a connection: since it lost one, or
        since it was opened if it never made one (a killed peer's port refuses every attempt). 0 while
        connected, and for an endpoint this side never sent to."""
        with self._send_lock:
            link = self._dealers.get(endpoint)
            if link is None:
                return 0.0
            link.update()
            return 0.0 if link.connected else time.monotonic() - link.since

    def _open_dealer(self, endpoint: str) -> _Link:
        """A fresh DEALER towards `endpoint` (closing the old one): never blocks, its queue is empty."""
        old = self._dealers.pop(endpoint, None)
        if old is not None:
            old.close()
        sock = self._socket(zmq.DEALER)  # on any error below, close() still closes it with the context
        link = self._dealers[endpoint] = _Link(sock)
        sock.connect(endpoint)
        return link

    def request(self, endpoint: str, message: Message, timeout_s: float) -> Message:
        """Send `message` and wait for the single reply. Raises TimeoutError naming the endpoint, or
        ConnectionRefusedError when the peer refuses the handshake (cluster_token mismatch)."""
        data = self._checked(message)
        sock = self._socket(zmq.DEALER)
        try:
            monitor = _monitor(sock, _HANDSHAKE_FAILED)
        except zmq.ZMQError:
            sock.close()
            raise
        try:
            sock.connect(endpoint)
            sock.send(data)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                ready = dict(poller.poll(max(1, int(left * 1000))))
                if sock in ready:
                    return decode(sock.recv())
                if monitor in ready:
                    reason = (_handshake_failure(recv_monitor_message(monitor), self._keys is not None)
                              or "it broke off the handshake: has it a cluster_token and this side none?")
                    raise ConnectionRefusedError(
                        f"control handshake with {endpoint} failed, {reason}; every instance needs the same "
                        "cache_transceiver_config.cluster_token")
            raise TimeoutError(f"no reply to {message.TYPE.name} from {endpoint} within {timeout_s} s")
        finally:
            _close_monitored(sock, monitor)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._send_lock:
            for link in self._dealers.values():
                link.close()
            self._dealers.clear()
        self._release_context()

    def _release_context(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)  # closes any socket an error left open, so this never waits on one

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if kind == zmq.DEALER and self.heartbeat_ms is not None:
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, self.heartbeat_ms // 4))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_ms)
        if self._keys is not None:
            sock.curve_secretkey = self._keys.secret
            sock.curve_publickey = self._keys.public
            if kind == zmq.ROUTER:
                sock.curve_server = True
            else:
                sock.curve_serverkey = self._keys.public
        return sock

    def _checked(self, message: Message) -> bytes:
        data = message.to_bytes()
        if len(data) > self.max_message_bytes:
            raise KVTransferError(
                f"{message.TYPE.name} is {len(data)} bytes, over the control plane's bound of "
                f"{self.max_message_bytes}: raise cache_transceiver_config.max_control_message_mb on every instance")
        return data

    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if self._monitor in ready:
                    reason = _handshake_failure(recv_monitor_message(self._monitor), self._keys is not None)
                    if reason is not None:
                        self._on_auth_failure(reason)
                if self._router in ready:
                    self._dispatch(self._router.recv_multipart())
        finally:
            _close_monitored(self._router, self._monitor)

    def _on_auth_failure(self, reason: str) -> None:
        self.auth_failures += 1
        self._auth_unreported += 1
        now = time.monotonic()
        if now < self._auth_log_after:
            return
        logger.warning("control listener %s: a peer failed authentication and is refused, %s%s", self.endpoint,
                       reason, f" ({self._auth_unreported} failures since the last report)"
                       if self._auth_unreported > 1 else "")
        self._auth_unreported = 0
        self._auth_log_after = now + _AUTH_LOG_INTERVAL_S

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.dropped_messages += 1
            logger.warning("control listener %s dropped a frame with %d parts", self.endpoint, len(frames))
            return
        identity, payload = frames
        try:
            message = decode(payload)
        except ProtocolError as exc:
            self.dropped_messages += 1
            logger.warning("control listener %s rejected a message: %s", self.endpoint, exc)
            return
        try:
            reply = self._handler(message)
        except Exception:
            self.dropped_messages += 1
            logger.exception("control listener %s: handler failed on %s", self.endpoint, message.TYPE.name)
            return
        if reply is None:
            return
        try:
            self._router.send_multipart([identity, self._checked(reply)])
        except KVTransferError as exc:
            self.dropped_messages += 1
            logger.error("control listener %s cannot answer %s: %s", self.endpoint, message.TYPE.name, exc)
