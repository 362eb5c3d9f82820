"""The checkpoint tensors of a hybrid model's own parts, under transformers' names: the Gated
DeltaNet layers (Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba`, Qwen3.5's separate
`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and the MoE layers' gated shared expert.

Torch-free, like `models.layout`, which calls these.
"""
from __future__ import annotations

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.hybrid.config import QWEN3_NEXT

Shape = tuple[int, ...]


def linear_attention_weights(a: ModelArgs, p: str) -> dict[str, Shape]:
    s = a.linear_attn
    assert s is not None
    h, la = a.hidden_size, p + "linear_attn."
    # The convolution's q | k | v channels (and Qwen3.5's in_proj_qkv rows) are asked for
    # as three parts (`views`), so a tensor-parallel rank reads its heads of each.
    out: dict[str, Shape] = {
        la + "conv1d_q.weight": (s.key_dim, 1, s.conv_kernel),
        la + "conv1d_k.weight": (s.key_dim, 1, s.conv_kernel),
        la + "conv1d_v.weight": (s.value_dim, 1, s.conv_kernel),
        la + "dt_bias": (s.num_v_heads,),
        la + "A_log": (s.num_v_heads,),
        la + "norm.weight": (s.head_v_dim,),
        la + "out_proj.weight": (h, s.value_dim),
    }
    if a.architecture == QWEN3_NEXT:
        out[la + "in_proj_qkvz.weight"] = (s.conv_dim + s.value_dim, h)
        out[la + "in_proj_ba.weight"] = (2 * s.num_v_heads, h)
    else:
        out[la + "in_proj_q.weight"] = (s.key_dim, h)
        out[la + "in_proj_k.weight"] = (s.key_dim, h)
        out[la + "in_proj_v.weight"] = (s.value_dim, h)
        out[la + "in_proj_z.weight"] = (s.value_dim, h)
        out[la + "in_proj_b.weight"] = (s.num_v_heads, h)
        out[la + "in_proj_a.weight"] = (s.num_v_heads, h)
    return out


def linear_attention_views(a: ModelArgs, p: str) -> dict[str, tuple[str, int]]:
    """Part name -> (the checkpoint tensor holding it, its first row there)."""
    s = a.linear_attn
    assert s is not None
    la = p + "linear_attn."
    fused = {"conv1d": "conv1d.weight"}
    if a.architecture != QWEN3_NEXT:
        fused["in_proj"] = "in_proj_qkv.weight"
    out: dict[str, tuple[str, int]] = {}
    for prefix, whole in fused.items():
        for part, first in (("q", 0), ("k", s.key_dim), ("v", 2 * s.key_dim)):
            out[f"{la}{prefix}_{part}.weight"] = (la + whole, first)
    return out


def shared_expert_weights(a: ModelArgs, p: str) -> dict[str, Shape]:
    h, i = a.hidden_size, a.shared_expert_intermediate_size
    if not i:
        return {}
    se = p + "mlp.shared_expert."
    return {se + "gate_proj.weight": (i, h), se + "up_proj.weight": (i, h),
            se + "down_proj.weight": (h, i), p + "mlp.shared_expert_gate.weight": (1, h)}
