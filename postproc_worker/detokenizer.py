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

import json
import weakref
from collections.abc import Sequence
from typing import Any

from tandem_serve.postproc_worker.detok_engines import (
    DECODER_CLEANUP_UNSAFE,
    ByteFallbackEngine,
    ByteFallbackTables,
    ByteLevelEngine,
    ByteLevelTables,
    CleanupStage,
    Engine,
    WindowEngine,
    byte_fallback_value,
)
from tandem_serve.tokenization.tokenizer import Tokenizer

# ---- per-tokenizer plan ----------------------------------------------------------------------


class _Plan:
    """What kind of engine a tokenizer needs, with its shared tables."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.kind = "window"
        self.byte_level: ByteLevelTables | None = None
        self.byte_fallback: ByteFallbackTables | None = None
        self.strip: tuple[str, int] = (" ", 0)
        self.byte_ids: frozenset[int] | None = None
        decoder = tok.raw.decoder
        spec: dict[str, Any] = json.loads(decoder.__getstate__()) if decoder is not None else {}
        self.unsafe_tail = DECODER_CLEANUP_UNSAFE if _has_cleanup(spec) else frozenset()
        if _has_byte_fallback(spec):
            self.byte_ids = frozenset(
                i for t, i in tok.raw.get_vocab(with_added_tokens=False).items()
                if byte_fallback_value(t) is not None
            )
        if spec.get("type") == "ByteLevel":
            self.kind = "byte_level"
            self.byte_level = ByteLevelTables(tok)
            return
        fallback = _byte_fallback_spec(spec)
        if fallback is not None:
            replaces, self.strip = fallback
            self.kind = "byte_fallback"
            self.byte_fallback = ByteFallbackTables(tok, replaces)

    def engine(self, skip: bool) -> Engine:
        if self.byte_level is not None:
            return ByteLevelEngine(self.byte_level, skip)
        if self.byte_fallback is not None:
            return ByteFallbackEngine(self.byte_fallback, skip, self.strip)
        return WindowEngine(self.tok, skip, self.byte_ids, self.unsafe_tail)


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
        self._engine: Engine = _plan_for(tok).engine(skip_special_tokens)
        self._cleanup = CleanupStage() if tok.clean_up_tokenization_spaces else None
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
