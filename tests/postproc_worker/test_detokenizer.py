"""IncrementalDetokenizer: deltas concatenate to HF decode(output_ids), never end mid-character."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from tandem_serve.postproc_worker import detokenizer as detok_mod
from tandem_serve.postproc_worker.detok_engines import DECODER_CLEANUP_UNSAFE, WindowEngine
from tandem_serve.postproc_worker.detokenizer import IncrementalDetokenizer, engine_kind
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import (
    BPE_SPECIAL_TOKENS,
    byte_level_bpe_dir,
    corpus_for,
    sentencepiece_dir,
    wordpiece_dir,
)

REPLACEMENT = "\ufffd"

FAMILIES: dict[str, tuple[Any, str, str, str]] = {
    "sentencepiece": (sentencepiece_dir, "<s>", "</s>", "byte_fallback"),
    "byte_level_bpe": (byte_level_bpe_dir, BPE_SPECIAL_TOKENS[0], BPE_SPECIAL_TOKENS[2],
                       "byte_level"),
    "wordpiece": (wordpiece_dir, "[CLS]", "[SEP]", "window"),
}


class Family:
    def __init__(self, name: str) -> None:
        build, self.bos, self.eos, self.kind = FAMILIES[name]
        from transformers import AutoTokenizer

        model_dir = str(build())
        self.name = name
        self.tok = Tokenizer.from_dir(model_dir)
        self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.texts = corpus_for(self.bos, self.eos)
        vocab = self.tok.raw.get_vocab()
        self.byte_ids = [vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab]


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request: pytest.FixtureRequest) -> Family:
    return Family(request.param)


def stream(
    tok: Tokenizer, ids: Sequence[int], skip: bool, rng: random.Random,
    engine: str | None = None,
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed ids in random chunks of 1..5; return the deltas, the flush and the detokenizer."""
    det = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=skip)
    if engine == "window":  # force the generic engine on any tokenizer
        plan = detok_mod._plan_for(tok)
        det._engine = WindowEngine(tok, skip, plan.byte_ids, plan.unsafe_tail)
    deltas = []
    i = 0
    while i < len(ids):
        k = rng.randint(1, 5)
        deltas.append(det.add(ids[i:i + k]))
        i += k
    return deltas, det.flush(), det


def check_stream(fam: Family, ids: list[int], skip: bool, rng: random.Random,
                 engine: str | None = None) -> None:
    deltas, tail, det = stream(fam.tok, ids, skip, rng, engine)
    want = fam.hf.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == want, (ids, skip)
    assert det.text == want
    # A U+FFFD in a delta must be one the full decode has at that very place.
    pos = 0
    for delta in deltas + [tail]:
        for j, ch in enumerate(delta):
            if ch == REPLACEMENT:
                assert want[pos + j] == REPLACEMENT
        pos += len(delta)


def test_engine_choice(fam: Family) -> None:
    assert engine_kind(fam.tok) == fam.kind


@pytest.mark.parametrize("skip", [True, False])
def test_corpus_streams_to_hf_decode(fam: Family, skip: bool) -> None:
    rng = random.Random(1)
    for text in fam.texts:
        ids = fam.hf(text)["input_ids"]
        for _ in range(3):
            check_stream(fam, ids, skip, rng)
        assert REPLACEMENT not in "".join(stream(fam.tok, ids, skip, rng)[0])


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_stream_to_hf_decode(fam: Family, skip: bool) -> None:
    # Random ids make invalid UTF-8, dangling byte sequences and specials anywhere.
    rng = random.Random(2)
    n = len(fam.hf)
    specials = sorted(fam.tok.special_ids)
    byte_ids = fam.byte_ids or list(range(min(n, 300)))
    for _ in range(150):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 40))]
        check_stream(fam, ids, skip, rng)
        mixed = [
            rng.choice(byte_ids) if r < 0.6 else rng.choice(specials) if r < 0.7
            else rng.randrange(n)
            for r in (rng.random() for _ in range(rng.randint(1, 30)))
        ]
        check_stream(fam, mixed, skip, rng)


@pytest.mark.parametrize("skip", [True, False])
def test_generic_window_engine_on_every_family(fam: Family, skip: bool) -> None:
    rng = random.Random(3)
    n = len(fam.hf)
    byte_ids = fam.byte_ids or list(range(min(n, 300)))
    cases = [fam.hf(t)["input_ids"] for t in fam.texts]
    cases += [[rng.randrange(n) for _ in range(rng.randint(1, 30))] for _ in range(60)]
    cases += [[rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(n)
               for _ in range(rng.randint(1, 30))] for _ in range(60)]
    for ids in cases:
        check_stream(fam, ids, skip, rng, engine="window")


