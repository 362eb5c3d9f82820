"""Workloads for `tandem bench serve`: prompts of known token length, and arrival times.

Datasets:

* `random`: prompts of random token ids (never special ids), decoded to text. Decoding then
  re-encoding does not round-trip (merges across token boundaries, byte-fallback pieces,
  SentencePiece's leading "▁"), so the text is refitted until `len(encode(text))` hits the
  target; the item records the count the server's tokenizer will really see (BOS included).
* `shared-prefix`: one random prefix of `prefix_len` tokens shared by every prompt, then a
  random suffix of about `input_len` tokens. The prefix ends in a newline and the suffix has
  no leading whitespace, so no token merges across the seam; every prompt is checked to
  start with exactly the prefix's token ids, which is what prefix caching keys on.
* `multi-turn`: conversations of `turns` requests each, every turn re-sending the whole
  conversation so far: an opening of `prefix_len` tokens, then about `input_len` tokens
  more per turn (the previous answer and the next question, drawn like the prefix, each
  ending in a newline so no token merges across turns).  Requests go round-robin over the
  conversations (every first turn, then every second...), so with enough conversations
  the device cache holds none of a conversation's history by its next turn: the workload
  of a host KV tier (`--kv-offloading-size`).
* `file`: JSONL, one `{"prompt": str, "output_len": int (optional)}` per line, taken in file
  order (cycled when `num_prompts` exceeds the lines).

Lengths are uniform integers in [len·(1−r), len·(1+r)] (r = range ratio), as vLLM draws them.
All randomness comes from `seed`, so two runs (or two engines in an A/B) get the same prompts.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

DATASETS = ("random", "shared-prefix", "multi-turn", "file")
# Refit rounds before settling for the closest length; real tokenizers converge in 1-3.
_MAX_FIT_ROUNDS = 24
# Distinct streams derived from one seed, so adding a dataset draw never moves arrivals.
_STREAM_DATASET = 0
_STREAM_ARRIVALS = 1
_STREAM_WARMUP = 2


class TokenizerLike(Protocol):
    """The part of `tokenization.tokenizer.Tokenizer` the datasets use."""

    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class BenchItem:
    """One request of the workload."""

    index: int
    prompt: str
    prompt_len: int  # tokens as the server's tokenizer counts them (0: unknown)
    output_len: int
    # Guided decoding: the constraint's GenerateOptions fields (guided_load.py); None: none.
    guided: dict[str, Any] | None = None


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] for uniform lengths around `length`; never below 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(int(length * (1.0 - range_ratio)), 1)
    high = max(int(length * (1.0 + range_ratio)), low)
    return low, high


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float,
                   n: int) -> list[int]:
    low, high = length_range(length, range_ratio)
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def allowed_token_ids(tok: TokenizerLike) -> np.ndarray:
    """Ids a random prompt may use: not special, and decoding to whole characters.

    Lone pieces of a UTF-8 sequence (byte-level BPE fragments, SentencePiece's <0x80>..<0xFF>)
    decode to U+FFFD, which re-encodes as several tokens and slows the length fit down.
    """
    ids = np.arange(tok.vocab_size, dtype=np.int64)
    if tok.special_ids:
        ids = ids[~np.isin(ids, np.fromiter(tok.special_ids, dtype=np.int64))]
    raw = getattr(tok, "raw", None)
    if raw is not None and hasattr(raw, "decode_batch"):  # one Rust call for the vocab
        texts = raw.decode_batch([[int(i)] for i in ids], skip_special_tokens=True)
    else:
        texts = [tok.decode([int(i)], skip_special_tokens=True) for i in ids]
    keep = np.fromiter((bool(t) and "\ufffd" not in t for t in texts), dtype=bool,
                       count=len(ids))
    return ids[keep] if keep.any() else ids


def _fit_text(tok: TokenizerLike, rng: np.random.Generator, allowed: np.ndarray, target: int,
              render: Callable[[list[int]], str], fixed_tokens: int) -> tuple[str, int]:
    """Text whose full encoding is `target` tokens (or the closest found), and its length.

    `render` turns random content ids into the prompt text; `fixed_tokens` is how many tokens
    the rendered text has besides the content (BOS, a shared prefix), the first guess.
    """
    ids = [int(i) for i in rng.choice(allowed, size=max(target - fixed_tokens, 0))]
    best: tuple[str, int] | None = None
    for _ in range(_MAX_FIT_ROUNDS):
        text = render(ids)
        n = len(tok.encode(text))
        if best is None or abs(n - target) < abs(best[1] - target):
            best = (text, n)
        if n == target:
            break
        if n > target:
            if not ids:
                break  # the fixed part alone is already longer; nothing left to trim
            ids = ids[:max(len(ids) - (n - target), 0)]
        else:
            ids += [int(i) for i in rng.choice(allowed, size=target - n)]
    assert best is not None
    return best


def _special_overhead(tok: TokenizerLike) -> int:
    """Tokens the post-processor adds to any text (BOS and the like)."""
    return len(tok.encode(""))


def random_dataset(tok: TokenizerLike, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0,
                   rng: np.random.Generator | None = None) -> list[BenchItem]:
    rng = rng or np.random.default_rng([seed, _STREAM_DATASET])
    allowed = allowed_token_ids(tok)
    overhead = _special_overhead(tok)
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    items = []
    for i in range(num_prompts):
        text, n = _fit_text(tok, rng, allowed, in_lens[i],
                            lambda ids: tok.decode(ids, skip_special_tokens=True), overhead)
        items.append(BenchItem(i, text, n, out_lens[i]))
    return items


def make_prefix(tok: TokenizerLike, prefix_len: int, rng: np.random.Generator,
                allowed: np.ndarray) -> str:
    """A random prefix text of about `prefix_len` tokens (BOS included) ending in a newline.

    A newline is a pre-tokenizer boundary for byte-level BPE and a byte-fallback token that
    no merge touches in SentencePiece models, so what follows cannot change its tokens.
    """
    if prefix_len <= 0:
        return ""

    def render(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True).rstrip() + "\n"

    text, _ = _fit_text(tok, rng, allowed, prefix_len, render, _special_overhead(tok) + 1)
    return text


def shared_prefix_dataset(tok: TokenizerLike, num_prompts: int, prefix_len: int,
                          input_len: int, output_len: int, range_ratio: float = 0.0,
                          seed: int = 0, rng: np.random.Generator | None = None,
                          prefix_rng: np.random.Generator | None = None) -> list[BenchItem]:
    """Prompts = one shared prefix + per-prompt random suffix of ~`input_len` tokens.

    The prefix is drawn from `prefix_rng` when given (else from `rng`, first), so warm-up
    prompts can share the measured prefix while their suffixes differ.
    """
    rng = rng or np.random.default_rng([seed, _STREAM_DATASET])
    allowed = allowed_token_ids(tok)
    prefix = make_prefix(tok, prefix_len, prefix_rng or rng, allowed)
    prefix_ids = tok.encode(prefix)
    n_prefix = len(prefix_ids)
    suffix_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)

    def render(ids: list[int]) -> str:
        return prefix + tok.decode(ids, skip_special_tokens=True).lstrip()

    items = []
    for i in range(num_prompts):
        for _attempt in range(8):
            text, n = _fit_text(tok, rng, allowed, n_prefix + suffix_lens[i], render, n_prefix)
            if tok.encode(text)[:n_prefix] == prefix_ids:
                break
        else:
            raise RuntimeError("could not build a suffix that keeps the shared prefix's tokens "
                               "intact; this tokenizer merges across newlines")
        items.append(BenchItem(i, text, n, out_lens[i]))
    return items


def multi_turn_dataset(tok: TokenizerLike, num_prompts: int, prefix_len: int,
                       input_len: int, output_len: int, turns: int,
                       rng: np.random.Generator) -> list[BenchItem]:
    """`num_prompts` requests over ceil(num_prompts / turns) conversations, round-robin."""
    if turns < 1:
        raise ValueError(f"--turns must be >= 1, got {turns}")
    allowed = allowed_token_ids(tok)
    overhead = _special_overhead(tok)
    num_conversations = -(-num_prompts // turns)
    histories = [make_prefix(tok, max(prefix_len, overhead + 2), rng, allowed)
                 for _ in range(num_conversations)]
    items: list[BenchItem] = []
    for _turn in range(turns):
        for c in range(num_conversations):
            if len(items) == num_prompts:
                return items
            # make_prefix counts the special tokens once; a turn in the middle has none.
            histories[c] += make_prefix(tok, input_len + overhead, rng, allowed)
            items.append(BenchItem(len(items), histories[c], len(tok.encode(histories[c])),
                                   output_len))
    return items


def file_dataset(path: str | Path, num_prompts: int, output_len: int,
                 tok: TokenizerLike | None = None) -> list[BenchItem]:
    """JSONL prompts in file order; `output_len` fills lines that do not give one."""
    rows: list[tuple[str, int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'prompt'")
            out = obj.get("output_len", output_len)
            if not isinstance(out, int) or isinstance(out, bool) or out < 1:
                raise ValueError(f"{path}:{lineno}: output_len must be a positive integer")
            rows.append((obj["prompt"], out))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    n = num_prompts if num_prompts > 0 else len(rows)
    items = []
    for i in range(n):
        prompt, out = rows[i % len(rows)]
        items.append(BenchItem(i, prompt, len(tok.encode(prompt)) if tok else 0, out))
    return items


def load_dataset(name: str, tok: TokenizerLike | None, *, num_prompts: int, input_len: int,
                 output_len: int, range_ratio: float = 0.0, prefix_len: int = 0,
                 dataset_path: str = "", seed: int = 0, warmup: bool = False
                 ) -> list[BenchItem]:
    """Build a dataset by name. `warmup=True` draws different prompts from the same seed,
    so warm-up requests do not pre-fill the prefix cache with the measured prompts."""
    rng = dataset_rng(seed, warmup)
    if name == "file":
        if not dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        return file_dataset(dataset_path, num_prompts, output_len, tok)
    if tok is None:
        raise ValueError(f"--dataset {name} needs a tokenizer (--model DIR)")
    if name == "random":
        return random_dataset(tok, num_prompts, input_len, output_len, range_ratio, rng=rng)
    if name == "shared-prefix":
        # Warm-up shares the measured prefix (a server in steady state has it cached) but
        # not the suffixes; the measured run draws its prefix first from the same stream.
        prefix_rng = np.random.default_rng([seed, _STREAM_DATASET]) if warmup else None
        return shared_prefix_dataset(tok, num_prompts, prefix_len, input_len, output_len,
                                     range_ratio, rng=rng, prefix_rng=prefix_rng)
    if name == "multi-turn":
        return multi_turn_dataset(tok, num_prompts, prefix_len, input_len, output_len, 4, rng)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def dataset_rng(seed: int, warmup: bool = False) -> np.random.Generator:
    """The draws of a dataset (`warmup`: of its warm-up requests, apart from the measured)."""
    return np.random.default_rng([seed, _STREAM_WARMUP if warmup else _STREAM_DATASET])


def arrival_offsets(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of `n` requests arriving as a Poisson process.

    Gaps are exponential with mean 1/rate; the first request goes at 0. A rate of `inf`
    sends everything at once.
    """
    if n <= 0:
        return []
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"request rate must be > 0 or inf, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, _STREAM_ARRIVALS])
    gaps = rng.exponential(1.0 / request_rate, size=n - 1)
    return [0.0] + [float(x) for x in np.cumsum(gaps)]
