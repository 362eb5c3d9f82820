"""Input-token detail in the postproc worker: PromptDetail chunks → the first OutputDelta."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tandem_serve.postproc_worker.postprocessor import Postprocessor
from tandem_serve.proto.request_messages import RegisterRequest
from tandem_serve.proto.request_params import FinishReason, OutputOptions
from tandem_serve.proto.token_messages import OutputDelta, PromptDetail
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.postproc_worker.test_postprocessor import batch
from tests.tokenizer_utils import sentencepiece_dir

PROMPT = [1, 100, 200, 300, 400, 500]  # 6 positions; position 0 (BOS) has no score
TOP_K = 3


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(str(sentencepiece_dir()))


def register(proc: Postprocessor, rid: int) -> list[OutputDelta]:
    return proc.register(RegisterRequest(rid, np.array(PROMPT, dtype=np.int32),
                                         OutputOptions(), 10))


def chunk(rid: int, start: int, end: int, last: bool, top: bool = True) -> PromptDetail:
    """Scores for positions [start, end): logprob -p/10, rank p, alternatives 10p + j."""
    pos = np.arange(start, end)
    return PromptDetail(
        rid, start, np.array(PROMPT[start:end], dtype=np.int32),
        (-pos / 10).astype(np.float32), pos.astype(np.int32),
        (pos[:, None] * 10 + np.arange(TOP_K)).astype(np.int32) if top else None,
        np.tile(-np.arange(TOP_K, dtype=np.float32), (len(pos), 1)) if top else None,
        last)


def check_detail(d: OutputDelta, tok: Tokenizer, top: bool = True) -> None:
    assert d.prompt_logprobs is not None and d.prompt_ranks is not None
    assert len(d.prompt_logprobs) == len(PROMPT) == len(d.prompt_ranks)
    assert math.isnan(d.prompt_logprobs[0]) and d.prompt_ranks[0] == 0
    for p in range(1, len(PROMPT)):
        assert d.prompt_logprobs[p] == pytest.approx(-p / 10)
        assert d.prompt_ranks[p] == p
    if not top:
        assert d.prompt_top_texts is None and d.prompt_top_logprobs is None
        return
    assert d.prompt_top_texts is not None and d.prompt_top_logprobs is not None
    assert d.prompt_top_texts[0] == [] and d.prompt_top_logprobs[0] == []
    for p in range(1, len(PROMPT)):
        assert d.prompt_top_texts[p] == [tok.id_to_token(p * 10 + j) for j in range(TOP_K)]
        assert d.prompt_top_logprobs[p] == [0.0, -1.0, -2.0]


def test_chunks_in_order_go_on_the_first_delta_only(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 4)
    assert proc.on_prompt_detail(chunk(4, 1, 3, last=False)) == []
    assert proc.on_prompt_detail(chunk(4, 3, 6, last=True)) == []
    first = proc.on_batch(batch(0, 0, [(4, 42, 0)]))
    second = proc.on_batch(batch(0, 1, [(4, 43, int(FinishReason.MAX_TOKENS))]))
    assert len(first) == 1 and len(second) == 1
    check_detail(first[0], tok)
    assert second[0].prompt_logprobs is None and second[0].prompt_top_texts is None
    assert second[0].finish_reason == FinishReason.MAX_TOKENS


def test_without_alternatives(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 4)
    proc.on_prompt_detail(chunk(4, 1, 6, last=True, top=False))
    (d,) = proc.on_batch(batch(0, 0, [(4, 42, 0)]))
    check_detail(d, tok, top=False)


def test_tokens_wait_for_the_last_chunk(tok: Tokenizer) -> None:
    # Whatever order the worker publishes a chunk and its step in, the first delta is whole.
    proc = Postprocessor(tok, 0)
    register(proc, 8)
    assert proc.on_prompt_detail(chunk(8, 1, 4, last=False)) == []
    assert proc.on_batch(batch(0, 0, [(8, 42, 0)])) == []
    assert proc.on_batch(batch(0, 1, [(8, 43, 0)])) == []
    released = proc.on_prompt_detail(chunk(8, 4, 6, last=True))
    assert [d.num_generated for d in released] == [1, 2]
    check_detail(released[0], tok)
    assert released[1].prompt_logprobs is None
    # Later tokens flow straight through.
    assert [d.num_generated for d in proc.on_batch(batch(1, 0, [(8, 44, 0)]))] == [3]


def test_detail_before_registration_is_kept_in_order(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    assert proc.on_prompt_detail(chunk(5, 1, 6, last=True)) == []
    assert proc.on_batch(batch(0, 0, [(5, 42, 0)])) == []
    (d,) = register(proc, 5)
    check_detail(d, tok)


def test_a_redone_prefill_after_the_first_delta_changes_nothing(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 6)
    proc.on_prompt_detail(chunk(6, 1, 6, last=True))
    (d,) = proc.on_batch(batch(0, 0, [(6, 42, 0)]))
    check_detail(d, tok)
    # A preempted request re-prefills its history; the client has its input detail already.
    assert proc.on_prompt_detail(chunk(6, 1, 6, last=True)) == []
    (d2,) = proc.on_batch(batch(1, 0, [(6, 43, 0)]))
    assert d2.prompt_logprobs is None and d2.num_generated == 2


def test_a_chunk_sent_again_overwrites(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 2)
    stale = chunk(2, 1, 3, last=False)
    stale.logprobs = np.full(2, -9.0, dtype=np.float32)
    proc.on_prompt_detail(stale)
    proc.on_prompt_detail(chunk(2, 1, 3, last=False))  # preempted mid-prefill, started again
    proc.on_prompt_detail(chunk(2, 3, 6, last=True))
    (d,) = proc.on_batch(batch(0, 0, [(2, 42, 0)]))
    check_detail(d, tok)


def test_a_one_token_prompt_has_only_the_empty_position(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    proc.register(RegisterRequest(3, np.array([1], dtype=np.int32), OutputOptions(), 4))
    empty = PromptDetail(3, 1, np.zeros(0, np.int32), np.zeros(0, np.float32),
                         np.zeros(0, np.int32), last=True)
    proc.on_prompt_detail(empty)
    (d,) = proc.on_batch(batch(0, 0, [(3, 42, 0)]))
    assert d.prompt_logprobs is not None and len(d.prompt_logprobs) == 1
    assert math.isnan(d.prompt_logprobs[0]) and d.prompt_ranks == [0]


def test_detail_of_a_forgotten_request_is_dropped(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 9)
    proc.on_prompt_detail(chunk(9, 1, 3, last=False))
    proc.on_batch(batch(0, 0, [(9, 42, 0)]))  # held
    proc.forget(9)
    assert proc.on_prompt_detail(chunk(9, 3, 6, last=True)) == []
    assert 9 not in proc.requests and 9 not in proc.pending


def test_requests_without_detail_are_not_held(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 7)
    (d,) = proc.on_batch(batch(0, 0, [(7, 42, 0)]))
    assert d.prompt_logprobs is None and d.num_generated == 1
