"""The streaming engines behind IncrementalDetokenizer, and its clean-up stage.

Which engine a tokenizer gets, and why each one's deltas are final, is described in
detokenizer.py; this module holds only their mechanics, so the plan and the public API read
apart from the per-token hot loops.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tandem_serve.tokenization.byte_level import gpt2_byte_decoder
from tandem_serve.tokenization.tokenizer import Tokenizer, clean_up_tokenization

_REPLACEMENT = "\ufffd"
_SKIP = object()  # marks an id whose token decode drops (skipped special or unknown id)


_CHAR_TO_BYTE = gpt2_byte_decoder()


class Engine(Protocol):
    def push(self, token_ids: Sequence[int]) -> str: ...

    def finish(self) -> str: ...


# ---- byte-level BPE --------------------------------------------------------------------------


class ByteLevelTables:
    """Per-tokenizer id -> bytes tables (one per skip_special_tokens), filled lazily."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.keep: dict[int, bytes] = {}
        self.skip: dict[int, bytes] = {}

    def fill(self, token_id: int, skip: bool) -> bytes:
        token = self._tok.raw.id_to_token(token_id)
        if token is None or (skip and token_id in self._tok.special_ids):
            data = b""
        else:
            try:
                data = bytes(_CHAR_TO_BYTE[c] for c in token)
            except KeyError:
                # The decoder passes tokens with chars outside the table through as UTF-8.
                data = token.encode("utf-8")
        (self.skip if skip else self.keep)[token_id] = data
        return data


class ByteLevelEngine:
    __slots__ = ("_table", "_fill", "_decode", "_skip")

    def __init__(self, tables: ByteLevelTables, skip: bool) -> None:
        self._table = tables.skip if skip else tables.keep
        self._fill = tables.fill
        self._skip = skip
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode

    def push(self, token_ids: Sequence[int]) -> str:
        table = self._table
        if len(token_ids) == 1:
            i = token_ids[0]
            data = table.get(i)
            if data is None:
                data = self._fill(i, self._skip)
            return self._decode(data)
        parts = []
        for i in token_ids:
            data = table.get(i)
            parts.append(data if data is not None else self._fill(i, self._skip))
        return self._decode(b"".join(parts))

    def finish(self) -> str:
        return self._decode(b"", True)


# ---- SentencePiece with byte fallback --------------------------------------------------------


class ByteFallbackTables:
    """Per-tokenizer id -> (text piece | byte value | _SKIP) tables, filled lazily."""

    def __init__(self, tok: Tokenizer, replaces: list[tuple[str, str]]) -> None:
        self._tok = tok
        self._replaces = replaces
        self.keep: dict[int, Any] = {}
        self.skip: dict[int, Any] = {}

    def fill(self, token_id: int, skip: bool) -> Any:
        token = self._tok.raw.id_to_token(token_id)
        entry: Any
        if token is None or (skip and token_id in self._tok.special_ids):
            entry = _SKIP
        else:
            for pattern, content in self._replaces:
                token = token.replace(pattern, content)
            entry = byte_fallback_value(token)
            if entry is None:
                entry = token
        (self.skip if skip else self.keep)[token_id] = entry
        return entry


def byte_fallback_value(token: str) -> int | None:
    # Mirrors the ByteFallback decoder: exactly "<0xHH>" (6 bytes) parsed as a base-16 u8;
    # Rust's from_str_radix also takes a leading "+".
    if len(token) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return None
    digits = token[3:5]
    body = digits[1:] if digits[0] == "+" else digits
    if not body or any(c not in "0123456789abcdefABCDEF" for c in body):
        return None
    return int(body, 16)


class ByteFallbackEngine:
    __slots__ = ("_table", "_fill", "_skip", "_run", "_strip_char", "_strip_left")

    def __init__(self, tables: ByteFallbackTables, skip: bool, strip: tuple[str, int]) -> None:
        self._table = tables.skip if skip else tables.keep
        self._fill = tables.fill
        self._skip = skip
        self._run = bytearray()
        self._strip_char, self._strip_left = strip

    def push(self, token_ids: Sequence[int]) -> str:
        table = self._table
        out = ""
        for i in token_ids:
            entry = table.get(i)
            if entry is None:
                entry = self._fill(i, self._skip)
            if entry is _SKIP:
                continue  # dropped before the decoder runs: does not end a byte run
            if entry.__class__ is int:
                self._run.append(entry)
                continue
            if self._run:
                out += self._flush_run()
            out += entry
        if out and self._strip_left:
            out = self._strip(out)
        return out

    def finish(self) -> str:
        out = self._flush_run() if self._run else ""
        if out and self._strip_left:
            out = self._strip(out)
        return out

    def _flush_run(self) -> str:
        run = bytes(self._run)
        self._run.clear()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return _REPLACEMENT * len(run)

    def _strip(self, text: str) -> str:
        # Strip(start=n) acts on the fused output: up to n leading copies of its char.
        while self._strip_left and text:
            if text[0] != self._strip_char:
                self._strip_left = 0
                break
            text = text[1:]
            self._strip_left -= 1
        return text


