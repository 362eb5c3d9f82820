"""Hermes / Qwen: each call is a JSON object between `<tool_call>` and `</tool_call>`.

    I'll look it up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the blocks is content. A block whose object has no string name (or is not an
object) is not a call: it stays in the content as written. The markers are matched as text,
so a tokenizer need not have them as single tokens.
"""
from __future__ import annotations

from tandem_serve.openai_api.agents.tool_parsers.base import Content, Scan, ToolParser, call_of
from tandem_serve.openai_api.agents.tool_parsers.json_scan import (
    Invalid,
    scan_object,
    settled,
    skip_ws,
)

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        content, out = Content(), Scan("")
        pos = 0
        while True:
            k = text.find(START, pos)
            if k < 0:
                tail = text[pos:]
                content.text(settled(tail, START, final))
                break
            content.text(text[pos:k])
            body = skip_ws(text, k + len(START))
            if body >= len(text) and not final:
                break  # the block has not said what it is yet
            try:
                if body >= len(text) or text[body] != "{":
                    raise Invalid("not an object")
                obj = scan_object(text, body, final)
                call = call_of(text, obj)
            except Invalid:
                content.text(START)  # not a call: the marker is text, and so is what follows
                pos = k + len(START)
                continue
            if call is None:
                if final:  # cut short before the name: what was written stays text
                    content.text(text[k:])
                break
            content.call()
            out.calls.append(call)
            if obj.end is None:
                break
            pos = self._after(text, obj.end, final)
            if pos < 0:
                break
        out.content = content.render(final)
        return out

    @staticmethod
    def _after(text: str, end: int, final: bool) -> int:
        """Where the text goes on after a call's object: past its `</tool_call>`, or at the
        next `<tool_call>` when the model left the block open; -1 while unknown."""
        close, again = text.find(END, end), text.find(START, end)
        if close >= 0 and (again < 0 or close < again):
            return close + len(END)
        if again >= 0:
            return again
        return end if final else -1
