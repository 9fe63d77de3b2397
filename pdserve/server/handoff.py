"""The disaggregated hand-off in its HTTP shape (docs/disaggregation.md).

A context_only answer's `disaggregated_params` is built here from the engine's typed
`ContextResult`, and the `opaque_state` a generation_only request brings back is read here into
what the engine takes (`DisaggInfo.first_gen_logprobs`). The engine never sees the HTTP shape.

    context worker                      orchestrator                      generation worker
    ContextResult ──context_answer_params──> disaggregated_params ──first_gen_logprobs──> DisaggInfo
                                   (opaque_state: base64 of FirstToken's bytes, passed on untouched)
"""

from __future__ import annotations

import base64
import binascii

from pdserve.engine.kv.wire import FirstToken, KVWireError
from pdserve.engine.output import ContextResult
from pdserve.engine.sequence import RequestType, num_answers
from pdserve.server.errors import bad_request


def context_answer_params(result: ContextResult, ctx_info_endpoint: str | None) -> dict:
    """What the generation worker needs, as the context_only answer's `disaggregated_params`. With n > 1,
    `first_gen_tokens` holds every choice's first token in order, and `opaque_state` their logprob entries."""
    firsts = (result.first_token, *result.other_choices)
    packed = FirstToken(firsts[0].token, tuple(e for f in firsts for e in f.logprobs))
    return {
        "request_type": RequestType.GENERATION_ONLY.value, "first_gen_tokens": [f.token for f in firsts],
        "ctx_request_id": result.disagg_request_id, "disagg_request_id": result.disagg_request_id,
        "opaque_state": base64.b64encode(packed.to_bytes()).decode() if packed.logprobs else None,
        "draft_tokens": None, "ctx_dp_rank": 0, "ctx_info_endpoint": ctx_info_endpoint,
    }


def first_gen_logprobs(opaque_state: str | None) -> tuple[dict, ...]:
    """The first tokens' logprob entries (one per choice) that a context worker packed into `opaque_state`
    (none without one)."""
    if not opaque_state:
        return ()
    try:
        return FirstToken.from_bytes(base64.b64decode(opaque_state, validate=True)).logprobs
    except (binascii.Error, KVWireError) as e:
        raise bad_request(f"disaggregated_params.opaque_state is not what a pdserve context worker sent: {e}",
                          "disaggregated_params.opaque_state") from None


def answer_choices(req) -> int:
    """The choices a whole answer to `req` (a completion or chat request) holds: its `n`, but one for a
    context_only request, whose other choices' first tokens ride in its disaggregated_params."""
    d = req.disaggregated_params
    return num_answers(RequestType(d.request_type) if d is not None else RequestType.CONTEXT_AND_GENERATION, req.n)
