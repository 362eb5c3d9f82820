"""Mistral: content, then `[TOOL_CALLS]` and the calls, in either of Mistral's two forms:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]   (v0.3)
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{}      (tokenizer v11+; also with
                                                                   [ARGS] after the name)

`[TOOL_CALLS]` is a special token in Mistral's tokenizers, which the detokenizer drops, so a
request this parser reads keeps special tokens in its text (as vLLM does; unless the request
sets `skip_special_tokens` itself), and the EOS token's text is cut off the end. Mistral's
chat templates want tool-call ids of 9 letters and digits, so this parser makes those.
"""
from __future__ import annotations

import re
import secrets
import string

from tandem_serve.openai_api.agents.tool_parsers.base import (
    CallScan,
    Content,
    Scan,
    ToolParser,
    call_of,
)
from tandem_serve.openai_api.agents.tool_parsers.json_scan import (
    Invalid,
    scan_object,
    settled,
    skip_ws,
    value_end,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def scan(self, text: str, final: bool) -> Scan:
        content, out = Content(), Scan("")
        k = text.find(BOT)
        if k < 0:
            content.text(settled(text, BOT, final))
        else:
            content.text(text[:k])
            i = skip_ws(text, k + len(BOT))
            if i < len(text) and text[i] == "[":
                _array(text, k, i, final, content, out)
            else:
                _named(text, k, final, content, out)
        out.content = content.render(final)
        return out


def _named(text: str, k: int, final: bool, content: Content, out: Scan) -> None:
    """`[TOOL_CALLS]name[ARGS]{...}`, repeated; k is the first marker."""
    while True:
        i = skip_ws(text, k + len(BOT))
        m = _NAME.match(text, i)
        j = m.end() if m else i
        if m and text.startswith(ARGS, j):
            j += len(ARGS)
        elif m and ARGS.startswith(text[j:]) and not final:
            return  # the name or [ARGS] may go on
        j = skip_ws(text, j)
        if j >= len(text) and not final:
            return
        if m is None or j >= len(text) or text[j] != "{":
            content.text(text[k:])  # not a call: the marker is text, and what follows
            return
        end = value_end(text, j, final)
        content.call()
        out.calls.append(CallScan(m.group(), text[j:end], True) if end is not None
                         else CallScan(m.group(), text[j:]))
        if end is None:
            return
        k = text.find(BOT, end)
        if k < 0:
            rest = text[end:]
            content.text(settled(rest, BOT, final))
            return
        content.text(text[end:k])


def _array(text: str, k: int, i: int, final: bool, content: Content, out: Scan) -> None:
    """`[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]`; text[i] is the `[`."""
    j = skip_ws(text, i + 1)
    first = len(out.calls)
    while j < len(text):
        try:
            if text[j] != "{":
                raise Invalid("not an object")
            obj = scan_object(text, j, final)
            call = call_of(text, obj)
        except Invalid:
            content.text(text[j:] if len(out.calls) > first else text[k:])
            return
        if call is None:
            if final:
                content.text(text[j:] if len(out.calls) > first else text[k:])
            return
        content.call()
        out.calls.append(call)
        if obj.end is None:
            return
        j = skip_ws(text, obj.end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] == "]":
            content.text(text[j + 1:])
            return
        elif j < len(text):
            content.text(text[j:])
            return
    if final and len(out.calls) == first:
        content.text(text[k:])
