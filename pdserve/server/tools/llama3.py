"""Llama 3.1's (to 3.3) tool-call syntax: the whole output is one [<|python_tag|>]{"name": N, "parameters": {...}}."""

from __future__ import annotations

import json

from pdserve.server.tools.base import Call, Cursor, Invalid, Scan, Syntax, call_object_schema, json_call, scan_with
from pdserve.server.tools.partial_json import skip_ws


class Llama3(Syntax):
    """Llama 3.1's: the whole output is one {"name": ..., "parameters": {...}} (after an optional <|python_tag|>).
    Asked for by a template whose text names `"parameters": dictionary of argument name` or writes
    <|python_tag|>. JSON without "parameters" (or "arguments") is content."""

    name = "llama3"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)
    example = '{"name": <function-name>, "parameters": <args-object>}'

    def asks_for(self, template: str) -> bool:
        return '"parameters": dictionary of argument name' in template or self.PYTHON_TAG in template

    def grammar(self, functions: list[dict], parallel: bool, special: dict[str, int] | None = None) -> str:
        schema = call_object_schema(functions, "parameters")
        return f"start: %json {json.dumps(schema)}\n"  # one call a turn, as Llama 3.1's template asks

    def scan(self, text: str, schemas: dict[str, dict], final: bool) -> Scan:
        i = skip_ws(text, 0)
        body = text[i:]
        if not body.startswith(("{", self.PYTHON_TAG)) and (final or not self.PYTHON_TAG.startswith(body)):
            return Scan(len(text))  # an output that begins so is no call

        def read(cur: Cursor, calls: list[Call], scan: Scan) -> None:
            cur.ws()
            if cur.at(self.PYTHON_TAG):
                cur.ws()
            calls.append(Call())
            json_call(cur, calls[0], ("parameters", "arguments"), name_needs_arguments=True)
            cur.ws()
            if cur.rest():
                raise Invalid

        return scan_with(text, 0, final, read)

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
