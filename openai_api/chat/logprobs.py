"""Token text and the two logprobs shapes of the OpenAI API.

The engine's deltas carry each generated token's id, logprob and top-n alternatives (ids
and logprobs); the prompt's come as raw token strings on the first delta when asked. OpenAI
names tokens by their text as it reads inside a text (" Hello", not "▁Hello"), which
`TokenPieces` computes once per id with the tokenizer's own decoder.

Logprobs are the engine's: after penalties and temperature, before top-k / top-p
truncation (see `gpu_worker.sampling.sampler`); a greedy request's are the model's log-softmax.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from tandem_serve.tokenization.tokenizer import Tokenizer

# JSON has no -inf; vLLM reports such logprobs as -9999 too.
FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def clamp(lp: float) -> float:
    return lp if lp > FLOOR else FLOOR


class TokenPieces:
    """A token's text inside a text: decode(anchor + token) minus decode(anchor).

    Decoding a token alone loses what decoders do at the start of a text (SentencePiece
    drops the leading space of "▁Hello"); after an anchor token it reads as in the middle
    of one. Cached per id: at most the vocabulary, built as tokens come up.
    """

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        anchor = tok.encode("a", add_special_tokens=False)[-1:]
        self._anchor = anchor
        self._anchor_text = tok.raw.decode(anchor, skip_special_tokens=False)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            raw = self._tok.raw
            both = raw.decode(self._anchor + [token_id], skip_special_tokens=False)
            if both.startswith(self._anchor_text):
                text = both[len(self._anchor_text):]
            else:
                text = raw.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def of_raw(self, token: str) -> str:
        """The same for a raw token string ("▁Hello"), as prompt alternatives arrive."""
        token_id = self._tok.token_to_id(token)
        return token if token_id is None else self(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        """UTF-8 bytes of the token's text; a byte-fallback token's own byte."""
        m = _BYTE_TOKEN.match(self._tok.id_to_token(token_id))
        if m:
            return [int(m.group(1), 16)]
        return list(self(token_id).encode("utf-8"))


class CompletionLogprobs:
    """`/v1/completions` logprobs: tokens, token_logprobs, top_logprobs, text_offset.

    `top_logprobs` holds the top n alternatives plus the chosen token (as vLLM does), so
    `logprobs: 0` still names the chosen token's logprob there.
    """

    def __init__(self, pieces: TokenPieces) -> None:
        self.pieces = pieces
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_prompt(self, ids: Sequence[int], lps: Sequence[float] | None,
                   top_texts: Sequence[Sequence[str]] | None,
                   top_lps: Sequence[Sequence[float]] | None, offset: int) -> int:
        """The echoed prompt's tokens; the first has no logprob (nothing precedes it)."""
        for j, token_id in enumerate(ids):
            piece = self.pieces(token_id)
            lp = lps[j] if lps is not None and j < len(lps) else math.nan
            if j == 0 or math.isnan(lp):
                self._append(piece, None, None, offset)
            else:
                top = {self.pieces.of_raw(t): clamp(x) for t, x in zip(
                    top_texts[j], top_lps[j], strict=True)} if top_texts and top_lps else {}
                top.setdefault(piece, clamp(lp))
                self._append(piece, clamp(lp), top, offset)
            offset += len(piece)
        return offset

    def add(self, ids: Sequence[int], lps: Sequence[float] | None,
            top_ids: Sequence[Sequence[int]] | None,
            top_lps: Sequence[Sequence[float]] | None, offset: int) -> int:
        """Generated tokens; returns the text offset after them."""
        for j, token_id in enumerate(ids):
            piece = self.pieces(token_id)
            lp = clamp(lps[j]) if lps is not None else None
            top: dict[str, float] = {}
            if top_ids is not None and top_lps is not None:
                top = {self.pieces(t): clamp(x) for t, x in zip(top_ids[j], top_lps[j],
                                                                  strict=True)}
            if lp is not None:
                top.setdefault(piece, lp)
            self._append(piece, lp, top, offset)
            offset += len(piece)
        return offset

    def _append(self, piece: str, lp: float | None, top: dict[str, float] | None,
                offset: int) -> None:
        self.tokens.append(piece)
        self.token_logprobs.append(lp)
        self.top_logprobs.append(top)
        self.text_offset.append(offset)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def chat_logprobs(pieces: TokenPieces, ids: Sequence[int], lps: Sequence[float] | None,
                  top_ids: Sequence[Sequence[int]] | None,
                  top_lps: Sequence[Sequence[float]] | None) -> list[dict[str, Any]]:
    """`/v1/chat/completions` logprobs.content entries: token, logprob, bytes, top_logprobs."""
    out = []
    for j, token_id in enumerate(ids):
        top = []
        if top_ids is not None and top_lps is not None:
            top = [{"token": pieces(t), "logprob": clamp(x), "bytes": pieces.token_bytes(t)}
                   for t, x in zip(top_ids[j], top_lps[j], strict=True)]
        out.append({"token": pieces(token_id),
                    "logprob": clamp(lps[j]) if lps is not None else FLOOR,
                    "bytes": pieces.token_bytes(token_id), "top_logprobs": top})
    return out
