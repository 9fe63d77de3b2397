"""A big body costs only its own request: it is parsed off the event loop (json_body.parse_json_body), so a
real `pdserve serve` answers /health while it parses 30 MiB of small values, and a list in a request stops
at its first bad item, so millions of bad items are one error, not millions.

Before: 30 MiB of `{}` held /health 5.3 s here (7.0 s in the issue), 30 MiB of `1e308` 2.3 s, and a
30 MiB `"prompt": [{}, ...]` made 23 M validation errors that grew the worker past 20 GB until the kernel
killed it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from pydantic import ValidationError

from pdserve.host import free_port
from pdserve.json_writer import items_at_least, json_dumps
from pdserve.server.json_body import MAX_ARRAYS, MAX_DEPTH, OFFLOAD_BYTES, MalformedBody, parse_json_object
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from pdserve.testing import make_tiny_model
from pdserve.testing.servers import wait_for_health

# The slowest /health allowed while a body is parsed. The issue asks 0.5 s on an idle machine (measured
# 0.22-0.36 s with benchmarks/hostile_bodies.py); the bound leaves room for a loaded test machine and is
# still under what the parse on the event loop cost (2.3-5.3 s).
HEALTH_BOUND_S = 1.0
MIB30 = 30 << 20
BIG = {
    "objects": b'{"model": "tiny", "max_tokens": 1, "pad": [' + b"{}, " * (MIB30 // 4 - 1) + b"{}]}",
    "1e308": b'{"model": "tiny", "max_tokens": 1, "pad": [' + b"1e308, " * (MIB30 // 7 - 1) + b"1e308]}",
}


@pytest.mark.parametrize("raw", [
    b'{"a": NaN}', b'{"a": [1, 1e400]}', b'{"a": "\\ud800"}', b'{"a": [%s]}' % (b"7" * 5000),
    b"[" * 100_000, b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", b"[" * (MAX_ARRAYS + 1),
    b'{"a": [' + b"[], " * MAX_ARRAYS + b"[]]}", b"[1, 2]", b"",
], ids=["nan", "1e400", "surrogate", "huge-int", "deep-unclosed", "depth-65", "arrays-unclosed", "arrays",
        "not-an-object", "empty"])
def test_the_off_loop_parse_refuses_what_the_inline_one_does(raw):
    with pytest.raises(MalformedBody) as inline:
        parse_json_object(raw)
    with pytest.raises(MalformedBody) as yielding:
        parse_json_object(raw, yielding=True)
    assert (inline.value.message, inline.value.param) == (yielding.value.message, yielding.value.param)


def test_the_off_loop_parse_reads_what_the_inline_one_does():
    raw = (b'{"a": [1, -2.5, null, true, "x\\u00e9", {"b": [[3]]}], "c": %s, "d": ' % (b"9" * 4000)
           + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}")
    assert parse_json_object(raw, yielding=True) == parse_json_object(raw)


def test_json_dumps_writes_what_json_dumps_does():
    small = {"a": [1, 2.5, None, True, "é"], "b": {"c": []}}
    big = {"enum": list(range(70_000)), "x": [{"y": "é"}] * 3}
    assert items_at_least(small, 1 << 16) == 8 and items_at_least(big, 1 << 16) >= 1 << 16
    for value in (small, big):
        for kw in ({}, {"ensure_ascii": False}, {"separators": (",", ":"), "sort_keys": True}, {"indent": 2}):
            assert json_dumps(value, **kw) == json.dumps(value, **kw)


def test_json_dumps_of_a_big_value_lets_other_threads_run():
    """A tool schema of megabytes written into a chat template, a body the orchestrator passes on: json's C
    encoder held the GIL throughout (~0.5 s for 4 M numbers here), every other thread, the event loop's
    included, stopped meanwhile."""
    value, gaps, done = {"enum": [1] * (4 << 20)}, [], threading.Event()

    def tick():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        t0 = time.monotonic()
        json_dumps(value)
        took = time.monotonic() - t0
    finally:
        done.set()
        ticker.join()
    assert max(gaps) < 0.25, f"another thread waited {max(gaps):.2f} s while {took:.2f} s of JSON was written"


@pytest.mark.parametrize("model, body", [
    (CompletionRequest, {"model": "m", "prompt": [{}] * 200_000}),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop_token_ids": ["a"] * 200_000}),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop": [1] * 200_000}),
    (ChatCompletionRequest, {"model": "m", "messages": [{}] * 60_000}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [1] * 200_000}]}),
    (DetokenizeRequest, {"tokens": [None] * 200_000}),
], ids=["prompt", "stop_token_ids", "stop", "messages", "content", "tokens"])
def test_a_list_stops_at_its_first_bad_item(model, body):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert e.value.error_count() <= 4  # one per shape a union allows


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("big-bodies")
    model = make_tiny_model(tmp / "tiny", num_layers=2, num_heads=4, num_kv_heads=2)
    port, log = free_port(), tmp / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", str(model), "--port", str(port),
                                 "--served-model-name", "tiny"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, log.read_text, timeout=120)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _health_while_posting(url: str, path: str, body: bytes, pause: float = 0.05) -> tuple[httpx.Response, float, int]:
    """(the answer to `body`, the slowest /health while it was handled, how many /health answered meanwhile)."""
    answer: dict = {}
    sender = threading.Thread(target=lambda: answer.update(r=httpx.post(
        url + path, content=body, headers={"content-type": "application/json"}, timeout=300)))
    slowest, polls = 0.0, 0
    with httpx.Client(timeout=30) as client:
        sender.start()
        while sender.is_alive():
            t0 = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            slowest, polls = max(slowest, time.monotonic() - t0), polls + 1
            time.sleep(pause)
    sender.join()
    return answer["r"], slowest, polls


@pytest.mark.parametrize("what", list(BIG))
def test_health_answers_while_a_30_mib_body_is_parsed(server, what):
    assert len(BIG[what]) > OFFLOAD_BYTES
    r, slowest, polls = _health_while_posting(server, "/v1/completions", BIG[what])
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_field"
    assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.2f} s while the body was parsed"
    assert polls >= 5, "the body was answered too fast to tell"


def _calls(*arguments: str) -> list[dict]:
    """A user's question and an assistant's turn for each of `arguments`, calling a tool with them."""
    calls = ({"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": a}}]}
        for i, a in enumerate(arguments))
    return [{"role": "user", "content": "hi"}, *calls]


# ~24 MB of calls' arguments, JSON text inside strings: the body parses fast, the text inside it did not (built
# when the case runs)
CALLS_24MB = {"numbers": lambda: _calls("[" + "1," * (12 << 20) + "1]"),
              "objects": lambda: _calls('{"a": [' + "{}," * (8 << 20) + "{}]}"),
              "string": lambda: _calls(json.dumps({"a": "fox " * (6 << 20)})),
              "6000-calls": lambda: _calls(*[json.dumps({"a": list(range(800))})] * 6000)}


@pytest.mark.parametrize("what", list(CALLS_24MB))
def test_health_answers_while_24_mb_of_arguments_are_read(server, what):
    """Issue 51: calls' arguments were parsed, written back by the chat template and measured on the event
    loop, which held /health 3-4.5 s here (numbers, objects, 6000 calls; 0.4 s for the one long string). Now a
    text of more values than MAX_TEXT_VALUES is refused before it is parsed, and a large conversation is read
    and rendered in a worker thread."""
    body = json.dumps({"model": "tiny", "max_tokens": 2, "messages": CALLS_24MB[what]()}).encode()
    r, slowest, polls = _health_while_posting(server, "/v1/chat/completions", body, pause=0.02)
    assert r.status_code == 400, r.text
    too_long = what in ("string", "6000-calls")  # read, rendered and refused for the context window
    assert r.json()["error"]["param"] == ("messages" if too_long else "messages.1.tool_calls.0.function.arguments")
    assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.2f} s while the arguments were read"
    assert polls >= 3, "the body was answered too fast to tell"


def test_a_prompt_of_a_million_bad_items_is_one_quick_400(server):
    body = b'{"model": "tiny", "max_tokens": 1, "prompt": [' + b"{}, " * (1 << 18) + b"{}]}"
    t0 = time.monotonic()
    r = httpx.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert time.monotonic() - t0 < 3.0
