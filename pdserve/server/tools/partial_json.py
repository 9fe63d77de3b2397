"""JSON text that may still be growing: where a value ends, or that it cannot end (the text is no JSON).

A streamed tool call's arguments are sent as their raw JSON text while the model writes them (server/tools/chat.py):
everything of a value that has been written belongs to it, so what matters is where it ends and whether the text
so far can still be JSON at all. `value_end` answers that for one value; `object_members` walks an object's
members as far as the text goes.

    value_end('{"a": [1, 2]} tail', 0) -> 13        the value is complete
    value_end('{"a": [1, 2', 0)        -> INCOMPLETE  a prefix of some JSON value
    value_end('{"a": x', 0)            -> INVALID     no JSON value starts so

The grammar is RFC 8259's, as json.loads reads it less NaN and Infinity. Nesting past MAX_DEPTH is INVALID
(such text is left as content, never a RecursionError).
"""

from __future__ import annotations

import json
import re

INCOMPLETE = -1  # the text ends inside the value
INVALID = -2  # the text cannot be (the start of) a JSON value
MAX_DEPTH = 64
WHITESPACE = " \t\n\r"

# (written as runs of plain characters between escapes, which the regex engine takes in one step each)
_STRING = re.compile(r'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"')
_STRING_START = re.compile(r'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*'
                           r'(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_START = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?)?\Z")
_LITERALS = ("true", "false", "null")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int, depth: int = 0) -> int:
    """The index just past the JSON value that starts at text[i] (no whitespace before it), INCOMPLETE when the
    text ends inside it, INVALID when no JSON value starts so. A number is complete only once a character that
    cannot continue it follows (the values walked here sit inside objects, so one always does)."""
    if i >= len(text):
        return INCOMPLETE
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        if m:
            return m.end()
        return INCOMPLETE if _STRING_START.match(text, i) else INVALID
    if c == "-" or c.isdigit():
        if _NUMBER_START.match(text, i):  # all the rest may still grow into a number
            return INCOMPLETE
        m = _NUMBER.match(text, i)
        return m.end() if m else INVALID
    if c in "{[":
        return INVALID if depth >= MAX_DEPTH else _container_end(text, i, depth + 1)
    for literal in _LITERALS:
        if text.startswith(literal, i):
            return i + len(literal)
        if literal.startswith(text[i:i + len(literal)]) and i + len(literal) > len(text):
            return INCOMPLETE
    return INVALID


def _container_end(text: str, i: int, depth: int) -> int:
    close = "}" if text[i] == "{" else "]"
    i = skip_ws(text, i + 1)
    if i < len(text) and text[i] == close:
        return i + 1
    while True:
        if close == "}":
            i = _key_end(text, i)
            if i < 0:
                return i
        i = value_end(text, i, depth)
        if i < 0:
            return i
        i = skip_ws(text, i)
        if i >= len(text):
            return INCOMPLETE
        if text[i] == close:
            return i + 1
        if text[i] != ",":
            return INVALID
        i = skip_ws(text, i + 1)


def _key_end(text: str, i: int) -> int:
    """Past `"key" :` and the whitespace after it: where the member's value starts."""
    if i >= len(text):
        return INCOMPLETE
    if text[i] != '"':
        return INVALID
    i = value_end(text, i)
    if i < 0:
        return i
    i = skip_ws(text, i)
    if i >= len(text):
        return INCOMPLETE
    return skip_ws(text, i + 1) if text[i] == ":" else INVALID


def object_members(text: str, i: int) -> tuple[list[tuple[str, int, int]], int]:
    """The members of the JSON object that starts at text[i] ('{'), as far as the text goes:
    [(key, value_start, value_end)], value_end INCOMPLETE for a value the text ends in; and the object's end
    (the index past its '}'), INCOMPLETE or INVALID. A member whose key is incomplete is not listed."""
    if i >= len(text):
        return [], INCOMPLETE
    if text[i] != "{":
        return [], INVALID
    members: list[tuple[str, int, int]] = []
    i = skip_ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        return members, i + 1
    while True:
        start = _key_end(text, i)
        if start < 0:
            return members, start
        key = json.loads(text[i:value_end(text, i)])
        end = value_end(text, start, 1)
        members.append((key, start, end))
        if end < 0:
            return members, end
        i = skip_ws(text, end)
        if i >= len(text):
            return members, INCOMPLETE
        if text[i] == "}":
            return members, i + 1
        if text[i] != ",":
            return members, INVALID
        i = skip_ws(text, i + 1)
