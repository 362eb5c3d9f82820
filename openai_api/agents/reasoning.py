"""Reasoning parsers (`--reasoning-parser`): a thinking model's `<think>…</think>` text becomes
`reasoning_content` (and `reasoning`, vLLM ≥ 0.10's name), the rest `content`.

    deepseek_r1  the output starts inside a thought (the template opened it, or the model
                 writes `<think>` first); everything up to `</think>` is reasoning, and an
                 output that never closes it is all reasoning
    qwen3        a thought only when the output starts with `<think>` (Qwen3 with
                 `enable_thinking: false` writes none); otherwise all content

The prompt decides first: a generation prompt that ends with `<think>` opens the thought
(Qwen3-Thinking-2507 and DeepSeek-R1 templates), one that ends with `</think>` closed it
(Qwen3's `enable_thinking: false`), and then the output is all content.

Like the tool parsers, `split` is a pure function of the text so far whose two parts only grow
(a marker cut in half is held back), so streamed parts add up to the non-streamed split.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from tandem_serve.frontend.validation import ValidationError
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.openai_api.agents.tool_parsers.json_scan import settled

THINK, END_THINK = "<think>", "</think>"


class Start(str, Enum):
    THOUGHT = "thought"  # the output starts inside a thought
    CONTENT = "content"  # the prompt closed the thought: no reasoning in the output
    AUTO = "auto"  # a thought only if the output opens one


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str


class ReasoningParser:
    name: ClassVar[str] = ""
    default: ClassVar[Start] = Start.THOUGHT

    def start(self, prompt: str) -> Start:
        tail = prompt.rstrip()
        if tail.endswith(END_THINK):
            return Start.CONTENT
        if tail.endswith(THINK):
            return Start.THOUGHT
        return self.default

    def split(self, text: str, start: Start, final: bool) -> ReasoningSplit:
        if start == Start.CONTENT:
            return ReasoningSplit("", text)
        lead = len(text) - len(text.lstrip())
        opened = text.startswith(THINK, lead)
        if not final and not opened and THINK.startswith(text[lead:]):
            return ReasoningSplit("", "")  # nothing yet, or the start of <think>
        if start == Start.AUTO and not opened:
            return ReasoningSplit("", text)
        body = lead + len(THINK) if opened else 0
        end = text.find(END_THINK, body)
        if end >= 0:
            return ReasoningSplit(text[body:end], text[end + len(END_THINK):])
        thought = text[body:]
        return ReasoningSplit(settled(thought, END_THINK, final), "")


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    default = Start.THOUGHT


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    default = Start.AUTO


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def reasoning_parser(name: str) -> ReasoningParser:
    return REASONING_PARSERS[name]()


# A thought: any text that ends with the first </think> (one lexeme, so llguidance's greedy
# lexer ends it right there; a thought lexeme without the marker would swallow the `</think`
# and fail at `>`).
_THOUGHT = r"THOUGHT: /(?s:.*)<\/think>/ & ~/(?s:.*)<\/think>(?s:.+)/"
_OPEN = r"OPEN: /[ \t\r\n]*<think>/"
_WS = r"WS: /[ \t\r\n]+/"


def _lark_regex(regex: str) -> str:
    """A regex as a Lark /.../ literal: its unescaped slashes escaped."""
    out, escaped = [], False
    for c in regex:
        if c == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(c)
        escaped = c == "\\" and not escaped
    return "/" + "".join(out) + "/"


def _no_gbnf(text: str) -> str:
    # The compiler reads a grammar with "::=" on a line as GBNF; JSON text has it only
    # inside strings, where \u003a is the same colon.
    return text.replace("::=", "\\u003a:=")


def _body(spec: GuidedSpec) -> list[str]:
    if spec.kind in (SpecKind.JSON_SCHEMA, SpecKind.JSON_OBJECT):
        schema = spec.value if spec.kind == SpecKind.JSON_SCHEMA else '{"type": "object"}'
        return [f"body: %json {_no_gbnf(json.dumps(json.loads(schema)))}"]
    if spec.kind == SpecKind.REGEX:
        if "::=" in spec.value:
            raise ValidationError(spec.field, "a regex with '::=' cannot follow a thought")
        return ["body: BODY", f"BODY: {_lark_regex(spec.value)}"]
    if spec.kind == SpecKind.CHOICE:
        return ["body: " + " | ".join(_no_gbnf(json.dumps(c, ensure_ascii=False))
                                       for c in spec.choices)]
    raise ValidationError(spec.field, "a grammar cannot be combined with the server's "
                                      "--reasoning-parser (it would have to describe the "
                                      "thought too); use guided_json, guided_regex, "
                                      "guided_choice or response_format")


def after_thought(spec: GuidedSpec, start: Start) -> GuidedSpec:
    """The constraint for the content after the thought: the thought itself is free text up to
    the first `</think>` (what the reasoning parser splits at), and the request's constraint
    applies from there on, as an llguidance grammar. A thought the prompt closed already
    leaves the constraint as it is."""
    if start == Start.CONTENT:
        return spec
    head = "start: THOUGHT WS? body" if start == Start.THOUGHT else \
        "start: OPEN THOUGHT WS? body | WS? body"
    lark = "\n".join([head, *_body(spec), _THOUGHT, _OPEN, _WS]) + "\n"
    return GuidedSpec(SpecKind.GRAMMAR, lark, field=spec.field)
