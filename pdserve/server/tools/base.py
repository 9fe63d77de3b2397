"""What every tool-call syntax shares: the scan of a choice's text (`Scan`, its `Call`s, the `Cursor` that
reads it), the `Syntax` interface, the grammar's building blocks and the reading of a JSON call object.

Each syntax's `scan(text, schemas, final)` reads a choice's text so far into a `Scan`: where the calls begin (the
text before is content), the calls as far as they go (a name once it is complete, the arguments' JSON text so
far) and whether the text turned out to be no call. What a scan reports of a growing text is never taken back
by a longer one: a name stays, arguments only grow, and a failure stays a failure. So a stream sends what each
scan adds, and ends with exactly what the scan of the finished text (the non-streamed answer) holds.

The JSON syntaxes send a call's arguments as the model wrote them (the raw JSON text; under a grammar, in
json.dumps' layout): every character of a value written so far is part of it (partial_json.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pdserve.engine.guided import JSON_LAYOUT
from pdserve.server.tools.partial_json import INCOMPLETE, INVALID, object_members, skip_ws, value_end

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NL = "\n"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")


@dataclass
class Call:
    name: str | None = None  # None until the name is complete and the text is surely a call
    arguments: str = ""  # the arguments' JSON text so far: a prefix of the finished call's


@dataclass
class Scan:
    start: int  # text[:start] is content: no call begins (or may yet begin) before it
    calls: list[Call] = field(default_factory=list)
    failed: bool = False  # the text from `start` is no call after all: all of it is content
    rest: str = ""  # text outside the calls after `start` (between and after them), content too


class Incomplete(Exception):
    """The text ends inside a call."""


class Invalid(Exception):
    """The text from the calls' start is no call."""


class Cursor:
    """A position in a choice's text, read forward; Incomplete at the text's end, Invalid at a mismatch."""

    def __init__(self, text: str, i: int = 0):
        self.text, self.i = text, i

    def rest(self) -> str:
        return self.text[self.i:]

    def ws(self) -> None:
        self.i = skip_ws(self.text, self.i)

    def at(self, literal: str) -> bool:
        """The text goes on with `literal` (which is read); Incomplete if it may still do so."""
        if self.text.startswith(literal, self.i):
            self.i += len(literal)
            return True
        if len(self.text) - self.i < len(literal) and literal.startswith(self.rest()):
            raise Incomplete
        return False

    def expect(self, literal: str) -> None:
        if not self.at(literal):
            raise Invalid

    def name_until(self, end: str) -> str:
        """A function name, then `end` (both read)."""
        after = _NAME_CHARS.match(self.text, self.i).end()
        if after - self.i > 64:
            raise Invalid
        if after == len(self.text):
            raise Incomplete
        name, self.i = self.text[self.i:after], after
        self.expect(end)
        if not NAME.fullmatch(name):
            raise Invalid
        return name

    def json_object(self, call: Call) -> None:
        """The JSON object there, as `call`'s arguments (as far as the text goes)."""
        start = self.i
        end = value_end(self.text, start)
        if start < len(self.text) and self.text[start] != "{" or end == INVALID:
            raise Invalid
        call.arguments = self.text[start:] if end == INCOMPLETE else self.text[start:end]
        if end == INCOMPLETE:
            raise Incomplete
        self.i = end


def held_from(text: str, marker: str, pos: int = 0) -> int:
    """Where text (from pos) ends with the first characters of `marker`: the place a call may yet begin."""
    for k in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


def lark_literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # Lark's string escapes are JSON's


