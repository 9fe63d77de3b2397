"""The strict JSON request-body parser shared by `pdserve serve` and the orchestrator.

Python's json module takes more than JSON: NaN, Infinity and -Infinity, numbers that overflow to inf
(1e400), lone UTF-16 surrogates ("\\ud800", which no UTF-8 encoder or tokenizer accepts), integers past
the digit limit of int() (4300), which it refuses with a message about sys, and any
nesting depth until its recursion fails. `parse_json_object` refuses each of them as a
`MalformedBody`, which both apps answer with a 400 naming the field the way pydantic names it
("temperature", "messages.0.content"), before anything else reads the body.

The apps call `parse_json_body`: a body over OFFLOAD_BYTES is parsed in a worker thread, so that the
event loop (every other request, /health) and the engine's thread go on meanwhile. Threads take turns at
the GIL only while one runs Python code, and json's C parser holds it for the whole body (1-3 s for 30 MiB
of `{}` or of `1e308`), so such a body is parsed with a Python hook for every object and number, the list
checks run a slice at a time, and a body of more than MAX_ARRAYS arrays (which json builds without a
hook) is refused before it is parsed. Strings, true, false and null still go through C alone: 30 MiB of
`""` keeps the GIL about 0.3 s at a time. The request that sent the body waits longer for its answer.

JSON text that a client sends inside a string field (a tool call's arguments) is read by `parse_json_text`
under the same rules, each refusal naming that field, and one more: it holds at most MAX_TEXT_VALUES arrays,
objects and commas, counted before it is parsed, so that json's C code (which holds the GIL throughout) parses
it, and writes it back into a chat template, in a bounded time without hooks. The other way is
pdserve/json_writer.py's `json_dumps`.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64  # nested arrays and objects; an OpenAI request needs about 5
# Arrays in a body; a request has a few, and one per chat message (65536 at most). 30 MiB of `[]` held the
# GIL 1-3 s in json's C parser
MAX_ARRAYS = 1 << 18
# Arrays, objects and commas in JSON text inside a string field: each is at least a token of what a model
# wrote, so more than a context window holds. 8 M of them (24 MB of `1,`) held the GIL ~1 s to parse, as long
# again to write back; this many, ~0.05 s each way
MAX_TEXT_VALUES = 1 << 18
OFFLOAD_BYTES = 1 << 20  # parsed inline below this: at most ~0.1 s of the event loop's time
_SLICE = 1 << 16  # list items checked at once by one C pass
_INT_DIGITS = sys.get_int_max_str_digits()  # int() refuses longer digit strings (0: no limit)
# Digits as "1", every other byte "0": a digit run past the limit is then one bytes.find, linear in the body
_DIGIT_MARKS = bytes(0x31 if 0x30 <= b <= 0x39 else 0x30 for b in range(256))

# A JSON string, escapes included: the brackets inside one do not nest. An unterminated one runs to the
# end, so that every match succeeds at once (a failing match would be retried from each later quote).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")
_FINE = (int, float, type(None))  # values that need no look: the parser made every float finite (bool is an int)
_FINE_TYPES = frozenset({int, float, bool, type(None)})


@dataclass
class MalformedBody(Exception):
    """A body that is not a JSON object a request may carry; always a 400."""

    message: str
    param: str | None = None
    code: str = "invalid_body"

    def __str__(self) -> str:
        return self.message


class _NonFinite:
    """What the parser makes of NaN, Infinity, -Infinity and an overflowing number: refused once the
    walk knows which field holds it."""

    __slots__ = ("literal",)

    def __init__(self, literal: str):
        self.literal = literal


def _parse_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


class _HugeInt:
    """What the parser makes of an integer past Python's digit limit for int(): refused by field."""

    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str) -> int | _HugeInt:
    digits = len(text) - text.startswith("-")
    return _HugeInt(digits) if _INT_DIGITS and digits > _INT_DIGITS else int(text)


async def parse_json_body(raw: bytes) -> dict[str, Any]:
    """`parse_json_object`, in a worker thread for a body over OFFLOAD_BYTES."""
    if len(raw) <= OFFLOAD_BYTES:
        return parse_json_object(raw)
    return await asyncio.to_thread(parse_json_object, raw, yielding=True)


