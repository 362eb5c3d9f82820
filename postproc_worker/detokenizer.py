"""Incremental detokenization: token ids in, text deltas out, one detokenizer per request.

Contract (DESIGN.md §4): `"".join(deltas) + flush()` equals `tokenizer.decode(output_ids)`
with the same `skip_special_tokens`, and no delta ever has to be taken back. A delta is emitted
only once the decoded text up to its end can no longer change, so an incomplete UTF-8 sequence
is held back and appears as U+FFFD only where the full decode has it too.

The output is decoded on its own, not after the prompt, because that is what
`tokenizer.decode(output_ids)` does: SentencePiece decoders drop the leading space of the first
output token ("▁Hello" alone decodes to "Hello"), and so does this detokenizer.

Three engines, chosen once per tokenizer from its decoder:

* byte-level BPE (GPT-2, Llama-3, Qwen): each id maps to bytes; a C-level incremental UTF-8
  decoder (errors="replace", the same maximal-subpart substitution as Rust's
  from_utf8_lossy) emits every complete character at once.
* SentencePiece with byte fallback (Llama-2, Mistral, Gemma: Replace("▁"," "), ByteFallback,
  Fuse, Strip): each id maps to a text piece or one byte. The decoder turns a whole run of
  byte tokens into text only if the entire run is valid UTF-8 (else one U+FFFD per byte), so
  a run is held until a non-byte token ends it; a later bad byte would otherwise change
  characters already sent.
* anything else (WordPiece, Metaspace, ...): decodes a small sliding window of recent ids
  with the tokenizer itself, as vLLM's prefix/read offsets do, and emits only the part of
  the window text that later ids cannot change; a full decode is the fallback when a window
  disagrees with text already emitted. ~0.2-0.3M tokens/s instead of millions.

`clean_up_tokenization_spaces` (non-BPE models only, as in transformers) is applied as a
stream stage that holds back the few characters a clean-up pattern could still span.
"""

from __future__ import annotations

import codecs
import json
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rpc.tokenizer import Tokenizer, clean_up_tokenization

_REPLACEMENT = "\ufffd"
_SKIP = object()  # marks an id whose token decode drops (skipped special or unknown id)


def _byte_level_char_to_byte() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-char table, as the ByteLevel decoder uses it.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_CHAR_TO_BYTE = _byte_level_char_to_byte()


class _Engine(Protocol):
    def push(self, token_ids: Sequence[int]) -> str: ...

    def finish(self) -> str: ...


# ---- byte-level BPE --------------------------------------------------------------------------


class _ByteLevelTables:
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


class _ByteLevelEngine:
    __slots__ = ("_table", "_fill", "_decode", "_skip")

    def __init__(self, tables: _ByteLevelTables, skip: bool) -> None:
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


class _ByteFallbackTables:
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
            entry = _byte_fallback_value(token)
            if entry is None:
                entry = token
        (self.skip if skip else self.keep)[token_id] = entry
        return entry


def _byte_fallback_value(token: str) -> int | None:
    # Mirrors the ByteFallback decoder: exactly "<0xHH>" (6 bytes) parsed as a base-16 u8;
    # Rust's from_str_radix also takes a leading "+".
    if len(token) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return None
    digits = token[3:5]
    body = digits[1:] if digits[0] == "+" else digits
    if not body or any(c not in "0123456789abcdefABCDEF" for c in body):
        return None
    return int(body, 16)


class _ByteFallbackEngine:
    __slots__ = ("_table", "_fill", "_skip", "_run", "_strip_char", "_strip_left")

    def __init__(self, tables: _ByteFallbackTables, skip: bool, strip: tuple[str, int]) -> None:
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


class _WindowEngine:
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
_DECODER_CLEANUP_UNSAFE = frozenset(" 'nvrdo")


class _CleanupStage:
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


# ---- per-tokenizer plan ----------------------------------------------------------------------


