"""Tool calling through the official openai client on the tiny model: tool_choice "required" and a named
function are enforced by the grammar (the call's name is a tool's, its arguments validate against the tool's
parameters), streamed as OpenAI's tool-call deltas; earlier calls and tool results go back through the chat
template; text that is not a call stays content; malformed tools and tool_choice are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_harness import openai_client, served

from pdserve.server.errors import APIError
from pdserve.engine.guided import Grammars
from pdserve.server.tools.chat import CallStream, call_syntax, parse_calls, render_messages, tool_setup
from pdserve.testing import make_tiny_model
from pdserve.tokenizer import Tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Sum", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A tiny model with room for the tools' description (~650 tokens of its small vocabulary)."""
    return make_tiny_model(tmp_path_factory.mktemp("tools") / "tiny", num_layers=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tool_client(tool_model):
    with served(tool_model, max_model_len=1024, num_kv_blocks=256, tokens_per_block=8) as srv:
        yield openai_client(srv)


def _check(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    assert call.type == "function" and call.id.startswith("call_")
    return args


def test_required_and_named_calls_are_enforced(tool_client):
    reply = tool_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    _check(choice.message.tool_calls[0])
    named = tool_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80,
                                                tool_choice={"type": "function", "function": {"name": "add"}},
                                                temperature=0)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and named.choices[0].finish_reason == "tool_calls"
    _check(call)
    stream = tool_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80,
                                                 tool_choice={"type": "function", "function": {"name": "add"}},
                                                 temperature=0, stream=True)
    calls, reasons = {}, []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                got["id"] = d.id or got["id"]
                got["name"] += (d.function.name or "") if d.function else ""
                got["arguments"] += (d.function.arguments or "") if d.function else ""
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("add", json.loads(
        call.function.arguments))]


def test_a_conversation_with_calls_and_results_goes_on(tool_client):
    first = tool_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                max_tokens=80, temperature=0)
    msg = first.choices[0].message
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in msg.tool_calls]},
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]
    reply = tool_client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                                max_tokens=8, temperature=0)
    assert reply.choices[0].message.tool_calls is None and isinstance(reply.choices[0].message.content, str)


def test_a_template_that_reads_tools_gets_them_and_calls_with_object_arguments():
    """HF chat templates (Qwen's, Llama 3's) write a call's arguments with `| tojson`: they get an object, not
    OpenAI's JSON text, which would be written twice encoded."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]}]
    messages, extra = render_messages(history, tool_setup(TOOLS, "auto", None), "{{ tools }}{{ messages }}")
    assert extra["tools"][1]["function"]["name"] == "add"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'  # the request's untouched
    plain, extra = render_messages(history, tool_setup(TOOLS, "auto", None), "{{ messages }}")
    assert extra == {} and "get_weather" in plain[0]["content"] and '"a": 1' in plain[2]["content"]


@pytest.mark.parametrize("template", ["{{ messages }}", "{{ tool_calls }}{{ messages }}"], ids=["flattened", "as-sent"])
def test_past_arguments_are_read_as_the_body_is(template):
    """A past call's arguments are JSON text: read with the body's bounds, each refusal a 400 naming them (a
    RecursionError and a lone surrogate once decoded were 500s, issue 51); text that is not JSON stays text.
    DeepSeek's templates, which write the text as given, get it unread."""
    def render(arguments: str, template: str = template):
        call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}
        return render_messages(ASK + [{"role": "assistant", "content": "", "tool_calls": [call]}], None, template)[0]

    for bad, why in [("[" * 5000 + "]" * 5000, "nests too deeply"), ('{"a": ["\\ud800"]}', "lone surrogate \\ud800"),
                     ('{"a": 1e999}', "finite")]:
        with pytest.raises(APIError) as e:
            render(bad)
        assert (e.value.status, e.value.param) == (400, "messages.1.tool_calls.0.function.arguments")
        assert why in e.value.message
    assert "not json" in str(render("not json")[1])
    deepseek = "{{ tool_calls }}<｜tool▁sep｜>{{ messages }}"
    assert call_syntax(deepseek) == "deepseek_v31"
    assert render('{"a": "\\ud800"}', deepseek)[1]["tool_calls"][0]["function"]["arguments"] == '{"a": "\\ud800"}'


