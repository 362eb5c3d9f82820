"""What a hybrid linear-attention checkpoint's config.json says (Qwen3-Next, Qwen3.5 dense and
MoE, and the language model of the published Qwen3.5 multimodal folders).

Returns ModelArgs fields (a dict, so this file does not import `models.config`). Missing keys
take transformers' class defaults; a value we cannot honour is a ValueError naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_5 = "Qwen3_5ForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
HYBRID_ARCHITECTURES = (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE)
# The published multimodal folders: a text_config, the language model's weights under
# model.language_model.*, a vision tower (`gpu_worker.vision`) and an MTP head (left out).
MULTIMODAL = {"Qwen3_5ForConditionalGeneration": QWEN3_5,
              "Qwen3_5MoeForConditionalGeneration": QWEN3_5_MOE}
MODEL_TYPES = {"qwen3_next": QWEN3_NEXT, "qwen3_5_text": QWEN3_5, "qwen3_5_moe_text": QWEN3_5_MOE}
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class LinearAttnShape:
    """A Gated DeltaNet layer's shape: key heads (queries share them), value heads (a multiple
    of the key heads), their dimensions, and the causal convolution's kernel width."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the convolution: q | k | v."""
        return 2 * self.key_dim + self.value_dim


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal folder's config as its language model's (`text_config` over the top
    level, the causal-LM architecture, `language_model` set); any other config unchanged."""
    archs = cfg.get("architectures") or []
    arch = next((MULTIMODAL[a] for a in archs if a in MULTIMODAL), None)
    if arch is None:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{archs[0]} config has no text_config")
    out = {**text, "architectures": [arch], "language_model": True}
    out.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return out


def hybrid_fields(cfg: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """Layer types, the linear layers' shape, gated attention, (1 + w) norms, the shared
    expert and where the weights live."""
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every `full_attention_interval`-th is full
        interval = int(cfg.get("full_attention_interval") or 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {layers}")
    for t in types:
        if t not in (LINEAR, FULL):
            raise ValueError(f"unsupported layer_types value {t!r}; supported: {LINEAR}, {FULL}")
    shape = LinearAttnShape(
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        head_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        head_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))
    if shape.num_v_heads % shape.num_k_heads:
        raise ValueError(f"linear_num_value_heads {shape.num_v_heads} is not a multiple of "
                         f"linear_num_key_heads {shape.num_k_heads}")
    if shape.conv_kernel < 2:
        raise ValueError(f"unsupported linear_conv_kernel_dim {shape.conv_kernel}: must be >= 2")
    if cfg.get("attention_bias"):
        raise ValueError(f"attention_bias {cfg['attention_bias']} is not supported for {arch}")
    return dict(layer_types=tuple(str(t) for t in types), linear_attn=shape,
                attn_output_gate=True, offset_norms=True,
                language_model=bool(cfg.get("language_model", False)))


def hybrid_moe_fields(cfg: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """Routed experts with a gated shared expert (Qwen3-Next: `decoder_sparse_step` and
    `mlp_only_layers` as Qwen3-MoE; Qwen3.5-MoE: every layer); empty for Qwen3.5 dense."""
    if arch == QWEN3_5 or (arch == QWEN3_NEXT and not int(cfg.get("num_experts", 512))):
        return {}
    experts = int(cfg.get("num_experts") or 512)
    step = int(cfg.get("decoder_sparse_step") or 1) if arch == QWEN3_NEXT else 1
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []} if arch == QWEN3_NEXT else set()
    k = int(cfg.get("num_experts_per_tok", 10))
    if not 0 < k <= experts:
        raise ValueError(f"num_experts_per_tok {k} must be between 1 and the number of "
                         f"experts, {experts}")
    return dict(num_experts=experts, num_experts_per_tok=k,
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 512)),
                # Qwen3.5-MoE's router always renormalises (it has no such key).
                norm_topk_prob=arch == QWEN3_5_MOE or bool(cfg.get("norm_topk_prob", True)),
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
                shared_expert_intermediate_size=int(
                    cfg.get("shared_expert_intermediate_size", 512)))
