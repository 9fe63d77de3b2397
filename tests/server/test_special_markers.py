"""Tool-call markers that a tokenizer makes special tokens (Llama 3.1's <|python_tag|>, Hermes-2-Pro's <tool_call>)
stay in the output text of a request whose tools are parsed, so its calls are found; every other special token is
still left out, and `skip_special_tokens: false` (vLLM's field) keeps them all.

The model is a tiny random-weight one whose tokenizer.json renames some of its reserved special tokens to every
syntax's markers (<tool_call>, </tool_call>, <|python_tag|>, DeepSeek's <｜tool▁...｜>). A grammar (tool_choice
required's, or vLLM's `structured_outputs` in Lark with llguidance's `<[id]>` token references) makes it write the
special token ids, as a trained model does."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_calls import WEATHER, tool_client  # noqa: F401 (a fixture, over this module's tool_model)
from test_tool_syntaxes import LLAMA3, TEMPLATES
from test_tool_syntaxes import TOOLS as ALL_TOOLS

from pdserve.engine.guided import Grammars
from pdserve.server.tools.chat import SYNTAXES, tool_setup
from pdserve.testing import make_tiny_model
from pdserve.testing.tiny import EOS_TOKEN_ID
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

MARKERS = tuple(dict.fromkeys(m for syntax in SYNTAXES.values() for m in syntax.markers))
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                  "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather?"}]


def _mark_special(model_dir) -> None:
    """Rename the last reserved special tokens of the tiny tokenizer to MARKERS (special, as in those checkpoints)."""
    path = model_dir / "tokenizer.json"
    spec = json.loads(path.read_text())
    reserved = [t for t in spec["added_tokens"] if t["content"].startswith("<|reserved_")]
    for token, text in zip(reserved[-len(MARKERS):], MARKERS):
        assert token["special"]
        token["content"] = text
    path.write_text(json.dumps(spec, ensure_ascii=False))


@pytest.fixture(scope="module")
def marked_dir(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("marked") / "m", num_layers=1, vocab_size=1024)
    _mark_special(model)
    return model


@pytest.fixture(scope="module")
def tok(marked_dir) -> Tokenizer:
    return Tokenizer.from_dir(marked_dir)


def _ids(tok: Tokenizer) -> tuple[int, int, int]:
    """(<tool_call>, </tool_call>, a special token that is no marker)."""
    return tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>"), tok.token_to_id("<|reserved_0|>")


def test_kept_markers_stay_and_other_special_tokens_go(tok):
    kept = tuple(tok.special_token_ids(SYNTAXES["hermes"].markers).values())
    assert kept == _ids(tok)[:2]
    tag = "<|python_tag|>"
    assert tok.special_token_ids((tag, "no such token", "a")) == {tag: tok.token_to_id(tag)}
    text = 'a<tool_call>\n{"x": 1}\n</tool_call><|reserved_0|>b'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == 'a\n{"x": 1}\nb'  # the default: every special token left out
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, keep_special=kept) == 'a<tool_call>\n{"x": 1}\n</tool_call>b'
    assert tok.decode(ids, skip_special_tokens=False, keep_special=kept) == text


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_incremental_deltas_join_to_the_decode_with_kept_ids(tok, data):
    """Whatever the ids and however they arrive, the streamed text adds up to the full decode, with the markers
    kept, with every special token kept, and with none (multi-byte characters split over tokens included)."""
    kept = tuple(tok.special_token_ids(MARKERS).values())
    pool = [*kept, EOS_TOKEN_ID, *_ids(tok)[2:], *tok.encode("é日🙂 ab{\"x\": 1}\n", add_special_tokens=False)]
    ids = data.draw(st.lists(st.sampled_from(pool) | st.integers(3, 500), max_size=24))
    prompt = tok.encode("<|im_start|>assistant\n<tool_call>", add_special_tokens=False)
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tok, prompt, skip, kept)
    text, i = "", 0
    while i < len(ids):
        n = data.draw(st.integers(1, 3))
        text += detok.step(ids[i:i + n])
        i += n
    assert text + detok.flush() == tok.decode(ids, skip, kept)
    assert detok.fork(prompt).keep_special == frozenset(kept)


def _call_grammar(tok: Tokenizer) -> str:
    """A special token that is no marker, then one Hermes call between the special <tool_call> and </tool_call>."""
    open_, close, other = _ids(tok)
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    return f'start: <[{other}]> <[{open_}]> "\\n" body "\\n" <[{close}]>\nbody: %json {json.dumps(call)}\n'


@pytest.fixture(scope="module")
def tool_model(marked_dir):
    """The model test_tool_calls' served `tool_client` serves here."""
    return marked_dir


