"""ModelArgs: the decoder's shape and family flags, parsed from a HF config.json.

Kept apart from the layers so loading can size the KV cache (and reject an unsupported
checkpoint) from the config alone, before any weights or modules exist. Family specifics
are in `config_families`, RoPE in `config_rope`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem_serve.gpu_worker.models.config_families import (
    GEMMA3,
    MIXTRAL,
    PHI3,
    QWEN3_MOE,
    bias_fields,
    gemma3_fields,
    moe_fields,
    sliding_windows,
)
from tandem_serve.gpu_worker.models.config_rope import SUPPORTED_ROPE_TYPES, rope_fields
from tandem_serve.gpu_worker.models.hybrid.config import (
    HYBRID_ARCHITECTURES,
    LINEAR,
    MODEL_TYPES,
    LinearAttnShape,
    hybrid_fields,
    hybrid_moe_fields,
    text_config,
)
from tandem_serve.gpu_worker.models.quant.config import QuantConfig
from tandem_serve.gpu_worker.models.quant.config import parse as parse_quant
from tandem_serve.proto.vision import VisionSpec, split_config

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelArgs"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    QWEN3_MOE,
    MIXTRAL,
    GEMMA3,
    PHI3,
    *HYBRID_ARCHITECTURES,
)
_MODEL_TYPE_TO_ARCH = {
    **MODEL_TYPES,
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": QWEN3_MOE,
    "mixtral": MIXTRAL,
    "gemma3_text": GEMMA3,
    "phi3": PHI3,
}

# hidden_act values the decoder implements (gpu_worker.models.layers.ACTIVATIONS).
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "swish", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (an MoE model's experts: moe_intermediate_size)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int | None = None
    rotary_dim: int = 0  # partial rotary: RoPE on the first rotary_dim dims (0: all of them)
    # LongRoPE (Phi-3): per-frequency divisors and the cos/sin scale.
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # Per layer: None = full attention, else the sliding window (keys with q - k < window).
    sliding_windows: tuple[int | None, ...] = ()
    attn_scale: float | None = None  # None: head_dim ** -0.5
    # Gemma: (1 + w) norms in float32, norms after attention and around the MLP, embeddings
    # scaled by sqrt(hidden).
    gemma_norms: bool = False
    final_logit_softcapping: float | None = None
    # Mixture of experts (num_experts 0: dense). moe_layers: per layer, experts or a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    router_weights_fp32: bool = False  # Mixtral weighs expert outputs in float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # How the linear weights are stored (None: plain floats); see `models.quant.config`.
    quant: QuantConfig | None = None
    # Vision-language checkpoints (`gpu_worker.vision`): M-RoPE's frequencies per position
    # axis (temporal, height, width; empty: plain RoPE) and the image placeholder token.
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    image_token_id: int = -1
    deepstack_layers: int = 0  # Qwen3-VL: layers whose output adds the tower's features
    # Hybrid linear-attention models (`models.hybrid`): per layer "linear_attention" (Gated
    # DeltaNet, a recurrent state per request) or "full_attention" (empty: every layer
    # attends), the linear layers' shape, a sigmoid gate on attention's output (q_proj's
    # second half per head), (1 + w) norms without Gemma's other traits, a gated shared
    # expert beside the routed ones, and weights under model.language_model.* (the
    # published multimodal folders).
    layer_types: tuple[str, ...] = ()
    linear_attn: LinearAttnShape | None = None
    attn_output_gate: bool = False
    offset_norms: bool = False
    shared_expert_intermediate_size: int = 0
    language_model: bool = False

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def is_linear(self, layer: int) -> bool:
        """A Gated DeltaNet layer (no KV cache; a recurrent state per request)."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR

    @property
    def is_hybrid(self) -> bool:
        return self.linear_attn is not None

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache: all but the linear-attention ones."""
        return sum(1 for n in range(self.num_layers) if not self.is_linear(n))

    @property
    def one_plus_norms(self) -> bool:
        """RMSNorms scale by (1 + w) in float32 (Gemma, Qwen3-Next, Qwen3.5)."""
        return self.gemma_norms or self.offset_norms

    @classmethod
    def from_hf_config(
        cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelArgs:
        """Build from a parsed config.json (and generation_config.json, whose eos/bos win,
        as they do for HF generate). Raises ValueError on anything unsupported."""
        # A multimodal folder: its language model's config (Qwen3.5's, `models.hybrid`), and
        # a VL checkpoint's vision spec (`proto.vision`).
        cfg, vision = split_config(cfg)
        cfg = text_config(cfg)
        arch = _architecture(cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} not a multiple of kv heads {kv_heads}")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}")
        family: dict[str, Any] = {**bias_fields(cfg, arch), **moe_fields(cfg, arch, layers)}
        if arch == GEMMA3:
            family.update(gemma3_fields(cfg))
        if arch in HYBRID_ARCHITECTURES:
            family.update(hybrid_fields(cfg, arch, layers))
            family.update(hybrid_moe_fields(cfg, arch, layers))
        gen = generation_config or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (
            () if eos is None else (int(eos),)
        )
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        quant = _quant(cfg, arch, family)
        rope = rope_fields(cfg, arch, head_dim, max_pos)
        if vision is not None:
            _check_mrope(vision, rope["rotary_dim"])
            family.update(mrope_section=vision.mrope_section,
                          mrope_interleaved=vision.mrope_interleaved,
                          image_token_id=vision.image_token_id,
                          deepstack_layers=vision.deepstack)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            **rope,
            qk_norm=arch in ("Qwen3ForCausalLM", QWEN3_MOE, GEMMA3, *HYBRID_ARCHITECTURES),
            # Gemma 3 ties its head unless told otherwise (its config class default).
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == GEMMA3)),
            hidden_act=act,
            sliding_windows=sliding_windows(cfg, arch, layers),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            quant=quant,
            **family,
        )


def _quant(cfg: dict[str, Any], arch: str, family: dict[str, Any]) -> QuantConfig | None:
    quant = parse_quant(cfg)
    # Stacked experts and Phi-3's fused checkpoint tensors have no quantized form here yet.
    if quant is not None and (family.get("num_experts") or arch == PHI3
                              or family.get("linear_attn")):
        raise ValueError(f"quantized {arch} checkpoints are not supported (quantization_config "
                         f"{quant.kind}): quantized mixture-of-experts, fused Phi-3 "
                         "projections and linear-attention layers are not implemented")
    return quant


def _check_mrope(vision: VisionSpec, rotary_dim: int) -> None:
    """M-RoPE's sections in order name an axis for each rotary frequency; interleaved (Qwen3-VL,
    Qwen3.5), every frequency past the sections' reach is the temporal axis', as in
    transformers, so any sizes do."""
    section = vision.mrope_section
    if section and not vision.mrope_interleaved and sum(section) * 2 != rotary_dim:
        raise ValueError(f"mrope_section {list(section)} must sum to the rotary dimension / 2 "
                         f"= {rotary_dim // 2}")


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return str(a)
    if not archs and cfg.get("model_type") in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[cfg["model_type"]]
    name = ", ".join(archs) if archs else f"model_type={cfg.get('model_type')!r}"
    raise ValueError(
        f"unsupported architecture {name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
