"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, the assistant's
`tool_calls` and `tool` messages through the chat template, and the model's calls read out of its text.

The call syntax is the one the model's chat template asks for (a module each beside this one): Hermes / Qwen's
`<tool_call>` JSON (the default, SmolLM2's family's too), Llama 3.1's bare JSON, the XML-style one of Qwen3.5,
Qwen3-Coder and Nemotron 3, DeepSeek-V3's and DeepSeek-V3.1's.

- A chat template that reads `tools` gets them; one that does not (SmolLM2-135M's, DeepSeek-V3's) gets the tools
  described in a system message that shows the syntax. One that reads `tools` or `tool_calls` gets the messages
  as sent (a call's arguments as an object, or as their JSON text for DeepSeek's templates, which write them as
  given); one that reads neither gets past calls written into the message text in the syntax.
- `tool_choice` "required" or a named function is enforced by a grammar (engine/guided.py): the output is one
  call (or several, with parallel_tool_calls) whose name is a tool's and whose arguments validate against its
  `parameters`. "auto" lets the model choose, and its text is read: calls become `tool_calls`, text that does not
  read as calls stays content, never an error. "none" sends no tools to the model.
- A syntax's markers that the tokenizer makes special tokens are written by the grammar as those tokens (what a
  model trained on them writes; a literal's text never matches a special token) and stay in the output text
  (other special tokens are left out, unless the request sends skip_special_tokens false), so its calls are found.
- Streamed (CallStream), content goes out as it comes up to where a call begins or may begin, then each call as
  OpenAI sends them: its id and name once the name is complete, then its arguments' JSON text as it grows.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import GuidedSpec
from pdserve.server.errors import bad_request
from pdserve.json_writer import json_dumps
from pdserve.server.json_body import MalformedBody, parse_json_text
from pdserve.server.protocol import AssistantMessage, ChatChunkChoice, DeltaMessage
from pdserve.server.tools.base import NAME as _NAME
from pdserve.server.tools.base import Syntax
from pdserve.server.tools.deepseek_v3 import DeepSeekV3
from pdserve.server.tools.deepseek_v31 import DeepSeekV31
from pdserve.server.tools.hermes import Hermes
from pdserve.server.tools.llama3 import Llama3
from pdserve.server.tools.qwen_xml import QwenXML

SYNTAXES: dict[str, Syntax] = {s.name: s for s in (DeepSeekV3(), DeepSeekV31(), QwenXML(), Llama3(), Hermes())}


@dataclass(frozen=True)
class ToolSetup:
    """What a request's tool fields mean for this request: the tools the model sees, and the grammar, if any."""

    tools: list[dict]  # each {"name", "description", "parameters"}
    guided: GuidedSpec | None
    parse: bool  # look for calls in the output
    syntax: str = "hermes"  # a key of SYNTAXES
    # the syntax's markers that the tokenizer makes special tokens (Llama 3.1's <|python_tag|>, Hermes-2-Pro's
    # <tool_call>), text -> id: the grammar writes them as those tokens, and they stay in the text
    special: dict[str, int] = field(default_factory=dict, hash=False)

    @property
    def schemas(self) -> dict[str, dict]:
        return {f["name"]: f["parameters"] for f in self.tools}

    @property
    def kept_special_ids(self) -> tuple[int, ...]:
        """Special tokens that stay in the output text, which is read for calls, when the others are left out."""
        return tuple(sorted(self.special.values())) if self.parse else ()


def call_syntax(template: str | None) -> str:
    """The tool-call syntax a chat template asks the model for (each syntax's `asks_for` says which text of the
    template it looks for); Hermes / Qwen's JSON when no other matches."""
    return next(name for name, s in SYNTAXES.items() if s.asks_for(template or ""))


