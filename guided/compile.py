"""Compile one validated constraint for one model: a `GuidedTable` or a `GuidedGrammar`.

Runs in the compile worker process (`guided/worker.py`): outlines-core holds the GIL for the
whole `Index` construction (seconds for a JSON object), so it must not share an interpreter
with the frontend's event loop, and a compile past its time limit is stopped by killing the
process. Tests call `Compiler` directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tandem_serve.guided.forms import FormError, explain_regex, grammar_lark, spec_regex
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.guided.table import NoOutput, build_table
from tandem_serve.guided.vocab import TokenVocabulary, ll_tokenizer
from tandem_serve.proto.guided_messages import GuidedGrammar, GuidedTable
from tandem_serve.tokenization.tokenizer import Tokenizer


class CompileError(ValueError):
    """The constraint cannot be compiled; the message says why (the caller names the field)."""


@dataclass
class CompileStats:
    seconds: float
    states: int = 0  # tables: automaton states (DONE not counted)
    classes: int = 0  # tables: token classes


class Compiler:
    """Owns the vocabulary in both compilers' forms, built once and reused."""

    def __init__(self, tok: Tokenizer, vocab_size: int) -> None:
        self.tok = tok
        self.vocab = TokenVocabulary.from_tokenizer(tok, vocab_size)
        self._outlines_vocab: Any = None
        self._ll_tokenizer: Any = None

    @property
    def outlines_vocabulary(self) -> Any:
        if self._outlines_vocab is None:
            from outlines_core import Vocabulary

            # outlines-core knows one EOS id; the table gives every EOS id the same class.
            self._outlines_vocab = Vocabulary(self.vocab.eos_ids[0], self.vocab.by_bytes())
        return self._outlines_vocab

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self.vocab, self.tok)
        return self._ll_tokenizer

    def compile(self, spec: GuidedSpec, key: str) -> tuple[GuidedTable | GuidedGrammar,
                                                           CompileStats]:
        start = time.perf_counter()
        try:
            if spec.kind == SpecKind.GRAMMAR:
                grammar = self.compile_grammar(spec.value, key)
                return grammar, CompileStats(time.perf_counter() - start)
            table = self.compile_table(spec, key)
        except (FormError, NoOutput) as e:
            raise CompileError(str(e)) from None
        rows, classes = table.next_state.shape
        return table, CompileStats(time.perf_counter() - start, rows - 1, classes)

    def compile_table(self, spec: GuidedSpec, key: str) -> GuidedTable:
        index = self.index(spec_regex(spec))
        return build_table(key, index.get_transitions(), index.get_initial_state(),
                           index.get_final_states(), self.vocab)

    def index(self, regex: str) -> Any:
        from outlines_core import Index

        try:
            return Index(regex, self.outlines_vocabulary)
        except ValueError as e:
            why = explain_regex(regex)
            if why:
                raise FormError(why) from None
            text = str(e)
            if "incompatible with the regex" in text:
                # "...Found no transitions from state N, missing tokens corresponding to..."
                detail = text.split("Found no transitions from state", 1)[-1]
                detail = detail.split(", ", 1)[-1].split(". This may be", 1)[0]
                raise FormError(f"this model's vocabulary cannot produce it ({detail})"
                                ) from None
            raise FormError(f"cannot build its automaton: {text}") from None

    def compile_grammar(self, grammar: str, key: str) -> GuidedGrammar:
        """Convert to Lark and have llguidance build it against this vocabulary."""
        import llguidance

        lark = grammar_lark(grammar)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(lark), self.ll_tokenizer)
        if is_error:
            raise FormError(f"grammar does not compile: {messages[0].strip()}")
        return GuidedGrammar(grammar_id=key, lark=lark)
