"""The XML-style tool-call syntax of Qwen3.5, Qwen3-Coder and NVIDIA Nemotron 3 (its chat templates write
`<function=` and `<parameter=`, both, in their instructions and past calls):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is text: one newline after `<parameter=K>` and one before `</parameter>` are the layout, not the value.
It becomes the JSON type its property's schema names, as vLLM's qwen3_coder parser does it: integer and number
(a number without a fraction becomes an integer), boolean (true / false), object and array (their JSON text),
null (the text null, where the schema allows null); anything else, a property the schema does not name, and a
value that does not convert stay the text. The call's arguments are json.dumps of those values in the order
written (two values for one parameter: no call).

Streamed, the arguments' JSON text grows as the values come: `{` with the name, each value once its
`</parameter>` is there, and a text value character by character, holding back only what may still be the
newline and `</parameter>` that end it.

The grammar (tool_choice required or a named function) writes the schema's properties in its order, the
required ones always, each value as its type: %json for numbers, booleans, objects, arrays; a string's `enum`
or anchored `pattern` as alternatives or a regex; other text up to the first `</parameter>`.
"""

from __future__ import annotations

import json
import math
import re

from pdserve.engine.guided import JSON_LAYOUT
from pdserve.server.tools.base import (NL, Call, Cursor, Incomplete, Invalid, Scan, Syntax, held_from, lark_literal,
                                       lark_text, scan_tagged)

_KEY = re.compile(r"[^<>\n]{1,128}")


def property_schema(parameters: dict | None, key: str) -> dict:
    """The schema of one parameter; one the tool's schema does not name is text."""
    props = (parameters or {}).get("properties")
    schema = props.get(key) if isinstance(props, dict) else None
    return schema if isinstance(schema, dict) else {"type": "string"}


def _types(schema: dict) -> list[str]:
    t = schema.get("type")
    return [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []


def is_text(schema: dict) -> bool:
    """A value that goes out as it is written: a plain string (one that may be null is held to its end)."""
    return _types(schema) == ["string"]


def convert(text: str, schema: dict):
    """A parameter's text as the JSON value its schema's type names."""
    types = _types(schema)
    if text.strip().lower() == "null" and (not types or "null" in types):
        return None
    for t in types:
        if t == "string":
            return text
        if t in ("integer", "number"):
            try:
                x = float(text)
            except ValueError:
                continue
            if math.isfinite(x):
                return int(x) if x.is_integer() and (t == "integer" or not re.search(r"[.eE]", text)) else x
        elif t == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        elif t in ("object", "array"):
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if isinstance(value, dict if t == "object" else list):
                return value
    if not types:
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def _strip_layout(raw: str) -> str:
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


class QwenXML(Syntax):
    name = "qwen3_xml"
    TAG, END = "<tool_call>", "</tool_call>"
    markers = (TAG, END)
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
    example = ("<tool_call>\n<function=example_function_name>\n<parameter=example_parameter>\nvalue\n</parameter>\n"
               "</function>\n</tool_call>")

    def asks_for(self, template: str) -> bool:
        return self.FUNCTION in template and self.PARAMETER in template

    def scan(self, text: str, schemas: dict[str, dict], final: bool) -> Scan:
        return scan_tagged(text, self.TAG, self.END, final, lambda cur, call: self._call(cur, call, schemas))

    def _call(self, cur: Cursor, call: Call, schemas: dict[str, dict]) -> None:
        cur.expect(self.FUNCTION)
        name = cur.name_until(">")
        call.name, call.arguments = name, "{"
        self._parameters(cur, call, schemas.get(name))

    def _parameters(self, cur: Cursor, call: Call, parameters: dict | None) -> None:
        pieces: list[str] = []
        seen: set[str] = set()
        while True:
            cur.ws()
            if cur.at(self.FUNCTION_END):
                call.arguments = "{" + ", ".join(pieces) + "}"
                return
            cur.expect(self.PARAMETER)
            end = cur.text.find(">", cur.i)
            if end < 0:
                if _KEY.fullmatch(cur.rest()) or not cur.rest():
                    raise Incomplete
                raise Invalid
            key = cur.text[cur.i:end]
            if not _KEY.fullmatch(key) or key in seen:
                raise Invalid
            seen.add(key)
            cur.i = end + 1
            schema = property_schema(parameters, key)
            head = "{" + "".join(p + ", " for p in pieces) + json.dumps(key, ensure_ascii=False) + ": "
            close = cur.text.find(self.PARAMETER_END, cur.i)
            if close < 0:
                if is_text(schema):  # the text so far, less what may be the newline and tag that end it
                    raw = cur.rest()
                    raw = raw[:min(held_from(raw, "\n" + self.PARAMETER_END), held_from(raw, self.PARAMETER_END))]
                    raw = raw[1:] if raw.startswith("\n") else raw
                    call.arguments = head + json.dumps(raw, ensure_ascii=False)[:-1]
                raise Incomplete
            value = convert(_strip_layout(cur.text[cur.i:close]), schema)
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            call.arguments = "{" + ", ".join(pieces)
            cur.i = close + len(self.PARAMETER_END)

    def grammar(self, functions: list[dict], parallel: bool, special: dict[str, int] | None = None) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        rules = [f"start: call{more}",
                 f"call: {lark_text(self.TAG + NL, special)} ({alternatives}) {lark_text(self.END, special)}"]
        for i, f in enumerate(functions):
            body = [lark_literal(f"{self.FUNCTION}{f['name']}>{NL}")]
            props = f["parameters"].get("properties")
            required = set(f["parameters"].get("required") or ())
            for j, (key, schema) in enumerate(props.items() if isinstance(props, dict) else ()):
                rule = f"p{i}_{j}"
                body.append(rule if key in required else f"{rule}?")
                rules += self._parameter_rules(rule, key, schema if isinstance(schema, dict) else {})
            body.append(lark_literal(self.FUNCTION_END + NL))
            rules.append(f"f{i}: {' '.join(body)}")
        return "\n".join(rules) + "\n"

    def _parameter_rules(self, rule: str, key: str, schema: dict) -> list[str]:
        opening, closing = lark_literal(f"{self.PARAMETER}{key}>{NL}"), lark_literal(f"{NL}{self.PARAMETER_END}{NL}")
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        pattern = schema.get("pattern")
        if "string" not in _types(schema) and (_types(schema) or choices is None):
            value = f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"
        elif isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices):
            value = " | ".join(lark_literal(c) for c in choices)
        elif isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$") and "/" not in pattern:
            value = f"/{pattern[1:-1]}/"
        else:  # free text, up to the first </parameter>
            return [f"{rule}: {opening} {rule}_text {lark_literal(NL)}",
                    f"{rule}_text[lazy]: /(?s:.*)/ {lark_literal(self.PARAMETER_END)}"]
        return [f"{rule}: {opening} {rule}_value {closing}", f"{rule}_value: {value}"]

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        out = []
        for name, arguments in calls:
            params = "".join(f"{self.PARAMETER}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                             f"\n{self.PARAMETER_END}\n" for k, v in arguments.items())
            out.append(f"{self.TAG}\n{self.FUNCTION}{name}>\n{params}{self.FUNCTION_END}\n{self.END}")
        return "\n".join(out)
