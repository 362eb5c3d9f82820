"""`guided.table`: renumbering, DONE, EOS and class compression, against outlines-core."""
from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import pytest

from tandem_serve.guided import table as gt
from tandem_serve.guided.forms import choice_regex, schema_regex
from tandem_serve.guided.table import NoOutput, advance, allowed, build_table, compress, done_state
from tandem_serve.guided.vocab import TokenVocabulary
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import sentencepiece_dir

EOS = 9


def toy_vocab(size: int = 12) -> TokenVocabulary:
    """Ids 0..size-1: id 0 is special, EOS (9) ends text, the rest are single letters."""
    tokens: list[bytes | None] = [None] + [bytes([ord("a") + i]) for i in range(1, size)]
    tokens[EOS] = None
    return TokenVocabulary(tuple(tokens), (EOS,), "sentencepiece")


def test_renumbered_with_done_and_eos_only_where_final() -> None:
    # 10 -a-> 20 -b-> 30 (final) -b-> 30; "c" from 10 also ends; 30 has EOS from outlines.
    a, b, c = 1, 2, 3
    transitions = {10: {a: 20, c: 30}, 20: {b: 30}, 30: {b: 30, EOS: 30}}
    t = build_table("t", transitions, 10, {30}, toy_vocab())
    assert t.initial_state == 0
    done = done_state(t)
    assert done == 3 and t.next_state.shape[0] == 4
    assert advance(t, 0, a) == 1 and advance(t, 1, b) == 2 and advance(t, 0, c) == 2
    assert advance(t, 2, b) == 2
    assert advance(t, 0, EOS) == advance(t, 1, EOS) == -1  # not final: no EOS
    assert advance(t, 2, EOS) == done
    assert allowed(t, done).nonzero()[0].tolist() == [EOS]  # DONE: only EOS, to DONE
    assert advance(t, done, EOS) == done
    # Special ids and ids no state allows are never allowed, not even in DONE.
    for never in (0, 4, 11):
        assert all(advance(t, s, never) == -1 for s in range(done + 1))


def test_every_eos_id_shares_the_eos_class() -> None:
    vocab = TokenVocabulary(toy_vocab().tokens[:8] + (None, None, None), (8, 9, 10),
                            "sentencepiece")
    t = build_table("t", {1: {2: 1, 8: 1}}, 1, {1}, vocab)
    assert t.token_class[8] == t.token_class[9] == t.token_class[10]
    assert allowed(t, 0)[[2, 8, 9, 10]].all()


def test_identical_columns_merge_and_distinct_ones_do_not() -> None:
    # b and c behave the same everywhere; d differs from them in one state only.
    b, c, d, e = 2, 3, 4, 5
    transitions = {0: {b: 1, c: 1, d: 1, e: 2}, 1: {b: 2, c: 2, d: 1}, 2: {}}
    t = build_table("t", transitions, 0, {2}, toy_vocab())
    cls = t.token_class
    assert cls[b] == cls[c]
    assert len({cls[b], cls[d], cls[e], cls[EOS], cls[0]}) == 5
    columns = {tuple(t.next_state[:, k]) for k in range(t.next_state.shape[1])}
    assert len(columns) == t.next_state.shape[1]  # no two classes are the same column


def test_a_hash_collision_falls_back_to_exact_classes() -> None:
    rng = np.random.default_rng(0)
    rows = [(np.arange(1, 40), rng.integers(0, 2, 39)) for _ in range(4)]  # repeats

    def colliding(rows: gt.Rows, vocab_size: int, seed: int) -> np.ndarray:
        return np.zeros(vocab_size, np.int64)  # every column "equal"

    table, token_class = compress(rows, 40, colliding)
    exact, exact_class = compress(rows, 40)
    dense = np.full((4, 40), -1)
    for i, (tok, nxt) in enumerate(rows):
        dense[i, tok] = nxt
    assert np.array_equal(table[:, token_class], dense)
    assert np.array_equal(exact[:, exact_class], dense)
    assert table.shape[1] == np.unique(dense, axis=1).shape[1] == exact.shape[1] < 20


