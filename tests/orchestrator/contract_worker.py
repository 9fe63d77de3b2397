"""A worker that speaks only the disaggregation contract (docs/disaggregation.md) and records what it
was sent. It isolates the orchestrator's split logic from the engine and the KV transfer, which the
tests using it are not about; test_disagg_flow.py runs the same flow against real workers."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

GEN_TEXT = ["A", "B", "C"]
FIRST_TOKEN = 504
CTX_REQUEST_ID = 17


def contract_worker(name: str, behaviour: dict) -> tuple[FastAPI, list[dict]]:
    """`behaviour` may hold: delay_s (before every answer), die_mid_stream (bool), context_error_after_s
    (a context_only request fails with a 500 after that long), hold_stream_s (a stream waits that long
    before its first chunk). Returns the app and the list of request bodies it received; a stream the
    caller closed early is recorded as {"closed_stream": True}."""
    app = FastAPI()
    received: list[dict] = []

    def completion(text: str, finish: str | None, params) -> dict:
        return {"id": f"cmpl-{name}", "object": "text_completion", "created": int(time.time()), "model": "tiny",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": {"prompt_tokens": 5, "completion_tokens": len(text), "total_tokens": 5 + len(text),
                          "prompt_tokens_details": {"cached_tokens": 16 if params else 0}},
                "disaggregated_params": params}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        received.append(body)
        await asyncio.sleep(behaviour.get("delay_s", 0))
        dp = body.get("disaggregated_params") or {}
        if dp.get("request_type") == "context_only":
            if "context_error_after_s" in behaviour:
                await asyncio.sleep(behaviour["context_error_after_s"])
                return JSONResponse({"error": {"message": "prefill failed", "type": "internal_error"}}, 500)
            if body.get("stream"):
                return JSONResponse({"error": {"message": "stream with context_only", "type": "x"}}, 400)
            if body.get("max_tokens") == 1:
                return completion("A", "length", None)
            return completion("A", "length", {
                "request_type": "generation_only", "first_gen_tokens": [FIRST_TOKEN], "ctx_request_id": CTX_REQUEST_ID,
                "disagg_request_id": dp["disagg_request_id"], "opaque_state": None, "draft_tokens": None,
                "ctx_dp_rank": 0, "ctx_info_endpoint": "tcp://127.0.0.1:1"})
        if not body.get("stream"):
            return completion("".join(GEN_TEXT), "length", None)

        async def sse():
            try:
                await asyncio.sleep(behaviour.get("hold_stream_s", 0))
            except asyncio.CancelledError:
                received.append({"closed_stream": True})
                raise
            for i, t in enumerate(GEN_TEXT):
                chunk = {"id": f"cmpl-{name}", "object": "text_completion", "created": 0, "model": "tiny",
                         "choices": [{"index": 0, "text": t, "logprobs": None,
                                      "finish_reason": "length" if i == len(GEN_TEXT) - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                if behaviour.get("die_mid_stream"):
                    raise RuntimeError("the generation worker died")
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 256}]}

    @app.get("/v1/disagg_info")
    async def disagg_info():
        return {"model": "tiny", "tokens_per_block": 8, "ctx_info_endpoint": "tcp://127.0.0.1:1",
                "kv_events_endpoint": None, "backend": "shm", "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1, "max_model_len": 256}

    return app, received
