"""Guided-decoding tables built directly with outlines-core, for benchmarks and tests.

The serving path compiles constraints in `guided/` (regex, choice and JSON schema through
outlines-core, with a cache); this module is the small, uncached equivalent that the gpu
worker's benchmarks and tests use to get a `GuidedTable` for a model folder's tokenizer:

* `vocabulary()`: the tokenizer's tokens as the bytes they decode to (byte-level BPE through
  GPT-2's byte-to-unicode map; SentencePiece through "▁" = space and `<0xNN>` byte
  fallback), special tokens left out, as an `outlines_core.Vocabulary`;
* `table_from_index()`: an `outlines_core.Index` as the table the worker steps on the device:
  reachable states renumbered from the initial one, a DONE row, EOS allowed only in final
  states (to DONE), and identical token columns merged into classes (the semantics in
  `proto.messages.GuidedTable`).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

import numpy as np

from proto.messages import GuidedTable
from tokenization.tokenizer import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable stand-in of every byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    spec = json.loads(tokenizer.raw.to_str())
    parts = [spec.get("decoder") or {}, spec.get("pre_tokenizer") or {}]
    return '"ByteLevel"' in json.dumps(parts)


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
    """Every non-special token id and the bytes it stands for in decoded text."""
    byte_level = _is_byte_level(tokenizer)
    table = _byte_level_decoder()
    out: dict[int, bytes] = {}
    for token, tid in tokenizer.raw.get_vocab(with_added_tokens=True).items():
        if tid in tokenizer.special_ids:
            continue
        if byte_level:
            if all(ch in table for ch in token):
                out[tid] = bytes(table[ch] for ch in token)
            else:  # an added, non-special token: its text as written
                out[tid] = token.encode()
            continue
        fallback = _BYTE_FALLBACK.fullmatch(token)
        out[tid] = bytes([int(fallback.group(1), 16)]) if fallback else \
            token.replace("▁", " ").encode()
    return out


def vocabulary(tokenizer: Tokenizer) -> Any:
    """The tokenizer as an `outlines_core.Vocabulary` (EOS: its first EOS id)."""
    from outlines_core import Vocabulary

    by_bytes: dict[bytes, list[int]] = defaultdict(list)
    for tid, raw in token_bytes(tokenizer).items():
        if raw and tid not in tokenizer.eos_token_ids:
            by_bytes[raw].append(tid)
    return Vocabulary(tokenizer.eos_token_ids[0], dict(by_bytes))


def _reachable(transitions: dict[int, dict[int, int]], initial: int) -> list[int]:
    order, seen = [initial], {initial}
    for state in order:  # grows while iterating: a breadth-first walk
        for nxt in transitions.get(state, {}).values():
            if nxt not in seen:
                seen.add(nxt)
                order.append(nxt)
    return order


def table_from_index(index: Any, vocab_size: int, eos_ids: Sequence[int],
                     table_id: str) -> GuidedTable:
    """An `outlines_core.Index` as a `GuidedTable` over a model vocabulary of `vocab_size`."""
    transitions: dict[int, dict[int, int]] = index.get_transitions()
    order = _reachable(transitions, index.get_initial_state())
    number = {state: i for i, state in enumerate(order)}
    done = len(order)
    eos = set(eos_ids)
    columns: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for state in order:
        for tok, nxt in transitions.get(state, {}).items():
            if tok not in eos and 0 <= tok < vocab_size:
                columns[tok].append((number[state], number[nxt]))
    finals = sorted(number[s] for s in index.get_final_states() if s in number)
    for tok in eos:
        columns[tok] = [(f, done) for f in finals] + [(done, done)]
    classes: dict[tuple[tuple[int, int], ...], int] = {(): 0}  # class 0: never allowed
    token_class = np.zeros(vocab_size, dtype=np.int32)
    for tok, column in columns.items():
        token_class[tok] = classes.setdefault(tuple(column), len(classes))
    next_state = np.full((done + 1, len(classes)), -1, dtype=np.int32)
    for signature, cls in classes.items():
        for state, nxt in signature:
            next_state[state, cls] = nxt
    return GuidedTable(table_id, next_state, token_class, 0)


def regex_table(regex: str, tokenizer: Tokenizer, vocab_size: int) -> GuidedTable:
    """The table of a regex (the Rust `regex` dialect) over this tokenizer."""
    from outlines_core import Index

    index = Index(regex, vocabulary(tokenizer))
    digest = hashlib.sha256(f"{regex}\0{vocab_size}\0{tokenizer.eos_token_ids}".encode())
    for tid, raw in sorted(token_bytes(tokenizer).items()):
        digest.update(tid.to_bytes(4, "little") + raw)
    return table_from_index(index, vocab_size, tokenizer.eos_token_ids, digest.hexdigest()[:32])


def choice_regex(choices: Iterable[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def json_schema_regex(schema: dict[str, Any]) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    return str(build_regex_from_schema(json.dumps(schema)))
