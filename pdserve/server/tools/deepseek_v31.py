"""DeepSeek-V3.1's tool-call syntax: DeepSeek-V3's with a shorter call,
<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>."""

from __future__ import annotations

from pdserve.server.tools.base import Call, Cursor
from pdserve.server.tools.deepseek_v3 import DeepSeekV3


class DeepSeekV31(DeepSeekV3):
    """DeepSeek-V3.1's shorter form: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜> per call, in the
    same <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>. Asked for by a template that writes <｜tool▁sep｜> and no
    ```json fence."""

    name = "deepseek_v31"
    between = ""
    example = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><function-name><｜tool▁sep｜><args-object><｜tool▁call▁end｜>"
               "<｜tool▁calls▁end｜>")

    def asks_for(self, template: str) -> bool:
        return self.SEP in template and "```json" not in template

    def head(self, name: str) -> str:
        return f"{self.CALL}{name}{self.SEP}"

    def tail(self) -> str:
        return self.CALL_END

    def read_call(self, cur: Cursor, call: Call) -> None:
        cur.expect(self.CALL)
        call.name = cur.name_until(self.SEP)
        cur.json_object(call)
        cur.ws()
        cur.expect(self.CALL_END)
