"""The tool-call syntaxes of the families the model issues added (server/tools/): Qwen3.5's
XML-style calls, DeepSeek-V3's and DeepSeek-V3.1's. Per syntax: a chat template is told apart by its text, a
finished output is read into calls (text that is no call, or a malformed call, stays content; XML values become
their schema's types), a streamed output's deltas add up to exactly the non-streamed calls wherever the text is
cut (hypothesis), and `tool_choice: required` on a tiny random-weight model of the family, served by pdserve with
a chat template of that syntax, answers calls that parse and validate, streamed and not, through the official
openai client."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import openai_client, served
from test_tool_calls import ADD, WEATHER

from pdserve.engine.guided import Grammars
from pdserve.server.tools.partial_json import INCOMPLETE, value_end
from pdserve.server.tools.chat import SYNTAXES, CallStream, call_syntax, parse_calls, render_messages, tool_setup
from pdserve.testing import make_tiny_model
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3
from pdserve.tokenizer import Tokenizer

NOTE = {"type": "object", "properties": {"text": {"type": "string"},
                                         "tags": {"type": "array", "items": {"type": "string"}},
                                         "urgent": {"type": "boolean"}, "score": {"type": "number"},
                                         "due": {"type": ["string", "null"]}}, "required": ["text"]}
PARAMS = {"get_weather": WEATHER, "add": ADD, "note": NOTE}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": p}} for n, p in PARAMS.items()]
ASK = [{"role": "user", "content": "Weather?"}]
NEW = ("qwen3_xml", "deepseek_v3", "deepseek_v31")

# Short templates of our own that ask for each syntax the way the family's own templates do (the markers
# call_syntax looks for: <function= and <parameter=; <｜tool▁sep｜> with or without a ```json fence).
XML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n{% for t in tools %}{{ t.function.name }}: "
    "{{ t.function.parameters | tojson }}\n{% endfor %}To call one, reply so:\n<tool_call>\n<function=NAME>\n"
    "<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}\n<tool_call>\n"
    "<function={{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_DEEPSEEK = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% elif m.content is none %}<｜Assistant｜><｜tool▁calls▁begin｜>{% for c in m.tool_calls %}CALL{% endfor %}"
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% else %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
DEEPSEEK_V3_TEMPLATE = _DEEPSEEK.replace("CALL", (  # arguments written as given: JSON text, as DeepSeek's do
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    "{{ c.function.name + '\\n```json\\n' + c.function.arguments + '\\n```' }}<｜tool▁call▁end｜>"))
DEEPSEEK_V31_TEMPLATE = _DEEPSEEK.replace("CALL", (
    "<｜tool▁call▁begin｜>{{ c.function.name + '<｜tool▁sep｜>' + c.function.arguments }}<｜tool▁call▁end｜>"))
LLAMA3 = '{% if tools %}<|python_tag|>{{ tools | tojson }}{% endif %}{{ messages }}'
TEMPLATES = {"qwen3_xml": XML_TEMPLATE, "deepseek_v3": DEEPSEEK_V3_TEMPLATE, "deepseek_v31": DEEPSEEK_V31_TEMPLATE}


def test_each_template_asks_for_its_syntax():
    for name, template in TEMPLATES.items():
        assert call_syntax(template) == name
    assert call_syntax("{{ messages }}") == "hermes"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tool-syntax-tok") / "tiny", num_layers=1)


@pytest.mark.parametrize("syntax", NEW + ("hermes", "llama3"))
def test_the_grammar_takes_what_the_syntax_writes(tiny_dir, syntax):
    """The grammar of `required` holds the calls as the syntax writes (and reads) them: text values, arrays,
    booleans and numbers too, two calls where the syntax has room for them."""
    grammars = Grammars(Tokenizer.from_dir(tiny_dir).backend.to_str(), 512, [2])
    tokenizer = Tokenizer.from_dir(tiny_dir)
    calls = [("note", {"text": "two\nlines </p>", "tags": ["a"], "urgent": False, "score": 2.5}),
             ("get_weather", {"city": "paris", "days": 3})][:1 if syntax == "llama3" else 2]
    setup = tool_setup(TOOLS, "required", None, TEMPLATES.get(syntax, LLAMA3 if syntax == "llama3" else None))
    assert setup.syntax == syntax
    guide = grammars.guide(setup.guided)
    guide.sync(tokenizer.encode(SYNTAXES[syntax].write_calls(calls), add_special_tokens=False))
    assert guide.matcher.is_accepting()


@pytest.mark.parametrize("syntax", NEW)
def test_past_calls_go_back_through_the_template(tiny_dir, syntax):
    """An assistant's call (OpenAI's shape: content null, arguments as JSON text) is written back by the template
    as the model wrote it: DeepSeek's templates get the arguments' text and content None, as they need."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "paris", "days": 3}'}}
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tokenizer = Tokenizer.from_dir(tiny_dir)
    tokenizer.chat_template = TEMPLATES[syntax]
    messages, extra = render_messages(history, tool_setup(TOOLS, "auto", None, TEMPLATES[syntax]), TEMPLATES[syntax])
    prompt = tokenizer.apply_chat_template(messages, **extra)
    assert SYNTAXES[syntax].write_calls([("get_weather", {"city": "paris", "days": 3})]) in prompt


