"""The one exception the serving layer raises, mapped to an OpenAI-style error body by app.py.

Status codes (documented in docs/server.md):
    400 invalid_request_error   malformed JSON, missing field, wrong type, bad value, prompt too long
    401 authentication_error    missing or wrong API key
    404 not_found_error         unknown model (code "model_not_found", as OpenAI does) or route
    409 conflict_error          a second in-flight request with the same disagg_request_id
    503 service_unavailable     a generation_only request whose KV transfer failed
    503 service_unavailable     the engine's step loop died (the reason is in the message)
    500 internal_error          anything else; the message names the exception, never a traceback
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          500: "internal_error", 503: "service_unavailable"}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=_TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
