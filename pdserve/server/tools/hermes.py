"""Hermes's tool-call syntax, Qwen2.5's, Qwen3's (dense and MoE) and SmolLM2's too: the default.

    <tool_call>
    {"name": N, "arguments": {...}}
    </tool_call>

any number of them, text around them.
"""

from __future__ import annotations

import json

from pdserve.server.tools.base import NL, Scan, Syntax, call_object_schema, json_call, lark_text, scan_tagged


class Hermes(Syntax):
    """<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, any number, text around them. The default."""

    name = "hermes"
    TAG, END = "<tool_call>", "</tool_call>"
    markers = (TAG, END)
    example = '<tool_call>\n{"name": <function-name>, "arguments": <args-object>}\n</tool_call>'

    def asks_for(self, template: str) -> bool:
        return True

    def grammar(self, functions: list[dict], parallel: bool, special: dict[str, int] | None = None) -> str:
        schema = call_object_schema(functions, "arguments")
        more = ' ("\\n" call)*' if parallel else ""  # calls one a line, as Qwen's templates write them
        tag, end = lark_text(self.TAG + NL, special), lark_text(NL + self.END, special)
        return f"start: call{more}\ncall: {tag} body {end}\nbody: %json {json.dumps(schema)}\n"

    def scan(self, text: str, schemas: dict[str, dict], final: bool) -> Scan:
        return scan_tagged(text, self.TAG, self.END, final,
                           lambda cur, call: json_call(cur, call, ("arguments", "parameters"), False))

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                         for n, a in calls)
