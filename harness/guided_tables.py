"""Guided-decoding tables for benchmarks and tests, from the serving path's own compiler.

The server compiles constraints in a worker process with caches (`guided.service`); the
benchmarks that drive a `ModelRunner` in-process (`bench step --guided`, the GPU check's
features stage) want a `GuidedTable` for a model folder's tokenizer without either, so this
calls `guided.compile.Compiler` in-process.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from functools import cache
from typing import Any

from tandem_serve.guided.compile import Compiler
from tandem_serve.guided.forms import choice_regex as _choice_regex
from tandem_serve.guided.forms import schema_regex
from tandem_serve.guided.spec import GuidedSpec, SpecKind
from tandem_serve.proto.guided_messages import GuidedTable
from tandem_serve.tokenization.tokenizer import Tokenizer


@cache
def _compiler(tokenizer: Tokenizer, vocab_size: int) -> Compiler:
    return Compiler(tokenizer, vocab_size)


def vocabulary(tokenizer: Tokenizer) -> Any:
    """The tokenizer as an `outlines_core.Vocabulary` (what the server's tables are built on)."""
    return _compiler(tokenizer, tokenizer.vocab_size).outlines_vocabulary


def regex_table(regex: str, tokenizer: Tokenizer, vocab_size: int) -> GuidedTable:
    """The table of a regex (the Rust `regex` dialect) over this tokenizer."""
    compiler = _compiler(tokenizer, vocab_size)
    key = hashlib.sha256(f"{regex}\0{compiler.vocab.fingerprint()}".encode()).hexdigest()[:32]
    return compiler.compile_table(GuidedSpec(SpecKind.REGEX, regex), key)


def choice_regex(choices: Iterable[str]) -> str:
    return _choice_regex(tuple(choices))


def json_schema_regex(schema: dict[str, Any]) -> str:
    return schema_regex(json.dumps(schema))
