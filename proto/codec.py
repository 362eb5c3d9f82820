"""msgpack codec for the dataclasses of `proto.messages`.

A message encodes to a list of frames: frame 0 is the msgpack body, later frames are the
raw buffers of large numpy arrays, so ZeroMQ (or the shm ring) can move them without a copy.
Small arrays stay inline.  No pickle anywhere: a peer can only make us build the dataclasses
listed in `MESSAGE_TYPES`.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np

from tandem_serve.proto import messages

SCHEMA_VERSION = 1
INLINE_LIMIT = 1024  # arrays at least this many bytes travel as their own frame

_EXT_ARRAY = 1
_EXT_ARRAY_FRAME = 2
_EXT_DATACLASS = 3

Frame = bytes | memoryview


class CodecError(ValueError):
    """A frame that is not a message of this schema; the receiver logs it and goes on."""


def _enum_fields(cls: type) -> dict[int, type[IntEnum]]:
    hints = typing.get_type_hints(cls)  # resolved in the module that defines it
    out: dict[int, type[IntEnum]] = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        hint = hints[f.name]
        if isinstance(hint, type) and issubclass(hint, IntEnum):
            out[i] = hint
    return out


_TYPES: tuple[type, ...] = messages.MESSAGE_TYPES
_TYPE_INDEX: dict[type, int] = {t: i for i, t in enumerate(_TYPES)}
_ENUMS: list[dict[int, type[IntEnum]]] = [_enum_fields(t) for t in _TYPES]
_FIELD_NAMES: list[tuple[str, ...]] = [tuple(f.name for f in dataclasses.fields(t)) for t in _TYPES]


def _as_numpy(obj: Any) -> np.ndarray | None:
    if isinstance(obj, np.ndarray):
        return obj
    # CPU torch tensors are accepted without importing torch in light processes.
    if type(obj).__module__.startswith("torch") and hasattr(obj, "numpy"):
        return obj.detach().numpy()
    return None


def encode(msg: Any) -> list[Frame]:
    if type(msg) not in _TYPE_INDEX:
        raise CodecError(f"cannot encode {type(msg).__name__}: not a registered message type")
    frames: list[Frame] = [b""]

    def default(obj: Any) -> Any:
        idx = _TYPE_INDEX.get(type(obj))
        if idx is not None:
            values = [getattr(obj, name) for name in _FIELD_NAMES[idx]]
            return msgpack.ExtType(_EXT_DATACLASS, _pack([idx, *values]))
        arr = _as_numpy(obj)
        if arr is not None:
            arr = np.ascontiguousarray(arr)
            head = [arr.dtype.str, list(arr.shape)]
            if arr.nbytes >= INLINE_LIMIT:
                frames.append(arr.data.cast("B"))
                return msgpack.ExtType(_EXT_ARRAY_FRAME, _pack([*head, len(frames) - 1]))
            return msgpack.ExtType(_EXT_ARRAY, _pack([*head, arr.tobytes()]))
        if isinstance(obj, (np.integer, np.floating, np.bool_)):
            return obj.item()
        raise TypeError(f"cannot encode a {type(obj).__name__}")

    def _pack(obj: Any) -> bytes:
        return msgpack.packb(obj, default=default, use_bin_type=True)

    frames[0] = _pack([SCHEMA_VERSION, msg])
    return frames


def decode(frames: Sequence[Frame]) -> Any:
    if not frames:
        raise CodecError("empty message")

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_DATACLASS:
            idx, *values = _unpack(data)
            if not 0 <= idx < len(_TYPES) or len(values) != len(_FIELD_NAMES[idx]):
                raise CodecError(f"unknown message type {idx} with {len(values)} fields")
            for i, enum in _ENUMS[idx].items():
                values[i] = enum(values[i])
            return _TYPES[idx](*values)
        if code == _EXT_ARRAY:
            dtype, shape, raw = _unpack(data)
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        if code == _EXT_ARRAY_FRAME:
            dtype, shape, index = _unpack(data)
            if not 0 < index < len(frames):
                raise CodecError(f"array frame {index} missing ({len(frames)} frames)")
            return np.frombuffer(frames[index], dtype=np.dtype(dtype)).reshape(shape)
        raise CodecError(f"unknown msgpack ext type {code}")

    def _unpack(data: Frame) -> Any:
        return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False)

    try:
        body = _unpack(frames[0])
    except CodecError:
        raise
    except Exception as exc:  # malformed bytes must never take the receiver down
        raise CodecError(f"malformed message: {exc}") from exc
    if not isinstance(body, list) or len(body) != 2:
        raise CodecError("malformed message: no schema header")
    version, msg = body
    if version != SCHEMA_VERSION:
        raise CodecError(f"schema version {version} does not match ours ({SCHEMA_VERSION})")
    if type(msg) not in _TYPE_INDEX:
        raise CodecError(f"body is a {type(msg).__name__}, not a message")
    return msg
