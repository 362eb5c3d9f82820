"""What the frontend and its compile worker say over the worker's stdin/stdout pipes.

Each message is a 4-byte little-endian length and a msgpack map (no pickle: the worker's
answers build only the dataclasses named here). The worker says `ready` once, then answers
each `compile` request in order.
"""
from __future__ import annotations

import struct
from typing import Any, BinaryIO

import msgpack
import numpy as np

from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 1 << 30


def frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def unframe_length(head: bytes) -> int:
    (n,) = _LENGTH.unpack(head)
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes")
    return int(n)


def unpack(body: bytes) -> dict[str, Any]:
    out = msgpack.unpackb(body, raw=False)
    if not isinstance(out, dict):
        raise ValueError("not a message")
    return out


def read_message(stream: BinaryIO) -> dict[str, Any] | None:
    """Blocking read (the worker's side); None at end of stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    n = unframe_length(head)
    body = stream.read(n)
    if len(body) < n:
        return None
    return unpack(body)


def spec_message(key: str, spec: GuidedSpec) -> dict[str, Any]:
    return {"key": key, "kind": spec.kind.value, "value": spec.value,
            "choices": list(spec.choices)}


def spec_from(message: dict[str, Any]) -> GuidedSpec:
    return GuidedSpec(kind=SpecKind(message["kind"]), value=str(message.get("value", "")),
                      choices=tuple(str(c) for c in message.get("choices", ())))


def compiled_message(item: GuidedTable | GuidedGrammar) -> dict[str, Any]:
    if isinstance(item, GuidedGrammar):
        return {"grammar_id": item.grammar_id, "lark": item.lark}
    return {"table_id": item.table_id, "next_state": item.next_state.tobytes(),
            "shape": list(item.next_state.shape), "token_class": item.token_class.tobytes(),
            "initial_state": item.initial_state}


def compiled_from(message: dict[str, Any]) -> GuidedTable | GuidedGrammar:
    if "lark" in message:
        return GuidedGrammar(grammar_id=str(message["grammar_id"]), lark=str(message["lark"]))
    rows, classes = (int(n) for n in message["shape"])
    next_state = np.frombuffer(message["next_state"], np.int32).reshape(rows, classes).copy()
    token_class = np.frombuffer(message["token_class"], np.int32).copy()
    return GuidedTable(table_id=str(message["table_id"]), next_state=next_state,
                       token_class=token_class, initial_state=int(message["initial_state"]))
