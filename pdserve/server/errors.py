"""The OpenAI-style error: the one exception the server raises (mapped to a body by app.py) and the
base of the orchestrator's (orchestrator/errors.py), with one status -> type table for both.

    400 invalid_request_error   malformed JSON, missing field, wrong type, bad value, prompt too long
                                (405, 413 and 415 too, and any status not listed here)
    401 authentication_error    missing or wrong API key (or cluster token)
    403 permission_error        raised by no pdserve code; a passed-on 403 that names no type
    404 not_found_error         unknown model (code "model_not_found", as OpenAI does) or route; a
                                generation_only request whose context instance holds no such KV
                                (code "kv_not_found")
    409 conflict_error          a second in-flight request with the same disagg_request_id
    500 internal_error          anything else; the message names the exception, never a traceback
    502 bad_gateway             the orchestrator: a worker is unreachable, broke the connection or failed
    503 service_unavailable     the engine's step loop died, the instance is draining, a generation_only
                                request's KV transfer failed; the orchestrator: no ready instance
    504 gateway_timeout         the orchestrator: a worker did not answer within request_timeout

When each status is used: docs/server.md and docs/orchestrator.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
         415: "invalid_request_error", 500: "internal_error", 502: "bad_gateway", 503: "service_unavailable",
         504: "gateway_timeout"}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str | None = None  # another server's own error type, kept when its error is passed on

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        # A plain dict, not the pydantic ErrorResponse: a passed-on error keeps whatever JSON its
        # server sent in code and param.
        return {"error": {"message": self.message, "type": self.type or TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
