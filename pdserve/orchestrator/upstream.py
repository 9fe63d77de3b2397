"""HTTP calls to workers over the process's one pooled httpx.AsyncClient, with failures mapped to
OrchestratorError (see errors.py): the caller never sees an httpx exception."""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import AsyncIterator

import httpx

from pdserve.orchestrator.errors import OrchestratorError, WorkerUnreachable
from pdserve.json_writer import items_at_least, json_dumps

CONNECT_TIMEOUT_S = 5.0
# A body of fewer items (array elements, object members) than this is written on the event loop, a bigger one in a
# worker thread by json_dumps, which leaves the GIL to the loop between items: json's C encoder held it 1.2 s for a
# body of 8 M numbers, and /health with it
_ENCODE_IN_PLACE = 1 << 12


def make_client(request_timeout: float, max_connections: int = 1024,
                worker_api_key: str | None = None, verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    """`worker_api_key`: the workers' own api_key, sent with every call to them; `verify`: the CAs
    trusted for https workers (pdserve/tls.py), else the system's."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections // 4)
    headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else None
    return httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=CONNECT_TIMEOUT_S), limits=limits,
                             trust_env=False, headers=headers, verify=verify)


def _transport_error(role: str, url: str, e: Exception, timeout: float) -> OrchestratorError:
    what = f"{role} server {url}"
    if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
        return WorkerUnreachable(502, f"{what} is unreachable ({type(e).__name__}: {e or 'connection failed'})",
                                 "worker_unreachable")
    if isinstance(e, httpx.TimeoutException):
        return OrchestratorError(
            504, f"{what} sent nothing for request_timeout={timeout:g} s, so the request was cancelled. A "
                 "non-streaming answer must arrive whole within it; for long generations use stream: true (the "
                 "timeout then bounds the wait for each chunk) or raise the orchestrator's request_timeout",
            "worker_timeout")
    return OrchestratorError(502, f"{what} failed mid-request ({type(e).__name__}: {e or 'connection lost'})",
                             "worker_failed")


def _status_error(role: str, url: str, status: int, content: bytes) -> OrchestratorError:
    """A worker's error answer: 4xx passes through (the request was bad), 5xx becomes 502/503."""
    try:
        err = json.loads(content)["error"]
        message, code, param, typ = err["message"], err.get("code"), err.get("param"), err.get("type")
    except (ValueError, KeyError, TypeError):
        message, code, param, typ = content[:300].decode(errors="replace") or "(empty body)", None, None, None
    if 400 <= status < 500:
        return OrchestratorError(status, message, code, param, typ)
    out = 503 if status == 503 else 502
    return OrchestratorError(out, f"{role} server {url} answered {status}: {message}", code or "worker_error")


async def _encoded(body: dict | None, headers: dict | None) -> tuple[bytes | None, dict | None]:
    """`body` as the JSON bytes httpx's json= would send, and the headers with its content type."""
    if body is None:
        return None, headers
    headers = {**(headers or {}), "Content-Type": "application/json"}
    if items_at_least(body, _ENCODE_IN_PLACE) < _ENCODE_IN_PLACE:
        return _dumps(body), headers
    return await asyncio.to_thread(_dumps, body), headers


def _dumps(body: dict) -> bytes:
    return json_dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


async def post_json(http: httpx.AsyncClient, role: str, url: str, path: str, body: dict, timeout: float,
                    headers: dict | None = None) -> dict:
    return await _request_json(http, "POST", role, url, path, body, timeout, headers)


async def get_json(http: httpx.AsyncClient, role: str, url: str, path: str, timeout: float) -> dict:
    return await _request_json(http, "GET", role, url, path, None, timeout)


async def _request_json(http: httpx.AsyncClient, method: str, role: str, url: str, path: str, body: dict | None,
                        timeout: float, headers: dict | None = None) -> dict:
    content, headers = await _encoded(body, headers)
    try:
        r = await http.request(method, url + path, content=content, headers=headers,
                               timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S))
    except httpx.HTTPError as e:
        raise _transport_error(role, url, e, timeout) from None
    if r.status_code != 200:
        raise _status_error(role, url, r.status_code, r.content)
    try:
        data = r.json()
    except ValueError:
        raise OrchestratorError(502, f"{role} server {url} answered {path} with a body that is not JSON",
                                "worker_bad_answer") from None
    if not isinstance(data, dict):
        raise OrchestratorError(502, f"{role} server {url} answered {path} with a non-object", "worker_bad_answer")
    return data


async def open_stream(http: httpx.AsyncClient, role: str, url: str, path: str, body: dict,
                      timeout: float, headers: dict | None = None) -> httpx.Response:
    """POST and return the streaming response once its status is 200 (the caller must aclose it)."""
    content, headers = await _encoded(body, headers)
    req = http.build_request("POST", url + path, content=content, headers=headers,
                             timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S))
    try:
        r = await http.send(req, stream=True)
    except httpx.HTTPError as e:
        raise _transport_error(role, url, e, timeout) from None
    if r.status_code != 200:
        try:
            content = await r.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await r.aclose()
        raise _status_error(role, url, r.status_code, content)
    return r


async def iter_stream(r: httpx.Response, role: str, url: str, timeout: float) -> AsyncIterator[bytes]:
    """The raw SSE bytes; a failure mid-stream raises OrchestratorError (the caller emits an error event)."""
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        raise _transport_error(role, url, e, timeout) from None