def test_text_is_released_as_soon_as_it_is_final(fam: Family) -> None:
    # Valid text: after each token everything decodable so far is out, except a trailing
    # incomplete character or (SentencePiece) a run of byte tokens that may still grow.
    byte_set = set(fam.byte_ids)
    for text in fam.texts:
        ids = fam.hf(text)["input_ids"]
        det = IncrementalDetokenizer(fam.tok, [], skip_special_tokens=True)
        for k, i in enumerate(ids, 1):
            det.add([i])
            so_far = fam.hf.decode(ids[:k], skip_special_tokens=True)
            visible = [t for t in ids[:k] if t not in fam.tok.special_ids]
            if so_far.endswith(REPLACEMENT) or (visible and visible[-1] in byte_set):
                assert so_far.startswith(det.text)
            elif fam.kind == "window":
                # clean-up holds only the trailing chars a clean-up pattern could still span
                assert so_far.startswith(det.text)
                assert set(so_far[len(det.text):]) <= DECODER_CLEANUP_UNSAFE
            else:
                assert det.text == so_far, (text, k)


def test_sentencepiece_output_starts_without_the_leading_space() -> None:
    # decode(output_ids) of "▁Hello ▁world" is "Hello world" (the decoder strips the first
    # space), even though after a prompt the model's first token carries a "▁".
    tok = Tokenizer.from_dir(str(sentencepiece_dir()))
    prompt = tok.encode("Say hi:")
    out = tok.raw.encode(" Hello world", add_special_tokens=False).ids
    assert tok.id_to_token(out[0]).startswith("▁")
    det = IncrementalDetokenizer(tok, prompt)
    assert det.add(out[:1]) == "Hello"
    assert det.add(out[1:]) == " world"
    assert det.flush() == ""
    assert det.text == tok.decode(out) == "Hello world"


@pytest.mark.parametrize("name", ["sentencepiece", "byte_level_bpe"])
def test_dangling_bytes_flush_as_replacement(name: str) -> None:
    fam_tok = Tokenizer.from_dir(str(FAMILIES[name][0]()))
    # "ok" then the first two of the three bytes of "你" (E4 BD A0)
    if name == "sentencepiece":
        ids = fam_tok.raw.encode("ok ", add_special_tokens=False).ids + [
            fam_tok.token_to_id("<0xE4>"), fam_tok.token_to_id("<0xBD>")]
    else:
        ids = fam_tok.raw.encode("ok", add_special_tokens=False).ids + [
            fam_tok.token_to_id("ä"), fam_tok.token_to_id("½")]
    det = IncrementalDetokenizer(fam_tok, [])
    deltas = [det.add([i]) for i in ids]
    assert REPLACEMENT not in "".join(deltas)
    tail = det.flush()
    assert tail.endswith(REPLACEMENT)
    assert "".join(deltas) + tail == fam_tok.decode(ids)
    assert det.flush() == ""


def test_special_token_in_the_middle(fam: Family) -> None:
    ids = fam.hf(f"before{fam.eos}after")["input_ids"]
    for skip in (True, False):
        deltas, tail, _ = stream(fam.tok, ids, skip, random.Random(4))
        text = "".join(deltas) + tail
        assert text == fam.hf.decode(ids, skip_special_tokens=skip)
        assert (fam.eos in text) is (not skip)


class _CountingRaw:
    """Wraps a tokenizers.Tokenizer to record the length of every decode call."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return self._raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def test_window_engine_decodes_a_small_window_not_the_whole_output() -> None:
    tok = Tokenizer.from_dir(str(wordpiece_dir()))
    counting = _CountingRaw(tok.raw)
    tok._raw = counting  # type: ignore[assignment]
    try:
        text = " ".join(corpus_for("[CLS]", "[SEP]")) * 20
        ids = counting._raw.encode(text, add_special_tokens=False).ids
        det = IncrementalDetokenizer(tok, [])
        for i in ids:
            det.add([i])
        det.flush()
    finally:
        tok._raw = counting._raw
    assert len(ids) > 1000
    lengths = counting.decoded_lengths
    assert max(lengths) <= 32 and sum(lengths) / len(lengths) <= 10, max(lengths)
    assert det.text == tok.decode(ids)


def test_native_engines_never_call_decode() -> None:
    for build in (sentencepiece_dir, byte_level_bpe_dir):
        tok = Tokenizer.from_dir(str(build()))
        counting = _CountingRaw(tok.raw)
        tok._raw = counting  # type: ignore[assignment]
        det = IncrementalDetokenizer(tok, [])
        ids = counting._raw.encode("Hello 你好 👍🏽 world", add_special_tokens=False).ids
        for i in ids:
            det.add([i])
        det.flush()
        tok._raw = counting._raw
        assert counting.decoded_lengths == []
        assert det.text == tok.decode(ids)


def test_add_after_flush_empty_add_and_numpy_ids() -> None:
    import numpy as np

    tok = Tokenizer.from_dir(str(byte_level_bpe_dir()))
    det = IncrementalDetokenizer(tok, [])
    assert det.add([]) == ""
    assert det.add(np.array([], dtype=np.int64)) == ""
    ids = np.array(tok.raw.encode("héllo wörld", add_special_tokens=False).ids, dtype=np.int64)
    assert det.add(ids[:2]) + det.add(ids[2:]) + det.flush() == "héllo wörld"
    det.flush()
    with pytest.raises(RuntimeError):
        det.add([5])

