"""A prefill/decode proxy for two vLLM servers joined by vLLM's NixlConnector (the peer of `pdserve
disaggregated` in the serving benchmarks).

    python benchmarks/vllm_pd_proxy.py --prefill http://127.0.0.1:8401 --decode http://127.0.0.1:8402 --port 8400

Each /v1/completions or /v1/chat/completions request becomes two:

    client ──> proxy ──1. prompt, max_tokens=1, kv_transfer_params.do_remote_decode=true──> prefill
                     <─── kv_transfer_params (engine id, block ids, side-channel host/port) ──┘
                     ──2. the original request + those kv_transfer_params ──> decode
                     <─── decode's response (SSE streamed through as it comes when stream=true)

The decode server pulls the prompt's KV from the prefill server over NIXL, then generates. The proxy
holds no state. A server that fails comes back as a 502 whose OpenAI-style error body names the
server and the reason; a 4xx from a server is the client's mistake and is passed through unchanged.
"""

from __future__ import annotations

import argparse
import uuid
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# Fields of the client's request that must not reach the prefill hop: it returns one token, not a
# stream, and min_tokens > max_tokens=1 would be rejected.
PREFILL_DROP = ("stream", "stream_options", "min_tokens", "max_completion_tokens")


class UpstreamError(Exception):
    """A server failed (unreachable, 5xx, or a reply without what the next hop needs)."""

    def __init__(self, server: str, reason: str, status: int = 502):
        super().__init__(f"{server} server: {reason}")
        self.status = status


def error_response(message: str, status: int) -> JSONResponse:
    kind = {502: "bad_gateway", 503: "service_unavailable"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in PREFILL_DROP}
    # kv_transfer_params tells vLLM's NixlConnector that another instance decodes this request: the
    # prefill server keeps the KV blocks (for a lease) and answers with where to read them from.
    out |= {"max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    return out


async def read_error(server: str, resp: httpx.Response) -> UpstreamError:
    text = (await resp.aread()).decode(errors="replace")[:2000]
    # 4xx: the request itself is wrong (e.g. prompt longer than max_model_len); pass it through.
    status = resp.status_code if 400 <= resp.status_code < 500 else 502
    return UpstreamError(server, f"HTTP {resp.status_code}: {text}", status)


class Proxy:
    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float):
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        # One long-lived client for both servers; a long read timeout because a queued request may
        # wait minutes for its prefill on a busy CPU server.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def prefill(self, path: str, body: dict, request_id: str) -> dict:
        try:
            resp = await self.client.post(self.prefill_url + path, json=prefill_body(body),
                                          headers={"X-Request-Id": request_id})
        except httpx.HTTPError as e:
            raise UpstreamError("prefill", f"{type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise await read_error("prefill", resp)
        params = resp.json().get("kv_transfer_params")
        if not params:
            raise UpstreamError("prefill", "the reply carries no kv_transfer_params; is the server started "
                                "with --kv-transfer-config '{\"kv_connector\": \"NixlConnector\", ...}'?")
        return params

    async def decode(self, path: str, body: dict, params: dict, request_id: str) -> httpx.Response:
        """Sends the decode hop and returns the response with its body not yet read."""
        req = self.client.build_request("POST", self.decode_url + path, json=body | {"kv_transfer_params": params},
                                        headers={"X-Request-Id": request_id})
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise UpstreamError("decode", f"{type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            err = await read_error("decode", resp)
            await resp.aclose()
            raise err
        return resp

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response("the request body is not JSON", 400)
        # The same id on both hops, so the two servers' logs can be matched.
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            params = await self.prefill(path, body, request_id)
            resp = await self.decode(path, body, params, request_id)
        except UpstreamError as e:
            return error_response(str(e), e.status)
        if body.get("stream"):
            return StreamingResponse(self.relay(resp), media_type="text/event-stream")
        try:
            content = await resp.aread()
        except httpx.HTTPError as e:
            return error_response(f"decode server: {type(e).__name__}: {e}", 502)
        finally:
            await resp.aclose()
        return Response(content, status_code=resp.status_code, media_type="application/json")

    async def relay(self, resp: httpx.Response):
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            # Headers are gone already; end the stream with an error event a client can see.
            yield f'data: {{"error": {{"message": "decode server: {type(e).__name__}", "code": 502}}}}\n\n'.encode()
        finally:
            await resp.aclose()

    async def health(self) -> Response:
        down = []
        for name, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                ok = (await self.client.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(name)
        if down:
            return error_response(f"not healthy: {', '.join(down)} server", 503)
        return Response(status_code=200)


def build_app(proxy: Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await proxy.client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            resp = await proxy.client.get(proxy.decode_url + "/v1/models")
        except httpx.HTTPError as e:
            return error_response(f"decode server: {type(e).__name__}: {e}", 502)
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="base URL of the prefill vLLM server")
    ap.add_argument("--decode", required=True, help="base URL of the decode vLLM server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8400)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait on either server")
    args = ap.parse_args()
    uvicorn.run(build_app(Proxy(args.prefill, args.decode, args.timeout)), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