def lark_text(s: str, special: dict[str, int] | None) -> str:
    """`s` as a Lark sequence: the markers in it that the tokenizer makes special tokens (`special`: text -> id)
    as those tokens (llguidance's <[id]>, which a literal's text never matches), the rest as literals."""
    if not special:
        return lark_literal(s)
    parts, at = [], 0
    for m in re.finditer("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)), s):
        parts += [lark_literal(s[at:m.start()])] if m.start() > at else []
        parts.append(f"<[{special[m.group()]}]>")
        at = m.end()
    return " ".join(parts + ([lark_literal(s[at:])] if at < len(s) else []))


def as_object(function: dict) -> dict:
    """A tool's parameters, an object even where its schema does not say so (arguments are one)."""
    return {"type": "object", **function["parameters"]}


def json_schema(function: dict) -> str:
    """A tool's parameters as llguidance's %json, in json.dumps' layout."""
    return json.dumps({**as_object(function), "x-guidance": JSON_LAYOUT})


def call_object_schema(functions: list[dict], arguments_key: str) -> dict:
    """The JSON syntaxes' call, {"name": N, <arguments_key>: {...}}, for one of `functions`, as a schema (with
    llguidance's layout): the name one of theirs, the arguments valid under that function's parameters."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, arguments_key: as_object(f)},
              "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}


class Syntax:
    """One family's tool-call syntax; `asks_for` tells a chat template that asks for it by its text."""

    name = ""
    example = ""  # how to call, for a template that does not describe the tools itself
    # Its tags' texts: where the tokenizer makes one a special token, it stays in the output text (chat.py)
    markers: tuple[str, ...] = ()
    arguments_as_text = False  # its templates write a past call's arguments as given (JSON text), not | tojson

    def asks_for(self, template: str) -> bool:
        raise NotImplementedError

    def grammar(self, functions: list[dict], parallel: bool, special: dict[str, int] | None = None) -> str:
        """Lark (llguidance's) for one call of one of `functions` (several with `parallel`); its markers that the
        tokenizer makes special tokens (`special`: text -> id) as those tokens, as a model trained on them
        writes them."""
        raise NotImplementedError

    def scan(self, text: str, schemas: dict[str, dict], final: bool) -> Scan:
        raise NotImplementedError

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        """Past calls [(name, arguments)] as the model would have written them."""
        raise NotImplementedError


def scan_with(text: str, start: int, final: bool, read) -> Scan:
    """Run `read(cursor, calls, scan)` from `start` and turn how it stops into the Scan."""
    scan = Scan(start)
    try:
        read(Cursor(text, start), scan.calls, scan)
    except Incomplete:
        scan.failed = final
    except Invalid:
        scan.failed = True
    if not scan.failed and final and not scan.calls:
        scan.failed = True
    return scan


def scan_tagged(text: str, tag: str, end: str, final: bool, read_call) -> Scan:
    """Calls each between `tag` and `end`, any number, text around them (Hermes's and the XML syntax's):
    `read_call(cursor, call)` reads one call's body into `call`."""
    start = text.find(tag)
    if start < 0:
        return Scan(len(text) if final else held_from(text, tag))

    def read(cur: Cursor, calls: list[Call], scan: Scan) -> None:
        while True:
            cur.expect(tag)
            cur.ws()
            calls.append(Call())
            read_call(cur, calls[-1])
            cur.ws()
            cur.expect(end)
            nxt = cur.text.find(tag, cur.i)
            if nxt < 0:
                held = len(cur.text) if final else held_from(cur.text, tag, cur.i)
                scan.rest += cur.text[cur.i:held]
                return
            scan.rest += cur.text[cur.i:nxt]
            cur.i = nxt

    return scan_with(text, start, final, read)


def json_call(cur: Cursor, call: Call, argument_keys: tuple[str, ...], name_needs_arguments: bool) -> None:
    """A {"name": ..., <one of argument_keys>: {...}} object into `call`, its arguments the raw text of their
    value ("{}" when it has none, unless `name_needs_arguments`: where the object alone says it is a call, its
    name is reported only once an arguments key is seen too, and an object without one is no call)."""
    text = cur.text
    members, end = object_members(text, cur.i)
    if end == INVALID or len({k for k, _, _ in members}) != len(members):
        raise Invalid
    found = {k: (s, e) for k, s, e in members}
    name = None
    if "name" in found:
        s, e = found["name"]
        if s < len(text) and text[s] != '"':
            raise Invalid
        if e >= 0:
            name = json.loads(text[s:e])
            if not NAME.fullmatch(name):
                raise Invalid
    keys = [k for k in argument_keys if k in found]
    if len(keys) > 1:
        raise Invalid
    arguments = ""
    if keys:
        s, e = found[keys[0]]
        if s < len(text) and text[s] != "{":
            raise Invalid
        arguments = text[s:] if e < 0 else text[s:e]
    if name is not None and (keys or not name_needs_arguments):
        call.name, call.arguments = name, arguments
    if end == INCOMPLETE:
        raise Incomplete
    if name is None or (name_needs_arguments and not keys):
        raise Invalid
    call.arguments = arguments or "{}"
    cur.i = end
