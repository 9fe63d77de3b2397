"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, the assistant's
`tool_calls` and `tool` messages through the chat template, and the model's calls parsed out of its text.

The call syntax is the Hermes / Qwen one, which SmolLM2's family and Qwen's templates use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or, for a chat template that asks for Llama 3.1's (its text names `"parameters": dictionary of argument name`,
or it writes `<|python_tag|>`), one bare JSON object: {"name": "get_weather", "parameters": {"city": "Paris"}}.

- A chat template that reads `tools` gets them (and the messages as sent); one that does not (SmolLM2-135M's)
  gets the tools described in a system message, and past calls written in the syntax above.
- `tool_choice` "required" or a named function is enforced by a grammar (engine/guided.py): the output is one
  call (or several, with parallel_tool_calls) whose name is a tool's and whose arguments validate against its
  `parameters`. "auto" lets the model choose, and its text is parsed: calls become `tool_calls`, text that does not
  parse stays content, never an error. "none" sends no tools to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pdserve.engine.guided import JSON_LAYOUT
from pdserve.engine.sampling_params import GuidedSpec
from pdserve.server.errors import bad_request
from pdserve.server.protocol import AssistantMessage, ChatChunkChoice, DeltaMessage

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolSetup:
    """What a request's tool fields mean for this request: the tools the model sees, and the grammar, if any."""

    tools: list[dict]  # each {"name", "description", "parameters"}
    guided: GuidedSpec | None
    parse: bool  # look for calls in the output
    syntax: str = "hermes"  # or "llama3"


def call_syntax(template: str | None) -> str:
    """The tool-call syntax a chat template asks the model for."""
    llama3 = template and ('"parameters": dictionary of argument name' in template or "<|python_tag|>" in template)
    return "llama3" if llama3 else "hermes"


def tool_setup(tools: list[dict] | None, tool_choice, parallel: bool | None,
               template: str | None = None) -> ToolSetup | None:
    """None when the request uses no tools; a 400 naming the field for a malformed tool or tool_choice."""
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
    if choice == "none":
        return ToolSetup([], None, False, syntax)
    if choice == "auto":
        return ToolSetup(functions, None, True, syntax)
    if choice == "required":
        return ToolSetup(functions, _grammar(functions, parallel is not False, syntax), True, syntax)
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
        return ToolSetup(functions, _grammar(named, False, syntax), True, syntax)
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


def _grammar(functions: list[dict], parallel: bool, syntax: str) -> GuidedSpec:
    """One call (several, with `parallel`, in the Hermes syntax) of one of `functions` (Lark with an embedded
    JSON schema, llguidance's %json)."""
    key = "parameters" if syntax == "llama3" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
              "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}
    if syntax == "llama3":  # one call per turn, as Llama 3.1's template asks
        return GuidedSpec("grammar", f"start: %json {json.dumps(schema)}\n", "tools")
    repeat = "+" if parallel else ""
    lark = (f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}\n")
    return GuidedSpec("grammar", lark, "tools")


def render_messages(messages: list[dict], setup: ToolSetup | None, template: str | None) -> tuple[list[dict], dict]:
    """The messages and extra template variables for the chat template."""
    calls = [(i, j, c) for i, m in enumerate(messages) for j, c in enumerate(m.get("tool_calls") or [])]
    for i, j, c in calls:
        fn = c.get("function")
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments", ""), str)):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                              f"\"function\": {{\"name\": ..., \"arguments\": \"<JSON text>\"}}}}",
                              f"messages.{i}.tool_calls.{j}")
    if setup is None or not setup.tools:
        return [_flatten(m) for m in messages], {}
    if template and "tools" in template:  # (templates read a call's arguments as an object, HF's convention)
        return [_with_object_arguments(m) for m in messages], {"tools": [{"type": "function", "function": f}
                                                                         for f in setup.tools]}
    described = "\n".join(json.dumps({"type": "function", "function": f}) for f in setup.tools)
    system = ("You may call one or more functions to answer. The functions are:\n<tools>\n" + described +
              "\n</tools>\nTo call one, write its name and arguments as JSON inside tags:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <args-object>}\n</tool_call>')
    out = [_flatten(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _flatten(m: dict) -> dict:
    """A message as a template without tool support reads it: past calls written as text."""
    calls = m.get("tool_calls")
    if not calls:
        return {"role": m["role"], "content": m.get("content") or ""}
    text = "\n".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _args(c)})}"
                     "\n</tool_call>" for c in calls)
    return {"role": m["role"], "content": ((m.get("content") or "") + "\n" + text).lstrip("\n")}