class _Plan:
    """What kind of engine a tokenizer needs, with its shared tables."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.kind = "window"
        self.byte_level: _ByteLevelTables | None = None
        self.byte_fallback: _ByteFallbackTables | None = None
        self.strip: tuple[str, int] = (" ", 0)
        self.byte_ids: frozenset[int] | None = None
        decoder = tok.raw.decoder
        spec: dict[str, Any] = json.loads(decoder.__getstate__()) if decoder is not None else {}
        self.unsafe_tail = _DECODER_CLEANUP_UNSAFE if _has_cleanup(spec) else frozenset()
        if _has_byte_fallback(spec):
            self.byte_ids = frozenset(
                i for t, i in tok.raw.get_vocab(with_added_tokens=False).items()
                if _byte_fallback_value(t) is not None
            )
        if spec.get("type") == "ByteLevel":
            self.kind = "byte_level"
            self.byte_level = _ByteLevelTables(tok)
            return
        fallback = _byte_fallback_spec(spec)
        if fallback is not None:
            replaces, self.strip = fallback
            self.kind = "byte_fallback"
            self.byte_fallback = _ByteFallbackTables(tok, replaces)

    def engine(self, skip: bool) -> _Engine:
        if self.byte_level is not None:
            return _ByteLevelEngine(self.byte_level, skip)
        if self.byte_fallback is not None:
            return _ByteFallbackEngine(self.byte_fallback, skip, self.strip)
        return _WindowEngine(self.tok, skip, self.byte_ids, self.unsafe_tail)


_FallbackSpec = tuple[list[tuple[str, str]], tuple[str, int]]


def _byte_fallback_spec(spec: dict[str, Any]) -> _FallbackSpec | None:
    """For Sequence[Replace(str)*, ByteFallback, Fuse, Strip(stop=0)?]: replaces and strip."""
    if spec.get("type") != "Sequence":
        return None
    steps = list(spec.get("decoders") or [])
    replaces: list[tuple[str, str]] = []
    while steps and steps[0].get("type") == "Replace":
        pattern = steps[0].get("pattern") or {}
        if "String" not in pattern:
            return None  # regex patterns: leave them to the tokenizer itself
        replaces.append((pattern["String"], steps.pop(0).get("content", "")))
    if [s.get("type") for s in steps[:2]] != ["ByteFallback", "Fuse"]:
        return None
    steps = steps[2:]
    strip = (" ", 0)
    if steps and steps[0].get("type") == "Strip":
        s = steps.pop(0)
        content = s.get("content", " ")
        if int(s.get("stop", 0)) != 0 or len(content) != 1:
            return None  # stripping the end cannot be streamed
        strip = (content, int(s.get("start", 0)))
    if steps:
        return None
    return replaces, strip


def _has_cleanup(spec: dict[str, Any]) -> bool:
    if spec.get("cleanup"):
        return True
    return any(_has_cleanup(s) for s in spec.get("decoders") or [])


def _has_byte_fallback(spec: dict[str, Any]) -> bool:
    if spec.get("type") == "ByteFallback":
        return True
    return any(_has_byte_fallback(s) for s in spec.get("decoders") or [])


_PLANS: weakref.WeakKeyDictionary[Tokenizer, _Plan] = weakref.WeakKeyDictionary()


def _plan_for(tok: Tokenizer) -> _Plan:
    plan = _PLANS.get(tok)
    if plan is None:
        plan = _PLANS[tok] = _Plan(tok)
    return plan


def engine_kind(tok: Tokenizer) -> str:
    """"byte_level", "byte_fallback" or "window": which engine this tokenizer gets."""
    return _plan_for(tok).kind


# ---- public API ------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Streams one request's output ids as text deltas."""

    __slots__ = ("_engine", "_cleanup", "_chunks", "_finished")

    def __init__(
        self, tok: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        # prompt_ids are accepted for the protocol but not decoded: the contract is
        # tokenizer.decode(output_ids), which sees the output alone.
        del prompt_ids
        self._engine: _Engine = _plan_for(tok).engine(skip_special_tokens)
        self._cleanup = _CleanupStage() if tok.clean_up_tokenization_spaces else None
        self._chunks: list[str] = []
        self._finished = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed the next output ids; return the text they complete (possibly "")."""
        if self._finished:
            raise RuntimeError("add() after flush()")
        if len(token_ids) == 0:
            return ""
        if hasattr(token_ids, "tolist"):  # numpy rows: plain ints are faster dict keys
            token_ids = token_ids.tolist()
        delta = self._engine.push(token_ids)
        if self._cleanup is not None:
            delta = self._cleanup.feed(delta)
        if delta:
            self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """End of request: whatever was held back (a dangling byte sequence becomes U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        delta = self._engine.finish()
        if self._cleanup is not None:
            delta = self._cleanup.feed(delta) + self._cleanup.finish()
        if delta:
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""


_BENCH_TEXT = (
    "The quick brown fox jumps over the lazy dog. Serving engines stream text to clients "
    "while the accelerator keeps computing; every delta must be valid UTF-8 text.\n"
    "def detokenize(ids):\n    return tokenizer.decode(ids)  # reference\n"
    "Numbers like 3.14159 and 2,718 appear too, with punctuation: (a), [b], {c}!\n"
)


def bench_detokenizer(
    tok: Tokenizer | str,
    n_tokens: int = 200_000,
    text: str | None = None,
    skip_special_tokens: bool = True,
    chunk: int = 1,
) -> float:
    """Tokens per second of `IncrementalDetokenizer.add` in this process (the plain case:
    one request, `chunk` ids per call). `tok` is a Tokenizer or a model folder."""
    if isinstance(tok, str):
        tok = Tokenizer.from_dir(tok)
    base = tok.raw.encode(text or _BENCH_TEXT, add_special_tokens=False).ids
    ids = (base * (n_tokens // max(1, len(base)) + 1))[:n_tokens]
    steps = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens)
    add = detok.add
    start = time.perf_counter()
    for step in steps:
        add(step)
    detok.flush()
    elapsed = time.perf_counter() - start
    return len(ids) / elapsed


if __name__ == "__main__":
    import sys

    for model_dir in sys.argv[1:]:
        t = Tokenizer.from_dir(model_dir)
        rate = bench_detokenizer(t)
        print(f"{model_dir}: {engine_kind(t)} engine, {rate:,.0f} tokens/s")
