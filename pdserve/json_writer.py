"""JSON written so that other threads run meanwhile.

json's C encoder holds the GIL for the whole value: 1.2 s for 8 M numbers, during which the event loop and the
engine's thread stand still. `json_dumps` writes a value of many items (a client's tool schema of megabytes
into a chat template, a body the orchestrator passes on) with Python's encoder instead, which lets other
threads have the GIL between items; a small value still goes through C. Its caller runs it in a worker thread
when the value may be big (server/serving.py, orchestrator/upstream.py).
"""

from __future__ import annotations

import json
from typing import Any

_SLICE = 1 << 16  # pieces joined at once: one join of millions of pieces holds the GIL too (~0.1 s for 4 M)


# Items (array elements, object members) in a value past which json_dumps writes it with Python's encoder
_DUMP_IN_C = 1 << 16


def items_at_least(value: Any, bound: int) -> int:
    """The items (array elements and object members, at every depth) `value` holds, counted until `bound`: a
    walk of at most ~`bound` steps, whatever the value's size."""
    count, todo = 0, [value]
    while todo and count < bound:
        v = todo.pop()
        if isinstance(v, (dict, list)):
            count += len(v)
            if count < bound:
                todo.extend(x for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (dict, list)))
    return count


def json_dumps(value: Any, **kw: Any) -> str:
    """json.dumps(value, **kw). A value of more than _DUMP_IN_C items (a client's tool schema of megabytes, a body
    the orchestrator passes on) is written by Python's encoder, which lets other threads have the GIL between
    items: json's C encoder holds it throughout (1.2 s for 8 M numbers; Python's takes ~4x as long, in a worker
    thread, without stopping the event loop)."""
    if items_at_least(value, _DUMP_IN_C) < _DUMP_IN_C:
        return json.dumps(value, **kw)
    # Joined a slice at a time: one join of millions of pieces holds the GIL too (~0.1 s for 4 M numbers)
    text, pieces = [], []
    for piece in json.JSONEncoder(**kw).iterencode(value):  # (not one-shot: the pure-Python encoder)
        pieces.append(piece)
        if len(pieces) == _SLICE:
            text.append("".join(pieces))
            pieces.clear()
    return "".join(text) + "".join(pieces)
