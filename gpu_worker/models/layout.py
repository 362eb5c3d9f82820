"""Which tensors each family's checkpoint holds, under the names the published models use.

`expected_weights` names what `CausalLM.load_weights` asks for, with whole-model shapes:
HF names, except that a fused tensor (Phi-3's `qkv_proj` and `gate_up_proj`) is asked for
as its parts (q_proj, k_proj, v_proj; gate_proj, up_proj), which `views` maps to row ranges
of the tensor in the file. Sharding (`sharding.checkpoint_part`) then cuts a part like any
unfused q_proj, so a tensor-parallel rank still reads only its rows. `checkpoint_shapes`
is what the files must hold.

Torch-free, so sharding and the launcher can use it.
"""
from __future__ import annotations

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.config_families import MIXTRAL, PHI3
from tandem_serve.gpu_worker.models.hybrid.layout import (
    linear_attention_views,
    linear_attention_weights,
    shared_expert_weights,
)

Shape = tuple[int, ...]


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def moe_prefix(a: ModelArgs) -> str:
    return "block_sparse_moe." if a.architecture == MIXTRAL else "mlp."


def expert_names(a: ModelArgs, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of one expert: Mixtral's w1 / w3 / w2, else HF's."""
    p = f"{layer_prefix(layer)}{moe_prefix(a)}experts.{expert}."
    if a.architecture == MIXTRAL:
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def router_name(a: ModelArgs, layer: int) -> str:
    return f"{layer_prefix(layer)}{moe_prefix(a)}gate.weight"


def norm_names(a: ModelArgs) -> tuple[str, ...]:
    base = ("input_layernorm.weight", "post_attention_layernorm.weight")
    if a.gemma_norms:
        return base + ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
    return base


def expected_weights(a: ModelArgs) -> dict[str, Shape]:
    h = a.hidden_size
    out: dict[str, Shape] = {"model.embed_tokens.weight": (a.vocab_size, h),
                             "model.norm.weight": (h,)}
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = (a.vocab_size, h)
    for n in range(a.num_layers):
        p = layer_prefix(n)
        out.update({p + name: (h,) for name in norm_names(a)})
        out.update(linear_attention_weights(a, p) if a.is_linear(n) else _attention(a, p))
        out.update(_moe(a, n) if a.is_moe(n) else _dense_mlp(a, p))
    return out


def _attention(a: ModelArgs, p: str) -> dict[str, Shape]:
    h, d = a.hidden_size, a.head_dim
    out: dict[str, Shape] = {}
    # A gated attention's q_proj also yields the output gate: per head, d query rows, d gate.
    q_rows = a.num_heads * (2 if a.attn_output_gate else 1)
    for name, rows in (("q", q_rows), ("k", a.num_kv_heads), ("v", a.num_kv_heads)):
        out[p + f"self_attn.{name}_proj.weight"] = (rows * d, h)
        if a.qkv_bias:
            out[p + f"self_attn.{name}_proj.bias"] = (rows * d,)
    out[p + "self_attn.o_proj.weight"] = (h, a.num_heads * d)
    if a.o_bias:
        out[p + "self_attn.o_proj.bias"] = (h,)
    if a.qk_norm:
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
    return out


def _dense_mlp(a: ModelArgs, p: str) -> dict[str, Shape]:
    h, i = a.hidden_size, a.intermediate_size
    out: dict[str, Shape] = {}
    for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        out[p + f"mlp.{name}_proj.weight"] = shape
        if a.mlp_bias:
            out[p + f"mlp.{name}_proj.bias"] = (shape[0],)
    return out


def _moe(a: ModelArgs, layer: int) -> dict[str, Shape]:
    h, i = a.hidden_size, a.moe_intermediate_size
    out: dict[str, Shape] = {router_name(a, layer): (a.num_experts, h)}
    for e in range(a.num_experts):
        gate, up, down = expert_names(a, layer, e)
        out.update({gate: (i, h), up: (i, h), down: (h, i)})
    return {**out, **shared_expert_weights(a, layer_prefix(layer))}


def views(a: ModelArgs) -> dict[str, tuple[str, int]]:
    """Part name -> (the fused checkpoint tensor holding it, its first row there)."""
    if a.is_hybrid:
        return {k: v for n in range(a.num_layers) if a.is_linear(n)
                for k, v in linear_attention_views(a, layer_prefix(n)).items()}
    if a.architecture != PHI3:
        return {}
    d, i = a.head_dim, a.intermediate_size
    q, kv = a.num_heads * d, a.num_kv_heads * d
    out: dict[str, tuple[str, int]] = {}
    for n in range(a.num_layers):
        p = layer_prefix(n)
        qkv, gate_up = p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight"
        out[p + "self_attn.q_proj.weight"] = (qkv, 0)
        out[p + "self_attn.k_proj.weight"] = (qkv, q)
        out[p + "self_attn.v_proj.weight"] = (qkv, q + kv)
        out[p + "mlp.gate_proj.weight"] = (gate_up, 0)
        out[p + "mlp.up_proj.weight"] = (gate_up, i)
    return out


def checkpoint_shapes(a: ModelArgs) -> dict[str, Shape]:
    """The tensors the checkpoint files must hold, with their shapes."""
    expected = expected_weights(a)
    parts = views(a)
    out = {name: shape for name, shape in expected.items() if name not in parts}
    for name, (fused, _) in parts.items():
        rows, *rest = expected[name]
        have = out.get(fused, (0, *rest))
        out[fused] = (have[0] + rows, *rest)
    return out
