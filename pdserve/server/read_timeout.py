"""A read timeout for every HTTP listener (`pdserve serve`, the orchestrator, its coordinator).

uvicorn waits for a request's headers and body as long as the client keeps the connection open: a
client sending its headers a byte a second holds a connection (and its memory) for as long as it likes,
and a few thousand such clients exhaust the process's file descriptors. `ReadTimeoutProtocol` is
uvicorn's h11 protocol with one timer per connection that enforces, with T = `client_read_timeout_s`:

* headers: a request's line and headers are complete within T of the connection opening, or of the
  first byte of a later request on a kept-alive connection (an idle kept-alive connection is
  uvicorn's `timeout_keep_alive`'s to close). Otherwise the client gets a 408 `request_timeout` and
  the connection is closed.
* body: no more than T passes between two reads of the body, unless the server itself stopped
  reading (flow control, while the app has not taken what it has). Otherwise the connection is
  closed; the app sees the client leave, as it would on a dropped connection.

Once the request has been read, nothing is timed here: a response may stream for as long as it takes.
"""

from __future__ import annotations

import json
import logging
import time
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

_LOG_EVERY_S = 60.0  # a slow-client flood is one warning a minute, with its count


def http_protocol(client_read_timeout_s: float) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...) for this timeout."""
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout_s": float(client_read_timeout_s)})


class ReadTimeoutProtocol(H11Protocol):
    read_timeout_s: ClassVar[float] = 30.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        now = self.loop.time()
        self._request_since = self._last_read = now  # when the headers' clock started; the latest read
        self._kept_alive = False  # idle after a response, before the next request's first byte
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._check)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        if self._kept_alive:
            self._kept_alive = False
            self._request_since = self._last_read
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._kept_alive = True
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        super().connection_lost(exc)

    def _check(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        now, state = self.loop.time(), self.conn.their_state
        if state is h11.IDLE and not self._kept_alive:
            left = self._request_since + self.read_timeout_s - now
            if left <= 0:
                self._refuse_slow_headers()
                return
        elif state is h11.SEND_BODY and not self.flow.read_paused:
            left = self._last_read + self.read_timeout_s - now
            if left <= 0:
                _note_slow_client(self.client, "body", self.read_timeout_s)
                self.transport.close()
                return
        elif state in (h11.IDLE, h11.SEND_BODY, h11.DONE):
            left = self.read_timeout_s  # kept alive, paused by us, or answering: nothing to time yet
        else:
            return  # closed or broken: h11 and uvicorn end the connection
        self._read_timer = self.loop.call_later(max(left, 0.01), self._check)

    def _refuse_slow_headers(self) -> None:
        _note_slow_client(self.client, "headers", self.read_timeout_s)
        body = json.dumps({"error": {
            "message": f"the request's headers did not arrive within {self.read_timeout_s:g} s "
                       "(client_read_timeout_s); send the whole request at once",
            "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


_last_note = {"at": 0.0, "count": 0}


def _note_slow_client(client, what: str, timeout_s: float) -> None:
    _last_note["count"] += 1
    now = time.monotonic()
    if now - _last_note["at"] < _LOG_EVERY_S:
        return
    log.warning("closed %d connection(s) whose request %s did not arrive within %g s (client_read_timeout_s); "
                "the latest from %s", _last_note["count"], what, timeout_s, client)
    _last_note.update(at=now, count=0)
