"""Every bad input gets its 4xx with an OpenAI-style body and a message that says what is wrong;
afterwards the server still answers correctly and no KV block is leaked."""

from __future__ import annotations

import pytest
from server_harness import MAX_MODEL_LEN, NUM_KV_BLOCKS, wait_kv_baseline

from pdserve.server.json_body import (
    MAX_DEPTH,
    MAX_TEXT_VALUES,
    MalformedBody,
    parse_json_object,
    parse_json_text,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_COMPLETION = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                 "ignore_eos": True}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def completion(**changes):
    body = {**OK_COMPLETION, **changes}
    return {k: v for k, v in body.items() if v is not ...}


def chat(**changes):
    body = {**OK_CHAT, **changes}
    return {k: v for k, v in body.items() if v is not ...}


def called(arguments: str) -> list[dict]:
    """A conversation whose assistant turn (messages[1]) called a tool with these arguments."""
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


ARGUMENTS = "messages.1.tool_calls.0.function.arguments"
LONG_IDS = list(range(3, 3 + MAX_MODEL_LEN + 10))

# (case id, path, JSON body or raw bytes, status, substrings the message must contain, error.param)
CASES = [
    ("malformed-json", COMPLETIONS, b'{"model": "tiny", "prompt": ', 400, ["not valid JSON"], None),
    ("body-not-object", COMPLETIONS, b'["tiny"]', 400, ["JSON object"], None),
    ("missing-model", COMPLETIONS, completion(model=...), 400, ["missing required field 'model'"], "model"),
    ("missing-prompt", COMPLETIONS, completion(prompt=...), 400, ["missing required field 'prompt'"], "prompt"),
    ("missing-messages", CHAT, chat(messages=...), 400, ["missing required field 'messages'"], "messages"),
    ("missing-message-role", CHAT, chat(messages=[{"content": "hi"}]), 400, ["'messages.0.role'"], "messages.0.role"),
    ("max-tokens-string", COMPLETIONS, completion(max_tokens="5"), 400, ["'max_tokens'", "integer", "'5'"],
     "max_tokens"),
    ("max-tokens-bool", COMPLETIONS, completion(max_tokens=True), 400, ["'max_tokens'", "integer"], "max_tokens"),
    ("temperature-string", COMPLETIONS, completion(temperature="hot"), 400, ["'temperature'", "number"],
     "temperature"),
    ("prompt-wrong-type", COMPLETIONS, completion(prompt=[1, "a"]), 400,
     ["'prompt'", "expected one of str, list[int]", "[1, 'a']"], "prompt"),
    ("messages-empty", CHAT, chat(messages=[]), 400, ["'messages'", "at least 1"], "messages"),
    # refused before validating and rendering them: 800 K of them held the event loop 6.6 s
    ("messages-too-many", CHAT, chat(messages=[{"role": "user", "content": "a"}] * 65537), 400,
     ["'messages'", "at most 65536 messages are allowed, got 65537"], "messages"),
    ("tokenize-messages-too-many", "/tokenize", {"messages": [{"role": "user", "content": "a"}] * 65537}, 400,
     ["at most 65536 messages"], "messages"),
    ("messages-not-list", CHAT, chat(messages="hi"), 400, ["'messages'"], "messages"),
    ("unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, ["messages.0.role", "wizard"],
     "messages.0.role"),
    ("prompt-over-context", COMPLETIONS, completion(prompt=LONG_IDS), 400,
     [f"maximum context length is {MAX_MODEL_LEN}", f"{len(LONG_IDS)} tokens"], "prompt"),
    ("prompt-plus-max-tokens-over-context", COMPLETIONS, completion(prompt=LONG_IDS[:100], max_tokens=50), 400,
     [f"maximum context length is {MAX_MODEL_LEN}", "150 tokens"], "max_tokens"),
    ("chat-over-context", CHAT, chat(messages=[{"role": "user", "content": "fox " * 200}]), 400,
     ["maximum context length"], "messages"),
    # a megabyte is refused by its length alone, not after seconds of encoding with the event loop held
    ("prompt-megabyte", COMPLETIONS, completion(prompt="fox " * (1 << 18)), 400,
     [f"maximum context length is {MAX_MODEL_LEN}", "at least", f"{1 << 20} characters"], "prompt"),
    ("chat-megabyte", CHAT, chat(messages=[{"role": "user", "content": "fox " * (1 << 18)}]), 400,
     [f"maximum context length is {MAX_MODEL_LEN}", "at least"], "messages"),
    ("max-tokens-zero", COMPLETIONS, completion(max_tokens=0), 400, ["max_tokens must be an integer >= 1, got 0"],
     "max_tokens"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-3), 400, ["max_tokens", "-3"], "max_tokens"),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, ["max_completion_tokens must be", ">= 1"],
     "max_completion_tokens"),
    ("temperature-negative", COMPLETIONS, completion(temperature=-1), 400, ["temperature must be in [0, 100]"],
     "temperature"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, ["top_p must be in (0, 1]"], "top_p"),
    # Found by schemathesis (test_serve_schema_fuzz.py): an empty message list reached the chat template, a 500.
    ("tokenize-empty-messages", "/tokenize", {"messages": []}, 400, ["'messages'", "at least 1"], "messages"),
    ("top-k-zero", COMPLETIONS, completion(top_k=0), 400, ["top_k must be -1"], "top_k"),
    ("min-p-above-one", COMPLETIONS, completion(min_p=2.0), 400, ["min_p must be in [0, 1]"], "min_p"),
    ("repetition-penalty-zero", COMPLETIONS, completion(repetition_penalty=0), 400, ["repetition_penalty"],
     "repetition_penalty"),
    ("logprobs-too-many", COMPLETIONS, completion(logprobs=50), 400, ["logprobs must be in [0, 20]"], "logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=3), 400, ["top_logprobs needs logprobs=true"],
     "top_logprobs"),
    ("too-many-stops", COMPLETIONS, completion(stop=[f"s{i}" for i in range(20)]), 400, ["at most 16 stop strings"],
     None),
    ("empty-stop-string", COMPLETIONS, completion(stop=[""]), 400, ["non-empty strings"], "stop"),
    ("n-zero", CHAT, chat(n=0), 400, ["n must be an integer in [1, 128]"], "n"),
    ("n-too-many", COMPLETIONS, completion(n=129), 400, ["n must be an integer in [1, 128]"], "n"),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400,
     ["only allowed with stream=true"], "stream_options"),
    ("best-of-two", COMPLETIONS, completion(best_of=2), 400, ["best_of must be 1"], "best_of"),
    ("echo", COMPLETIONS, completion(echo=True), 400, ["echo=true is not supported"], "echo"),
    ("min-tokens-over-max-tokens", COMPLETIONS, completion(max_tokens=4, min_tokens=5), 400,
     ["min_tokens must be an integer in [0, max_tokens=4]"], "min_tokens"),
    ("presence-penalty-too-large", CHAT, chat(presence_penalty=2.5), 400, ["presence_penalty must be in [-2, 2]"],
     "presence_penalty"),
    ("frequency-penalty-too-small", COMPLETIONS, completion(frequency_penalty=-3), 400,
     ["frequency_penalty must be in [-2, 2]"], "frequency_penalty"),
    ("logit-bias-not-a-token-id", CHAT, chat(logit_bias={"hello": 5}), 400, ["logit_bias keys must be token ids"],
     "logit_bias"),
    ("logit-bias-out-of-vocab", COMPLETIONS, completion(logit_bias={str(10**6): 5}), 400,
     ["logit_bias token ids must be in"], "logit_bias"),
    ("stop-token-id-out-of-vocab", COMPLETIONS, completion(stop_token_ids=[10**6]), 400,
     ["stop_token_ids must be in"], "stop_token_ids"),
    ("stop-token-id-negative", CHAT, chat(stop_token_ids=[-1]), 400, ["stop_token_ids must be in"], "stop_token_ids"),
    # the engine's refusals name their field too (they were sent with no param)
    ("prompt-nested-empty", COMPLETIONS, completion(prompt=[[]]), 400, ["prompt is empty"], "prompt"),
    # past int64, as vLLM refuses it: before, the sampler folded 2**63 onto seed 0's stream
    ("seed-past-int64", COMPLETIONS, completion(seed=1 << 63), 400, ["'seed'", "less than"], "seed"),
    ("seed-below-int64", CHAT, chat(seed=-(1 << 63) - 1), 400, ["'seed'", "greater than or equal"], "seed"),
    ("logit-bias-too-strong", COMPLETIONS, completion(logit_bias={"5": 500}), 400,
     ["logit_bias values must be in [-100, 100]"], "logit_bias"),
    ("empty-prompt", COMPLETIONS, completion(prompt=""), 400, ["prompt is empty"], "prompt"),
    ("batched-prompts", COMPLETIONS, completion(prompt=["a", "b"]), 400, ["one prompt per request"], "prompt"),
    ("token-id-out-of-vocab", COMPLETIONS, completion(prompt=[1, 2, 10**6]), 400, ["prompt token ids must be in"],
     "prompt"),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, ["only text parts", "image_url"], "messages"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), 400, ["function.name must be"],
     "tools.0.function.name"),
    ("unknown-model", COMPLETIONS, completion(model="gpt-9"), 404, ["'gpt-9' does not exist", "'tiny'"], "model"),
    ("unknown-model-chat", CHAT, chat(model="gpt-9"), 404, ["'gpt-9' does not exist"], "model"),
    # Python's json takes what JSON does not: each used to reach the engine or the tokenizer (a 500).
    ("logit-bias-superscript-digit", COMPLETIONS, completion(logit_bias={"\u00b2": 1}), 400,
     ["logit_bias keys must be token ids"], "logit_bias"),
    ("logit-bias-more-digits-than-int-takes", CHAT, chat(logit_bias={"9" * 5000: 1}), 400,
     ["logit_bias keys must be token ids"], "logit_bias"),
    *[(f"non-finite-{name}", path, body, 400, [f"'{param}'", "must be a finite number", literal], param)
      for name, path, body, param, literal in [
          ("nan", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature", "NaN"),
          ("infinity", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
           "top_p", "Infinity"),
          ("minus-infinity", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "presence_penalty": -Infinity}',
           "presence_penalty", "-Infinity"),
          ("overflow", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}', "temperature", "1e400"),
          ("in-logit-bias", CHAT, (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                   b'"logit_bias": {"5": NaN}}'), "logit_bias.5", "NaN"),
          ("in-unknown-field", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "extra": [1, NaN]}', "extra.1", "NaN"),
      ]],
    # past int()'s digit limit: the field, not a hint to call sys.set_int_max_str_digits()
    ("integer-of-5000-digits", COMPLETIONS, b'{"model": "tiny", "prompt": [1, %s]}' % (b"9" * 5000), 400,
     ["'prompt.1'", "an integer of 5000 digits (at most 4300)"], "prompt.1"),
    ("negative-integer-of-5000-digits", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "seed": -%s}' % (b"9" * 5000),
     400, ["'seed'", "5000 digits"], "seed"),
    *[(f"lone-surrogate-{name}", path, body, 400, [f"'{param}'", "not valid Unicode", "lone surrogate"], param)
      for name, path, body, param in [
          ("prompt", COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
          ("prompt-utf8-encoded", COMPLETIONS, b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', "prompt"),
          ("model", COMPLETIONS, b'{"model": "ti\\udfffny", "prompt": "hi"}', "model"),
          ("stop", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "stop": ["a", "\\udc00"]}', "stop.1"),
          ("message", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud800"}]}',
           "messages.0.content"),
          ("message-part", CHAT, (b'{"model": "tiny", "messages": [{"role": "user", "content": '
                                  b'[{"type": "text", "text": "\\udbff"}]}]}'), "messages.0.content.0.text"),
          ("tokenize", "/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
      ]],
    # A call's arguments are JSON text in a string: read as the body is (issue 51). Before, a RecursionError and
    # the tokenizer's TypeError were 500s, and 8 M values held the event loop seconds
    *[(f"arguments-{name}", path, {"messages": called(arguments)} if path == "/tokenize"
       else chat(messages=called(arguments)), 400, [f"'{ARGUMENTS}'", *needles], ARGUMENTS)
      for name, path, arguments, needles in [
          ("nested-too-deeply", CHAT, "[" * 50_000 + "]" * 50_000, ["nests too deeply", f"{MAX_DEPTH} levels"]),
          ("nested-65-levels", CHAT, "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), ["nests too deeply"]),
          ("lone-surrogate", CHAT, '{"a": "\\ud800"}', ["(at a in its JSON)", "lone surrogate \\ud800"]),
          ("lone-surrogate-in-a-name", CHAT, '{"b": [{"\\udc00x": 1}]}', ["at b.0 in its JSON",
                                                                          "lone surrogate \\udc00"]),
          ("lone-surrogate-tokenize", "/tokenize", '["\\udfff"]', ["lone surrogate \\udfff"]),
          ("nan", CHAT, '{"a": NaN}', ["must be a finite number, got NaN"]),
          ("too-many-values", CHAT, "[" + "1," * MAX_TEXT_VALUES + "1]",
           [f"{MAX_TEXT_VALUES + 1} arrays, objects and commas", f"at most {MAX_TEXT_VALUES}"]),
          ("too-deep-unclosed-tokenize", "/tokenize", "[" * 2000, ["nests too deeply"]),
      ]],
    ("nested-too-deeply", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400,
     ["nests too deeply", f"{MAX_DEPTH} levels"], None),
    ("nested-too-deeply-in-a-field", CHAT, b'{"model": "tiny", "x": ' + b"[" * 100_000 + b"}", 400,
     ["nests too deeply"], None),
    ("empty-body", COMPLETIONS, b"", 400, ["the request body is empty"], None),
    ("opaque-state-not-from-a-context-worker", COMPLETIONS,
     completion(disaggregated_params={"request_type": "generation_only", "disagg_request_id": 5,
                                      "first_gen_tokens": [7], "ctx_info_endpoint": "tcp://127.0.0.1:9",
                                      "opaque_state": "not base64!"}),
     400, ["opaque_state is not what a pdserve context worker sent"], "disaggregated_params.opaque_state"),
]



@pytest.mark.parametrize("path,body,status,needles,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_with_clear_message(http, path, body, status, needles, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"], err["message"]
    assert err["param"] == param
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert "Traceback" not in r.text


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_is_taken_whatever_its_content_type(http, content_type):
    """`curl -d '{...}'` sends the form type, some clients none: the body is still the JSON object it is
    (as the orchestrator takes it). Before, FastAPI passed it on as bytes, and the client was told its
    body "must be a JSON object"."""
    import json

    headers = {"content-type": content_type} if content_type else {}
    r = http.post(COMPLETIONS, content=json.dumps(OK_COMPLETION).encode(), headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == http.post(COMPLETIONS, json=OK_COMPLETION).json()["choices"][0]["text"]
    bad = http.post(COMPLETIONS, content=b'{"model": "tiny", "prompt": NaN}', headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text  # still strict


def test_integers_at_and_past_the_digit_limit():
    """Integers are parsed by json's own code unless the body holds a run of digits past int()'s limit
    (4300): the check is one scan of the body, and a run inside a string only costs the careful parse."""
    limit = 4300
    assert parse_json_object(b'{"a": [1, %s]}' % (b"7" * limit))["a"][1] == int("7" * limit)
    with pytest.raises(MalformedBody, match=f"an integer of {limit + 1} digits"):
        parse_json_object(b'{"a": [1, -%s]}' % (b"7" * (limit + 1)))
    assert parse_json_object(b'{"a": "%s", "b": 12}' % (b"7" * (limit + 1))) == {"a": "7" * (limit + 1), "b": 12}


def test_json_text_in_a_field_is_read_as_the_body_is():
    """parse_json_text: the body's refusals, each naming the field, plus a bound on the arrays, objects and commas
    outside strings (counted before parsing, as they cost json's C code, which holds the GIL, time to parse and
    to write back); text that is not JSON is an invalid_json refusal that a caller may take as text."""
    field = "messages.1.tool_calls.0.function.arguments"
    assert parse_json_text('{"a": [1, "\\u00e9", null]}', field) == {"a": [1, "\u00e9", None]}
    assert parse_json_text('"' + "," * (MAX_TEXT_VALUES + 1) + '"', field) == "," * (MAX_TEXT_VALUES + 1)
    assert len(parse_json_text("[" + "1," * (MAX_TEXT_VALUES - 1) + "1]", field)) == MAX_TEXT_VALUES
    for text, code, why in [("[" * 50_000, "invalid_body", "nests too deeply"),
                            ('{"a": "\\udbff"}', "invalid_value", "lone surrogate \\udbff"),
                            ('{"a": -Infinity}', "invalid_value", "got -Infinity"),
                            ("[%s]" % ("9" * 5000), "invalid_value", "an integer of 5000 digits"),
                            ("[" + "{}," * (MAX_TEXT_VALUES // 2) + "{}]", "invalid_value", f"{MAX_TEXT_VALUES + 2} arrays"),
                            ("[1, 2", "invalid_json", "not valid JSON")]:
        with pytest.raises(MalformedBody) as e:
            parse_json_text(text, field)
        assert (e.value.param, e.value.code) == (field, code) and f"'{field}'" in e.value.message
        assert why in e.value.message, e.value.message


def test_unknown_route_and_method_are_openai_errors(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    r = http.get(COMPLETIONS)
    assert r.status_code == 405 and "error" in r.json()


def test_server_still_serves_and_no_kv_leak_after_bad_inputs(http):
    """Runs after the parametrized cases (file order): the same greedy request answers identically,
    streaming works, and every KV block is free again."""
    first = http.post(COMPLETIONS, json=OK_COMPLETION)
    assert first.status_code == 200
    for path, body, *_ in CASES:
        http.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
            else http.post(path, json=body)
    again = http.post(COMPLETIONS, json=OK_COMPLETION)
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert again.json()["usage"]["completion_tokens"] == 8
    with http.stream("POST", CHAT, json={**OK_CHAT, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    m = wait_kv_baseline(http)
    assert m["pdserve_kv_cache_blocks_free"] == NUM_KV_BLOCKS
    assert m["pdserve_num_requests_running"] == 0 and m["pdserve_num_requests_waiting"] == 0
