"""The orchestrator's one exception, returned to the client as an OpenAI-style error body.

    400 invalid_request_error   the request is not something the orchestrator can split
    401 authentication_error    missing or wrong API key / cluster token
    4xx (a worker's)            passed through unchanged: the client's request was bad
    502 bad_gateway             a worker is unreachable, broke the connection, or failed (5xx)
    503 service_unavailable     no ready instance of a role (the reason names them)
    504 gateway_timeout         a worker did not answer within request_timeout
"""

from __future__ import annotations

from dataclasses import dataclass

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 500: "internal_error", 502: "bad_gateway",
          503: "service_unavailable", 504: "gateway_timeout"}


@dataclass
class OrchestratorError(Exception):
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    type: str | None = None  # a worker's own error type, kept when its error is passed through

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type or _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class WorkerUnreachable(OrchestratorError):
    """The connection to a worker could not be made: nothing was sent, so another instance may be tried."""
