"""A request's output constraint as the frontends validated it, before it is compiled."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SpecKind(str, Enum):
    REGEX = "regex"  # the Rust `regex` dialect: no look-around, no backreferences
    CHOICE = "choice"  # one of `choices`, exactly
    JSON_SCHEMA = "json_schema"  # `value` is the schema's JSON text
    JSON_OBJECT = "json_object"  # one top-level JSON object of any content
    GRAMMAR = "grammar"  # GBNF/EBNF with a `root ::= ...` rule, else Lark


@dataclass(frozen=True)
class GuidedSpec:
    kind: SpecKind
    value: str = ""  # the regex, schema text or grammar (empty for choice and json_object)
    choices: tuple[str, ...] = ()
    # The request field it came from, so compile errors can name it (e.g.
    # "params.decoding.regex" over gRPC, "response_format" over HTTP).
    field: str = ""
