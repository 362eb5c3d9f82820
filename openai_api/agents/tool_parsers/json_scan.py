"""How far a JSON value or object reaches in a text that may still be growing.

Tool-call parsers see model output a delta at a time and must say, at every moment, what
they know for sure: a call's name once its string is closed, its arguments as the raw text
written so far. These helpers answer on the whole text seen so far, so a parser built on
them gives the same answer however the text was cut into deltas. They check structure
(brackets, strings, keys), not every rule of JSON: a complete value is what `json.loads`
judges, when it matters.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"
# A closed string, a bracket, or a lone quote (a string still open at the end of the text).
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]"]', re.S)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_SCALAR_START = "-0123456789tfn"


class Invalid(ValueError):
    """The text cannot be the JSON the parser expects, whatever follows."""


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in WHITESPACE:
        i += 1
    return i


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (0: none):
    text a later delta may turn into the marker, so it is held back."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def settled(text: str, marker: str, final: bool) -> str:
    """`text` as far as it can be shown: all of it once final, else without an end that a
    later delta may still turn into `marker`."""
    return text if final else text[:len(text) - partial_suffix(text, marker)]


def value_end(text: str, i: int, final: bool) -> int | None:
    """Where the JSON value starting at text[i] ends; None while the text ends inside it
    (a final text: the value was cut short). Invalid if no value starts there."""
    if i >= len(text):
        return None
    c = text[i]
    if c in "{[":
        fast = _decoded_end(text, i)
        if fast != _UNKNOWN:
            return fast
        depth = 0
        for part in _STRUCTURE.finditer(text, i):
            token = part.group()
            if token == '"':
                return None  # an unterminated string runs to the end
            if token in "{[":
                depth += 1
            elif token in "}]":
                depth -= 1
                if depth == 0:
                    return part.end()
        return None
    if c == '"':
        string = _STRING.match(text, i)
        return string.end() if string else None
    m = _SCALAR.match(text, i)
    if m and (m.end() < len(text) or final):
        return m.end()
    rest = text[i:]
    if c in _SCALAR_START and (m or any(w.startswith(rest) for w in ("true", "false", "null"))
                               or rest == "-"):
        return None  # a number or literal still being written
    raise Invalid(f"no JSON value starts at {rest[:20]!r}")


_DECODER = json.JSONDecoder()
_UNKNOWN = -1


def _decoded_end(text: str, i: int) -> int | None:
    """The end of a valid JSON value at text[i] by the C decoder, None when the decoder ran
    out of text (the value is still being written), _UNKNOWN otherwise (invalid JSON: the
    bracket count decides). Rescanning a growing argument in Python on every delta costs
    O(n) per delta; this keeps that at C speed."""
    try:
        return _DECODER.raw_decode(text, i)[1]
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text):
            return None
        if exc.msg.startswith("Unterminated string") and _STRING.match(text, exc.pos) is None:
            return None
        return _UNKNOWN


@dataclass
class ObjectScan:
    """A JSON object as far as the text goes: each key's value span (end None: still open)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # just past the closing brace, once written
    invalid: bool = False  # the text went wrong before the object closed


def scan_object(text: str, i: int, final: bool) -> ObjectScan:
    """The object that starts with the `{` at text[i]."""
    out = ObjectScan()
    n = len(text)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        out.end = j + 1
        return out
    while j < n:
        if text[j] != '"':
            out.invalid = True
            return out
        key = _STRING.match(text, j)
        if key is None:
            return out
        j = skip_ws(text, key.end())
        if j >= n:
            return out
        if text[j] != ":":
            out.invalid = True
            return out
        j = skip_ws(text, j + 1)
        if j >= n:
            return out
        try:
            end = value_end(text, j, final)
        except Invalid:
            out.invalid = True
            return out
        out.fields.setdefault(json.loads(key.group()), (j, end))
        if end is None:
            return out
        j = skip_ws(text, end)
        if j >= n:
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] != ",":
            out.invalid = True
            return out
        j = skip_ws(text, j + 1)
    return out
