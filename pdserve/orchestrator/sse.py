"""Server-sent events the orchestrator writes itself (the workers' streams pass through untouched)."""

from __future__ import annotations

import json
from typing import AsyncIterator


EVENT_END = b"\n\n"  # the blank line that ends an event (pdserve workers write no \r)


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + EVENT_END


DONE = b"data: [DONE]\n\n"


async def finished_answer_as_stream(answer: dict, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """A complete (non-streaming) answer as the stream a worker would have sent: one content chunk,
    then the usage chunk when asked for, then [DONE]. Used when the context worker's first token
    already finished the request, so no generation worker streams anything."""
    head = {"id": answer.get("id"), "created": answer.get("created"), "model": answer.get("model")}
    choices = []
    for c in answer.get("choices") or []:
        if chat:
            content = (c.get("message") or {}).get("content", "")
            choices.append({"index": c.get("index", 0), "delta": {"role": "assistant", "content": content},
                            "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason"),
                            "stop_reason": c.get("stop_reason")})
        else:
            choices.append({k: c.get(k) for k in ("index", "text", "logprobs", "finish_reason", "stop_reason")})
    obj = "chat.completion.chunk" if chat else "text_completion"
    yield event({**head, "object": obj, "choices": choices, "usage": None})
    if include_usage:
        yield event({**head, "object": obj, "choices": [], "usage": answer.get("usage")})
    yield DONE
