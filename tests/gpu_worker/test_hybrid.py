"""Hybrid linear-attention models, their parts: the gated delta rule and its convolution
(against transformers' own torch code, and chunked against recurrent), what config.json says
(the three architectures, the published multimodal layout, values refused by name), and what
cannot be served with them yet refused at start-up."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.hybrid import delta_rule
from tandem_serve.gpu_worker.models.hybrid.state_cache import SlotPool, bytes_per_slot
from tandem_serve.gpu_worker.models.sharding import Shard, local_args
from tandem_serve.ipc.process import StartupError
from tandem_serve.proto.config import ServerConfig
from tandem_serve.proto.speculative import parse_speculative
from tandem_serve.tandem.preflight import check_hybrid
from tests.gpu_worker.hybrid_utils import HYBRIDS, checkpoint
from tests.gpu_worker.runner_driver import make_runner
from tests.gpu_worker.triton_utils import DEVICE

CPU = torch.device("cpu")


def _inputs(length: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0
            ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(length, hk, dk, generator=g), torch.randn(length, hk, dk, generator=g),
            torch.randn(length, hv, dv, generator=g), -torch.rand(length, hv, generator=g) * 2,
            torch.rand(length, hv, generator=g), torch.randn(hv, dk, dv, generator=g))


@pytest.mark.parametrize("length", [1, 64, 150])
def test_chunked_delta_rule_is_transformers(length: int) -> None:
    """Bit for bit transformers' chunked kernel (what HF generate's prefill runs), from a
    given state, grouped value heads, a length that is not a multiple of the chunk."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = _inputs(length)
    want, want_state = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, new_state = delta_rule.chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want[0], rtol=0, atol=0)
    torch.testing.assert_close(new_state, want_state[0], rtol=0, atol=0)


def test_chunks_and_steps_carry_the_state() -> None:
    """A sequence cut into pieces (chunked prefill) then stepped token by token (decode)
    equals the whole sequence at once: the state carries everything."""
    q, k, v, g, beta, _ = _inputs(100, seed=1)
    whole, whole_state = delta_rule.chunked(q, k, v, g, beta, None)
    first, state = delta_rule.chunked(q[:37], k[:37], v[:37], g[:37], beta[:37], None)
    second, state = delta_rule.chunked(q[37:90], k[37:90], v[37:90], g[37:90], beta[37:90],
                                       state)
    outs = [first, second]
    batch = state[None]
    for t in range(90, 100):
        o, batch = delta_rule.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                             beta[t:t + 1], batch)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batch[0], whole_state, rtol=1e-4, atol=1e-5)


def test_convolution_state_rolls() -> None:
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(20, 6, generator=g), torch.randn(6, 4, generator=g)
    whole, last = delta_rule.conv_sequence(x, None, weight)
    head, state = delta_rule.conv_sequence(x[:2], None, weight)  # shorter than the kernel
    outs = [head]
    batch = state[None]
    for t in range(2, 20):
        o, batch = delta_rule.conv_step(x[t:t + 1], batch, weight)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole)
    torch.testing.assert_close(batch[0], last)
    torch.testing.assert_close(last, x[-3:].T)


def _config(ckpt_root: Path, family: str) -> dict:
    return json.loads(Path(checkpoint(ckpt_root, family), "config.json").read_text())


def test_configs_are_read(ckpt_root: Path) -> None:
    nxt, dense, moe = (ModelArgs.from_hf_config(_config(ckpt_root, f)) for f in HYBRIDS)
    assert nxt.layer_types == ("linear_attention", "full_attention") * 2
    assert dense.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    for a in (nxt, dense, moe):
        assert a.is_hybrid and a.attn_output_gate and a.one_plus_norms and a.qk_norm
        assert a.rotary_dim == 4 and a.head_dim == 16  # partial_rotary_factor 0.25
        assert a.linear_attn is not None and a.linear_attn.conv_dim == 2 * 32 + 32
    assert nxt.num_attention_layers == 2 and dense.num_attention_layers == 1
    assert (moe.num_experts, moe.shared_expert_intermediate_size, moe.norm_topk_prob) == (
        4, 48, True)
    assert dense.num_experts == 0 and nxt.moe_layers == (True,) * 4
    s = dense.linear_attn
    per_layer = s.conv_dim * 3 * 4 + s.num_v_heads * s.head_k_dim * s.head_v_dim * 4
    assert bytes_per_slot(dense, torch.float32) == 3 * per_layer


