"""`guided.compile` and `guided.forms`: every constraint form, and why a bad one is refused."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tandem_serve.guided.compile import CompileError, Compiler
from tandem_serve.guided.forms import choice_regex, escape_rust, grammar_lark, is_gbnf
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.guided.table import advance, allowed, done_state
from tandem_serve.guided.vocab import TokenVocabulary
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import byte_level_bpe_dir, sentencepiece_dir

ARITHMETIC_GBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+\n'
ARITHMETIC_LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: /[0-9]+/\n'
PERSON = ('{"type": "object", "properties": {"name": {"type": "string"}, '
          '"age": {"type": "integer"}}, "required": ["name", "age"]}')


@functools.cache
def compiler(family: str) -> Compiler:
    folder = sentencepiece_dir() if family == "sentencepiece" else byte_level_bpe_dir()
    tok = Tokenizer.from_dir(str(folder))
    return Compiler(tok, tok.vocab_size + 3)


def table(spec: GuidedSpec, family: str = "sentencepiece") -> GuidedTable:
    item, stats = compiler(family).compile(spec, "key")
    assert isinstance(item, GuidedTable) and item.table_id == "key"
    assert stats.states == item.next_state.shape[0] - 1 and stats.seconds >= 0
    return item


def accepts(t: GuidedTable, family: str, text: str) -> bool:
    """Does the table take `text`, spelt one byte per token, and then EOS?"""
    vocab = compiler(family).vocab
    by_bytes = {b: i for i, b in enumerate(vocab.tokens) if b is not None and len(b) == 1}
    state = t.initial_state
    for byte in text.encode():
        state = advance(t, state, by_bytes[bytes([byte])])
        if state < 0:
            return False
    return advance(t, state, vocab.eos_ids[0]) == done_state(t)


@pytest.mark.parametrize("family", ["sentencepiece", "byte_level"])
def test_regular_forms_accept_what_they_should(family: str) -> None:
    phone = table(GuidedSpec(SpecKind.REGEX, r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"), family)
    assert accepts(phone, family, "(555) 123-4567")
    assert not accepts(phone, family, "(555) 123-456") and not accepts(phone, family, "555-1234")
    colours = table(GuidedSpec(SpecKind.CHOICE, choices=("red", "dark blue", "(x)")), family)
    assert all(accepts(colours, family, c) for c in ("red", "dark blue", "(x)"))
    assert not accepts(colours, family, "re") and not accepts(colours, family, "x")
    person = table(GuidedSpec(SpecKind.JSON_SCHEMA, PERSON), family)
    assert accepts(person, family, '{"name": "Ada", "age": 36}')
    assert not accepts(person, family, '{"name": "Ada"}')


def test_a_final_state_without_continuations_forces_eos() -> None:
    t = table(GuidedSpec(SpecKind.CHOICE, choices=("yes", "no")))
    tok = compiler("sentencepiece").tok
    state = t.initial_state
    for byte in b"yes":
        state = advance(t, state, tok.token_to_id(f"<0x{byte:02X}>") or 0)
    only = np.flatnonzero(allowed(t, state)).tolist()
    assert only == list(compiler("sentencepiece").vocab.eos_ids)


def test_escaping_makes_choices_literal() -> None:
    assert escape_rust("a.b*c") == r"a\.b\*c"
    assert choice_regex(("1+1", "[x]")) == r"(1\+1|\[x\])"


def test_grammars_gbnf_and_lark() -> None:
    assert is_gbnf(ARITHMETIC_GBNF) and not is_gbnf(ARITHMETIC_LARK)
    assert not is_gbnf('start: "a" // root ::= x\n')
    lark = grammar_lark(ARITHMETIC_GBNF)
    assert "::=" not in lark
    for text in (ARITHMETIC_GBNF, ARITHMETIC_LARK):
        item, _ = compiler("sentencepiece").compile(GuidedSpec(SpecKind.GRAMMAR, text), "g")
        assert isinstance(item, GuidedGrammar) and item.grammar_id == "g"
        assert "::=" not in item.lark


def test_grammar_matches_with_llguidance() -> None:
    """The Lark the frontend sends is what the gpu worker's matcher will run."""
    import llguidance

    c = compiler("byte_level")
    item, _ = c.compile(GuidedSpec(SpecKind.GRAMMAR, ARITHMETIC_GBNF), "g")
    assert isinstance(item, GuidedGrammar)
    matcher = llguidance.LLMatcher(c.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(
        item.lark))
    ids = c.tok.raw.encode("12+3", add_special_tokens=False).ids
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    assert not matcher.try_consume_tokens(c.tok.raw.encode("x", add_special_tokens=False).ids)


BAD = [
    (SpecKind.REGEX, "(a", "unclosed group"),
    (SpecKind.REGEX, "(?=a)b", "look-around"),
    (SpecKind.REGEX, r"(a)\1", "backreferences are not supported"),
    (SpecKind.JSON_SCHEMA, '{"type": ', "not valid JSON"),
    (SpecKind.JSON_SCHEMA, "[1, 2]", "must be a JSON object"),
    (SpecKind.JSON_SCHEMA, '{"type": "string", "format": "nope"}', "unsupported JSON schema"),
    (SpecKind.JSON_SCHEMA, '{"type": "foo"}', "Unsupported type: foo"),
    (SpecKind.GRAMMAR, 'root ::= [a', "GBNF grammar does not parse"),
    (SpecKind.GRAMMAR, "start: foo", 'unknown name: "foo"'),
    (SpecKind.GRAMMAR, "start: (", "grammar does not compile"),
    (SpecKind.GRAMMAR, "   ", "must not be empty"),
]


@pytest.mark.parametrize("kind, text, reason", BAD)
def test_bad_constraints_say_why(kind: SpecKind, text: str, reason: str) -> None:
    with pytest.raises(CompileError) as err:
        compiler("sentencepiece").compile(GuidedSpec(kind, text), "k")
    assert reason in str(err.value)
    assert "open an issue" not in str(err.value)


def test_text_the_vocabulary_cannot_spell_is_refused() -> None:
    """Real vocabularies spell every byte; one without any "z" cannot spell "fizz"."""
    tok = Tokenizer.from_dir(str(sentencepiece_dir()))
    c = Compiler(tok, tok.vocab_size)
    c.vocab = TokenVocabulary(tuple(None if b is not None and b"z" in b else b
                                    for b in c.vocab.tokens), c.vocab.eos_ids, c.vocab.family)
    with pytest.raises(CompileError, match="vocabulary cannot produce it"):
        c.compile(GuidedSpec(SpecKind.REGEX, "fizz"), "k")
    c.compile(GuidedSpec(SpecKind.REGEX, "fi(zz)?"), "k")  # a way round it is fine