def parse_json_object(raw: bytes, yielding: bool = False) -> dict[str, Any]:
    """The body as a dict, or MalformedBody saying what is wrong and where. `yielding`: parse so as to let
    other threads have the GIL often (slower; see the module docstring)."""
    if not raw.strip():
        raise MalformedBody("the request body is empty; send a JSON object")
    _check_arrays(raw)
    body = _loads(raw, yielding, None)
    if not isinstance(body, dict):
        raise MalformedBody(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def parse_json_text(text: str, field: str) -> Any:
    """The value a client's JSON text holds, read from the string field `field` (named as pydantic names it:
    "messages.1.tool_calls.0.function.arguments"), under the body's rules plus MAX_TEXT_VALUES; each refusal is
    a MalformedBody whose param is `field`, and text that is not JSON one with code "invalid_json"."""
    raw = text.encode()
    if _structure(raw) > MAX_TEXT_VALUES and (found := _structure(_STRING.sub(b"", raw))) > MAX_TEXT_VALUES:
        # (the first count takes the marks inside strings too: most texts pass it without a scan)
        raise MalformedBody(f"'{field}' is too large: its JSON holds {found} arrays, objects and commas; at most "
                            f"{MAX_TEXT_VALUES} are read", field, "invalid_value")
    return _loads(raw, False, field)


def _loads(raw: bytes, yielding: bool, field: str | None) -> Any:
    """json.loads of `raw` with every value checked (_check_values); `field`: the string field that held the
    text, None for the body."""
    # Parsing each integer in Python takes 4x as long as json's own (1.1 s against 0.3 s for 4 M of them), so
    # that is kept for bodies that hold a run of digits int() would refuse, or that must let go of the GIL
    hooks: dict[str, Any] = {"parse_int": _parse_int, "object_hook": _same} if yielding else {}
    if not yielding and _may_hold_huge_int(raw):
        hooks["parse_int"] = _parse_int
    what = "the request body" if field is None else f"'{field}'"
    try:
        value = json.loads(raw, parse_constant=_NonFinite, parse_float=_parse_float, **hooks)
    except RecursionError:  # json's own bound on nesting (about 1000 levels); MAX_DEPTH is checked below
        raise _too_deep(field) from None
    except json.JSONDecodeError as e:
        raise MalformedBody(f"{what} is not valid JSON: {e.msg} at character {e.pos}", field,
                            "invalid_json") from None
    except ValueError as e:  # bytes that are not UTF-8 (nor -16, -32)
        raise MalformedBody(f"{what} is not valid JSON: {e}", field, "invalid_json") from None
    _check_values(value, (), field)
    return value


def _structure(raw: bytes) -> int:
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{")


def _same(obj: dict) -> dict:
    """json's object_hook: a call into Python per object, where another thread may take the GIL."""
    return obj


def _may_hold_huge_int(raw: bytes) -> bool:
    return bool(_INT_DIGITS) and raw.translate(_DIGIT_MARKS).find(b"1" * (_INT_DIGITS + 1)) != -1


def _check_arrays(raw: bytes) -> None:
    """Refuse more than MAX_ARRAYS arrays before json.loads, which builds arrays without a hook, holding the
    GIL throughout."""
    if raw.count(b"[") <= MAX_ARRAYS:
        return  # even counting brackets inside strings: most bodies, without a scan
    arrays = _STRING.sub(b"", raw).count(b"[")
    if arrays > MAX_ARRAYS:
        raise MalformedBody(f"the request body holds {arrays} arrays; a request needs at most {MAX_ARRAYS}")


def _too_deep(field: str | None) -> MalformedBody:
    what = "the request body" if field is None else f"'{field}'"
    return MalformedBody(f"{what} nests too deeply: more than {MAX_DEPTH} levels of arrays and objects", field)


def _check_values(value: Any, path: tuple, field: str | None) -> None:
    """Every string valid Unicode, every number finite, no array or object deeper than MAX_DEPTH; `path` is
    where `value` sits in the body, or in the JSON text of the string field `field`."""
    if isinstance(value, (dict, list)) and len(path) >= MAX_DEPTH:
        raise _too_deep(field)
    if isinstance(value, dict):
        for key, item in value.items():
            bad = _surrogate(key)
            if bad:
                raise MalformedBody(f"a field name in {_where(path, field)} is not valid Unicode (lone surrogate "
                                    f"{bad})", _param(path, field), "invalid_value")
            if not isinstance(item, _FINE):
                _check_values(item, (*path, key), field)
    elif isinstance(value, list):
        for start in range(0, len(value), _SLICE):
            part = value[start:start + _SLICE]
            if set(map(type, part)) <= _FINE_TYPES:  # numbers and nulls only: one C pass over the slice
                continue
            for i, item in enumerate(part, start):
                if not isinstance(item, _FINE):
                    _check_values(item, (*path, i), field)
    elif isinstance(value, _NonFinite):
        raise MalformedBody(f"invalid value for {_where(path, field)}: must be a finite number, got {value.literal}",
                            _param(path, field), "invalid_value")
    elif isinstance(value, _HugeInt):
        raise MalformedBody(f"invalid value for {_where(path, field)}: an integer of {value.digits} digits (at most "
                            f"{_INT_DIGITS})", _param(path, field), "invalid_value")
    elif isinstance(value, str):
        bad = _surrogate(value)
        if bad:
            raise MalformedBody(f"invalid value for {_where(path, field)}: not valid Unicode (lone surrogate {bad})",
                                _param(path, field), "invalid_value")


def _surrogate(text: str) -> str | None:
    """The first lone surrogate in `text`, spelled as a JSON escape; None when there is none."""
    if text.isascii():
        return None
    match = _SURROGATE.search(text)
    return f"\\u{ord(match.group()):04x}" if match else None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string"}.get(type(value), "a number")


def _param(path: tuple, field: str | None = None) -> str | None:
    """The param of a refusal: the body's field at `path`, or the string field `field` whatever `path` is
    inside its JSON text."""
    return field or ".".join(str(p) for p in path) or None


def _where(path: tuple, field: str | None = None) -> str:
    inside = ".".join(str(p) for p in path)
    if field is not None:
        return f"'{field}'" + (f" (at {inside} in its JSON)" if inside else "")
    return f"'{inside}'" if path else "the request body"
