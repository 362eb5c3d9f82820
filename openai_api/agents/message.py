"""One chat choice's output as an assistant message: reasoning, content and tool calls.

The engine's text goes through the reasoning parser first (if the server has one), and the
content part then through the request's tool parser (auto: the server's, required / named: the
JSON the constraint wrote). `MessageStream.feed` returns what became sure since the last
delta; `message()` parses a whole output at once. Both run the same pure scans, so a stream
adds up to the non-streamed message however the engine's deltas were cut.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tandem_serve.openai_api.agents.reasoning import ReasoningParser, Start
from tandem_serve.openai_api.agents.tool_parsers.base import (
    CallDelta,
    ToolCall,
    ToolParser,
    ToolStream,
)
from tandem_serve.openai_api.agents.tool_parsers.json_scan import partial_suffix


class ToolMode(str, Enum):
    NONE = "none"  # no calls: the text is content
    AUTO = "auto"  # the server's parser finds calls in free text
    REQUIRED = "required"  # guided: a JSON array of calls
    NAMED = "named"  # guided: the arguments of one function


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class Message:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]

    def to_json(self, with_reasoning: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if with_reasoning:  # vLLM's two names for it
            out["reasoning_content"] = out["reasoning"] = self.reasoning
        if self.calls:
            out["tool_calls"] = [c.to_json() for c in self.calls]
        return out


@dataclass
class Output:
    """How a request's choices read their text (shared by its choices)."""

    mode: ToolMode = ToolMode.NONE
    parser: ToolParser | None = None  # None with ToolMode.NONE
    new_id: Callable[[], str] | None = None  # the server parser's id style
    max_calls: int | None = None  # 1 with parallel_tool_calls: false
    reasoning: ReasoningParser | None = None
    start: Start = Start.CONTENT
    # The text of the EOS tokens, when special tokens are kept in the text (mistral's
    # [TOOL_CALLS]): the one the output ends with is no part of the message.
    eos_texts: tuple[str, ...] = ()

    def stream(self) -> MessageStream:
        return MessageStream(self)

    def message(self, text: str) -> Message:
        reasoning, content = self._split(self.trim(text, True), True)
        calls: list[ToolCall] = []
        if self.parser is not None:
            content, calls = self.parser.parse(content, self.new_id)
            calls = calls[:self.max_calls]
        return Message(reasoning if self.reasoning is not None and reasoning else None,
                       None if calls and not content else content, calls)

    def trim(self, text: str, final: bool) -> str:
        """The text without the EOS token's text it ends with; until the text is final, a
        possible start of one waits."""
        for eos in self.eos_texts:
            if text.endswith(eos):
                return text[:-len(eos)]
            if not final:
                text = text[:len(text) - partial_suffix(text, eos)]
        return text

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        split = self.reasoning.split(text, self.start, final)
        return split.reasoning, split.content

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model called (a `length` stays `length`); a named
        function ends with "stop", as in vLLM."""
        if reason == "stop" and has_calls and self.mode in (ToolMode.AUTO, ToolMode.REQUIRED):
            return "tool_calls"
        return reason


class MessageStream:
    def __init__(self, output: Output) -> None:
        self.output = output
        self.text = ""
        self.reasoning = ""  # sent so far
        self.content_in = ""  # the content part so far (before tool parsing)
        self.tools = ToolStream(output.parser, output.max_calls, output.new_id) \
            if output.parser is not None else None

    @property
    def has_calls(self) -> bool:
        return bool(self.tools and self.tools.calls)

    def feed(self, delta: str, final: bool) -> MessageDelta:
        self.text += delta
        reasoning, content = self.output._split(self.output.trim(self.text, final), final)
        out = MessageDelta(reasoning[len(self.reasoning):])
        self.reasoning += out.reasoning
        fresh = content[len(self.content_in):]
        self.content_in += fresh
        if self.tools is None:
            out.content = fresh
        else:
            tools = self.tools.feed(fresh, final)
            out.content, out.calls = tools.content, tools.calls
        return out


def message_deltas(d: MessageDelta, with_reasoning: bool) -> list[dict[str, Any]]:
    """A message delta as chat chunk deltas: reasoning, then content, then tool calls."""
    out: list[dict[str, Any]] = []
    if d.reasoning and with_reasoning:
        out.append({"reasoning_content": d.reasoning, "reasoning": d.reasoning})
    if d.content:
        out.append({"content": d.content})
    if d.calls:
        out.append({"tool_calls": [c.to_json() for c in d.calls]})
    return out
