"""The detokenizer alone: tokens per second of `IncrementalDetokenizer.add` in this process.

    python -m tandem_serve.bench.postproc.detokenizer MODEL_DIR...
"""
from __future__ import annotations

import sys
import time

from tandem_serve.postproc_worker.detokenizer import IncrementalDetokenizer, engine_kind
from tandem_serve.tokenization.tokenizer import Tokenizer

BENCH_TEXT = (
    "The quick brown fox jumps over the lazy dog. Serving engines stream text to clients "
    "while the accelerator keeps computing; every delta must be valid UTF-8 text.\n"
    "def detokenize(ids):\n    return tokenizer.decode(ids)  # reference\n"
    "Numbers like 3.14159 and 2,718 appear too, with punctuation: (a), [b], {c}!\n"
)


def bench_detokenizer(
    tok: Tokenizer | str,
    n_tokens: int = 200_000,
    text: str | None = None,
    skip_special_tokens: bool = True,
    chunk: int = 1,
) -> float:
    """Tokens per second of `IncrementalDetokenizer.add` in this process (the plain case:
    one request, `chunk` ids per call). `tok` is a Tokenizer or a model folder."""
    if isinstance(tok, str):
        tok = Tokenizer.from_dir(tok)
    base = tok.raw.encode(text or BENCH_TEXT, add_special_tokens=False).ids
    ids = (base * (n_tokens // max(1, len(base)) + 1))[:n_tokens]
    steps = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens)
    add = detok.add
    start = time.perf_counter()
    for step in steps:
        add(step)
    detok.flush()
    elapsed = time.perf_counter() - start
    return len(ids) / elapsed


if __name__ == "__main__":
    for model_dir in sys.argv[1:]:
        t = Tokenizer.from_dir(model_dir)
        rate = bench_detokenizer(t)
        print(f"{model_dir}: {engine_kind(t)} engine, {rate:,.0f} tokens/s")
