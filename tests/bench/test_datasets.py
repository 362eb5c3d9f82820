"""Benchmark workloads: seeded, of the asked token lengths, prefixes shared token for token."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from tandem_serve.bench.serve.datasets import (
    BenchItem,
    allowed_token_ids,
    arrival_offsets,
    dataset_rng,
    file_dataset,
    length_range,
    load_dataset,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
)

try:
    from tandem_serve.tokenization.tokenizer import Tokenizer
except ImportError:  # another engineer's module; the datasets cannot be tested without it
    pytest.skip("tokenization/tokenizer.py is not there yet", allow_module_level=True)

BOS, EOS = "<|bos|>", "<|eos|>"


def _training_text(n_lines: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ("the of and model token server stream text output input space line hello world "
             "你好 世界 模型 café naïve über ✓ 42 3.14 (x) [y] {z} def return").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 16)))
            for _ in range(n_lines)]


def _build_bpe_dir(root: Path) -> Path:
    """A tiny byte-level BPE (GPT-2 style, BOS added by the post-processor) in `root`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=600, special_tokens=[BOS, EOS], show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(_training_text(), trainer=trainer)
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, raw.token_to_id(BOS))])
    root.mkdir(parents=True, exist_ok=True)
    raw.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return root


@pytest.fixture(scope="module")
def bpe_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(str(_build_bpe_dir(tmp_path_factory.mktemp("bpe"))))


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """The Llama-2-style SentencePiece tokenizer the tiny default model ships."""
    pytest.importorskip("mistral_common")
    from tests.tokenizer_utils import sentencepiece_dir

    return Tokenizer.from_dir(str(sentencepiece_dir()))


@pytest.fixture(params=["bpe", "sentencepiece"])
def any_tok(request: pytest.FixtureRequest) -> Tokenizer:
    name = "bpe_tok" if request.param == "bpe" else "sp_tok"
    return request.getfixturevalue(name)


# --------------------------------------------------------------------------- lengths


def test_length_range() -> None:
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    assert length_range(1, 0.9) == (1, 1)  # never below one token
    with pytest.raises(ValueError):
        length_range(100, 1.0)
    with pytest.raises(ValueError):
        length_range(100, -0.1)


def test_allowed_ids_exclude_special(bpe_tok: Tokenizer) -> None:
    allowed = set(allowed_token_ids(bpe_tok).tolist())
    assert bpe_tok.special_ids and not (allowed & set(bpe_tok.special_ids))
    assert len(allowed) > bpe_tok.vocab_size // 2


# --------------------------------------------------------------------------- random


def test_random_dataset_is_seeded(bpe_tok: Tokenizer) -> None:
    a = random_dataset(bpe_tok, 12, 40, 16, 0.3, seed=7)
    b = random_dataset(bpe_tok, 12, 40, 16, 0.3, seed=7)
    c = random_dataset(bpe_tok, 12, 40, 16, 0.3, seed=8)
    assert a == b
    assert [i.prompt for i in a] != [i.prompt for i in c]
    assert [i.index for i in a] == list(range(12))


def test_random_lengths_within_range_ratio(any_tok: Tokenizer) -> None:
    items = random_dataset(any_tok, 40, 64, 20, 0.25, seed=1)
    in_lo, in_hi = length_range(64, 0.25)
    out_lo, out_hi = length_range(20, 0.25)
    assert all(out_lo <= it.output_len <= out_hi for it in items)
    assert len({it.output_len for it in items}) > 3  # really drawn, not all the middle
    for it in items:
        # The recorded count is the server's count (BOS included), and the fit hits the
        # drawn length up to a token or two where re-encoding cannot land exactly.
        assert it.prompt_len == len(any_tok.encode(it.prompt))
        assert in_lo - 2 <= it.prompt_len <= in_hi + 2
    assert len({it.prompt_len for it in items}) > 3


def test_random_fixed_length_is_exact(any_tok: Tokenizer) -> None:
    items = random_dataset(any_tok, 30, 50, 8, 0.0, seed=3)
    assert all(it.output_len == 8 for it in items)
    exact = sum(it.prompt_len == 50 for it in items)
    assert exact >= 27, [it.prompt_len for it in items]
    assert all(abs(it.prompt_len - 50) <= 2 for it in items)


def test_random_prompts_hold_no_special_tokens(bpe_tok: Tokenizer) -> None:
    overhead = len(bpe_tok.encode(""))
    for it in random_dataset(bpe_tok, 20, 60, 4, 0.0, seed=5):
        ids = bpe_tok.encode(it.prompt)
        assert not set(ids[overhead:]) & set(bpe_tok.special_ids)


# ---------------------------------------------------------------------- shared prefix