@pytest.mark.parametrize("key, value, words", [
    ("layer_types", ["linear_attention", "mamba", "linear_attention", "full_attention"],
     "layer_types value 'mamba'"),
    ("linear_num_value_heads", 3, "linear_num_value_heads 3"),
    ("linear_conv_kernel_dim", 1, "linear_conv_kernel_dim 1"),
    ("attention_bias", True, "attention_bias True"),
])
def test_unsupported_values_are_named(ckpt_root: Path, key: str, value: object,
                                      words: str) -> None:
    cfg = {**_config(ckpt_root, "qwen3.5"), key: value}
    with pytest.raises(ValueError, match=words):
        ModelArgs.from_hf_config(cfg)


def test_slots_are_bounded() -> None:
    pool = SlotPool(2)
    a, b = pool.take(), pool.take()
    assert {a, b} == {0, 1}
    with pytest.raises(RuntimeError, match="--max-num-seqs"):
        pool.take()
    pool.give(a)
    assert pool.take() == a


def test_unsupported_combinations_are_refused(ckpt_root: Path) -> None:
    path = checkpoint(ckpt_root, "qwen3.5")
    spec = parse_speculative(json.dumps({"method": "draft_model", "model": path,
                                         "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match="speculative method 'draft_model' is not supported"):
        make_runner(path, speculative=spec)
    with pytest.raises(StartupError, match="LoRA adapters under tensor parallelism"):
        check_hybrid(ServerConfig(model=path, adapter_cache=str(ckpt_root),
                                  tensor_parallel_size=2), _config(ckpt_root, "qwen3.5"))
    cfg = {**_config(ckpt_root, "qwen3.5"), "linear_num_key_heads": 3,
           "linear_num_value_heads": 6}
    with pytest.raises(ValueError, match="linear_num_key_heads 3 is not divisible"):
        local_args(ModelArgs.from_hf_config(cfg), Shard(0, 2))


@pytest.mark.triton
@pytest.mark.parametrize("dims", [(2, 4, 16, 8), (1, 3, 24, 40)], ids=["grouped", "odd"])
def test_recurrent_kernel_is_the_torch_step(triton_interpreter: None,
                                            dims: tuple[int, int, int, int]) -> None:
    """The Triton kernel CUDA decode steps take (here under the interpreter): the torch
    step's output and states, written in place into the rows' slots only (head dims that
    are not powers of two, value dims over several tiles)."""
    from tandem_serve.gpu_worker.models import fused

    hk, hv, dk, dv = dims
    g = torch.Generator().manual_seed(4)
    rows, num_slots = 3, 6
    q, k = torch.randn(rows, hk, dk, generator=g), torch.randn(rows, hk, dk, generator=g)
    v = torch.randn(rows, hv, dv, generator=g)
    decay, beta = -torch.rand(rows, hv, generator=g), torch.rand(rows, hv, generator=g)
    pool = torch.randn(num_slots, hv, dk, dv, generator=g)
    # On a GPU host (gpu-check's gpu tests stage) the kernel runs compiled, on CUDA tensors.
    q, k, v, decay, beta, pool = (t.to(DEVICE) for t in (q, k, v, decay, beta, pool))
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    want_pool = pool.clone()
    want = delta_rule.recurrent_update(q, k, v, decay, beta, want_pool, slots)
    with fused.forced():
        got = delta_rule.recurrent_update(q, k, v, decay, beta, pool, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[1, 3, 5]], want_pool[[1, 3, 5]], rtol=0, atol=0)
