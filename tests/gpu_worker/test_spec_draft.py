"""Speculative decoding with a draft model (`gpu_worker.spec.draft_model`): the runner's output
with draft_model speculation equals its output without, token for token (greedy, seeded,
stop ids, max tokens, logprobs, preemption, prompts chunked over plans and spread over a
plan's steps), with no host read inside a plan; a copy of the target as draft gets nearly
every draft accepted; the draft's KV blocks count in the cache's memory."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.spec.draft_model import DraftModel
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.request_params import FinishReason, SamplingParams
from tandem_serve.proto.speculative import parse_speculative
from tests.gpu_worker.model_utils import EOS_ID, make_copier_checkpoint, make_tiny_checkpoint
from tests.gpu_worker.runner_driver import Driver, run_busy_batch
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.gpu_worker.test_speculative import token_details


@pytest.fixture(scope="module")
def copier(ckpt_root: Path) -> str:
    """Nearly a bigram model (see make_copier_checkpoint): copy-heavy prompts continue
    along chains the prompt holds."""
    return make_copier_checkpoint(ckpt_root, tokenizer=False)


@pytest.fixture(scope="module")
def small_draft(ckpt_root: Path) -> str:
    """A different, smaller random llama with the target's vocabulary: its drafts are
    nearly all rejected, which must not change a token."""
    return make_tiny_checkpoint(ckpt_root, "llama", tokenizer=False, seed=9, hidden_size=32,
                                intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1)


def draft_spec(model: str, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": k})


def make_runner(model: str, spec: str, **kw: Any) -> ModelRunner:
    kw.setdefault("num_kv_blocks", 400)
    kw.setdefault("block_size", 4)
    return ModelRunner(WorkerConfig(model, device="cpu", dtype="float32",
                                    speculative=parse_speculative(spec), **kw))


def scenario(model: str, spec: str, k: int, per_step: bool, chain: list[int]
             ) -> tuple[dict[int, list[int]], dict[int, FinishReason], Driver]:
    """Requests through plans of `k` steps until all finish: a separate prefill plan, a
    prompt chunked over three plans, one joining a running batch (its prompt spread over
    steps: mixed verify steps), a preemption and its resume."""
    runner = make_runner(model, spec)
    runner.step_guard = forbid_host_sync
    d = Driver(runner)
    d.add(5, chain[:40] + chain[2:6], SamplingParams(max_new_tokens=24), chunk=10)
    d.run(k, per_step)  # no decode row: a separate prefill forward, the draft's too
    copy = chain[:30] + chain[:3]
    d.add(0, copy, SamplingParams(max_new_tokens=30, stop_token_ids=[EOS_ID]))
    d.add(1, chain[5:25] + chain[5:8], SamplingParams(max_new_tokens=13))  # cut in a run
    d.add(2, copy, SamplingParams(max_new_tokens=30, stop_token_ids=[chain[6]]))
    d.add(3, copy, SamplingParams(max_new_tokens=20, logprobs=True, top_n=3))
    d.add(6, chain[10:30] + chain[10:12], SamplingParams(max_new_tokens=100))
    d.prefill(5, 12)
    d.run(k, per_step)
    prompt = chain[:12] + chain[:4]
    d.add(4, prompt, SamplingParams(max_new_tokens=20, temperature=0.9, seed=11))
    if k >= 3:  # its prompt in pieces over steps 0-2, decoding from step 2
        d.prefill(4, len(prompt) - 1, [5, 5, len(prompt) - 11])
    d.run(k, per_step)
    d.preempt(6)
    d.run(k, per_step)
    d.resume(6)
    d.prefill(5, len(d.reqs[5].prompt) - 1 - 22)
    for _ in range(150):
        if all(t.finish for t in d.reqs.values()):
            break
        d.run(k, per_step)
    return d.outputs(), {rid: t.finish for rid, t in d.reqs.items()}, d


@pytest.fixture(scope="module")
def chain(copier: str) -> list[int]:
    """Greedy output from one token: the chain the copy-heavy prompts repeat."""
    d = Driver(make_runner(copier, ""))
    d.add(0, [7], SamplingParams(max_new_tokens=40))
    for _ in range(10):
        d.run(8)
    return [7] + d.outputs()[0]


def counts(d: Driver) -> tuple[int, int, int]:
    return (sum(x.num_drafts for x in d.done), sum(x.num_draft_tokens for x in d.done),
            sum(x.num_accepted_tokens for x in d.done))


@pytest.mark.parametrize("k, per_step, draft", [(8, True, "copy"), (1, False, "copy"),
                                                (8, True, "small")])
def test_output_equals_output_without_speculation(copier: str, small_draft: str,
                                                  chain: list[int], k: int, per_step: bool,
                                                  draft: str) -> None:
    want, want_finish, plain = scenario(copier, "", k, per_step, chain)
    spec = draft_spec(copier if draft == "copy" else small_draft)
    got, got_finish, d = scenario(copier, spec, k, per_step, chain)
    assert got == want
    assert got_finish == want_finish
    assert want_finish[2] == FinishReason.EOS_TOKEN and len(want[1]) == 13
    for (lp, rank, top), (lp2, rank2, top2) in zip(token_details(plain, 3), token_details(d, 3),
                                                   strict=True):
        assert abs(lp - lp2) < 1e-4 and rank == rank2 and top == top2
    drafts, tokens, accepted = counts(d)
    assert drafts > 0 and tokens >= drafts and 0 <= accepted <= tokens
    if draft == "copy":  # rows advanced several tokens a step
        assert accepted > 0
        steps = sum(k for _ in d.done)
        assert sum(map(len, got.values())) > steps


def test_the_busy_batch_with_a_shared_prefix_keeps_parity(copier: str) -> None:
    """runner_driver's busy batch (a chunked prompt, a join, a preemption and resume, a
    prompt whose first 64 tokens are another request's cached blocks: the draft reads its
    mirror of them) gives the same tokens with a draft model."""
    outs = []
    for spec in ("", draft_spec(copier, 2)):
        d = Driver(make_runner(copier, spec, block_size=16))
        run_busy_batch(d, 2, True)  # short plans: request 1 still runs when preempted
        outs.append(d.outputs())
    assert outs[0] == outs[1]
    assert all(outs[0].values())


def test_a_copy_of_the_target_gets_its_drafts_accepted(copier: str, chain: list[int]) -> None:
    """Greedy rows and a draft that is the target: each draft is the target's argmax (up to
    float rounding between batch shapes), so nearly all are accepted."""
    runner = make_runner(copier, draft_spec(copier, 4))
    d = Driver(runner)
    d.add(0, [7], SamplingParams(max_new_tokens=40))
    d.add(1, chain[:10], SamplingParams(max_new_tokens=40))
    for _ in range(20):
        if all(t.finish for t in d.reqs.values()):
            break
        d.run(8)
    assert d.outputs()[0] == chain[1:41]
    _, tokens, accepted = counts(d)
    assert tokens > 0 and accepted >= 0.9 * tokens, (accepted, tokens)


def test_the_draft_cache_counts_in_the_kv_memory(copier: str, small_draft: str) -> None:
    """A cache sized from memory holds the draft's blocks too: same bytes, fewer blocks."""
    alone = make_runner(copier, "", num_kv_blocks=0, kv_cache_memory=0.001)
    both = make_runner(copier, draft_spec(small_draft), num_kv_blocks=0,
                       kv_cache_memory=0.001)
    assert isinstance(both.proposer, DraftModel) and len(both.proposer.caches) == 1
    target_bytes = sum(t.nbytes for kv in alone.kv_caches for t in kv)
    draft_bytes = sum(t.nbytes for kv in both.proposer.caches for t in kv)
    # Target 2 layers x 2 heads, draft 1 layer x 1 head, both of head_dim 16: 4 to 1.
    assert both.num_blocks == alone.num_blocks * 4 // 5
    assert sum(t.nbytes for kv in both.kv_caches for t in kv) + draft_bytes <= target_bytes


