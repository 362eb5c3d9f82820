"""Hybrid models (Qwen3-Next, Qwen3.5 dense and MoE; the published multimodal Qwen3.5
folders are tests/gpu_worker/test_vision.py's) through `ModelRunner.execute` against HF
`generate()` (greedy, float32); with n-gram speculation, drafts rejected and the linear
layers' states rolled back to each row's accepted run.

A busy batch: requests joining a running batch, a prompt chunked over two plans, one spread
over three steps of a plan (mixed steps; it joins the decode rows mid-plan and reads the
state its last piece left in the same forward), a preemption while a newcomer takes its
blocks and state slot, and the resume (recompute from position 0) — at K=8 publishing per
step and at K=1 publishing after the plan (the sync baseline), under the host-sync guard.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem_serve.proto.speculative import parse_speculative
from tests.gpu_worker.hybrid_utils import HYBRIDS, checkpoint
from tests.gpu_worker.model_utils import random_prompts
from tests.gpu_worker.runner_driver import (
    BUSY_LENGTHS,
    Driver,
    busy_batch_head,
    hf_greedy,
    make_runner,
    run_to_finish,
)
from tests.gpu_worker.sync_guard import forbid_host_sync


def busy_batch(d: Driver, k: int, per_step: bool, vocab: int = 512) -> list[list[int]]:
    """runner_driver's busy batch, whose request 5 prefills over three steps instead of
    sharing cached blocks (a hybrid hit needs a checkpointed state: see
    test_prefix_hits_restore_checkpointed_states)."""
    p = random_prompts(BUSY_LENGTHS, vocab, seed=7)
    busy_batch_head(d, p, k, per_step)
    d.add(5, p[5])
    if k >= 3:  # its prompt over three steps; it decodes from the third on
        d.prefill(5, len(p[5]) - 1, [30, 30, len(p[5]) - 61])
    run_to_finish(d, k, per_step)
    return p


@pytest.mark.parametrize("family, k, per_step", [
    *((f, 8, True) for f in HYBRIDS), ("qwen3.5", 1, False), ("qwen3-next", 1, False)],
    ids=[*(f"{f}-async-k8" for f in HYBRIDS), "qwen3.5-sync-k1", "qwen3-next-sync-k1"])
def test_busy_batch_equals_hf(ckpt_root: Path, family: str, k: int, per_step: bool) -> None:
    path = checkpoint(ckpt_root, family)
    runner = make_runner(path, max_num_seqs=6)
    runner.step_guard = forbid_host_sync
    d = Driver(runner, seed=len(family))
    prompts = busy_batch(d, k, per_step)
    want = [hf_greedy(path, q) for q in prompts]
    assert [d.reqs[r].out for r in range(6)] == want
    assert max(len(set(o)) for o in want) >= 8  # parity means something: output varies
    assert runner.slots is not None and runner.slots.num_free == 6 - sum(
        1 for t in d.reqs.values() if not t.gone)


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5"])
def test_ngram_speculation_rolls_states_back(ckpt_root: Path, family: str) -> None:
    """Every row speculates ("adaptive": false); prompts over 64 token ids repeat n-grams, so
    drafts happen, and most are rejected: the states kept are the accepted runs'."""
    spec = parse_speculative('{"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_max": 3, "prompt_lookup_min": 1, '
                             '"adaptive": false}')
    path = checkpoint(ckpt_root, family)
    runner = make_runner(path, speculative=spec)
    runner.step_guard = forbid_host_sync
    d = Driver(runner, seed=1)
    prompts = busy_batch(d, 8, True, vocab=64)
    assert [d.reqs[r].out for r in range(6)] == [hf_greedy(path, q) for q in prompts]
    drafted = sum(x.num_draft_tokens for x in d.done)
    accepted = sum(x.num_accepted_tokens for x in d.done)
    assert drafted > 20 and 0 < accepted < drafted


