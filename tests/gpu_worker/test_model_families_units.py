"""The mechanisms under the new families, one at a time: the MoE dispatch against a loop
over experts and transformers' routers, windowed reads of the paged cache, and what a
config.json may ask for that we refuse (with the key named)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.attention.base import AttentionMetadata
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.moe import experts_forward, grouped_usable, route
from tests.gpu_worker.family_utils import checkpoint
from tests.gpu_worker.sync_guard import forbid_host_sync
from tests.gpu_worker.test_attention import ATOL, Scenario, attend, dense_reference

# ---------------------------------------------------------------------------------- MoE


def _loop_reference(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    i = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].double(), strict=True):
            gu = gate_up[e].double() @ x[t].double()
            out[t] += w * (down[e].double() @ (F.silu(gu[:i]) * gu[i:]))
    return out


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_equal_a_loop_and_read_nothing_back(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 8, 32, 16, 2
    x = torch.randn(tokens, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    down = torch.randn(e, h, i, generator=g) / i**0.5
    router = torch.randn(e, h, generator=g)
    args = ModelArgs("Qwen3MoeForCausalLM", 10, h, 4 * i, 1, 1, 1, h, 1e-6, 64,
                     num_experts=e, num_experts_per_tok=k, norm_topk_prob=True)
    assert grouped_usable(x.device, x.dtype, (h, i))
    with forbid_host_sync():
        ids, w = route(x, router, args)
        grouped = experts_forward(x, ids, w, gate_up, down, F.silu, grouped=True)
        gathered = experts_forward(x, ids, w, gate_up, down, F.silu, grouped=False)
    want = _loop_reference(x, ids, w, gate_up, down)
    torch.testing.assert_close(grouped.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(gathered.double(), want, rtol=0, atol=1e-5)
    assert torch.allclose(w.sum(-1), torch.ones(tokens))


def test_routers_match_transformers() -> None:
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 16, generator=g)
    cases = [(Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8,
                                                num_experts_per_tok=3, norm_topk_prob=norm)),
              "Qwen3MoeForCausalLM", 3, norm) for norm in (False, True)]
    cases.append((MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8,
                                                  num_experts_per_tok=2)),
                  "MixtralForCausalLM", 2, True))
    for module, arch, k, norm in cases:
        with torch.no_grad():
            module.weight.copy_(torch.randn(8, 16, generator=g))
            _, want_w, want_ids = module(x)
        args = ModelArgs(arch, 10, 16, 32, 1, 1, 1, 16, 1e-6, 64, num_experts=8,
                         num_experts_per_tok=k, norm_topk_prob=norm,
                         router_weights_fp32=arch == "MixtralForCausalLM")
        ids, w = route(x, module.weight.detach(), args)
        assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


def test_grouped_matmul_needs_16_byte_strides() -> None:
    cpu = torch.device("cpu")
    assert grouped_usable(cpu, torch.float32, (64, 32))
    assert not grouped_usable(cpu, torch.float32, (64, 30))
    assert not grouped_usable(cpu, torch.bfloat16, (64, 36))


# ---------------------------------------------------------------------- sliding windows


def _poison_outside(sc: Scenario, blocks: list[int], first_kept: int) -> None:
    """NaN into the blocks before `first_kept`: read at all (even masked), they poison the
    output (0 * NaN), so a finite output proves they were never read. Block 0 is spared: the
    gathers read it for table padding (masked), trusting that a real block holds numbers."""
    for b in blocks[:first_kept]:
        if b == 0:
            continue
        sc.cache[0][b] = float("nan")
        sc.cache[1][b] = float("nan")


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_reads_only_the_blocks_in_the_window(block_size: int) -> None:
    window, d = 20, 16
    sc = Scenario(4, 2, d, block_size, num_blocks=96, seed=block_size)
    seqs = [sc.add(n, 1) for n in (7, 45, 130)]
    for s in seqs:
        _poison_outside(sc, s.blocks, max(0, len(s.k) - window) // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([sc.slot(s, len(s.k) - 1) for s in seqs]),
        block_tables=sc.block_tables(seqs),
        seq_lens=torch.tensor([len(s.k) for s in seqs], dtype=torch.int32),
        query_start_loc=None, query_lens=None, max_seq_len=130, is_decode=True)
    q = torch.stack([s.q[0] for s in seqs])
    k = torch.stack([s.k[-1] for s in seqs])
    v = torch.stack([s.v[-1] for s in seqs])
    out = attend(q, k, v, sc.cache, meta, 0.25, window)
    for i, s in enumerate(seqs):
        ref = dense_reference(s.q, s.k, s.v, 0.25, window)
        torch.testing.assert_close(out[i], ref[0], atol=ATOL, rtol=0)
    full = attend(q, k, v, sc.cache, meta, 0.25)
    assert torch.isnan(full[2]).all(), "the poison is where full attention reads"


def test_prefill_after_a_prefix_reads_only_the_blocks_in_the_window() -> None:
    window, bs, d = 12, 4, 16
    sc = Scenario(4, 2, d, bs, num_blocks=64, seed=3)
    s = sc.add(90, 30)  # 60 tokens in the cache, 30 queries now
    _poison_outside(sc, s.blocks, (60 - window + 1) // bs)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([sc.slot(s, p) for p in range(60, 90)]),
        block_tables=sc.block_tables([s]), seq_lens=torch.tensor([90], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 30], dtype=torch.int32), query_lens=[30],
        max_seq_len=90, is_decode=False)
    out = attend(s.q, s.k[60:], s.v[60:], sc.cache, meta, 0.25, window)
    torch.testing.assert_close(out, dense_reference(s.q, s.k, s.v, 0.25, window), atol=ATOL,
                               rtol=0)


# ------------------------------------------------------------------- config refusals


def _config(ckpt_root: Path, family: str) -> dict[str, Any]:
    path = Path(checkpoint(ckpt_root, family, published=True), "config.json")
    cfg: dict[str, Any] = json.loads(path.read_text())
    return cfg


@pytest.mark.parametrize("family, change, words", [
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"sliding_window": None}, "sliding_window"),
    ("gemma3", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "yarn"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                    "sliding_attention": {"rope_type": "linear"}}},
     "sliding_attention"),
    ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types"),
    ("phi3", {"rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}},
     "short_factor"),
    ("phi3", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("phi3", {"partial_rotary_factor": 0.2}, "partial_rotary_factor"),
    ("qwen3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("mixtral", {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 8,
                                  "short_factor": [1.0] * 8}}, "longrope"),
])
def test_unsupported_settings_name_the_key(ckpt_root: Path, family: str, change: dict[str, Any],
                                           words: str) -> None:
    cfg = {**_config(ckpt_root, family), **change}
    with pytest.raises(ValueError, match=words):
        ModelArgs.from_hf_config(cfg)


def test_phi3_old_rope_names_are_longrope_and_factors_may_be_given(ckpt_root: Path) -> None:
    cfg = _config(ckpt_root, "phi3")
    su = {**cfg, "rope_scaling": {**cfg["rope_scaling"], "type": "su"}}
    assert ModelArgs.from_hf_config(su) == ModelArgs.from_hf_config(cfg)
    given = {**cfg, "rope_scaling": {**cfg["rope_scaling"], "attention_factor": 1.5}}
    assert ModelArgs.from_hf_config(given).rope_attention_factor == 1.5
    short = {**cfg, "max_position_embeddings": 64}  # no extension: no cos/sin scale
    assert ModelArgs.from_hf_config(short).rope_attention_factor == 1.0


def test_gemma3_layer_types_win_over_the_pattern(ckpt_root: Path) -> None:
    cfg = _config(ckpt_root, "gemma3")
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    args = ModelArgs.from_hf_config({**cfg, "layer_types": types})
    assert args.sliding_windows == (None, 20, 20, None)
    default = {k: v for k, v in cfg.items() if k != "sliding_window_pattern"}
    assert ModelArgs.from_hf_config(default).sliding_windows == (20,) * 4  # pattern 6
