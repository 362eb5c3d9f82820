"""Turning pooling inputs into token ids, as sentence-transformers' tokenizer call does.

Texts go through the model folder's tokenizer with its special tokens ([CLS] ... [SEP],
<s> ... </s>, a decoder's end token); a cross-encoder's (query, document) pair through its
pair template, which also sets the token types BERT adds to the embeddings.  Token-id input is
used as given.  `truncate_prompt_tokens` = N keeps the first N tokens the way the tokenizer
truncates (right side, special tokens kept, the longer text of a pair first): a clone of the
tokenizer with truncation on does it, so the shared one is never mutated.  Without it, an
input over the model's limit (`max_seq_length`) is a 400 naming the input.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer as RawTokenizer

from tandem_serve.openai_api.errors import ApiError
from tandem_serve.pooling.folder import PoolingSpec
from tandem_serve.tokenization.tokenizer import Tokenizer

MAX_CLONES = 8
THREAD_CHARS = 4096  # more text than this is tokenized on a thread, off the event loop


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    types: list[int]


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param, "invalid_parameter")


class PoolingInputs:
    def __init__(self, tok: Tokenizer, spec: PoolingSpec, vocab_size: int) -> None:
        self.raw = tok.raw
        self.spec = spec
        self.vocab_size = vocab_size
        self._clones: dict[int, RawTokenizer] = {}  # by tokens kept, the last few used

    def _truncating(self, keep: int) -> RawTokenizer:
        """A clone of the tokenizer that keeps `keep` tokens, as HF's truncation=True does."""
        clone = self._clones.pop(keep, None)
        if clone is None:
            clone = RawTokenizer.from_str(self.raw.to_str())
            clone.encode_special_tokens = self.raw.encode_special_tokens
            clone.enable_truncation(keep, strategy="longest_first", direction="right")
            if len(self._clones) >= MAX_CLONES:
                self._clones.pop(next(iter(self._clones)))
        self._clones[keep] = clone  # most recently used last
        return clone

    def limit(self, truncate: int | None) -> int | None:
        """The tokens to keep (None: no truncation), checked against the model's limit."""
        if truncate is None:
            return None
        if truncate == -1:
            return self.spec.max_seq_length
        if truncate == 0 or truncate > self.spec.max_seq_length:
            raise bad("truncate_prompt_tokens",
                      f"must be -1 or between 1 and the model's maximum of "
                      f"{self.spec.max_seq_length} tokens (got {truncate})")
        return truncate

    async def texts(self, texts: Sequence[str], params: Sequence[str],
                    keep: int | None) -> list[Encoded]:
        return await self._encode(list(texts), params, keep)

    async def pairs(self, firsts: Sequence[str], seconds: Sequence[str],
                    params: Sequence[str], keep: int | None) -> list[Encoded]:
        return await self._encode(list(zip(firsts, seconds, strict=True)), params, keep)

    def token_ids(self, lists: Sequence[Sequence[int]], params: Sequence[str],
                  keep: int | None) -> list[Encoded]:
        out = []
        for ids, param in zip(lists, params, strict=True):
            if not ids:
                raise bad(param, "must not be empty")
            wrong = [i for i in ids if not 0 <= i < self.vocab_size]
            if wrong:
                raise bad(param, f"token id {wrong[0]} is outside the vocabulary "
                                 f"(0 to {self.vocab_size - 1})")
            kept = list(ids[:keep]) if keep is not None else list(ids)
            out.append(self._checked(Encoded(kept, []), param))
        return out

    async def _encode(self, items: list, params: Sequence[str],
                      keep: int | None) -> list[Encoded]:
        for item, param in zip(items, params, strict=True):
            if any(text == "" for text in (item if isinstance(item, tuple) else (item,))):
                raise bad(param, "must not be empty")
        tok = self.raw if keep is None else self._truncating(keep)
        chars = sum(len(t) for item in items for t in (item if isinstance(item, tuple)
                                                       else (item,)))
        if chars > THREAD_CHARS:  # encode_batch releases the GIL: the loop goes on
            encodings = await asyncio.to_thread(tok.encode_batch, items)
        else:
            encodings = tok.encode_batch(items)
        types = self.spec.uses_token_types
        return [self._checked(Encoded(e.ids, e.type_ids if types else []), param)
                for e, param in zip(encodings, params, strict=True)]

    def _checked(self, enc: Encoded, param: str) -> Encoded:
        n, limit = len(enc.ids), self.spec.max_seq_length
        if n > limit:
            raise bad(param, f"{n} tokens, over this model's maximum of {limit} "
                             f"(max_seq_length); shorten it or set truncate_prompt_tokens")
        return enc