def test_shared_prefix_is_shared_token_for_token(any_tok: Tokenizer) -> None:
    prefix_len, suffix_len = 48, 24
    items = shared_prefix_dataset(any_tok, 16, prefix_len, suffix_len, 8, 0.0, seed=11)
    encoded = [any_tok.encode(it.prompt) for it in items]
    # Length of the common token prefix across all prompts.
    common = 0
    while all(len(e) > common and e[common] == encoded[0][common] for e in encoded):
        common += 1
    assert abs(common - prefix_len) <= 2, common
    # ...and the prompts really differ after it.
    assert len({tuple(e[common:]) for e in encoded}) == len(items)
    for it, e in zip(items, encoded, strict=True):
        assert it.prompt_len == len(e)
        assert abs(it.prompt_len - (prefix_len + suffix_len)) <= 2


def test_shared_prefix_is_seeded(bpe_tok: Tokenizer) -> None:
    a = shared_prefix_dataset(bpe_tok, 6, 30, 10, 4, 0.2, seed=2)
    b = shared_prefix_dataset(bpe_tok, 6, 30, 10, 4, 0.2, seed=2)
    assert a == b


def test_warmup_prompts_share_prefix_but_not_suffixes(bpe_tok: Tokenizer) -> None:
    kwargs = dict(num_prompts=6, input_len=12, output_len=4, prefix_len=32, seed=4)
    main = load_dataset("shared-prefix", bpe_tok, **kwargs)  # type: ignore[arg-type]
    warm = load_dataset("shared-prefix", bpe_tok, warmup=True, **kwargs)  # type: ignore[arg-type]
    n = 30
    assert {tuple(bpe_tok.encode(it.prompt)[:n]) for it in main + warm} == {
        tuple(bpe_tok.encode(main[0].prompt)[:n])}
    assert not {it.prompt for it in main} & {it.prompt for it in warm}
    rnd = load_dataset("random", bpe_tok, num_prompts=4, input_len=20, output_len=4, seed=4)
    rnd_w = load_dataset("random", bpe_tok, num_prompts=4, input_len=20, output_len=4, seed=4,
                         warmup=True)
    assert not {it.prompt for it in rnd} & {it.prompt for it in rnd_w}


# ------------------------------------------------------------------------------ file


def test_file_dataset(tmp_path: Path, bpe_tok: Tokenizer) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello world", "output_len": 5}\n'
                    "\n"
                    '{"prompt": "the model streams text"}\n', encoding="utf-8")
    items = file_dataset(path, 5, output_len=9, tok=bpe_tok)
    assert [it.prompt for it in items] == ["hello world", "the model streams text"] * 2 + [
        "hello world"]
    assert [it.output_len for it in items] == [5, 9, 5, 9, 5]
    assert items[1].prompt_len == len(bpe_tok.encode("the model streams text"))
    assert [it.index for it in items] == list(range(5))
    # Without a tokenizer the count is unknown (the server reports it).
    assert file_dataset(path, 0, 3)[0] == BenchItem(0, "hello world", 0, 5)
    via_loader = load_dataset("file", None, num_prompts=2, input_len=0, output_len=9,
                              dataset_path=str(path))
    assert [it.output_len for it in via_loader] == [5, 9]


@pytest.mark.parametrize("line", ['{"text": "x"}', "not json", '{"prompt": "x", "output_len": 0}',
                                  '["x"]'])
def test_file_dataset_rejects_bad_lines(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        file_dataset(path, 1, 4)


def test_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dataset-path"):
        load_dataset("file", None, num_prompts=1, input_len=1, output_len=1)
    with pytest.raises(ValueError, match="tokenizer"):
        load_dataset("random", None, num_prompts=1, input_len=1, output_len=1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        file_dataset(empty, 1, 1)


# ------------------------------------------------------------------------- arrivals


def test_poisson_arrivals_are_seeded_with_mean_gap() -> None:
    rate = 20.0
    a = arrival_offsets(20000, rate, seed=3)
    assert a == arrival_offsets(20000, rate, seed=3)
    assert a != arrival_offsets(20000, rate, seed=4)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a[:-1], a[1:], strict=True))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)


def test_infinite_rate_sends_all_at_once() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(0, 1.0) == []
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_multi_turn_conversations_grow_turn_by_turn(any_tok: Tokenizer) -> None:
    items = multi_turn_dataset(any_tok, 7, 20, 12, 4, 3, dataset_rng(3))
    assert [i.index for i in items] == list(range(7))
    # Three conversations, round-robin: turns 1 of 0, 1, 2, then turns 2, then turn 3 of 0.
    for earlier, later in ((0, 3), (1, 4), (2, 5), (3, 6)):
        a, b = items[earlier], items[later]
        assert b.prompt.startswith(a.prompt)
        assert any_tok.encode(b.prompt)[:a.prompt_len] == any_tok.encode(a.prompt)
        assert 8 <= b.prompt_len - a.prompt_len <= 16
    assert not items[1].prompt.startswith(items[0].prompt)
    with pytest.raises(ValueError, match="--turns"):
        multi_turn_dataset(any_tok, 2, 0, 4, 1, 0, dataset_rng(0))
