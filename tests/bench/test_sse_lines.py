"""The bench client reads an SSE stream line by line where the SSE spec ends lines, and nowhere else.

Regression: a plan check's sweep (bf16, 4 req/s) lost a request as "malformed SSE event: Unterminated
string": the generated text held a character that str.splitlines takes for a line end (httpx's
aiter_lines splits like it), and the event's JSON was cut in two. The server here is a plain HTTP server
on a real socket that writes such a stream in pieces; what is under test is the client's reading.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.runner import EndpointConfig, stream_one
from pdserve.bench.workload import WorkloadRequest

# Raw in JSON strings (JSON escapes only U+0000-U+001F), line ends to str.splitlines.
TEXTS = ["a\u2028b", "c\x85d", "e\u2029f"]


def _events() -> bytes:
    out = b""
    for text in TEXTS:
        chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
        out += b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
    usage = {"id": "x", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": len(TEXTS)}}
    return out + b"data: " + json.dumps(usage).encode() + b"\r\n\r\n" + b"data: [DONE]\n\n"


class _Stream(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = _events()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for i in range(0, len(body), 7):  # pieces that end mid-event and mid-character
            self.wfile.write(body[i:i + 7])
            self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def sse_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_an_event_whose_text_holds_a_unicode_line_separator_is_one_event(sse_url):
    async def run() -> RequestRecord:
        ep = EndpointConfig(base_url=sse_url, model="m", request_timeout_s=30)
        req = WorkloadRequest(index=0, prompt=[1, 2, 3, 4], prompt_len=4, output_len=len(TEXTS))
        async with httpx.AsyncClient(timeout=30) as client:
            return await stream_one(client, ep, req, RequestRecord(0, 4, len(TEXTS)), 0.0)

    record = asyncio.run(run())
    assert record.error == "" and record.success
    assert record.output_tokens == len(TEXTS) and len(record.itl) == len(TEXTS) - 1