def _streamed_calls(stream) -> tuple[dict, str, str | None]:
    calls, content, reason = {}, "", None
    for chunk in stream:
        for c in chunk.choices:
            reason = c.finish_reason or reason
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
    return calls, content, reason


def test_a_call_between_special_markers_comes_back_as_tool_calls(tool_client, tok):
    kw = dict(model="tiny", messages=ASK, tools=WEATHER_TOOL, tool_choice="auto", max_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"grammar": _call_grammar(tok)}})
    choice = tool_client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None  # the other special token is left out
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, content, reason = _streamed_calls(tool_client.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls" and content == ""
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    # a moved stream (resume, as the orchestrator sends it) goes on from the marker the lost instance sent
    resume = {"token_ids": list(_ids(tok)[2:]) + [_ids(tok)[0]], "sent_chars": 0}
    moved = tool_client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "resume": resume}},
                                                stream=True)
    assert _streamed_calls(moved) == (calls, "", "tool_calls")


def test_skip_special_tokens_false_keeps_them_all_and_the_default_drops_them(tool_client, tok):
    open_, close, other = _ids(tok)
    grammar = f'start: "x" <[{open_}]> "y" <[{other}]> "z" <[{close}]>'
    kw = dict(model="tiny", prompt="hi", max_tokens=20, temperature=0)
    so = {"structured_outputs": {"grammar": grammar}}
    assert tool_client.completions.create(**kw, extra_body=so).choices[0].text == "xyz"
    everything = "x<tool_call>y<|reserved_0|>z</tool_call>"
    off = {**so, "skip_special_tokens": False}
    assert tool_client.completions.create(**kw, extra_body=off).choices[0].text == everything
    stream = tool_client.completions.create(**kw, extra_body=off, stream=True)
    assert "".join(c.choices[0].text for c in stream) == everything
    # a moved stream counts the characters its client has in the same text, special tokens and all
    sent = "x<tool_call>"
    resume = {"token_ids": tok.encode(sent, add_special_tokens=False), "sent_chars": len(sent)}
    moved = tool_client.completions.create(**kw, extra_body={**off, "resume": resume}, stream=True)
    assert "".join(c.choices[0].text for c in moved) == everything[len(sent):]
    # a chat request without tools keeps no markers; with skip_special_tokens false it keeps every special token
    chat = dict(model="tiny", messages=ASK, max_tokens=20, temperature=0)
    assert tool_client.chat.completions.create(**chat, extra_body=so).choices[0].message.content == "xyz"
    assert tool_client.chat.completions.create(**chat, extra_body=off).choices[0].message.content == everything


@pytest.mark.parametrize("syntax", ("hermes", "qwen3_xml", "deepseek_v3", "deepseek_v31", "llama3"))
def test_the_required_grammar_writes_special_markers_as_their_tokens(marked_dir, tok, syntax):
    """tool_choice required's grammar takes the calls as the syntax writes them, encoded by a tokenizer that makes
    the markers special tokens (as the model's own past calls are, and as a model trained on them writes them)."""
    setup = tool_setup(ALL_TOOLS, "required", None, TEMPLATES.get(syntax, LLAMA3 if syntax == "llama3" else None), tok)
    assert setup.syntax == syntax
    assert set(setup.kept_special_ids) == {tok.token_to_id(m) for m in SYNTAXES[syntax].markers}
    grammars = Grammars(tok.backend.to_str(), 1024, [EOS_TOKEN_ID])
    guide = grammars.guide(setup.guided)
    calls = [("get_weather", {"city": "paris", "days": 3}), ("add", {"a": 1, "b": 2})][:1 if syntax == "llama3" else 2]
    ids = tok.encode(SYNTAXES[syntax].write_calls(calls), add_special_tokens=False)
    assert set(ids) & set(setup.kept_special_ids) or syntax == "llama3"  # (Llama 3.1's calls have no marker)
    guide.sync(ids)
    assert guide.matcher.is_accepting()


def test_required_calls_through_special_markers_stream_and_not(tool_client):
    kw = dict(model="tiny", messages=ASK, tools=WEATHER_TOOL, tool_choice="required", parallel_tool_calls=False,
              max_tokens=200, temperature=0)
    choice = tool_client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, content, reason = _streamed_calls(tool_client.chat.completions.create(**kw, stream=True))
    assert (calls, content, reason) == ({0: {"name": "get_weather", "arguments": call.function.arguments}}, "",
                                        "tool_calls")
