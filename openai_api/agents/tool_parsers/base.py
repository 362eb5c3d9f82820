"""What a tool-call parser answers, and the stream that turns its answers into deltas.

A parser is a pure function of the text so far: `scan(text, final)` says which content and
which calls the text holds *for sure* — content that no later text can turn into a call,
each call once its name is known, with its arguments as the raw JSON text written so far.
Every parser keeps that answer growing by appending only (text that might still become a
marker or a call is held back until it is decided), so `ToolStream` sends each moment's
answer minus what it sent before, and the deltas of any split of an output add up to
`scan(output, final=True)`: the non-streamed answer. Arguments are the model's own JSON
text, byte for byte, in both modes.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from tandem_serve.openai_api.agents.tool_parsers.json_scan import Invalid, ObjectScan

# The keys a call object may name its arguments by (Llama 3.x writes "parameters").
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallScan:
    name: str
    arguments: str  # the raw JSON text of the arguments so far
    complete: bool = False  # the arguments' value is closed


@dataclass
class Scan:
    content: str
    calls: list[CallScan] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Content:
    """Text outside the calls, in order; whitespace touching a call is dropped, and until the
    text is final its trailing whitespace waits (a call may follow it)."""

    def __init__(self) -> None:
        self._pieces: list[str | None] = []  # None: a call

    def text(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)

    def call(self) -> None:
        self._pieces.append(None)

    def render(self, final: bool) -> str:
        out = []
        last = len(self._pieces) - 1
        for k, piece in enumerate(self._pieces):
            if piece is None:
                continue
            if k > 0 and self._pieces[k - 1] is None:
                piece = piece.lstrip()
            if (k < last and self._pieces[k + 1] is None) or (k == last and not final):
                piece = piece.rstrip()
            out.append(piece)
        return "".join(out)


def call_of(text: str, obj: ObjectScan, keys: tuple[str, ...] = ARGUMENT_KEYS
            ) -> CallScan | None:
    """The call an object scan describes; None while its name is unknown. Invalid when it
    cannot be a call (closed or broken without a string name)."""
    span = obj.fields.get("name")
    if span is None or span[1] is None:
        if obj.end is not None or obj.invalid:
            raise Invalid("a call object needs a name")
        return None
    name = json.loads(text[span[0]:span[1]])
    if not isinstance(name, str) or not name:
        raise Invalid("a call's name must be a non-empty string")
    for key in keys:
        if key in obj.fields:
            start, end = obj.fields[key]
            return CallScan(name, text[start:end], True) if end is not None else \
                CallScan(name, text[start:])
    if obj.end is not None or obj.invalid:
        return CallScan(name, "{}", True)  # a call without arguments takes none
    return CallScan(name, "")


class ToolParser:
    """One model family's way of writing calls into its text."""

    name: ClassVar[str] = ""
    # Its marker is a special token in its models' tokenizers: the text must keep them.
    keeps_special_tokens: ClassVar[bool] = False

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def parse(self, text: str, new_id: Callable[[], str] | None = None
              ) -> tuple[str, list[ToolCall]]:
        """The whole output's content and calls (the non-streamed answer)."""
        scan = self.scan(text, final=True)
        new_id = new_id or self.new_id
        return scan.content, [ToolCall(new_id(), c.name, c.arguments) for c in scan.calls]


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # the first delta of a call carries its id and name
    name: str | None = None

    def to_json(self) -> dict[str, object]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolStream:
    """A parser over a growing text: each `feed` returns what became sure since the last."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None,
                 new_id: Callable[[], str] | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.new_id = new_id or parser.new_id
        self.text = ""
        self.content = ""  # sent so far
        self.calls: list[ToolCall] = []  # sent so far, arguments as sent

    def feed(self, delta: str, final: bool = False) -> ToolDelta:
        self.text += delta
        scan = self.parser.scan(self.text, final)
        out = ToolDelta(scan.content[len(self.content):])
        self.content += out.content
        for i, call in enumerate(scan.calls[:self.max_calls]):
            if i == len(self.calls):
                self.calls.append(ToolCall(self.new_id(), call.name, call.arguments))
                out.calls.append(CallDelta(i, call.arguments, self.calls[i].id, call.name))
            elif len(call.arguments) > len(self.calls[i].arguments):
                more = call.arguments[len(self.calls[i].arguments):]
                self.calls[i].arguments += more
                out.calls.append(CallDelta(i, more))
        return out
