"""Each constraint form as what its compiler takes: a regex for outlines-core, Lark for llguidance.

* regex: as given, in the Rust `regex` dialect outlines-core compiles (no look-around, no
  backreferences; `\\d` and `\\w` are Unicode classes, as there).
* choice: an alternation of the escaped choices, so the output is exactly one of them.
* json_schema: outlines-core's `build_regex_from_schema` with its defaults: at most one space
  where JSON allows whitespace (`[ ]?`; unbounded whitespace lets a model loop on blanks
  forever), nesting of recursive schemas cut at depth 3. It enforces string lengths, item
  counts, pattern, enum, const and the common formats; numeric bounds (minimum, maximum,
  multipleOf) are accepted and not enforced, as in vLLM's outlines backend.
* json_object (format=JSON): one top-level JSON object of any content, which is the regex
  outlines-core builds for the schema {"type": "object"}: values nest two levels below the
  top object (objects and arrays inside objects and arrays), whitespace as above. A regex
  cannot count brackets, so deeper nesting is out; that depth already has 1623 states on a
  32k vocabulary and compiles in 8-20 s on one core, which is why it is precompiled at
  start-up (docs/DESIGN.md).
* grammar: GBNF/EBNF (a line with `::=`) converted to llguidance's Lark, else Lark as given
  (vLLM's rule).

Pure Python but for the two compilers, which are imported where they run (the compile worker).
"""
from __future__ import annotations

import json
import re
from typing import Any

from tandem_serve.guided.spec import GuidedSpec, SpecKind

# Rust regex-syntax's meta characters (regex_syntax::is_meta_character).
_RUST_META = set("\\.+*?()|[]{}^$#&-~")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class FormError(ValueError):
    """The constraint is malformed; the message says what and where."""


def escape_rust(text: str) -> str:
    return "".join("\\" + c if c in _RUST_META else c for c in text)


def choice_regex(choices: tuple[str, ...]) -> str:
    return "(" + "|".join(escape_rust(c) for c in choices) + ")"


def parse_schema(text: str) -> dict[str, Any]:
    """The schema as a JSON object; FormError naming the problem otherwise."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormError(f"not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise FormError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return schema


def schema_regex(text: str) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    parse_schema(text)
    try:
        return str(build_regex_from_schema(text))
    except ValueError as e:  # outlines' message ends in a plea to open an issue there
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FormError(f"unsupported JSON schema: {first}") from None


def json_object_regex() -> str:
    from outlines_core.json_schema import build_regex_from_schema

    return str(build_regex_from_schema(JSON_OBJECT_SCHEMA))


def spec_regex(spec: GuidedSpec) -> str:
    """The regex of a regular constraint (every kind but grammar)."""
    if spec.kind == SpecKind.REGEX:
        return spec.value
    if spec.kind == SpecKind.CHOICE:
        return choice_regex(spec.choices)
    if spec.kind == SpecKind.JSON_SCHEMA:
        return schema_regex(spec.value)
    if spec.kind == SpecKind.JSON_OBJECT:
        return json_object_regex()
    raise ValueError(f"{spec.kind.value} is not a regular constraint")


def explain_regex(regex: str) -> str:
    """Why the regex does not parse, in regex-syntax's words (llguidance parses the same
    dialect and says where; outlines-core only says the automaton failed); "" if it parses."""
    import llguidance

    message = llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_regex(regex))
    if "regex parse error:" not in message:
        return ""
    detail = message.split("regex parse error:", 1)[1]
    detail = detail.split("\n   1 | start:", 1)[0].rstrip()
    return "invalid regular expression:" + detail


_COMMENT = re.compile(r"(#|//).*$")


def is_gbnf(grammar: str) -> bool:
    """vLLM's test: any line with `::=` (outside a comment) makes it GBNF/EBNF, else Lark."""
    return any("::=" in _COMMENT.sub("", line) for line in grammar.splitlines())


def grammar_lark(grammar: str) -> str:
    """The grammar in llguidance's Lark dialect; FormError when GBNF does not convert."""
    if not grammar.strip():
        raise FormError("must not be empty")
    if not is_gbnf(grammar):
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return str(gbnf_to_lark(grammar))
    except Exception as e:  # GbnfToLarkError and the parser's own asserts
        raise FormError(f"GBNF grammar does not parse: {e}") from None
