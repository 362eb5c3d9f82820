"""ModelArgs: the decoder's shape and family flags, parsed from a HF config.json.

Kept apart from the layers so loading can size the KV cache (and reject an unsupported
checkpoint) from the config alone, before any weights or modules exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

# hidden_act values the decoder implements (gpu_worker.models.layers.ACTIVATIONS).
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "swish", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
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
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # Per layer: None = full attention, else the sliding window (keys with q - k < window).
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(
        cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelArgs:
        """Build from a parsed config.json (and generation_config.json, whose eos/bos win,
        as they do for HF generate). Raises ValueError on anything unsupported."""
        arch = _architecture(cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} not a multiple of kv heads {kv_heads}")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))

        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files use
        # `rope_scaling` (`type` or `rope_type`) plus a top-level `rope_theta`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if prf not in (None, 1, 1.0):
            raise ValueError(f"unsupported partial_rotary_factor {prf}")

        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}")

        attention_bias = bool(cfg.get("attention_bias", False))
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "MistralForCausalLM":
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = attention_bias

        gen = generation_config or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (
            () if eos is None else (int(eos),)
        )
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
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
            rope_theta=theta,
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            # A top-level value wins over the rope dict's, as in transformers.
            rope_original_max_position_embeddings=int(
                cfg.get("original_max_position_embeddings")
                or rope.get("original_max_position_embeddings")
                or max_pos
            ),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=act,
            sliding_windows=_sliding_windows(cfg, arch, layers),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
        )


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


def _sliding_windows(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (int(window) if window else None,) * layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
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
