"""Prompt logprobs (PromptDetail) from prefill, against HF's forward logits; their routing."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem_serve.gpu_worker.sampling.prompt_logprobs import ROWS_PER_SLICE
from tandem_serve.ipc.channels import Receiver
from tandem_serve.ipc.token_channel import TokenReader, TokenWriter, detail_for
from tandem_serve.proto.config import Addresses
from tandem_serve.proto.request_params import SamplingParams
from tandem_serve.proto.token_messages import PromptDetail, TokenBatch
from tests.gpu_worker.model_utils import (
    EOS_ID,
    HFReference,
    make_tiny_checkpoint,
    random_prompts,
)
from tests.gpu_worker.runner_driver import Driver, make_runner


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("plp")
    return make_tiny_checkpoint(root, "qwen2", tokenizer=False, seed=7)


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """log_softmax of HF's forward logits [L, V]; row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def params(top_n: int = 0, max_new_tokens: int = 4) -> SamplingParams:
    return SamplingParams(prompt_logprobs=True, top_n=top_n, max_new_tokens=max_new_tokens,
                          stop_token_ids=[EOS_ID])


def details(d: Driver, rid: int) -> list[PromptDetail]:
    return [m for m in d.messages if isinstance(m, PromptDetail) and m.request_id == rid]


def joined(parts: list[PromptDetail]) -> tuple[np.ndarray | None, ...]:
    """The parts' columns end to end, after checking they tile 1 .. L-1 exactly once."""
    at = 1
    for part in parts:
        assert part.start == at, "every prompt token scored once, in order"
        at += len(part.token_ids)
    assert [p.last for p in parts] == [False] * (len(parts) - 1) + [True]
    cols = ["token_ids", "logprobs", "ranks", "top_ids", "top_logprobs"]
    if parts[0].top_ids is None:
        cols = cols[:3]
    return tuple(np.concatenate([getattr(p, c) for p in parts]) for c in cols)


