"""`guided.vocab`: the bytes of every token, judged by what Hugging Face decodes."""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem_serve.guided.vocab import TokenVocabulary, UnsupportedTokenizer, ll_tokenizer
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import (
    BPE_PLAIN_ADDED_TOKEN,
    BPE_SPECIAL_TOKENS,
    MULTILINGUAL_CORPUS,
    byte_level_bpe_dir,
    sentencepiece_dir,
    wordpiece_dir,
)

REPO = Path(__file__).resolve().parents[2]
FAMILIES = {"sentencepiece": sentencepiece_dir, "byte_level": byte_level_bpe_dir}
EXTRA = 7  # model vocab rows past the tokenizer (embedding padding)


@functools.cache
def _loaded(family: str) -> tuple[Tokenizer, Any, TokenVocabulary]:
    from transformers import AutoTokenizer

    folder = str(FAMILIES[family]())
    tok = Tokenizer.from_dir(folder)
    return tok, AutoTokenizer.from_pretrained(folder), TokenVocabulary.from_tokenizer(
        tok, tok.vocab_size + EXTRA)


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, Any, TokenVocabulary]:
    return (request.param, *_loaded(request.param))


def test_family_and_never_allowed_ids(family: tuple[str, Tokenizer, Any, TokenVocabulary]
                                      ) -> None:
    name, tok, hf, vocab = family
    assert vocab.family == name
    assert vocab.vocab_size == tok.vocab_size + EXTRA
    assert vocab.eos_ids == tuple(tok.eos_token_ids)
    never = {i for i, b in enumerate(vocab.tokens) if b is None}
    assert set(hf.all_special_ids) | set(vocab.eos_ids) <= never
    assert set(range(tok.vocab_size, vocab.vocab_size)) <= never
    assert never - set(range(tok.vocab_size, vocab.vocab_size)) == tok.special_ids
    if name == "byte_level":  # an added token that is not special is plain text
        plain = tok.token_to_id(BPE_PLAIN_ADDED_TOKEN)
        assert plain is not None and vocab.tokens[plain] == BPE_PLAIN_ADDED_TOKEN.encode()
        assert {tok.token_to_id(t) for t in BPE_SPECIAL_TOKENS} <= never


def test_each_token_is_what_hf_decodes_after_another(
        family: tuple[str, Tokenizer, Any, TokenVocabulary]) -> None:
    """decode([anchor, t]) = decode([anchor]) + bytes(t): a lone SentencePiece token would lose
    its leading space to the decoder's Strip, which only touches the text's first character."""
    _, tok, hf, vocab = family
    anchor = hf.encode("the", add_special_tokens=False)[0]
    head = hf.decode([anchor])
    checked = 0
    for i, b in enumerate(vocab.tokens[:tok.vocab_size]):
        if b is None:
            continue
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:  # a piece of a character: the corpus test covers those
            assert "\ufffd" in hf.decode([anchor, i]), i
            continue
        assert hf.decode([anchor, i]) == head + text, (i, tok.id_to_token(i), b)
        checked += 1
    assert checked > tok.vocab_size // 3  # most tokens are whole characters


def test_token_bytes_concatenate_to_the_text(
        family: tuple[str, Tokenizer, Any, TokenVocabulary]) -> None:
    """Multi-byte characters split over byte-fallback or byte-level tokens come out whole."""
    name, _, hf, vocab = family
    for text in MULTILINGUAL_CORPUS:
        if "{" in text or not text:
            continue
        ids = hf.encode(text, add_special_tokens=False)
        joined = b"".join(vocab.tokens[i] or b"<special>" for i in ids)
        if name == "sentencepiece":  # the encoder prepends "▁", the decoder strips it
            joined = joined.removeprefix(b" ")
        assert joined.decode("utf-8") == hf.decode(ids), text


def test_fingerprint_changes_with_what_a_table_depends_on() -> None:
    tok, _, vocab = _loaded("sentencepiece")
    same = TokenVocabulary.from_tokenizer(tok, tok.vocab_size + EXTRA)
    assert same.fingerprint() == vocab.fingerprint()
    assert TokenVocabulary.from_tokenizer(tok, tok.vocab_size).fingerprint() != \
        vocab.fingerprint()
    other_eos = TokenVocabulary(vocab.tokens, (1,), vocab.family)
    assert other_eos.fingerprint() != vocab.fingerprint()
    swapped = list(vocab.tokens)
    swapped[100], swapped[101] = swapped[101], swapped[100]
    assert TokenVocabulary(tuple(swapped), vocab.eos_ids, vocab.family).fingerprint() != \
        vocab.fingerprint()


def test_fingerprint_is_the_same_in_another_process() -> None:
    _, _, vocab = _loaded("byte_level")
    code = ("from tandem_serve.guided.vocab import TokenVocabulary; "
            "from tandem_serve.tokenization.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_dir({str(byte_level_bpe_dir())!r}); "
            f"print(TokenVocabulary.from_tokenizer(t, t.vocab_size + {EXTRA}).fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=120).stdout.strip()
    assert out == vocab.fingerprint()


def test_a_wordpiece_tokenizer_cannot_be_guided() -> None:
    tok = Tokenizer.from_dir(str(wordpiece_dir()))
    with pytest.raises(UnsupportedTokenizer, match="byte-level BPE or SentencePiece"):
        TokenVocabulary.from_tokenizer(tok, tok.vocab_size)


def test_llguidance_tokenizer_has_the_same_bytes(
        family: tuple[str, Tokenizer, Any, TokenVocabulary]) -> None:
    _, tok, _, vocab = family
    ll = ll_tokenizer(vocab, tok)
    assert ll.vocab_size == vocab.vocab_size
    assert list(ll.eos_tokens) == list(vocab.eos_ids)
    for i, b in enumerate(vocab.tokens):
        if b is None or b.startswith(b"\xff"):  # llguidance's special-token marker byte
            assert ll.is_special_token(i), i
        else:
            assert ll.decode_bytes([i]) == b, i
