"""ZeroMQ control plane: one ROUTER listener per rank, DEALER sockets towards peers.

Threads:
* the listener thread owns the ROUTER socket. It decodes a frame, hands the typed message to the
  handler (which only updates session state or enqueues work, never waits on a transfer) and, if
  the handler returns a message, sends it back to the asker. A malformed frame or a handler
  exception is logged and dropped; the listener keeps running.
* any thread may `send` (one DEALER per peer endpoint, guarded by a lock) or `request` (a one-off
  DEALER that waits for the single reply, used for the cached RankInfo exchange).

KV bytes never travel here.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import zmq

from pdserve.kv_transfer.control.messages import Message, ProtocolError, decode

logger = logging.getLogger(__name__)

Handler = Callable[[Message], "Message | None"]

_POLL_MS = 50


class Messenger:
    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0, name: str = "kv") -> None:
        self._handler = handler
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(f"tcp://{host}:{port if port else '*'}")
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dealers: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self.dropped_messages = 0
        self._thread = threading.Thread(target=self._listen, name=f"{name}-control", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, endpoint: str, message: Message) -> None:
        """Queue `message` to the peer listening at `endpoint` (fire-and-forget, ordered per endpoint)."""
        data = message.to_bytes()
        with self._send_lock:
            sock = self._dealers.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                self._dealers[endpoint] = sock
            sock.send(data)

    def request(self, endpoint: str, message: Message, timeout_s: float) -> Message:
        """Send `message` and wait for the single reply; raises TimeoutError naming the endpoint."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send(message.to_bytes())
            if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise TimeoutError(f"no reply to {message.TYPE.name} from {endpoint} within {timeout_s} s")
            return decode(sock.recv())
        finally:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._send_lock:
            for sock in self._dealers.values():
                sock.close()
            self._dealers.clear()
        self._ctx.term()

    def _listen(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._router.poll(_POLL_MS, zmq.POLLIN):
                    continue
                frames = self._router.recv_multipart()
                self._dispatch(frames)
        finally:
            self._router.close()

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
        if reply is not None:
            self._router.send_multipart([identity, reply.to_bytes()])