def test_text_that_is_not_a_call_stays_content():
    assert parse_calls("hello") == ("hello", [])
    broken = 'x <tool_call>\n{"name": "add", "arguments": {</tool_call>'
    assert parse_calls(broken) == (broken, [])
    content, calls = parse_calls('ok <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    assert content == "ok" and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}


@pytest.mark.parametrize("fields,param,why", [
    ({"tools": [{"type": "function", "function": {"parameters": ADD}}]}, "tools.0.function.name", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "distinct"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": ["add"]}}, "tool_choice", "required"),
    ({"tools": TOOLS, "messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "function": "add"}]}]},
     "messages.1.tool_calls.0", "arguments"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "no response_format"),
], ids=["no-name", "not-a-function", "unknown-function", "choice-without-tools", "bad-choice", "duplicate-name",
        "function-not-object", "past-call-malformed", "with-response-format"])
def test_bad_tools_are_400s_naming_the_field(tool_client, fields, param, why):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        tool_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=fields)
    err = e.value.body
    assert err["param"] == param and why in err["message"], err


LLAMA3_TEMPLATE = ('{% if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument '
                   'name and its value}.{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}')


def test_llama3_calls_are_bare_json_enforced_and_parsed(tool_model):
    """A template asking for Llama 3.1's syntax: the grammar forces one bare {"name", "parameters"} object, and
    such an output (after an optional <|python_tag|>) is the call; JSON without parameters stays content."""
    assert call_syntax(LLAMA3_TEMPLATE) == "llama3" and call_syntax("{{ messages }}") == "hermes"
    setup = tool_setup(TOOLS, {"type": "function", "function": {"name": "add"}}, None, LLAMA3_TEMPLATE)
    tokenizer = Tokenizer.from_dir(tool_model)
    grammars = Grammars(tokenizer.backend.to_str(), 512, [2])
    guide = grammars.guide(setup.guided)
    guide.sync(tokenizer.encode('{"name": "add", "parameters": {"a": 3, "b": 4}}', add_special_tokens=False))
    assert guide.matcher.is_accepting()
    content, calls = parse_calls('<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}', "llama3")
    assert content is None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 3, "b": 4}'}
    assert parse_calls('{"name": "Ada", "age": 36}', "llama3") == ('{"name": "Ada", "age": 36}', [])


def _replay(pieces: list[str], syntax_template: str | None = None) -> list[dict]:
    stream = CallStream(tool_setup(TOOLS, "auto", None, syntax_template), 0)
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out += [c.delta.model_dump(exclude_none=True) | ({"finish": c.finish_reason} if c.finish_reason else {})
                for c in stream.chunks(piece, last, "stop" if last else None)]
    return out


def test_streamed_content_goes_out_at_once_and_a_call_as_it_comes():
    """auto: text that cannot start a call is sent as it comes; a tag's first characters are held until they
    turn out to be text or a call; the call goes out as OpenAI's deltas, its name once complete, then its
    arguments (test_tool_syntaxes.py streams them in pieces)."""
    deltas = _replay(["Let me ", "check <to", "ol_call>\n{\"name\": \"add\", ", '"arguments": {"a": 1}}\n</tool_call>'])
    assert [d.get("content") for d in deltas[:2]] == ["Let me ", "check "]  # "<to" held, then the call
    head, args, end = deltas[2:]
    assert head["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert args["tool_calls"][0]["function"]["arguments"] == '{"a": 1}' and end == {"finish": "tool_calls"}
    plain = _replay(["a <b", "r> and <to", "o much"])
    assert "".join(d.get("content", "") for d in plain) == "a <br> and <too much" and plain[-1]["finish"] == "stop"
    assert [d.get("content") for d in plain[:3]] == ["a <b", "r> and ", "<too much"]  # only "<to" was held
    llama = _replay(["  <|python", '_tag|>{"name": "add", "parameters": {}}'], LLAMA3_TEMPLATE)
    assert llama[0]["tool_calls"][0]["function"]["name"] == "add" and llama[-1] == {"finish": "tool_calls"}
    assert _replay(["Sure", ", 2"], LLAMA3_TEMPLATE)[0] == {"content": "Sure"}


def test_auto_streams_text_as_it_comes(tool_client):
    """The tiny model writes no call: its text streams in pieces, equal to the whole answer's."""
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    whole = tool_client.chat.completions.create(**kw).choices[0].message
    pieces = [c.choices[0].delta.content for c in tool_client.chat.completions.create(**kw, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert whole.tool_calls is None and len(pieces) > 3 and "".join(pieces) == whole.content
