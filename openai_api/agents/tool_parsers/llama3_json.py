"""Llama 3.1 / 3.2 JSON tool calls: the whole output is one or more call objects, optionally
after `<|python_tag|>`, separated by `;`.

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

An output that does not start with `{` (after whitespace and the tag) is plain content, as in
vLLM's parser; so is whatever follows the last object that parses as a call. The key of the
arguments is `parameters` (Llama's) or `arguments`.
"""
from __future__ import annotations

from tandem_serve.openai_api.agents.tool_parsers.base import Content, Scan, ToolParser, call_of
from tandem_serve.openai_api.agents.tool_parsers.json_scan import Invalid, scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        tagged = text.startswith(PYTHON_TAG, i)
        if tagged:
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return Scan("")  # nothing but whitespace or the start of the tag yet
        if i >= len(text):
            return Scan("" if tagged or not final else text)
        if text[i] != "{":
            return Scan(text if final else text.rstrip())
        return self._calls(text, i, final)

    @staticmethod
    def _calls(text: str, i: int, final: bool) -> Scan:
        content, out = Content(), Scan("")
        while True:
            try:
                obj = scan_object(text, i, final)
                call = call_of(text, obj)
            except Invalid:
                content.text(text[i:])  # not a call: the rest is text
                break
            if call is None:
                if final:
                    content.text(text[i:])
                break
            content.call()
            out.calls.append(call)
            if obj.end is None:
                break
            i = skip_ws(text, obj.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            if i >= len(text):
                break
            if text[i] != "{":
                content.text(text[i:])
                break
        out.content = content.render(final)
        return out