@pytest.mark.parametrize("k, per_step", [(8, True), (1, False)], ids=["async-k8", "sync-k1"])
def test_prefix_hits_restore_checkpointed_states(ckpt_root: Path, k: int,
                                                 per_step: bool) -> None:
    """States are checkpointed every 64 tokens (4 blocks): the same 150-token prompt again
    and a prompt extending it share its first 128 tokens' blocks and start from the
    checkpoint at their end (restored into their slots as the plan adds them, so one with
    nothing left to prefill decodes from it at once); a prompt sharing only the first 64
    tokens starts from that checkpoint; every output equals HF."""
    path = checkpoint(ckpt_root, "qwen3.5")
    runner = make_runner(path, prefix_caching=True)
    assert runner.state_checkpoint_blocks == 4
    d = Driver(runner, seed=3)
    long, exact = random_prompts([150, 128], 512, seed=11)
    d.add(0, long, chunk=100)  # its checkpoints at 64 (prefill), 128 (next plan's piece)
    d.add(4, exact)  # its checkpoint at 128 comes from its first decode step
    d.run(k, per_step)
    d.prefill(0, len(long) - 1 - 100)
    d.run(k, per_step)
    extended = long + random_prompts([40], 512, seed=12)[0]
    other = long[:64] + random_prompts([90], 512, seed=13)[0]
    after_exact = exact + random_prompts([30], 512, seed=14)[0]
    d.add(1, long, shared=d.reqs[0].blocks[:8], cached=128)
    d.add(2, extended, shared=d.reqs[0].blocks[:8], cached=128)
    d.add(3, other, shared=d.reqs[0].blocks[:4], cached=64)
    d.add(5, after_exact, shared=d.reqs[4].blocks[:8], cached=128)
    d.add(6, long[:129], shared=d.reqs[0].blocks[:8], cached=128)  # no prefill: decodes at once
    d.run_until_done([k])
    prompts = [long, long, extended, other, exact, after_exact, long[:129]]
    assert [d.reqs[r].out for r in range(7)] == [hf_greedy(path, q) for q in prompts]


def test_lora_on_attention_and_mlp_projections_equals_peft(ckpt_root: Path) -> None:
    """Adapters on the gated attention (q_proj's query and gate rows land apart in the fused
    projection) and on the MLPs, beside base rows, equal PEFT's greedy output; an adapter
    on the linear-attention projections is refused by name."""
    from tandem_serve.adapters.peft import AdapterError
    from tests.lora_utils import ADAPTERS, make_adapter, peft_greedy

    path = checkpoint(ckpt_root, "qwen3.5")
    cache = ckpt_root / "hybrid-adapters"
    for name in ("attn", "mlp", "all"):
        make_adapter(path, cache / name, **ADAPTERS[name])
    runner = make_runner(path, adapter_cache=str(cache), max_loras=2)
    with pytest.raises(AdapterError, match="targets '(in|out)_proj.*which the model does not"):
        runner.lora.load(1, "all")  # type: ignore[union-attr]
    d = Driver(runner, seed=2)
    d.load(1, "attn")
    d.load(2, "mlp")
    prompts = random_prompts([20, 45, 70, 9], 512, seed=4)
    slots = [0, 1, 2, 1]
    for rid, (prompt, slot) in enumerate(zip(prompts, slots, strict=True)):
        d.add(rid, prompt, lora_slot=slot)
    d.run_until_done([8])
    folders = {0: None, 1: cache / "attn", 2: cache / "mlp"}
    for rid, (prompt, slot) in enumerate(zip(prompts, slots, strict=True)):
        want = peft_greedy(path, folders[slot], [prompt], 24)[0]
        assert d.reqs[rid].out == want[:len(d.reqs[rid].out)], rid
        if slot:
            assert d.reqs[rid].out != hf_greedy(path, prompt), f"adapter {slot} changes nothing"


def test_state_memory_comes_out_of_the_kv_budget(ckpt_root: Path) -> None:
    path = checkpoint(ckpt_root, "qwen3-next")
    small, large = (make_runner(path, num_kv_blocks=0, kv_cache_memory=0.01, max_num_seqs=n)
                    for n in (1, 64))
    states = large.model.states
    assert states is not None and states.nbytes > 0
    assert len(large.kv_caches) == 2  # attention layers only
    per_block = sum(t[0].nbytes * 2 for t in large.kv_caches) // (large.num_blocks + 1)
    assert small.num_blocks - large.num_blocks == pytest.approx(
        (states.nbytes - small.model.states.nbytes) / per_block, abs=1)
    assert states.recurrent[0].dtype == torch.float32
