"""Piecewise graphs' cut of a mixed forward (`gpu_worker.graphs.piecewise`), run as plain calls on
the CPU: the pieces between attention calls, over a token count padded to a bucket, give the
logits and KV cache of the model's own forward, for the families whose layers differ most
(Gemma 3: sliding windows, two RoPEs, scaled embeddings, capped logits; Qwen3-MoE: q/k norms
and experts).  The graphs themselves are captured on a GPU (`tests/gpu_worker/
test_runner_graphs.py`, `scripts/gpu-check`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tandem_serve.gpu_worker.attention import flex as flex_attention
from tandem_serve.gpu_worker.attention.flex import FlexBackend
from tandem_serve.gpu_worker.batch import DecodeBatch, build_decode_batch
from tandem_serve.gpu_worker.graphs.piecewise import MixedGraphs, token_buckets
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.gpu_worker.steps import PrefillInputs, lay_out
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.plan_messages import NewRequest, StepPlan
from tandem_serve.proto.request_params import SamplingParams
from tests.gpu_worker.family_utils import family_checkpoint
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import Driver, make_runner
from tests.gpu_worker.sync_guard import forbid_host_sync

KV = list[tuple[torch.Tensor, torch.Tensor]]


def test_buckets_cover_every_count_up_to_the_largest() -> None:
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(2176)[:7] == [16, 32, 64, 128, 256, 384, 512]
    assert token_buckets(2176)[-2:] == [2048, 2176]


def mixed_step(runner: ModelRunner, vocab: int) -> tuple[DecodeBatch, PrefillInputs]:
    """Two rows decoding and a 61-token prompt whose 60-token chunk completes in step 0, so
    its decode row reads the piece's KV from the same forward: 63 tokens."""
    d = Driver(runner, seed=4)
    short, other, joiner = random_prompts([30, 52, 61], vocab, seed=8)
    d.add(0, short)
    d.add(1, other)
    d.run(2)
    blocks = [d.free.pop() for _ in range(5)]
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=[EOS_ID])
    runner.apply(StepPlan(9, 4, new=[NewRequest(2, np.array(joiner, np.int32), sampling,
                                                blocks, 0, 60)]))
    layout = lay_out(runner.requests.values(), 4, False)
    batch = build_decode_batch(layout.decoding, runner.vocab_size, runner.device, None,
                               layout.join_steps)
    return batch, runner.executor.step_inputs(layout.steps[0], batch, layout.join_steps)


def snapshot(runner: ModelRunner) -> KV:
    return [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def restore(runner: ModelRunner, kv: KV) -> None:
    for (k, v), (k0, v0) in zip(runner.kv_caches, kv, strict=True):
        k.copy_(k0)
        v.copy_(v0)


@pytest.mark.parametrize("family, flex", [("llama", False), ("llama", True),
                                          ("gemma3", False), ("qwen3-moe", False)])
@torch.inference_mode()
def test_the_pieces_equal_the_eager_forward(llama: str, ckpt_root: Path, family: str,
                                            flex: bool) -> None:
    path = llama if family == "llama" else family_checkpoint(ckpt_root, family)
    runner = make_runner(path, attention_backend="flex" if flex else "sdpa")
    batch, pre = mixed_step(runner, 512)
    assert batch.size == 3 and pre.ids.shape[0] == 60
    before = snapshot(runner)
    want, want_hidden = runner.executor.forward_mixed(batch, 0, pre)
    want_kv = snapshot(runner)
    # 63 tokens -> the 64 bucket
    runner.executor.mixed_graphs = MixedGraphs(runner.model, 100, capture=False)
    for _ in range(2):  # the second time over the buffers the first one left
        restore(runner, before)
        with forbid_host_sync():
            got, got_hidden = runner.executor.forward_mixed(batch, 0, pre)
        assert list(runner.executor.mixed_graphs.graphs) == [64]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_hidden, want_hidden, atol=1e-5, rtol=0)
        for (k, v), (kw, vw) in zip(runner.kv_caches, want_kv, strict=True):
            torch.testing.assert_close(k[:-1], kw[:-1], atol=1e-5, rtol=0)  # scratch aside
            torch.testing.assert_close(v[:-1], vw[:-1], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_a_step_above_the_largest_bucket_runs_eagerly(llama: str) -> None:
    runner = make_runner(llama)
    batch, pre = mixed_step(runner, 512)
    before = snapshot(runner)
    want, _ = runner.executor.forward_mixed(batch, 0, pre)
    restore(runner, before)
    runner.executor.mixed_graphs = MixedGraphs(runner.model, 48, capture=False)
    got, _ = runner.executor.forward_mixed(batch, 0, pre)
    assert not runner.executor.mixed_graphs.graphs  # never built: 63 tokens > 48
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@torch.inference_mode()
def test_the_attention_kernel_is_compiled_at_start_up(llama: str, ckpt_root: Path, family: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner choosing the flex backend runs one call per distinct window over a dummy
    decode and prefill row (the CPU runs the operator eagerly), reading the cache and writing
    nothing: a compile that fails shows at start-up, not in the first mixed step."""
    path = llama if family == "llama" else family_checkpoint(ckpt_root, family)
    windows: list[int | None] = []
    real = flex_attention.flex_mixed

    def counted(q: torch.Tensor, kv: Any, scale: float, plan: Any, w: int | None
                ) -> torch.Tensor:
        windows.append(w)
        out = real(q, kv, scale, plan, w)
        assert out.shape == q.shape and torch.isfinite(out).all()
        return out

    monkeypatch.setattr(flex_attention, "flex_mixed", counted)
    runner = make_runner(path, attention_backend="flex")
    assert isinstance(runner.attention, FlexBackend) and runner.model.attention is runner.attention
    assert windows == list(runner.model._windows) and len(windows) == (2 if family == "gemma3"
                                                                         else 1)
    assert not any(c.any() for kv in runner.kv_caches for c in kv)  # allocated zero, unwritten


@pytest.mark.gpu
@torch.inference_mode()
def test_captured_pieces_equal_the_eager_forward_on_cuda(llama: str) -> None:
    runner = ModelRunner(WorkerConfig(llama, device="cuda", dtype="float32", block_size=16,
                                      num_kv_blocks=400, max_num_seqs=8))
    pieces, runner.executor.mixed_graphs = runner.executor.mixed_graphs, None
    assert pieces is not None
    batch, pre = mixed_step(runner, 512)
    before = snapshot(runner)
    want, want_hidden = runner.executor.forward_mixed(batch, 0, pre)
    runner.executor.mixed_graphs = pieces
    for _ in range(2):
        restore(runner, before)
        got, got_hidden = runner.executor.forward_mixed(batch, 0, pre)
        assert pieces.enabled and set(pieces.graphs) == set(pieces.buckets)  # at start-up
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got_hidden, want_hidden, atol=1e-4, rtol=0)
