"""Every backend of `tandem bench serve` by its `--backend` name."""
from __future__ import annotations

from typing import Any

from tandem_serve.bench.serve.backends.base import BACKENDS, Backend, BackendOptions
from tandem_serve.bench.serve.backends.hf_generate import HFGenerateBackend
from tandem_serve.bench.serve.backends.openai_compatible import (
    OpenAIBackend,
    TransformersServeBackend,
)
from tandem_serve.bench.serve.backends.tandem import TandemBackend


def make_backend(name: str, opts: BackendOptions, tokenizer: Any = None) -> Backend:
    if name == "tandem":
        return TandemBackend(opts)
    if name in ("openai-completions", "openai-chat"):
        return OpenAIBackend(opts, chat=name == "openai-chat")
    if name == "transformers-serve":
        return TransformersServeBackend(opts)
    if name == "hf-generate":
        return HFGenerateBackend(opts, tokenizer)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
