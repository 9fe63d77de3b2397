"""An SSE event the server writes is one line for every client, whatever text it carries.

JSON leaves U+0085, U+2028 and U+2029 raw inside strings; clients that split a stream with
str.splitlines (httpx's aiter_lines, requests' iter_lines(decode_unicode=True)) take them for line ends
and get half an event. The server escapes them: the same JSON value, on one line.
"""

from __future__ import annotations

import json

from pdserve.server.protocol import CompletionChunk, CompletionChoice
from pdserve.server.serving import sse

TEXT = "line\u2028next\x85and\u2029last, caf\u00e9 \u4e2d"


def test_a_chunk_whose_text_holds_unicode_line_ends_is_one_line_of_the_same_json():
    chunk = CompletionChunk(id="cmpl-1", created=0, model="m",
                            choices=[CompletionChoice(index=0, text=TEXT)])
    event = sse(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    line = event[len("data: "):-2]
    assert line.splitlines() == [line]
    assert json.loads(line)["choices"][0]["text"] == TEXT
    assert "caf\u00e9 \u4e2d" in line  # other non-ASCII text stays as it was
