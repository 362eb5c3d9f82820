"""The two workloads of `tandem bench spec`, as `bench serve` items (text prompts, exactly
`output_len` greedy tokens each).

* copy-heavy, on the copier (`copier.py`): a passage of `input_len` tokens that is the
  model's own greedy chain from a random word, then the passage's first `RESTART` tokens
  again.  The model continues by copying the passage, so its whole output is a span of the
  prompt.  With a real model (`--model`): natural-language passages behind an instruction to
  copy them, the copy already begun.
* plain: `bench serve`'s random prompts of `input_len` tokens (random non-special ids,
  decoded), as the other benchmarks use: nothing in them for the model to copy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tandem_serve.bench.serve.config import BenchConfig
from tandem_serve.bench.serve.datasets import BenchItem
from tandem_serve.bench.serve.run import build_dataset
from tandem_serve.bench.spec.copier import NextToken, chain

WORKLOADS = ("copy", "plain")
# Tokens of the passage repeated after it: the copy's beginning, which the model continues.
RESTART = 8

PASSAGES = (
    "The river left its banks late in the spring, after the snow on the northern hills had "
    "melted all at once. Farmers moved their animals to the higher fields, and the mill "
    "stood silent for three weeks while the water slowly went down again.",
    "A good recipe tells you what to buy, how long each step takes, and what the dish should "
    "look like when it is done. It also warns you about the mistakes that people usually "
    "make, such as adding the salt too early or opening the oven door too often.",
    "The library opens at nine in the morning and closes at six in the evening. Visitors may "
    "borrow up to five books at a time for two weeks, and they can renew each book twice "
    "unless another reader has asked for it in the meantime.",
    "When the train finally arrived, it was almost an hour late. The passengers who had been "
    "waiting on the cold platform climbed aboard quickly, found their seats, and opened the "
    "newspapers they had already read twice while they were waiting.",
    "Every program that reads input from people should check it before using it. A number "
    "that is too large, a name that is empty, or a date in the wrong format should produce "
    "a clear message that says which field was wrong and what was expected.",
    "The old lighthouse keeper wrote the weather in his notebook every evening: the wind, "
    "the clouds, the height of the waves, and the ships that passed. After forty years the "
    "notebooks filled a whole shelf in the small room below the lamp.",
)


def copier_items(model: str, tokenizer: Any, n: int, input_len: int, output_len: int,
                 seed: int) -> list[BenchItem]:
    """`n` copy prompts for the copier: its chain of `input_len` tokens, then its start."""
    if output_len > input_len - RESTART:
        raise ValueError(f"--output-len ({output_len}) must be at most --input-len minus "
                         f"{RESTART} ({input_len - RESTART}): the copy must stay inside the "
                         "passage")
    f = NextToken(model)
    words = f.words
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        passage = chain(f, int(rng.choice(words)), input_len)
        ids = passage + passage[:RESTART]
        text = tokenizer.decode(ids)
        got = tokenizer.encode(text)
        if got[-len(ids):] != ids:
            raise RuntimeError(f"copy prompt {i} does not re-encode to its ids; the copier's "
                               "words are not whole-word pieces of this tokenizer")
        items.append(BenchItem(i, text, len(got), output_len))
    return items


def natural_items(tokenizer: Any, n: int, output_len: int, seed: int) -> list[BenchItem]:
    """`n` natural-language copy prompts for a real model: a passage, then its copy begun."""
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        text = PASSAGES[int(rng.integers(len(PASSAGES)))]
        begun = " ".join(text.split()[:6])
        prompt = (f"Copy the following passage exactly, word for word.\n\nPassage:\n{text}\n\n"
                  f"Copy:\n{begun}")
        items.append(BenchItem(i, prompt, len(tokenizer.encode(prompt)), output_len))
    return items


def plain_items(model: str, tokenizer: Any, n: int, input_len: int, output_len: int,
                seed: int) -> list[BenchItem]:
    cfg = BenchConfig(model=model, num_prompts=n, input_len=input_len, output_len=output_len,
                      seed=seed)
    return build_dataset(cfg, tokenizer)


def build_items(kind: str, model: str, copier: bool, tokenizer: Any, n: int, input_len: int,
                output_len: int, seed: int) -> list[BenchItem]:
    """The `n` requests of workload `kind` ("copy" or "plain")."""
    if kind == "copy":
        return copier_items(model, tokenizer, n, input_len, output_len, seed) if copier \
            else natural_items(tokenizer, n, output_len, seed)
    if kind == "plain":
        return plain_items(model, tokenizer, n, input_len, output_len, seed)
    raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")
