"""The orchestrator's exceptions: the server's OpenAI-style `APIError` (server/errors.py, which holds
the status -> type table), raised as `OrchestratorError` so the orchestrator's handlers catch its own.

    400 invalid_request_error   the request is not something the orchestrator can split
    401 authentication_error    missing or wrong API key / cluster token
    4xx (a worker's)            passed through unchanged: the client's request was bad
    502 bad_gateway             a worker is unreachable, broke the connection, or failed (5xx)
    503 service_unavailable     no ready instance of a role (the reason names them)
    504 gateway_timeout         a worker did not answer within request_timeout
"""

from __future__ import annotations

from pdserve.server.errors import APIError


class OrchestratorError(APIError):
    """An `APIError` whose third argument is the code (the orchestrator names a code far more often
    than a param): OrchestratorError(status, message, code, param, type)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(status, message, param, code, type)


NOT_A_WORKER = "not_a_worker"  # the code an orchestrator answers /v1/disagg_info with
NOT_A_WORKER_MESSAGE = ("this is a pdserve orchestrator, not a worker: list the workers' urls (pdserve serve) in "
                        "context_servers and generation_servers")


class WorkerUnreachable(OrchestratorError):
    """The connection to a worker could not be made: nothing was sent, so another instance may be tried."""
