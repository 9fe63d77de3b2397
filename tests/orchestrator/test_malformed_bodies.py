"""What Python's json takes but JSON does not (NaN, Infinity, 1e400, lone surrogates, deep nesting) is a
400 from the orchestrator naming the field, as it is from `pdserve serve` (the same parser,
pdserve/server/json_body.py); a logit_bias key the worker cannot read is the worker's 400, passed
through. Each used to be a 500 (or a 502). Real workers, an orchestrator app in a thread."""

from __future__ import annotations

import json

import httpx
import pytest
from harness import MODEL_NAME, AppThread, wait_healthy

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.server.json_body import MAX_DEPTH, MAX_TEXT_VALUES

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = b'"messages": [{"role": "user", "content": "hi"}]'

# (case id, path, raw body, substrings of the message, error.param)
CASES = [
    ("nan", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
     ["'temperature'", "must be a finite number, got NaN"], "temperature"),
    ("infinity", CHAT, b'{"model": "tiny", ' + HI + b', "top_p": Infinity}',
     ["'top_p'", "must be a finite number, got Infinity"], "top_p"),
    ("minus-infinity", COMPLETIONS, b'{"model": "tiny", "prompt": [1, 2], "frequency_penalty": -Infinity}',
     ["'frequency_penalty'", "must be a finite number, got -Infinity"], "frequency_penalty"),
    ("overflow", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}',
     ["'temperature'", "must be a finite number, got 1e400"], "temperature"),
    ("nan-deep-inside", CHAT, b'{"model": "tiny", ' + HI + b', "logit_bias": {"5": NaN}}',
     ["'logit_bias.5'", "finite"], "logit_bias.5"),
    ("surrogate-prompt", COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud800"}',
     ["'prompt'", "not valid Unicode", "\\ud800"], "prompt"),
    ("surrogate-message", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\udfff"}]}',
     ["'messages.0.content'", "not valid Unicode"], "messages.0.content"),
    ("surrogate-model", CHAT, b'{"model": "\\udc00", ' + HI + b'}', ["'model'", "not valid Unicode"], "model"),
    ("surrogate-stop", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "stop": "\\ud800"}',
     ["'stop'", "not valid Unicode"], "stop"),
    ("surrogate-utf8-encoded", COMPLETIONS, b'{"model": "tiny", "prompt": "\xed\xa0\x80"}',
     ["'prompt'", "not valid Unicode"], "prompt"),
    ("nested-too-deeply", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, ["nests too deeply", f"{MAX_DEPTH} levels"],
     None),
    ("nested-too-deeply-unclosed", CHAT, b'{"model": "tiny", "x": ' + b"[" * 100_000, ["nests too deeply"], None),
    ("logit-bias-superscript-digit", COMPLETIONS, '{"model": "tiny", "prompt": [1, 2], "max_tokens": 2, '
                                                  '"logit_bias": {"²": 1}}'.encode(),
     ["logit_bias keys must be token ids"], "logit_bias"),
    ("empty", COMPLETIONS, b"", ["the request body is empty"], None),
    ("integer-of-5000-digits", COMPLETIONS, b'{"model": "tiny", "max_tokens": %s, "prompt": "hi"}' % (b"9" * 5000),
     ["'max_tokens'", "an integer of 5000 digits"], "max_tokens"),
]


def _called(arguments: str) -> bytes:
    """A chat body whose assistant turn (messages[1]) called a tool with these arguments."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return json.dumps({"model": MODEL_NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}).encode()


# Bodies the orchestrator passes on (their JSON is valid) and a worker refuses: a call's arguments, JSON text
# inside a string, read as the body is (issue 51). Each was a worker's 500 (RecursionError, the tokenizer's
# TypeError), so a 502 through the orchestrator.
ARGUMENTS = {"nested-too-deeply": _called("[" * 50_000 + "]" * 50_000),
             "lone-surrogate": _called('{"a": "\\ud800"}'),
             "non-finite": _called('{"a": [1, NaN]}'),
             "too-many-values": _called("[" + "1," * MAX_TEXT_VALUES + "1]")}


@pytest.fixture(scope="module")
def orch(workers):
    cfg = DisaggConfig(context_servers={"urls": [workers[0].url]}, generation_servers={"urls": [workers[1].url]},
                       conditional_disagg={"max_local_prefill_length": 64})
    with AppThread(build_app(cfg)) as app:
        wait_healthy(app.url)
        yield app


@pytest.mark.parametrize("path,body,needles,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_body_is_400_naming_the_field(orch, path, body, needles, param):
    r = httpx.post(orch.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    for needle in needles:
        assert needle in err["message"], err["message"]


@pytest.fixture(scope="module")
def orch_direct(workers):
    """An orchestrator that sends each request straight to a context instance (no /tokenize first)."""
    cfg = DisaggConfig(context_servers={"urls": [workers[0].url]}, generation_servers={"urls": [workers[1].url]})
    with AppThread(build_app(cfg)) as app:
        wait_healthy(app.url)
        yield app


@pytest.mark.parametrize("what", list(ARGUMENTS))
def test_a_body_gets_the_same_400_from_the_orchestrator_as_from_a_worker(workers, orch, orch_direct, what):
    answers = [httpx.post(url + CHAT, content=ARGUMENTS[what], headers={"content-type": "application/json"},
                          timeout=60) for url in (workers[0].url, orch.url, orch_direct.url)]
    worker = answers[0]
    assert worker.status_code == 400 and worker.json()["error"]["param"] == \
        "messages.1.tool_calls.0.function.arguments", worker.text
    for r in answers[1:]:
        assert (r.status_code, r.json()) == (400, worker.json())


def test_still_serves_after_malformed_bodies(orch):
    """A surrogate pair (one valid character) is not a lone surrogate, and the orchestrator keeps serving."""
    body = b'{"model": "%s", "prompt": "\\ud83d\\ude00 hi", "max_tokens": 2, "ignore_eos": true}' % MODEL_NAME.encode()
    r = httpx.post(orch.url + COMPLETIONS, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    metrics = httpx.get(orch.url + "/metrics").text
    assert 'pdserve_orchestrator_client_errors_total{status="400"}' in metrics
    assert 'pdserve_orchestrator_client_errors_total{status="500"}' not in metrics