def _calls(found: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]


@pytest.mark.parametrize("syntax", NEW)
def test_a_finished_output_is_read_and_what_is_no_call_stays_content(syntax):
    calls = [("get_weather", {"city": "paris", "days": 3}), ("add", {"a": 1, "b": 2})]
    written = SYNTAXES[syntax].write_calls(calls)
    content, found = parse_calls("Let me look. " + written, syntax, PARAMS)
    assert content == "Let me look." and _calls(found) == calls
    assert found[0]["id"].startswith("call_") and found[0]["type"] == "function"
    assert parse_calls("no call here", syntax, PARAMS) == ("no call here", [])
    for cut in (len(written) // 2, len(written) - 3):  # a call cut short is content, whole
        assert parse_calls(written[:cut], syntax, PARAMS) == (written[:cut], [])
    if syntax.startswith("deepseek"):  # a model that stops before <｜tool▁calls▁end｜> still called
        assert _calls(parse_calls(written.removesuffix("<｜tool▁calls▁end｜>"), syntax, PARAMS)[1]) == calls
    broken = written.replace('"days"', "days")  # JSON that does not parse
    if syntax == "qwen3_xml":
        broken = written.replace("get_weather", "get weather")  # no function name
    assert parse_calls(broken, syntax, PARAMS) == (broken, [])


def test_xml_values_take_their_schema_types():
    text = ("<tool_call>\n<function=note>\n<parameter=text>\n two\nlines \n</parameter>\n<parameter=tags>\n"
            '["a", "b"]\n</parameter>\n<parameter=urgent>\nTrue\n</parameter>\n<parameter=score>\n2\n</parameter>\n'
            "<parameter=due>\nnull\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>")
    _, found = parse_calls(text, "qwen3_xml", PARAMS)
    assert _calls(found) == [("note", {"text": " two\nlines ", "tags": ["a", "b"], "urgent": True, "score": 2,
                                       "due": None, "extra": "7"})]
    _, found = parse_calls(text.replace("\n2\n", "\n2.5\n").replace("True", "maybe"), "qwen3_xml", PARAMS)
    assert _calls(found)[0][1]["score"] == 2.5 and _calls(found)[0][1]["urgent"] == "maybe"  # as text, as vLLM
    twice = text.replace("<parameter=extra>", "<parameter=text>")
    assert parse_calls(twice, "qwen3_xml", PARAMS) == (twice, [])  # one parameter twice: no call


def _stream(syntax: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], str | None, int]:
    """Replay `pieces` through a CallStream: (content, [(name, arguments)], finish_reason, argument deltas)."""
    stream = CallStream(tool_setup(TOOLS, "auto", None, TEMPLATES.get(syntax, "{{ messages }}")), 0)
    content, calls, reason, pieces_of_arguments = "", {}, None, 0
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        for choice in stream.chunks(piece, last, "stop" if last else None):
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d["index"], ["", ""])
                assert ("id" in d) == (call == ["", ""])  # id and name first, then arguments
                call[0] += d["function"].get("name", "")
                call[1] += d["function"]["arguments"]
                pieces_of_arguments += bool(d["function"]["arguments"])
            reason = choice.finish_reason or reason
    return content, [tuple(c) for c in calls.values()], reason, pieces_of_arguments


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<>"), max_size=12)
_ARGUMENTS = st.fixed_dictionaries({"text": _TEXT}, optional={"tags": st.lists(_TEXT, max_size=3),
                                                               "urgent": st.booleans(), "score": st.integers(-9, 99)})


