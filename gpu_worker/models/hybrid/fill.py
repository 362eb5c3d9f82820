"""Filling a hybrid model's own parameters from checkpoint tensors (`models.fill` calls these).

Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` interleave their parts per key head ([q, k,
v, z] rows of one key head, then the next); they are reordered here once into Qwen3.5's
layout (all q, all k, all v, all z; all b, all a), so one forward serves both families.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.hybrid.config import QWEN3_NEXT
from tandem_serve.gpu_worker.models.hybrid.layers import LinearAttentionLayer

Get = Callable[[str], torch.Tensor]


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def split_gated_q(q_proj: torch.Tensor, heads: int, head_dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated attention's q_proj [heads * 2 * d, hidden] (per head: d query rows, then d
    gate rows) -> (query rows, gate rows), each [heads * d, hidden]."""
    per_head = q_proj.reshape(heads, 2 * head_dim, -1)
    return (per_head[:, :head_dim].reshape(heads * head_dim, -1),
            per_head[:, head_dim:].reshape(heads * head_dim, -1))


def fill_linear_attention(a: ModelArgs, layer: LinearAttentionLayer, p: str, get: Get) -> None:
    s = a.linear_attn
    assert s is not None
    la = p + "linear_attn."
    if a.architecture == QWEN3_NEXT:
        r = s.num_v_heads // s.num_k_heads
        qkvz = get(la + "in_proj_qkvz.weight").reshape(s.num_k_heads, -1, a.hidden_size)
        sizes = [s.head_k_dim, s.head_k_dim, r * s.head_v_dim, r * s.head_v_dim]
        q, k, v, z = (x.reshape(-1, a.hidden_size) for x in qkvz.split(sizes, dim=1))
        ba = get(la + "in_proj_ba.weight").reshape(s.num_k_heads, 2 * r, a.hidden_size)
        b, a_rows = (x.reshape(-1, a.hidden_size) for x in ba.split([r, r], dim=1))
        parts = [q, k, v, z, b, a_rows]
    else:
        parts = [get(la + f"in_proj_{n}.weight") for n in ("q", "k", "v", "z", "b", "a")]
    layer.qkv_weight = _frozen(torch.cat(parts))
    layer.o_weight = _frozen(get(la + "out_proj.weight"))
    conv = torch.cat([get(la + f"conv1d_{n}.weight") for n in ("q", "k", "v")])
    layer.conv_weight = _frozen(conv.reshape(s.conv_dim, s.conv_kernel))
    layer.dt_bias = _frozen(get(la + "dt_bias"))
    layer.a_log = _frozen(get(la + "A_log"))
    layer.gated_norm = _frozen(get(la + "norm.weight"))
