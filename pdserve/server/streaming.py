"""An SSE response that releases what it streams, however the exchange ends.

Starlette closes nothing when a client is gone before the first byte: the response start fails
(ASGI 2.4: `send` raises OSError) before the body is iterated, and closing a generator that never
started runs none of its code, `finally` included. `ClosingStreamingResponse` therefore calls its
body's `aclose` itself once the response is over, then `on_close`. `OwnedStream` pairs an SSE body
with the source it reads (the engine's output generator), so that closing it also closes the
source, which aborts the engine request and frees its KV blocks even if the body never ran.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OwnedStream:
    """`body`'s chunks; `aclose` closes `body`, then `source`."""

    def __init__(self, body: AsyncIterator, source: AsyncIterator):
        self.body, self.source = body, source

    def __aiter__(self) -> AsyncIterator:
        return self.body.__aiter__()

    async def aclose(self) -> None:
        try:
            await self.body.aclose()
        finally:
            await self.source.aclose()


class ClosingStreamingResponse(StreamingResponse):
    """text/event-stream over `body`; afterwards `body.aclose()` (when it has one), then `on_close()`."""

    def __init__(self, body, on_close: Callable[[], None] | None = None):
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
