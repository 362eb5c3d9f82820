"""`--kv-cache-dtype fp8` through the runner: twice the blocks of bfloat16 in the same memory
(four times float32's), greedy tokens equal to HF `generate()` whose attention reads k/v
rounded through e4m3 (an independent reference of what an fp8 cache holds), and the same
tokens however the scheduler cuts the work (mixed steps, K=1 sync and K=8 async, preemption,
prefix hits mid-prompt, the FlexAttention path), with no host read in the K-step loop.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem_serve.gpu_worker.attention.kv_cache import FP8
from tandem_serve.gpu_worker.runner import ModelRunner
from tandem_serve.proto.config import WorkerConfig
from tandem_serve.proto.request_params import SamplingParams
from tests.gpu_worker.model_utils import EOS_ID, random_prompts
from tests.gpu_worker.runner_driver import make_runner
from tests.gpu_worker.served import Served
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.gpu_worker.triton_utils import use_backend

NEW = 40


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, stop_token_ids=[EOS_ID])


@pytest.mark.parametrize("dtype, kv, blocks", [
    ("bfloat16", "auto", 256), ("float32", "auto", 128), ("float32", "fp8", 512),
    ("bfloat16", "fp8_e4m3", 512)])
def test_blocks_for_the_same_memory(llama: str, dtype: str, kv: str, blocks: int) -> None:
    """1 MiB of cache: a block of this model is 2 layers x 2 (K, V) x 16 tokens x 2 heads x
    16 dims = 2,048 elements, so 256 blocks in bfloat16, 128 in float32, 512 in fp8."""
    runner = ModelRunner(WorkerConfig(llama, device="cpu", dtype=dtype, block_size=16,
                                      kv_cache_memory=1 / 1024, kv_cache_dtype=kv))
    assert runner.num_blocks == blocks
    k_cache, v_cache = runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == (FP8 if kv != "auto" else runner.dtype)
    real = sum(t[:-1].nbytes for kv_pair in runner.kv_caches for t in kv_pair)
    assert real == 1 << 20  # the scratch block aside, exactly the memory asked for


_hf_fp8: dict[str, Any] = {}


def hf_fp8_greedy(path: str, prompt: list[int], n: int = NEW) -> list[int]:
    """HF generate()'s greedy tokens with every key and value the attention reads rounded
    through e4m3 (saturated at ±448), as an fp8 cache stores them."""
    import transformers.models.llama.modeling_llama as llama_mod
    from transformers import AutoModelForCausalLM

    if path not in _hf_fp8:
        _hf_fp8[path] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
    eager = llama_mod.eager_attention_forward

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)

    def attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  *args: Any, **kw: Any) -> Any:
        return eager(module, q, rounded(k), rounded(v), *args, **kw)

    llama_mod.eager_attention_forward = attention
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = _hf_fp8[path].generate(ids, attention_mask=torch.ones_like(ids),
                                         do_sample=False, max_new_tokens=n)
    finally:
        llama_mod.eager_attention_forward = eager
    gen: list[int] = out[0, len(prompt):].tolist()
    return gen[:gen.index(EOS_ID) + 1] if EOS_ID in gen else gen


def _workload(served: Served, new: int = NEW) -> dict[int, list[int]]:
    """Streams decoding while long prompts arrive and prefill in pieces inside the steps;
    three prompts share a 64-token prefix.  Each request's first `new` tokens."""
    base, *p = random_prompts([64, 9, 23, 15, 100, 40, 30], 512, seed=17)
    prompts = [p[0], base + p[1], p[2], p[3], base + p[4], base + p[5]]
    for rid, prompt in enumerate(prompts):
        served.add(rid, prompt, greedy(new), after_plans=rid)
    served.prompts = prompts  # type: ignore[attr-defined]
    out = served.run()
    served.close()
    return out


@pytest.fixture(scope="module")
def reference(llama: str) -> dict[str, Any]:
    """The workload on an fp8 cache, K=8 async, plenty of blocks; HF's tokens for it."""
    runner = make_runner(llama, kv_cache_dtype="fp8")
    served = Served(runner, 8, True, budget=24)
    out = _workload(served)
    prompts = served.prompts  # type: ignore[attr-defined]
    return {"out": out, "hf": {rid: hf_fp8_greedy(llama, p) for rid, p in enumerate(prompts)},
            "spread": served.spread(), "f32": _workload(Served(make_runner(llama), 8, True,
                                                               budget=24))}


def test_greedy_equals_hf_reading_fp8_rounded_kv(reference: dict[str, Any]) -> None:
    assert reference["spread"], "prompts prefilled in pieces inside the decode steps"
    assert reference["out"] == reference["hf"]
    # The cache really is fp8: the tokens part from the float32 cache's somewhere.
    assert reference["out"] != reference["f32"]


@pytest.mark.parametrize("k, async_mode, backend, blocks, new", [
    (1, False, "auto", 400, NEW), (8, True, "flex", 400, NEW), (8, True, "auto", 16, NEW),
    (8, False, "auto", 18, NEW), (8, True, "triton", 11, 12)],
    ids=["sync-K1", "flex", "preempt-async", "preempt-sync", "triton-preempt"])
def test_the_same_tokens_however_the_work_is_cut(
        request: pytest.FixtureRequest, llama: str, reference: dict[str, Any], k: int,
        async_mode: bool, backend: str, blocks: int, new: int) -> None:
    """What attention reads is what the cache holds, whichever path wrote and reads it.
    (Triton's interpreter runs each decode row's program in Python: there, the first 12
    tokens of each request, in a cache small enough that the prompts alone preempt.)"""
    runner = make_runner(llama, kv_cache_dtype="fp8", num_kv_blocks=blocks,
                         attention_backend=use_backend(request, backend))
    runner.step_guard = forbid_host_sync
    served = Served(runner, k, async_mode, budget=20)
    assert _workload(served, new) == {rid: t[:new] for rid, t in reference["out"].items()}
    stats = served.sched.stats
    assert stats.prefix_hit_tokens >= 64
    if blocks < 100:
        assert stats.num_preemptions > 0
