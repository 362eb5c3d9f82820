"""What sets one family apart in its config.json: biases, sliding windows, experts, Gemma 3.

Each function returns ModelArgs fields (a dict, so this file does not import `config`).
Missing keys take transformers' class defaults, as `from_pretrained` would; keys we cannot
honour are a ValueError naming the key.
"""
from __future__ import annotations

from typing import Any

QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
PHI3 = "Phi3ForCausalLM"
# Families whose every layer slides when `sliding_window` is set (no per-layer switch).
_WHOLE_MODEL_WINDOW = ("MistralForCausalLM", MIXTRAL, PHI3)
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", QWEN3_MOE)


def bias_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    attention_bias = bool(cfg.get("attention_bias", False))
    if arch == "Qwen2ForCausalLM":
        qkv, o = True, False
    elif arch in ("MistralForCausalLM", MIXTRAL, PHI3):
        qkv = o = False
    else:
        qkv = o = attention_bias
    mlp = bool(cfg.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False
    return dict(qkv_bias=qkv, o_bias=o, mlp_bias=mlp)


def sliding_windows(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    """Per layer: None = full attention, else the window (keys with q - k < window)."""
    window = cfg.get("sliding_window")
    if arch in _WHOLE_MODEL_WINDOW:
        return (int(window) if window else None,) * layers
    if arch == GEMMA3:
        return tuple(int(window) if t == "sliding_attention" and window else None
                     for t in _gemma3_layer_types(cfg, layers))
    if arch in _QWEN:
        # HF nulls sliding_window unless use_sliding_window; layer_types says which layers use it
        # (older configs: layers >= max_window_layers).
        if not window or not cfg.get("use_sliding_window", False):
            return (None,) * layers
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (None,) * layers


def _gemma3_layer_types(cfg: dict[str, Any], layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is "
                             f"{layers}")
        return [str(t) for t in types]
    # Published configs: every `sliding_window_pattern`-th layer (i + 1) is global.
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)]


def moe_fields(cfg: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """Experts and routing (empty for a dense family)."""
    if arch == QWEN3_MOE:
        # transformers 5 writes `num_local_experts`, published configs `num_experts`.
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 128)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        moe = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        out: dict[str, Any] = dict(
            num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=moe)
    elif arch == MIXTRAL:
        out = dict(num_experts=int(cfg.get("num_local_experts") or 8),
                   num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                   moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                   moe_layers=(True,) * layers, router_weights_fp32=True)
    else:
        return {}
    k, experts = int(out["num_experts_per_tok"]), int(out["num_experts"])
    if not 0 < k <= experts:
        raise ValueError(f"num_experts_per_tok {k} must be between 1 and the number of "
                         f"experts, {experts}")
    return out


def gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's attention scale, (1 + w) norms around attention and the MLP, scaled
    embeddings and capped logits."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping {cfg['attn_logit_softcapping']} is not "
                         "supported (Gemma 3 checkpoints set it to null)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a decoder serves "
                         "causal attention only)")
    if not cfg.get("sliding_window", 4096):
        raise ValueError("sliding_window is null; Gemma 3's sliding layers need a window")
    cap = cfg.get("final_logit_softcapping")
    return dict(attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                gemma_norms=True, final_logit_softcapping=None if cap is None else float(cap))