def test_a_draft_with_another_vocabulary_is_refused(copier: str, ckpt_root: Path) -> None:
    other = make_tiny_checkpoint(ckpt_root, "llama", tokenizer=False, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size 300, the target 512"):
        make_runner(copier, draft_spec(other))


def test_the_draft_cache_holds_every_token_the_target_holds(copier: str, chain: list[int]
                                                            ) -> None:
    """With the target as its own draft, the draft's cache must hold the target's K and V at
    every position the rows have passed: prompts prefilled alone, in a step's pieces, and
    the decoded tokens, the last accepted draft's too (the p - 1 row).  Only the newest
    position before the input token may still wait for the next step's p - 1 row."""
    runner = make_runner(copier, draft_spec(copier, 4))
    d = Driver(runner)
    d.add(0, chain[:21], SamplingParams(max_new_tokens=200), chunk=8)
    d.run(4)  # no decode row: a separate prefill
    d.add(1, chain[3:15] + chain[3:6], SamplingParams(max_new_tokens=200))
    d.prefill(0, 12, [4, 4, 4])  # its last 12 prompt tokens spread over steps 0-2
    for _ in range(3):
        d.run(4)
    draft = runner.proposer
    assert isinstance(draft, DraftModel)
    bs = runner.block_size
    for rid in (0, 1):
        req = runner.requests[rid]
        assert len(req.history) > 40
        pos = torch.arange(len(req.history) - 2)
        slots = torch.tensor(req.block_ids)[pos // bs] * bs + pos % bs
        for target, mirror in zip(runner.kv_caches, draft.caches, strict=True):
            for t, x in zip(target, mirror, strict=True):
                want = t.view(-1, *t.shape[2:])[slots]
                got = x.view(-1, *x.shape[2:])[slots]
                assert torch.allclose(got, want, atol=1e-4), (rid, (got - want).abs().amax())