def tool_setup(tools: list[dict] | None, tool_choice, parallel: bool | None,
               template: str | None = None, tokenizer=None) -> ToolSetup | None:
    """None when the request uses no tools; a 400 naming the field for a malformed tool or tool_choice.
    `tokenizer` (pdserve.tokenizer.Tokenizer) tells which of the syntax's markers are special tokens."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    syntax = call_syntax(template)
    special = tokenizer.special_token_ids(SYNTAXES[syntax].markers) if tokenizer is not None else {}
    if choice == "none":
        return ToolSetup([], None, False, syntax)
    if choice == "auto":
        return ToolSetup(functions, None, True, syntax, special)
    if choice == "required":
        return ToolSetup(functions, _grammar(functions, parallel is not False, syntax, special), True, syntax, special)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                              "tool_choice.function.name")
        named = [f for f in functions if f["name"] == name]
        return ToolSetup(functions, _grammar(named, False, syntax, special), True, syntax, special)
    raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")


def _function(i: int, tool: dict) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                          f"tools.{i}.type")
    f = tool["function"]
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'",
                          f"tools.{i}.function.name")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object)",
                          f"tools.{i}.function.parameters")
    return {"name": name, "description": f.get("description") or "", "parameters": params}


def _grammar(functions: list[dict], parallel: bool, syntax: str, special: dict[str, int]) -> GuidedSpec:
    """One call (several, with `parallel`, where the syntax has room for them) of one of `functions`."""
    return GuidedSpec("grammar", SYNTAXES[syntax].grammar(functions, parallel, special), "tools")


def render_messages(messages: list[dict], setup: ToolSetup | None, template: str | None) -> tuple[list[dict], dict]:
    """The messages and extra template variables for the chat template."""
    calls = [(i, j, c) for i, m in enumerate(messages) for j, c in enumerate(m.get("tool_calls") or [])]
    for i, j, c in calls:
        fn = c.get("function")
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments", ""), str)):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                              f"\"function\": {{\"name\": ..., \"arguments\": \"<JSON text>\"}}}}",
                              f"messages.{i}.tool_calls.{j}")
    template = template or ""
    syntax = SYNTAXES[setup.syntax if setup is not None else call_syntax(template)]
    tools = setup.tools if setup is not None else []
    if "tool_calls" in template or (tools and "tools" in template):
        out = [_as_sent(i, m, syntax.arguments_as_text) for i, m in enumerate(messages)]
    else:
        out = [_flatten(i, m, syntax) for i, m in enumerate(messages)]
    if not tools:
        return out, {}
    if "tools" in template:  # (templates read a call's arguments as an object, HF's convention)
        return out, {"tools": [{"type": "function", "function": f} for f in tools]}
    described = "\n".join(json_dumps({"type": "function", "function": f}) for f in setup.tools)
    system = ("You may call one or more functions to answer. The functions are:\n<tools>\n" + described +
              "\n</tools>\nTo call one, write its name and arguments so:\n" + syntax.example)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _flatten(i: int, m: dict, syntax: Syntax) -> dict:
    """Message `i` as a template that does not read tool_calls takes it: past calls written into its text."""
    calls = m.get("tool_calls")
    if not calls:
        return {"role": m["role"], "content": m.get("content") or ""}
    text = syntax.write_calls([(c["function"]["name"], _args(i, j, c)) for j, c in enumerate(calls)])
    return {"role": m["role"], "content": ((m.get("content") or "") + "\n" + text).lstrip("\n")}


def _as_sent(i: int, m: dict, arguments_as_text: bool) -> dict:
    """Message `i`, `m`, as a template that reads tool_calls takes it: a message that calls has content None when
    it says nothing (DeepSeek's templates write the calls only then), and each call's arguments (OpenAI's JSON
    text) are the object HF's templates read with `| tojson`, unless the template writes them as given."""
    if not m.get("tool_calls"):
        return m
    calls = m["tool_calls"] if arguments_as_text else [
        {**c, "function": {**c["function"], "arguments": _args(i, j, c)}} for j, c in enumerate(m["tool_calls"])]
    return {**m, "content": m.get("content") or None, "tool_calls": calls}


def _args(i: int, j: int, call: dict):
    """Call `j` of message `i`'s arguments as the value their JSON text holds, read as the body is (bounded in
    depth and size, strings valid Unicode once their escapes are decoded): a 400 naming the field when they
    break those bounds; text that is not JSON stays the text."""
    raw = call["function"].get("arguments") or "{}"
    try:
        return parse_json_text(raw, f"messages.{i}.tool_calls.{j}.function.arguments")
    except MalformedBody as e:
        if e.code == "invalid_json":
            return raw
        raise bad_request(e.message, e.param, e.code) from None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(text: str, syntax: str = "hermes", schemas: dict[str, dict] | None = None
                ) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output. Text that does not read as calls is all content."""
    scan = SYNTAXES[syntax].scan(text, schemas or {}, final=True)
    if scan.failed or not scan.calls:
        return text, []
    calls = [{"id": _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in scan.calls]
    return (text[:scan.start] + scan.rest).strip() or None, calls


def assistant_message(text: str, finish_reason: str | None,
                      setup: ToolSetup | None) -> tuple[AssistantMessage, str | None]:
    """A finished choice's message and finish_reason: its calls as tool_calls ("tool_calls") when it made any."""
    if setup is None or not setup.parse:
        return AssistantMessage(content=text), finish_reason
    content, calls = parse_calls(text, setup.syntax, setup.schemas)
    if not calls:
        return AssistantMessage(content=text), finish_reason
    return AssistantMessage(content=content, tool_calls=calls), _reason(finish_reason)


def _reason(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


class CallStream:
    """One streamed choice whose tools may be called, as OpenAI streams it. Text before where a call begins (or
    may yet begin) goes out as content at once. Each call goes out as a delta with its index, id, type and name
    once its name is complete, then deltas of its arguments' JSON text as the model writes it (what the
    syntax's scan reports: never taken back, so the pieces add up to the non-streamed call's arguments). Text
    that turns out to be no call goes out as content; other text between and after calls goes out when the
    choice ends. A call that breaks off (max_tokens, or text no call allows) after its name went out leaves
    what was sent; its text then goes out as content too, and the finish_reason is the engine's."""

    def __init__(self, setup: ToolSetup, index: int):
        self.setup, self.index = setup, index
        self.syntax = SYNTAXES[setup.syntax]
        self.text, self.sent = "", 0  # the choice's text so far, and how much of it went out as content
        self.calls: list[tuple[str, str]] = []  # each call sent: (name, arguments sent)
        self.plain = False  # the text turned out to be no call: all of it is content

    def chunks(self, new_text: str, finished: bool, finish_reason: str | None) -> list[ChatChunkChoice]:
        self.text += new_text
        scan = None if self.plain else self.syntax.scan(self.text, self.setup.schemas, final=finished)
        if scan is None or scan.failed:
            self.plain = True
            out = self._content(len(self.text))
            if finished:
                out.append(self._choice(DeltaMessage(), finish_reason))
            return out
        out = self._content(scan.start)
        for i, call in enumerate(scan.calls):
            out += self._call_deltas(i, call.name, call.arguments)
        if finished:
            if scan.rest.strip():
                out.append(self._choice(DeltaMessage(content=scan.rest)))
            out.append(self._choice(DeltaMessage(), _reason(finish_reason) if self.calls else finish_reason))
        return out

    def _content(self, end: int) -> list[ChatChunkChoice]:
        if self.calls and not self.plain or end <= self.sent:
            return []
        text, self.sent = self.text[self.sent:end], end
        return [self._choice(DeltaMessage(content=text))]

    def _call_deltas(self, i: int, name: str | None, arguments: str) -> list[ChatChunkChoice]:
        if name is None:
            return []
        out = []
        if i == len(self.calls):
            self.calls.append((name, ""))
            out.append(self._choice(DeltaMessage(tool_calls=[{"index": i, "id": _call_id(), "type": "function",
                                                               "function": {"name": name, "arguments": ""}}])))
        sent = self.calls[i][1]
        if len(arguments) > len(sent) and arguments.startswith(sent):  # (a scan only ever adds to them)
            self.calls[i] = (name, arguments)
            piece = {"index": i, "function": {"arguments": arguments[len(sent):]}}
            out.append(self._choice(DeltaMessage(tool_calls=[piece])))
        return out

    def _choice(self, delta: DeltaMessage, finish_reason: str | None = None) -> ChatChunkChoice:
        return ChatChunkChoice(index=self.index, delta=delta, finish_reason=finish_reason)