def test_dead_ends_are_cut_and_an_unsatisfiable_start_is_an_error() -> None:
    # 2 loops forever without reaching the final state 3: never enter it.
    transitions = {0: {1: 2, 2: 3}, 2: {1: 2}, 3: {EOS: 3}}
    t = build_table("t", transitions, 0, {3}, toy_vocab())
    assert t.next_state.shape[0] == 3  # start, final, DONE
    assert advance(t, 0, 1) == -1 and advance(t, 0, 2) == 1
    with pytest.raises(NoOutput):
        build_table("t", {0: {1: 2}, 2: {1: 2}}, 0, {5}, toy_vocab())


# ------------------------------------------------------------------ against outlines-core


@functools.cache
def sp_vocab() -> tuple[Tokenizer, TokenVocabulary, Any]:
    from outlines_core import Vocabulary

    tok = Tokenizer.from_dir(str(sentencepiece_dir()))
    vocab = TokenVocabulary.from_tokenizer(tok, tok.vocab_size + 3)
    return tok, vocab, Vocabulary(vocab.eos_ids[0], vocab.by_bytes())


REGEXES = {
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "choice": choice_regex(("red", "green", "light blue", "a.b*")),
    "schema": '{"type": "object", "properties": {"name": {"type": "string"}, '
              '"age": {"type": "integer"}}, "required": ["name", "age"]}',
    "unicode": r"(é|日本)+[0-9]?",
}


@pytest.mark.parametrize("name", list(REGEXES))
def test_walks_agree_with_outlines(name: str) -> None:
    """Random walks: the table allows exactly outlines' tokens in every state it reaches,
    EOS exactly where outlines is final, and its state numbering is a bijection."""
    from outlines_core import Index

    _, vocab, ovocab = sp_vocab()
    regex = schema_regex(REGEXES[name]) if name == "schema" else REGEXES[name]
    index = Index(regex, ovocab)
    t = build_table("t", index.get_transitions(), index.get_initial_state(),
                    index.get_final_states(), vocab)
    assert t.token_class.shape == (vocab.vocab_size,)
    eos = vocab.eos_ids[0]
    rng = random.Random(0)
    ours_of: dict[int, int] = {}
    for _ in range(12):
        theirs, ours = index.get_initial_state(), t.initial_state
        for _ in range(40):
            assert ours_of.setdefault(theirs, ours) == ours
            want = set(index.get_allowed_tokens(theirs)) - {eos}
            got = set(np.flatnonzero(allowed(t, ours)).tolist())
            final = index.is_final_state(theirs)
            assert got == want | ({eos} if final else set())
            if not want or (final and rng.random() < 0.1):
                assert advance(t, ours, eos) == done_state(t)
                break
            token = rng.choice(sorted(want))
            theirs, ours = index.get_next_state(theirs, token), advance(t, ours, token)
    assert len(set(ours_of.values())) == len(ours_of)


def test_choice_allows_exactly_the_choices() -> None:
    from outlines_core import Index

    tok, vocab, ovocab = sp_vocab()
    choices = ("red", "green", "light blue", "a.b*")
    index = Index(choice_regex(choices), ovocab)
    t = build_table("t", index.get_transitions(), index.get_initial_state(),
                    index.get_final_states(), vocab)
    for choice in choices:
        state = t.initial_state
        for token in tok.raw.encode(choice, add_special_tokens=False).ids:
            if vocab.tokens[token] is not None and vocab.tokens[token].startswith(b" "):
                break  # SentencePiece put a leading "▁" on the first piece: not the choice
            state = advance(t, state, token)
        else:
            assert advance(t, state, vocab.eos_ids[0]) == done_state(t), choice