# ---- any other decoder -----------------------------------------------------------------------


class WindowEngine:
    """Decodes a small window of recent ids with `tokenizers` itself (any decoder).

    The window text is split into a part already emitted and a held tail. A step emits the
    window text from the emitted part up to the last position that later ids cannot change:
    not into a trailing U+FFFD (an incomplete character), not while a byte-fallback run is
    open, and, for decoders with a built-in clean-up, not past a char a clean-up pattern
    could still span. The window start slides forward once it trails by more than a few ids,
    and only to a start that renders the held text identically."""

    _CONTEXT = 4

    __slots__ = ("_decode", "_quiet", "_byte_ids", "_vocab_size", "_unsafe", "_ids", "_start",
                 "_decoded", "_stable", "_tail", "_emitted")

    def __init__(
        self, tok: Tokenizer, skip: bool, byte_ids: frozenset[int] | None,
        unsafe_tail: frozenset[str] = frozenset(),
    ) -> None:
        raw = tok.raw
        self._decode: Callable[[list[int]], str] = lambda ids: raw.decode(ids, skip)
        self._quiet = tok.special_ids if skip else frozenset()
        self._byte_ids = byte_ids
        self._vocab_size = tok.vocab_size
        self._unsafe = unsafe_tail
        self._ids: list[int] = []
        self._start = 0  # window = ids[start:]
        self._decoded = 0  # len(ids) at the last decode
        self._stable = ""  # window text already emitted
        self._tail = ""  # window text decoded but held
        self._emitted: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        out = []
        for i in token_ids:
            self._ids.append(i)
            if i in self._quiet or i >= self._vocab_size:
                continue  # renders as nothing, and must not end a pending byte run
            if self._byte_ids is not None and i in self._byte_ids:
                continue  # a byte-fallback run decodes all-or-nothing: wait for its end
            delta = self._step()
            if delta:
                out.append(delta)
        return "".join(out)

    def _step(self) -> str:
        text = self._decode(self._ids[self._start:])
        self._decoded = len(self._ids)
        if not text.startswith(self._stable):
            return self._resync()
        delta = self._release(text)
        if len(self._ids) - self._start > 2 * self._CONTEXT:
            self._slide()
        return delta

    def _release(self, text: str) -> str:
        done = len(self._stable)
        cut = len(text.rstrip(_REPLACEMENT))
        while cut > done and text[cut - 1] in self._unsafe:
            cut -= 1
        if cut <= done:
            self._tail = text[done:]
            return ""
        delta = text[done:cut]
        self._stable, self._tail = text[:cut], text[cut:]
        self._emitted.append(delta)
        return delta

    def _slide(self) -> None:
        start = len(self._ids) - self._CONTEXT
        text = self._decode(self._ids[start:])
        whole = self._stable + self._tail
        # The new start must render as a plain suffix of the current window (no first-token
        # special casing in the part that matters) and still cover the held tail.
        if whole.endswith(text) and len(text) >= len(self._tail):
            self._start = start
            self._stable = text[: len(text) - len(self._tail)]

    def _resync(self) -> str:
        # The window rendered differently from text already emitted: decode everything once
        # and continue from a window that covers the whole output (it slides again later).
        full = self._decode(self._ids)
        emitted = "".join(self._emitted)
        self._emitted = [emitted]
        self._start = 0
        self._stable = emitted if full.startswith(emitted) else full[: len(emitted)]
        self._tail = ""
        return self._release(full)

    def finish(self) -> str:
        if self._decoded == len(self._ids) and not self._tail:
            return ""
        text = self._decode(self._ids[self._start:])
        if text.startswith(self._stable):
            delta = text[len(self._stable):]
        else:
            delta = self._decode(self._ids)[len("".join(self._emitted)):]
        self._stable, self._tail = self._stable + delta, ""
        self._decoded = len(self._ids)
        return delta


# ---- clean-up stage --------------------------------------------------------------------------

# No clean-up pattern has one of these chars left of a position inside it, so the text can be
# cut after any other char and cleaned piecewise with the same result as cleaning it whole.
_CLEANUP_UNSAFE = frozenset(" 'nvr")
# The clean-up built into the WordPiece/CTC decoders also rewrites " do not".
DECODER_CLEANUP_UNSAFE = frozenset(" 'nvrdo")


class CleanupStage:
    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> str:
        pending = self._pending + text
        cut = len(pending)
        while cut and pending[cut - 1] in _CLEANUP_UNSAFE:
            cut -= 1
        self._pending = pending[cut:]
        return clean_up_tokenization(pending[:cut]) if cut else ""

    def finish(self) -> str:
        out = clean_up_tokenization(self._pending)
        self._pending = ""
        return out
