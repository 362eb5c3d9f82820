"""Calls written under a guided constraint (`tool_choice` "required" or a named function):
the output is JSON by construction, so reading it needs no markers.

    required   [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]
    named      {"city": "Paris"}          (the named function's arguments, nothing else)
"""
from __future__ import annotations

from tandem_serve.openai_api.agents.tool_parsers.base import CallScan, Scan, ToolParser, call_of
from tandem_serve.openai_api.agents.tool_parsers.json_scan import Invalid, scan_object, skip_ws


class RequiredParser(ToolParser):
    """A JSON array of {name, parameters} objects, as `tools.required_schema` describes."""

    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan("")
        i = skip_ws(text, 0)
        if i < len(text) and text[i] == "[":
            self._items(text, skip_ws(text, i + 1), final, out)
        if final and not out.calls:  # not what the constraint allows: keep the text
            out.content = text
        return out

    @staticmethod
    def _items(text: str, j: int, final: bool, out: Scan) -> None:
        while j < len(text) and text[j] == "{":
            try:
                obj = scan_object(text, j, final)
                call = call_of(text, obj, ("parameters", "arguments"))
            except Invalid:
                return
            if call is None:
                return
            out.calls.append(call)
            if obj.end is None:
                return
            j = skip_ws(text, obj.end)
            if j >= len(text) or text[j] != ",":
                return
            j = skip_ws(text, j + 1)


class NamedParser(ToolParser):
    """The whole output is the arguments of one known function."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        args = text.lstrip()
        if not args and not final:
            return Scan("")  # the call starts with its first character (after a thought)
        return Scan("", [CallScan(self.function, args, final)])