def test_prompt_logprobs_match_hf_across_chunks(qwen2: str) -> None:
    head, other = random_prompts([120, 60], 512, seed=3)
    # A greedy tail: those tokens rank 1, the random head's tokens anywhere.
    prompt = head + HFReference(qwen2).greedy(head, 30)
    assert len(prompt) == 150
    want = hf_prompt_logprobs(qwen2, prompt)
    d = Driver(make_runner(qwen2), seed=1)
    d.add(0, prompt, params(top_n=5), chunk=50)
    d.add(1, other)  # no prompt logprobs: in the same forwards, sends nothing
    d.run(2)
    d.prefill(0, 60)
    d.run(2)
    assert not details(d, 1) and len(details(d, 0)) == 2
    d.prefill(0, 39)  # the last chunk ends at position 148: scores token 149
    first_token = len(d.messages)
    d.run(2)
    parts = details(d, 0)
    assert [len(p.token_ids) for p in parts] == [50, 60, 39]
    # The detail goes out before the request's first token.
    later = [m for m in d.messages[first_token:] if isinstance(m, TokenBatch)]
    assert d.messages.index(parts[-1]) < d.messages.index(later[0])
    ids, lps, ranks, top_ids, top_lps = joined(parts)
    np.testing.assert_array_equal(ids, prompt[1:])
    rows, targets = want[:-1], torch.tensor(prompt[1:])
    chosen = rows.gather(1, targets[:, None])
    np.testing.assert_allclose(lps, chosen[:, 0].numpy(), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(ranks, (rows > chosen).sum(1).numpy() + 1)
    hf_top_lps, hf_top_ids = rows.topk(5, dim=1)
    np.testing.assert_array_equal(top_ids, hf_top_ids.numpy())
    np.testing.assert_allclose(top_lps, hf_top_lps.numpy(), atol=1e-4, rtol=0)
    assert (ranks[-29:] == 1).all() and ranks[:100].min() > 1


def test_long_chunk_is_scored_in_slices(qwen2: str) -> None:
    [prompt] = random_prompts([ROWS_PER_SLICE + 40], 512, seed=4)
    want = hf_prompt_logprobs(qwen2, prompt)
    d = Driver(make_runner(qwen2), seed=2)
    d.add(0, prompt, params())
    d.run(1)
    [part] = details(d, 0)
    assert part.top_ids is None and part.last and len(part.logprobs) == len(prompt) - 1
    chosen = want[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    np.testing.assert_allclose(part.logprobs, chosen.numpy(), atol=1e-4, rtol=0)


def test_preempted_request_never_sends_a_token_twice(qwen2: str) -> None:
    a, b = random_prompts([80, 100], 512, seed=5)
    d = Driver(make_runner(qwen2), seed=3)
    d.add(0, a, params(top_n=2, max_new_tokens=12), chunk=30)
    d.add(1, b, params(max_new_tokens=12), chunk=99)
    d.run(4)
    d.preempt(0)  # mid-prompt: 30 scored
    d.preempt(1)  # after its whole prompt was scored and it decoded
    d.run(1)
    d.resume(0)  # re-prefills from position 0 in one chunk
    d.resume(1)
    d.run_until_done([4])
    ids, *_ = joined(details(d, 0))
    np.testing.assert_array_equal(ids, a[1:])
    assert [len(p.token_ids) for p in details(d, 0)] == [30, 49]
    ids, *_ = joined(details(d, 1))
    np.testing.assert_array_equal(ids, b[1:])
    assert len(d.reqs[0].out) == len(d.reqs[1].out) == 12


def test_one_token_prompt_gets_an_empty_last_detail(qwen2: str) -> None:
    d = Driver(make_runner(qwen2), seed=4)
    d.add(0, [5], params(top_n=3))
    d.run(2)
    [part] = details(d, 0)
    assert part.last and part.start == 1 and len(part.token_ids) == 0
    assert part.top_ids is not None and part.top_ids.shape == (0, 3)
    assert len(d.reqs[0].out) == 2


# ---------------------------------------------------------------------------- routing


def detail(rid: int) -> PromptDetail:
    return PromptDetail(rid, 1, np.array([7], np.int32), np.array([-1.5], np.float32),
                        np.array([2], np.int32), last=True)


def token_batch() -> TokenBatch:
    return TokenBatch(0, 0, np.array([2, 3], np.int64), np.array([10, 11], np.int32),
                      np.zeros(2, np.uint8), last=True)


def test_detail_goes_to_its_owner_only() -> None:
    assert detail_for(detail(3), 1, 2) is not None and detail_for(detail(3), 0, 2) is None


def test_zeromq_writer_sends_a_detail_to_its_owner(tmp_path: Path) -> None:
    addr = Addresses.local(str(tmp_path), "plp", 2, use_ring=False)
    inboxes = [Receiver(a, bind=True) for a in addr.postproc_inboxes]
    writer = TokenWriter(addr)
    try:
        writer.put(detail(3))
        writer.put(token_batch())
        first = [inbox.get(timeout=5.0) for inbox in inboxes]
        assert isinstance(first[0], TokenBatch) and first[0].request_ids.tolist() == [2]
        assert isinstance(first[1], PromptDetail) and first[1].request_id == 3
        second = inboxes[1].get(timeout=5.0)
        assert isinstance(second, TokenBatch) and second.request_ids.tolist() == [3]
    finally:
        writer.close()
        for inbox in inboxes:
            inbox.close()


def test_ring_readers_pass_only_their_own_details(tmp_path: Path) -> None:
    addr = Addresses.local(str(tmp_path), f"plp{os.getpid()}", 2, use_ring=True)
    writer = TokenWriter(addr, ready_timeout=10.0)
    readers = [TokenReader(addr, i) for i in range(2)]
    try:
        writer.wait_ready()
        writer.put(detail(3))
        writer.put(token_batch())
        got0 = readers[0].get(timeout=5.0)
        assert isinstance(got0, TokenBatch) and got0.request_ids.tolist() == [2]
        got1 = readers[1].get(timeout=5.0)
        assert isinstance(got1, PromptDetail) and got1.request_id == 3
        got1 = readers[1].get(timeout=5.0)
        assert isinstance(got1, TokenBatch) and got1.request_ids.tolist() == [3]
        assert readers[0].get(timeout=0.05) is None
    finally:
        for r in readers:
            r.close()
        writer.close()
