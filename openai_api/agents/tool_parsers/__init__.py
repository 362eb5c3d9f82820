"""Tool-call parsers: each turns one model family's written calls into OpenAI tool calls
(`--enable-auto-tool-choice --tool-call-parser NAME`).

`base` holds the contract (a pure `scan` of the text so far that only ever grows, and the
stream that diffs it), `json_scan` the incremental JSON reading they share.
"""
from __future__ import annotations

from tandem_serve.openai_api.agents.tool_parsers.base import ToolParser
from tandem_serve.openai_api.agents.tool_parsers.hermes import HermesParser
from tandem_serve.openai_api.agents.tool_parsers.llama3_json import Llama3JsonParser
from tandem_serve.openai_api.agents.tool_parsers.mistral import MistralParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str) -> ToolParser:
    return TOOL_PARSERS[name]()