def _with_object_arguments(m: dict) -> dict:
    """`m` with each tool call's arguments (OpenAI's JSON text) as the object a chat template reads."""
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": _args(c)}} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _args(call: dict):
    raw = call["function"].get("arguments") or "{}"
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_calls(text: str, syntax: str = "hermes") -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output. Calls that do not parse leave the whole text as content."""
    if syntax == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        found = [body] if body.startswith("{") and body.endswith("}") else []
    else:
        found = _CALL.findall(text)
    if not found:
        return text, []
    calls = []
    for body in found:
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or (
                syntax == "llama3" and not ("parameters" in call or "arguments" in call)):  # JSON, not a call
            return text, []
        args = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    content = _CALL.sub("", text).strip() if syntax == "hermes" else ""
    return content or None, calls


def assistant_message(text: str, finish_reason: str | None,
                      setup: ToolSetup | None) -> tuple[AssistantMessage, str | None]:
    """A finished choice's message and finish_reason: its calls as tool_calls ("tool_calls") when it made any."""
    if setup is None or not setup.parse:
        return AssistantMessage(content=text), finish_reason
    content, calls = parse_calls(text, setup.syntax)
    if not calls:
        return AssistantMessage(content=text), finish_reason
    reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return AssistantMessage(content=content, tool_calls=calls), reason


_TAG, _PYTHON_TAG = "<tool_call>", "<|python_tag|>"


class CallStream:
    """One streamed choice whose tools may be called. Text that cannot be (the start of) a call is sent as content
    at once; from where a call starts (or may start) on, the text is held, and sent when the choice ends as
    OpenAI's tool-call deltas (tool_call_deltas), or as content where it is no call after all."""

    def __init__(self, setup: ToolSetup, index: int):
        self.setup, self.index = setup, index
        self.text, self.sent = "", 0  # the choice's text so far, and how much of it went out as content
        self.call_started = False
        self.plain = False  # llama3: the text began as no call does, so all of it is content

    def chunks(self, new_text: str, finished: bool, finish_reason: str | None) -> list[ChatChunkChoice]:
        self.text += new_text
        out = []
        safe = self._safe_end()
        if safe > self.sent:
            out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(content=self.text[self.sent:safe])))
            self.sent = safe
        if finished:
            out += tool_call_deltas(self.text[self.sent:], finish_reason, self.setup, self.index)
        return out

    def _safe_end(self) -> int:
        """How much of the text may go out as content: up to where a call starts or may yet start."""
        if self.call_started:
            return self.sent
        if self.setup.syntax == "llama3":  # a call is the whole output
            body = self.text.lstrip()
            if self.plain or (body and not body.startswith(("{", _PYTHON_TAG)) and not _PYTHON_TAG.startswith(body)):
                self.plain = True
                return len(self.text)
            self.call_started = bool(body)
            return self.sent
        start = self.text.find(_TAG, self.sent)
        if start >= 0:
            self.call_started = True
            return start
        for k in range(min(len(_TAG) - 1, len(self.text) - self.sent), 0, -1):
            if self.text.endswith(_TAG[:k]):
                return len(self.text) - k
        return len(self.text)


def tool_call_deltas(text: str, finish_reason: str | None, setup: ToolSetup, index: int) -> list[ChatChunkChoice]:
    """The rest of a streamed choice (CallStream's held text) when it ends: OpenAI's delta shape, a first delta
    per call with its id, type and name, then its arguments; text that holds no call goes out as content."""
    message, reason = assistant_message(text, finish_reason, setup)
    if not message.tool_calls:
        return [ChatChunkChoice(index=index, delta=DeltaMessage(content=text or None), finish_reason=finish_reason)]
    deltas = [ChatChunkChoice(index=index, delta=DeltaMessage(content=message.content))] if message.content else []
    for i, call in enumerate(message.tool_calls):
        head = {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"],
                                                                             "arguments": ""}}
        deltas.append(ChatChunkChoice(index=index, delta=DeltaMessage(tool_calls=[head])))
        deltas.append(ChatChunkChoice(index=index, delta=DeltaMessage(tool_calls=[
            {"index": i, "function": {"arguments": call["function"]["arguments"]}}])))
    deltas.append(ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=reason))
    return deltas
