"""DeepSeek-V3's (and R1's) tool-call syntax:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N
    ```json
    {...}
    ```<｜tool▁call▁end｜>, more calls, then <｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json

from pdserve.server.tools.base import (Call, Cursor, Scan, Syntax, held_from, json_schema, lark_literal, lark_text,
                                        scan_with)


class DeepSeekV3(Syntax):
    """DeepSeek-V3's (and R1's): <｜tool▁calls▁begin｜>, then per call <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    and its arguments in a ```json fence, then <｜tool▁call▁end｜>; <｜tool▁calls▁end｜> after the last. Asked
    for by a template that writes <｜tool▁sep｜> and a ```json fence. Its templates write a past call's arguments
    as the JSON text they are given."""

    name = "deepseek_v3"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    markers = (BEGIN, END, CALL, SEP, CALL_END)
    between = "\n"  # what its templates write between two calls
    arguments_as_text = True
    example = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>\n```json\n"
               "<args-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")

    def asks_for(self, template: str) -> bool:
        return self.SEP in template and "```json" in template

    def head(self, name: str) -> str:
        return f"{self.CALL}function{self.SEP}{name}\n```json\n"

    def tail(self) -> str:
        return f"\n```{self.CALL_END}"

    def grammar(self, functions: list[dict], parallel: bool, special: dict[str, int] | None = None) -> str:
        more = (f" ({lark_literal(self.between)} call)*" if self.between else " call*") if parallel else ""
        rules = [f"start: {lark_text(self.BEGIN, special)} call{more} {lark_text(self.END, special)}",
                 "call: " + " | ".join(f"f{i}" for i in range(len(functions)))]
        for i, f in enumerate(functions):
            rules.append(f"f{i}: {lark_text(self.head(f['name']), special)} a{i} {lark_text(self.tail(), special)}")
            rules.append(f"a{i}: %json {json_schema(f)}")
        return "\n".join(rules) + "\n"

    def read_call(self, cur: Cursor, call: Call) -> None:
        cur.expect(self.CALL)
        cur.expect("function")
        cur.expect(self.SEP)
        call.name = cur.name_until("\n")
        cur.expect("```json")
        cur.ws()
        cur.json_object(call)
        cur.ws()
        cur.expect("```")
        cur.ws()
        cur.expect(self.CALL_END)

    def scan(self, text: str, schemas: dict[str, dict], final: bool) -> Scan:
        start = text.find(self.BEGIN)
        if start < 0:
            return Scan(len(text) if final else held_from(text, self.BEGIN))

        def read(cur: Cursor, calls: list[Call], scan: Scan) -> None:
            cur.expect(self.BEGIN)
            while True:
                cur.ws()
                if calls and (final and not cur.rest() or cur.at(self.END)):  # (a model may stop before the end)
                    scan.rest = cur.rest()
                    return
                calls.append(Call())
                self.read_call(cur, calls[-1])

        return scan_with(text, start, final, read)

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        body = self.between.join(self.head(n) + json.dumps(a, ensure_ascii=False) + self.tail() for n, a in calls)
        return self.BEGIN + body + self.END
