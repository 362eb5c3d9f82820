"""The bytes each token id stands for, which is what a constraint on the output text is about.

Two tokenizer families are understood, told apart by the tokenizer.json decoder:

* SentencePiece style (Llama-2, Mistral): `▁` is a space and `<0xNN>` (byte fallback) is the
  byte NN; everything else is the token's UTF-8 text.
* Byte-level BPE (GPT-2, Llama-3, Qwen): every character of a token stands for one byte through
  GPT-2's printable-byte table; a token with a character outside the table (an added token)
  is its own UTF-8 text, as `tokenizers`' ByteLevel decoder does.

Special tokens, tokens that stand for no bytes, and ids of the model's vocabulary past the
tokenizer's (padding rows of the embedding) are never part of a constrained output: their entry
is None. The EOS ids are special too; a compiled constraint allows them only where the text
may end.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from tandem_serve.tokenization.byte_level import gpt2_byte_decoder
from tandem_serve.tokenization.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class UnsupportedTokenizer(ValueError):
    """Guided decoding cannot map this tokenizer's tokens to bytes."""


def _decoder_types(node: Any) -> list[str]:
    """Every decoder type in the (possibly nested Sequence) decoder, in order."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [t for d in node.get("decoders", []) for t in _decoder_types(d)]
    return [str(node.get("type", ""))]


def tokenizer_family(tok: Tokenizer) -> str:
    """"byte_level" or "sentencepiece"; UnsupportedTokenizer for anything else."""
    decoder = json.loads(tok.raw.to_str()).get("decoder")
    types = _decoder_types(decoder)
    if "ByteLevel" in types:
        return "byte_level"
    if "Metaspace" in types or "ByteFallback" in types or any(
            d.get("type") == "Replace" and d.get("content") == " "
            for d in _flatten(decoder)):
        return "sentencepiece"
    raise UnsupportedTokenizer(
        "guided decoding needs a byte-level BPE or SentencePiece-style tokenizer; this "
        f"model's tokenizer decodes with {types or 'no decoder'}")


def _flatten(node: Any) -> list[dict[str, Any]]:
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [d for sub in node.get("decoders", []) for d in _flatten(sub)]
    return [node]


def token_bytes(token: str, family: str) -> bytes:
    """The bytes one token string stands for in its family."""
    if family == "sentencepiece":
        m = _BYTE_TOKEN.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("▁", " ").encode("utf-8")
    table = gpt2_byte_decoder()
    try:
        return bytes(table[c] for c in token)
    except KeyError:  # an added token written as plain text
        return token.encode("utf-8")


@dataclass(frozen=True)
class TokenVocabulary:
    """Token id -> bytes for every id of the model's vocabulary (None: never allowed)."""

    tokens: tuple[bytes | None, ...]  # len == vocab_size
    eos_ids: tuple[int, ...]
    family: str
    # The tokenizer's own strings for its special tokens (llguidance names them in grammars).
    special_names: tuple[tuple[int, str], ...] = ()

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer, vocab_size: int) -> TokenVocabulary:
        """`vocab_size` is the model's (config.json), which may exceed the tokenizer's."""
        if not tok.eos_token_ids:
            raise UnsupportedTokenizer("guided decoding needs an EOS token, and this model "
                                       "names none (generation_config.json / config.json)")
        family = tokenizer_family(tok)
        eos = tuple(i for i in tok.eos_token_ids if 0 <= i < vocab_size)
        if not eos:
            raise UnsupportedTokenizer(f"the EOS ids {tok.eos_token_ids} are outside the "
                                       f"model's vocabulary of {vocab_size}")
        never = set(tok.special_ids) | set(eos)
        tokens: list[bytes | None] = []
        for i in range(vocab_size):
            text = tok.id_to_token(i) if i < tok.vocab_size and i not in never else ""
            b = token_bytes(text, family) if text else b""
            tokens.append(b or None)
        names = tuple((i, tok.id_to_token(i)) for i in sorted(never) if i < tok.vocab_size)
        return cls(tuple(tokens), eos, family, names)

    def fingerprint(self) -> str:
        """Hash of everything a compiled constraint depends on: bytes per id, EOS ids, size."""
        h = hashlib.sha256(f"{self.family}|{self.vocab_size}|{self.eos_ids}|".encode())
        for b in self.tokens:
            # Length-prefixed, so no two vocabularies hash the same stream.
            h.update(b"\xff" if b is None else len(b).to_bytes(4, "little") + b)
        return h.hexdigest()

    def by_bytes(self) -> dict[bytes, list[int]]:
        """bytes -> every id with those bytes (outlines-core's Vocabulary input)."""
        out: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.tokens):
            if b is not None:
                out.setdefault(b, []).append(i)
        return out


def ll_tokenizer(vocab: TokenVocabulary, tok: Tokenizer) -> Any:
    """An llguidance `LLTokenizer` over exactly these token bytes (the model's vocab size).

    Special tokens keep their names (a Lark grammar may name them, `<|eot_id|>`); ids past
    the tokenizer are special tokens no grammar can reach by text.
    """
    import llguidance

    names = dict(vocab.special_names)
    # 0xFF is llguidance's special-token marker, and never part of UTF-8 text anyway.
    special = [i for i, b in enumerate(vocab.tokens) if b is None or b.startswith(b"\xff")]
    specials = set(special)
    raw = tok.raw

    class _Wrapped:
        eos_token_id = vocab.eos_ids[0]
        bos_token_id = tok.bos_token_id
        tokens = [b if b is not None and i not in specials
                  else names.get(i, f"<|tandem_unused_{i}|>").encode()
                  for i, b in enumerate(vocab.tokens)]
        special_token_ids = special

        def __call__(self, text: str) -> list[int]:
            if not isinstance(text, str):
                raise TypeError("text")  # llguidance then passes str
            return list(raw.encode(text, add_special_tokens=False).ids)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()),
                                  eos_token=list(vocab.eos_ids))
