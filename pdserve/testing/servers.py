"""Test support for HTTP services: an ASGI app served in a thread, and waiting for a server process."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from typing import Callable

import httpx
import uvicorn

from pdserve.server.read_timeout import http_protocol


class ClientGoneBeforeFirstByte:
    """ASGI wrapper: a streaming (text/event-stream) answer's response start fails the way it does once
    the client has hung up (ASGI 2.4: `send` raises OSError), so the body is never iterated. Every
    other message passes through."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}

        async def gone(message):
            headers = dict(message.get("headers") or [])
            if message["type"] == "http.response.start" and headers.get(b"content-type", b"").startswith(
                    b"text/event-stream"):
                raise OSError("the client hung up")
            await send(message)

        await self.app(scope, receive, gone)


class UvicornThread:
    """Serve an ASGI app on a free loopback port from a daemon thread; `with` starts and stops it. It reads
    requests as pdserve's own listeners do (read_timeout.py)."""

    def __init__(self, app, name: str = "uvicorn", client_read_timeout_s: float = 30.0):
        self.name = name
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                                    http=http_protocol(client_read_timeout_s)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"{name}-{self.port}")

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start within 20 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        assert not self.thread.is_alive(), f"{self.name} did not stop within 10 s"


def wait_for_health(url: str, proc: subprocess.Popen, log: Callable[[], str], timeout: float = 60.0) -> None:
    """Until `url`/health answers 200; fails with the process's log if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server process exited early:\n{log()}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer /health within {timeout:.0f} s"
        time.sleep(0.1)
