"""The postproc worker's state machine, driven with token batches and no processes."""
from __future__ import annotations

import numpy as np
import pytest

from tandem_serve.postproc_worker.postprocessor import Postprocessor
from tandem_serve.proto.request_messages import ForgetRequest, RegisterRequest
from tandem_serve.proto.request_params import FinishReason, OutputOptions
from tandem_serve.proto.token_messages import TokenBatch
from tandem_serve.tokenization.tokenizer import Tokenizer
from tests.tokenizer_utils import byte_level_bpe_dir, sentencepiece_dir


def batch(plan: int, step: int, rows: list[tuple[int, int, int]],
          top: int = 0) -> TokenBatch:
    rids = np.array([r[0] for r in rows], dtype=np.int64)
    toks = np.array([r[1] for r in rows], dtype=np.int32)
    fin = np.array([r[2] for r in rows], dtype=np.uint8)
    b = TokenBatch(plan, step, rids, toks, fin)
    if top:
        b.logprobs = np.full(len(rows), -0.5, dtype=np.float32)
        b.ranks = np.ones(len(rows), dtype=np.int32)
        b.top_ids = np.tile(np.arange(top, dtype=np.int32), (len(rows), 1))
        b.top_logprobs = np.tile(-np.arange(top, dtype=np.float32) - 0.5, (len(rows), 1))
    return b


@pytest.fixture(params=["sentencepiece", "bpe"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    path = sentencepiece_dir() if request.param == "sentencepiece" else byte_level_bpe_dir()
    return Tokenizer.from_dir(str(path))


def register(proc: Postprocessor, rid: int, **opts: object) -> None:
    proc.register(RegisterRequest(rid, np.array([1], dtype=np.int32), OutputOptions(**opts), 100))


def feed(proc: Postprocessor, rid: int, ids: list[int], per_plan: int = 2,
         finish_last: FinishReason = FinishReason.NOT_FINISHED) -> list:
    deltas = []
    for i, t in enumerate(ids):
        fin = finish_last if i == len(ids) - 1 else FinishReason.NOT_FINISHED
        deltas += proc.on_batch(batch(i // per_plan, i % per_plan, [(rid, t, int(fin))]))
    return deltas


def test_stop_string_across_three_tokens_and_a_plan_boundary(tok: Tokenizer) -> None:
    text = "alpha beta gamma delta"
    ids = tok.encode(text)
    if tok.bos_token_id is not None and ids and ids[0] == tok.bos_token_id:
        ids = ids[1:]
    full = tok.decode(ids)
    stop = full[full.index("beta") + 2: full.index("gamma") + 3]  # "ta gam"
    for include in (True, False):
        proc = Postprocessor(tok, 0)
        register(proc, 7, stop_sequences=[stop], include_stop_sequence=include)
        deltas = feed(proc, 7, ids, per_plan=1)
        out = "".join(d.text for d in deltas)
        end = full.index(stop) + (len(stop) if include else 0)
        assert out == full[:end]
        assert deltas[-1].finish_reason == FinishReason.STOP_SEQUENCE
        assert deltas[-1].stop_sequence == stop
        # Later tokens of a finished request are discarded.
        assert proc.on_batch(batch(9, 0, [(7, ids[0], 0)])) == []


def test_tokens_before_registration_are_kept(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    ids = tok.encode("hello there world")[-3:]
    assert proc.on_batch(batch(0, 0, [(5, ids[0], 0)])) == []
    deltas = proc.register(RegisterRequest(5, np.array([1], np.int32), OutputOptions(), 10))
    deltas += feed(proc, 5, ids[1:], finish_last=FinishReason.MAX_TOKENS)
    assert "".join(d.text for d in deltas) == tok.decode(ids)
    assert deltas[-1].finish_reason == FinishReason.MAX_TOKENS
    assert deltas[-1].num_generated == 3


def test_eos_sets_the_stop_sequence_to_the_eos_text(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 3)
    eos = tok.eos_token_ids[0]
    deltas = feed(proc, 3, tok.encode("fine")[-1:] + [eos], finish_last=FinishReason.EOS_TOKEN)
    assert deltas[-1].finish_reason == FinishReason.EOS_TOKEN
    assert deltas[-1].stop_sequence == tok.id_to_token(eos)
    assert deltas[-1].num_generated == 2


def test_token_detail_and_masked_rows(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 1, token_details=True, logprobs=True, ranks=True, top_n=2)
    register(proc, 2)
    out = proc.on_batch(batch(0, 0, [(1, 42, 0), (2, -1, 0)], top=3))
    assert len(out) == 1
    d = out[0]
    assert d.token_texts == [tok.id_to_token(42)]
    assert d.logprobs == [-0.5] and d.ranks == [1]
    assert d.top_ids == [[0, 1]] and d.top_logprobs == [[-0.5, -1.5]]


def test_forget_drops_state_and_later_tokens(tok: Tokenizer) -> None:
    proc = Postprocessor(tok, 0)
    register(proc, 9)
    proc.forget(ForgetRequest(9).request_id)
    assert proc.on_batch(batch(0, 0, [(9, 42, 0)])) == []
    assert 9 not in proc.requests and 9 not in proc.pending
