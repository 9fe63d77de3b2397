"""A cap on request bodies, shared by `pdserve serve`, the orchestrator and its coordinator.

Starlette reads a body whole into memory before anything parses it, so without a cap one client can
send a body of any size and the process grows until the kernel kills it. `BodyLimitMiddleware` reads
the body first, up to `max_mb` MiB (the setting `max_request_body_mb`), and hands it on; a body over
the cap is answered with a 413 and never reaches the app. A Content-Length over the cap is refused
before a byte is read (a client that sent `Expect: 100-continue` never sends the body at all). The
rest of a refused body is read and thrown away, up to DRAIN_FACTOR times the cap, so that the client,
still sending, reads the 413 rather than a reset connection; past that the server closes the connection.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from pdserve.server.errors import APIError

DRAIN_FACTOR = 4


class BodyLimitMiddleware:
    """Pure ASGI. Put it inside the auth middleware, so that a 401 still wins over a 413."""

    def __init__(self, app, max_mb: float):
        self.app, self.max_bytes = app, int(max_mb * (1 << 20))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            waits = headers.get(b"expect", b"").lower() == b"100-continue"  # sends nothing unless asked to
            await self._refuse(scope, receive, send, f"{int(declared)} bytes", more=not waits)
            return
        chunks, size, left = [], 0, []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                left = [message]  # the client left: the app sees that as it would have
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes", size,
                                   message.get("more_body", False))
                return
            if not message.get("more_body", False):
                break
        # the body as one message, as Starlette would have joined it
        messages = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}] if chunks else []
        messages += left

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, what: str, read: int = 0, more: bool = True) -> None:
        """Answer 413 after throwing away the rest of the body, within DRAIN_FACTOR times the cap."""
        while more and read <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left: nobody to answer
            read += len(message.get("body", b""))
            more = message.get("more_body", False)
        mib = self.max_bytes / (1 << 20)
        err = APIError(413, f"the request body is {what}, over the limit of {self.max_bytes} bytes ({mib:g} MiB); "
                            "send a smaller request or raise max_request_body_mb", code="request_too_large")
        await JSONResponse(err.body(), status_code=413)(scope, receive, send)
