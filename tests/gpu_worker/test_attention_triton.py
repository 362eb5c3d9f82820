"""The Triton attention backend (`gpu_worker.attention.triton_attn`) end to end, under
Triton's interpreter on the CPU (the kernels a GPU runs): its plans against the SDPA
backend's on the same cache, and generation against HF for what only it exercises here —
speculative verify rows, sliding windows (Gemma 3), mixture of experts and LongRoPE.
Mixed steps, preemption, prefix hits and the fp8 cache run through it in test_mixed_steps
and test_kv_fp8.  The interpreter is slow: these stay few and small.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem_serve.gpu_worker.attention.base import AttentionMetadata
from tandem_serve.gpu_worker.attention.kv_cache import FP8, allocate_kv_cache
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend
from tandem_serve.gpu_worker.models.loader import load_model
from tandem_serve.gpu_worker.spec import policy
from tandem_serve.proto.request_params import SamplingParams
from tests.gpu_worker.family_utils import checkpoint
from tests.gpu_worker.model_utils import (
    EOS_ID,
    PagedDriver,
    make_copier_checkpoint,
    random_prompts,
)
from tests.gpu_worker.runner_driver import hf_greedy
from tests.gpu_worker.test_speculative import SPEC, _chain_of, _run

# `triton`: gpu-check's gpu tests stage runs these compiled on a GPU host.
pytestmark = [pytest.mark.usefixtures("triton_interpreter"), pytest.mark.triton]

BS, HKV, G, D = 16, 2, 2, 16


def _backend():  # type: ignore[no-untyped-def]
    from tandem_serve.gpu_worker.attention.triton_attn import TritonBackend

    return TritonBackend()


def _cache(kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    (k, v), = allocate_kv_cache(1, 24, BS, HKV, D, kv_dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    for t in (k, v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return k, v


def _meta(kind: str) -> AttentionMetadata:
    """Rows over shuffled blocks: decode rows far apart in length (two SDPA gather groups),
    a prefill chunk after a cached prefix, and the two mixed."""
    tables = torch.tensor([[7, 3, 11, 19, 2], [5, -1, -1, -1, -1], [8, 1, 14, 0, 21]],
                          dtype=torch.int32)
    if kind == "decode":
        lens = torch.tensor([70, 9, 41], dtype=torch.int32)
        return AttentionMetadata(torch.tensor([-1, 5 * BS + 8, 14 * BS + 8]), tables, lens,
                                 None, None, 70, True, decode_lens=[70, 9, 41])
    if kind == "prefill":
        slots = torch.cat((torch.arange(14 * BS + 2, 14 * BS + 16), torch.tensor([0])))
        return AttentionMetadata(slots, tables[2:], torch.tensor([49], dtype=torch.int32),
                                 torch.tensor([0, 15], dtype=torch.int32), [15], 49, False,
                                 prefill_seq_lens=[49])
    slots = torch.cat((torch.tensor([19 * BS + 5, -1]), torch.arange(14 * BS, 14 * BS + 12)))
    return AttentionMetadata(slots, tables, torch.tensor([54, 3, 44], dtype=torch.int32),
                             None, [1, 1, 12], 54, False, num_decode=2, decode_max_seq_len=54,
                             prefill_seq_lens=[44])


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8], ids=["f32", "fp8"])
def test_plans_attend_as_sdpa_does(kind: str, window: int | None,
                                   kv_dtype: torch.dtype) -> None:
    """The same forward through both backends: same output (1e-5) and the same cache."""
    meta = _meta(kind)
    t = meta.slot_mapping.shape[0]
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HKV * G, HKV, HKV))
    scale = D ** -0.5
    outs, caches = [], []
    for backend in (SdpaBackend(), _backend()):
        cache = _cache(kv_dtype)
        plan = backend.prepare(meta, cache, (None, window))
        outs.append(backend.forward(q, k, v, cache, plan, scale, window))
        caches.append(cache)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a.float(), b.float())


@pytest.mark.parametrize("family", ["gemma3", "qwen3-moe", "phi3"])
def test_families_generate_as_hf(ckpt_root: Path, family: str) -> None:
    """Sliding windows and Gemma's layers (gemma3), experts (qwen3-moe), LongRoPE past its
    original length (phi3): one batched prefill, then decode with masked rows.  (The
    70-token prompt is past Phi-3's 64 and keeps Gemma's window off the first key tile.)"""
    path = checkpoint(ckpt_root, family)
    model = load_model(path, torch.float32, torch.device("cpu"))
    model.attention = _backend()
    prompts = random_prompts([70, 9, 33], 512, seed=3)
    driver = PagedDriver(model, num_blocks=60, block_size=16, seed=1)
    ours = driver.generate([driver.new_seq(p) for p in prompts], 6, extra_masked_rows=1)
    assert ours == [hf_greedy(path, p, 6) for p in prompts]


def test_verify_rows_keep_greedy_parity(ckpt_root: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative verify rows (1 + k queries a row) through the kernel: the tokens of the
    run without speculation, with drafts accepted.  (The policy's start-up timing of
    forwards of up to 64 rows would dominate under the interpreter: 2 rows here.)"""
    monkeypatch.setitem(policy.MEASURED_ROWS, "cpu", 2)
    copier = make_copier_checkpoint(ckpt_root, tokenizer=False)
    chain = _chain_of(copier)
    greedy = SamplingParams(max_new_tokens=12, stop_token_ids=[EOS_ID])
    requests = [(chain[:14] + chain[:3], greedy), (chain[5:15] + chain[5:8], greedy)]
    want, _, _ = _run(copier, "", 8, True, requests)
    got, _, d = _run(copier, SPEC, 8, True, requests, guard=True, attention_backend="triton")
    assert got == want
    assert sum(done.num_accepted_tokens for done in d.done) > 0
