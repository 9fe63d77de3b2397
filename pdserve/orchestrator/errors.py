"""The orchestrator's exceptions: the server's OpenAI-style `APIError` (server/errors.py, which holds
the status -> type table), raised as `OrchestratorError` so the orchestrator's handlers catch its own.

    400 invalid_request_error   the request is not something the orchestrator can split
    401 authentication_error    missing or wrong API key / cluster token
    4xx (a worker's)            passed through unchanged: the client's request was bad
    502 bad_gateway             a worker is unreachable, broke the connection, or failed (5xx)
    503 service_unavailable     no ready instance of a role (the reason names them), with Retry-After
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

    def headers(self) -> dict[str, str]:
        """The response's headers: Retry-After on a 503 that waits for an instance to be (back) up, which a
        client (the OpenAI SDK among them) honours before it tries again."""
        if self.status == 503 and self.code == NO_READY_INSTANCE:
            return {"Retry-After": str(RETRY_AFTER_S)}
        return {}


NO_READY_INSTANCE = "no_ready_instance"
# A restarted instance is routed to at the first health probe (every 2 s by default) after it serves; the
# supervisor's first restart waits 1 s. Sooner would mostly find it still down.
RETRY_AFTER_S = 2


NOT_A_WORKER = "not_a_worker"  # the code an orchestrator answers /v1/disagg_info with
NOT_A_WORKER_MESSAGE = ("this is a pdserve orchestrator, not a worker: list the workers' urls (pdserve serve) in "
                        "context_servers and generation_servers")


class WorkerUnreachable(OrchestratorError):
    """The connection to a worker could not be made: nothing was sent, so another instance may be tried."""