@pytest.mark.parametrize("syntax", NEW + ("hermes",))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=st.lists(_ARGUMENTS, min_size=1, max_size=2), before=_TEXT, data=st.data())
def test_streamed_deltas_add_up_to_the_non_streamed_calls(syntax, arguments, before, data):
    text = before + SYNTAXES[syntax].write_calls([("note", a) for a in arguments])
    content, found = parse_calls(text, syntax, PARAMS)
    assert [a for _, a in _calls(found)] == arguments
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=30)))
    streamed, calls, reason, _ = _stream(syntax, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in found]
    assert reason == "tool_calls" and streamed.strip() == (content or "")


@pytest.mark.parametrize("syntax", NEW + ("hermes",))
def test_a_name_goes_out_when_complete_and_arguments_as_they_grow(syntax):
    text = "Hi " + SYNTAXES[syntax].write_calls([("note", {"text": "a longer text", "tags": ["x", "y"]})])
    content, calls, reason, pieces = _stream(syntax, list(text))  # one character at a time
    assert content == "Hi " and calls == [("note", '{"text": "a longer text", "tags": ["x", "y"]}')]
    assert pieces > 10 and reason == "tool_calls"
    # no call after all: the text held while it might have been one goes out as content
    broken = text.replace("note", "no te")
    assert _stream(syntax, list(broken))[:3] == (broken, [], "stop")


def _serve_tiny(root, syntax: str):
    """A tiny model of the family (Qwen3.5 for the XML syntax, DeepSeek-V3 for DeepSeek's) with the syntax's
    chat template in its tokenizer_config."""
    if syntax == "qwen3_xml":
        model = make_tiny_model(root / syntax, arch="qwen3_5", num_layers=4, max_position_embeddings=1536)
    else:
        model = make_tiny_deepseek_v3(root / syntax, max_position_embeddings=1536)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATES[syntax]}))
    return model


@pytest.fixture(scope="module", params=NEW)
def family_client(request, tmp_path_factory):
    model = _serve_tiny(tmp_path_factory.mktemp("tool-syntax"), request.param)
    with served(model, max_model_len=1536, num_kv_blocks=256, tokens_per_block=8) as srv:
        yield request.param, openai_client(srv)


def test_required_calls_parse_and_validate_streamed_and_not(family_client):
    syntax, client = family_client
    kw = dict(model="tiny", messages=ASK, tools=TOOLS[:2], tool_choice="required", parallel_tool_calls=False,
              max_tokens=300, temperature=0)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, (syntax, choice)
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"name": "", "arguments": [], "id": d.id})
                got["name"] += d.function.name or ""
                got["arguments"].append(d.function.arguments or "")
    assert reasons[-1] == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == call.function.name and "".join(calls[0]["arguments"]) == call.function.arguments
    assert len([a for a in calls[0]["arguments"] if a]) > 2  # the arguments came in pieces
    if syntax.startswith("deepseek"):  # the call goes back through the template, its arguments as JSON text
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS[:2], max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=6), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(value=st.dictionaries(st.text(max_size=4), _JSON, max_size=4), indent=st.sampled_from([None, 1]),
       junk=st.text(max_size=3), data=st.data())
def test_partial_json_agrees_with_json_loads(value, indent, junk, data):
    """value_end: a JSON object's text ends where json.loads says, each of its prefixes is INCOMPLETE, and a
    text that value_end takes whole is one json.loads takes."""
    text = json.dumps(value, indent=indent, ensure_ascii=data.draw(st.booleans()))
    assert value_end(text + "}", 0) == len(text)
    assert all(value_end(text[:k], 0) == INCOMPLETE for k in range(len(text)))
    mangled = data.draw(st.integers(0, len(text)))
    other = text[:mangled] + junk + text[mangled:]
    end = value_end(other, 0)
    if end == len(other):
        assert json.loads(other) is not None
    elif end >= 0:
        json.loads(other[:end])
