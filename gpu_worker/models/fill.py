"""Filling a CausalLM's parameters from checkpoint tensors (`load_weights`).

`get(name)` returns one tensor under its HF name (`layout.expected_weights`), already in
the target dtype, on the target device and cut to this rank's part. A quantized checkpoint
also passes `linear(names)`, which builds a fused linear from its parts' names: a dense
weight, or a `QuantLinear` the layer runs instead of its (then empty) weight parameter.
Here the parts become the model's fused parameters: q|k|v, gate|up, q_norm|k_norm per
head, Gemma's (1 + w) norms in float32, and each MoE layer's experts stacked into one
tensor per projection.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from tandem_serve.gpu_worker.models import layout
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.decoder import CausalLM, DecoderLayer
from tandem_serve.gpu_worker.models.hybrid.fill import fill_linear_attention, split_gated_q
from tandem_serve.gpu_worker.models.hybrid.layers import LinearAttentionLayer
from tandem_serve.gpu_worker.models.moe import grouped_usable
from tandem_serve.gpu_worker.models.quant.linear import QuantLinear

Get = Callable[[str], torch.Tensor]
Linear = Callable[[list[str]], "torch.Tensor | QuantLinear"]


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def load_weights(model: CausalLM, get: Get, linear: Linear | None = None) -> None:
    """Fill every parameter of `model` from ``get(hf_name)`` (and its linear layers from
    ``linear(hf_names)`` when given).

    Fused tensors are concatenated on the target device; the parts are dropped right away.
    """
    a = model.config
    model.embed_tokens = _frozen(get("model.embed_tokens.weight"))
    model.norm = _norm(a, get("model.norm.weight"))
    model.lm_head = model.embed_tokens if a.tie_word_embeddings else _frozen(get("lm_head.weight"))
    for n, layer in enumerate(model.layers):
        _fill_layer(a, cast(DecoderLayer, layer), layout.layer_prefix(n), get, linear)
    device = model.embed_tokens.device
    model.ropes = [r.to(device) for r in model.ropes]
    if a.gemma_norms:
        model.embed_scale = torch.tensor(a.hidden_size**0.5).to(model.embed_tokens.dtype)
    left = [n for n, t in model.named_parameters() if t.is_meta]
    if left:
        raise ValueError(f"weights not loaded: {', '.join(left)}")


def _norm(a: ModelArgs, weight: torch.Tensor) -> nn.Parameter:
    # Gemma, Qwen3-Next and Qwen3.5 scale by (1 + w) in float32 (HF: `1.0 +
    # self.weight.float()`), folded here once.
    return _frozen(1.0 + weight.float() if a.one_plus_norms else weight)


def _fill_layer(a: ModelArgs, layer: DecoderLayer, p: str, get: Get,
                linear: Linear | None) -> None:
    def cat(names: list[str]) -> nn.Parameter:
        parts = [get(p + x) for x in names]
        return _frozen(parts[0] if len(parts) == 1 else torch.cat(parts))

    def weight(attr: str, names: list[str]) -> None:
        if linear is None:
            setattr(layer, attr, cat(names))
            return
        built = linear([p + x for x in names])
        if isinstance(built, torch.Tensor):
            setattr(layer, attr, _frozen(built))
        else:  # the layer runs the QuantLinear; the parameter stays an empty placeholder
            layer.quant[attr] = built
            setattr(layer, attr, _frozen(torch.empty(0, dtype=built.dtype,
                                                     device=built.tensors_device)))

    layer.input_norm = _norm(a, get(p + "input_layernorm.weight"))
    layer.post_norm = _norm(a, get(p + "post_attention_layernorm.weight"))
    if a.gemma_norms:
        layer.pre_ff_norm = _norm(a, get(p + "pre_feedforward_layernorm.weight"))
        layer.post_ff_norm = _norm(a, get(p + "post_feedforward_layernorm.weight"))
    if isinstance(layer, LinearAttentionLayer):
        fill_linear_attention(a, layer, p, get)
    else:
        _fill_attention(a, layer, p, get, weight, cat)
    if layer.moe:
        _fill_experts(a, layer, get, p)
        return
    weight("gate_up_weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"])
    weight("down_weight", ["mlp.down_proj.weight"])
    if a.mlp_bias:
        layer.gate_up_bias = cat(["mlp.gate_proj.bias", "mlp.up_proj.bias"])
        layer.down_bias = cat(["mlp.down_proj.bias"])


def _fill_attention(a: ModelArgs, layer: DecoderLayer, p: str, get: Get,
                    weight: Callable[[str, list[str]], None],
                    cat: Callable[[list[str]], nn.Parameter]) -> None:
    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    if a.attn_output_gate:  # q | k | v | gate (hybrid models are never quantized)
        q, gate = split_gated_q(get(p + qkv[0] + ".weight"), a.num_heads, a.head_dim)
        layer.qkv_weight = _frozen(torch.cat(
            [q, get(p + qkv[1] + ".weight"), get(p + qkv[2] + ".weight"), gate]))
    else:
        weight("qkv_weight", [x + ".weight" for x in qkv])
    if a.qkv_bias:
        layer.qkv_bias = cat([x + ".bias" for x in qkv])
    weight("o_weight", ["self_attn.o_proj.weight"])
    if a.o_bias:
        layer.o_bias = cat(["self_attn.o_proj.bias"])
    if a.qk_norm:
        qn = get(p + "self_attn.q_norm.weight")
        kn = get(p + "self_attn.k_norm.weight")
        both = torch.cat([qn.expand(a.num_heads, -1), kn.expand(a.num_kv_heads, -1)])
        layer.qk_norm_weight = _norm(a, both)


def _fill_experts(a: ModelArgs, layer: DecoderLayer, get: Get, p: str) -> None:
    """Stack the experts into [E, 2I, H] (gate rows, then up) and [E, H, I], one expert at a
    time into preallocated tensors, so loading holds one expert's copy beyond the model."""
    n = layer.layer_idx
    router = get(layout.router_name(a, n))
    i, h = a.moe_intermediate_size, a.hidden_size
    gate_up = torch.empty((a.num_experts, 2 * i, h), dtype=router.dtype, device=router.device)
    down = torch.empty((a.num_experts, h, i), dtype=router.dtype, device=router.device)
    for e in range(a.num_experts):
        gate, up, dn = layout.expert_names(a, n, e)
        gate_up[e, :i].copy_(get(gate))
        gate_up[e, i:].copy_(get(up))
        down[e].copy_(get(dn))
    layer.router = _frozen(router)
    layer.experts_gate_up = _frozen(gate_up)
    layer.experts_down = _frozen(down)
    layer.grouped = grouped_usable(router.device, router.dtype, (h, i))
    if a.shared_expert_intermediate_size:
        se = p + "mlp.shared_expert."
        layer.shared_gate_up = _frozen(torch.cat([get(se + "gate_proj.weight"),
                                                  get(se + "up_proj.weight")]))
        layer.shared_down = _frozen(get(se + "down_proj.weight"))
        layer.shared_gate = _frozen(get(p + "mlp.shared_expert_gate.weight"))
