"""One decoder for Llama, Mistral, Qwen2 and Qwen3 checkpoints, driven by ModelArgs flags.

Differences between the families handled here:
  * Qwen2: bias on q/k/v (not o);
  * Qwen3: per-head RMSNorm on q and k before RoPE (optional bias on q/k/v/o);
  * Llama: optional bias on q/k/v/o (``attention_bias``) and on the MLP (``mlp_bias``);
  * Mistral / Qwen sliding-window layers: a window on the attention mask.

Weights are fused at load (q|k|v into one matrix, gate|up into one) so a layer runs three
matmuls for attention+MLP input projections instead of five. Numerics follow HF: RMSNorm in
float32 then cast, RoPE cos/sin computed in float32 then cast to the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attention import (
    AttentionMetadata,
    AttentionPlan,
    KVCache,
    paged_attention,
    prepare_attention,
)

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

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


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
        if act not in _ACTIVATIONS:
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


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, computed exactly as transformers does."""
    dim = args.head_dim
    base = args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if args.rope_type == "linear":
        inv_freq = inv_freq / args.rope_factor
    elif args.rope_type == "llama3":
        factor = args.rope_factor
        low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
        old_ctx = args.rope_original_max_position_embeddings or args.max_position_embeddings
        low_freq_wavelen = old_ctx / low
        high_freq_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF (normalise in fp32, cast, then scale) so half-precision outputs match.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D] (both halves). HF's rotate_half formulation."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def onednn_fp32_usable() -> bool:
    """Whether oneDNN's packed linear runs here at full fp32 accuracy.

    On CPU, MKL's sgemm is slow for the skinny decode matmuls on some hosts (measured on an AMD
    EPYC: vocab projection ~3x, layer projections ~1.2x slower than oneDNN with pre-packed
    weights). Checked numerically once so a reduced-precision math mode (bf16/tf32) or a
    broken build silently keeps the plain F.linear path.
    """
    global _ONEDNN_OK
    if _ONEDNN_OK is None:
        _ONEDNN_OK = False
        available = torch.backends.mkldnn.is_available()
        if available:
            try:
                g = torch.Generator().manual_seed(0)
                w = torch.randn(300, 64, generator=g)
                x = torch.randn(5, 64, generator=g)
                got = torch.ops.mkldnn._linear_pointwise(
                    x, torch.ops.mkldnn._reorder_linear_weight(w, 32), None, "none", [], ""
                )
                want = F.linear(x.double(), w.double())
                _ONEDNN_OK = bool(torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4))
            except (RuntimeError, AttributeError):
                pass
    return _ONEDNN_OK


_ONEDNN_OK: bool | None = None


def pack_linear(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of a [out, in] weight for CPU float32, else None (use F.linear)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn_fp32_usable():
        return None
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
    return packed


def onednn_rows(m: int) -> int:
    """How many rows a packed linear runs with when it is given ``m``: ``m`` rounded up to one
    of 8 sizes per octave (exact up to 16, then steps of 2 to 32, 4 to 64, ...).

    oneDNN builds (JIT-compiles) a primitive per input shape and keeps it in two caches (its
    own and ideep's, 1024 entries each), about half a MB per shape and weight. Prefill token
    counts and decode batch sizes take hundreds of values, so unpadded the gpu worker's RSS
    grew for as long as new row counts kept turning up, by hundreds of MB. Rounding bounds the
    shapes to ~8 per octave (72 up to 2048 rows) for at most 12.5% padded rows; batch sizes up
    to 16 and the powers of two run unpadded.
    """
    if m <= 16:
        return m
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """x [M, in] -> [M, out], through oneDNN with ``packed`` (see pack_linear), else F.linear."""
    if packed is not None:
        m = x.shape[0]
        rows = onednn_rows(m)
        if rows != m:  # zero rows, dropped again below (a view: no copy)
            x = F.pad(x, (0, 0, 0, rows - m))
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed, bias, "none", [], ""
        )
        return out[:m] if rows != m else out
    return F.linear(x, weight, bias)


def _param(shape: tuple[int, ...]) -> nn.Parameter:
    # Placeholders on the meta device: no memory until load_weights puts the real tensors in.
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.intermediate_size = args.intermediate_size
        self.eps = args.rms_norm_eps
        self.scale = args.head_dim**-0.5
        self.sliding_window = args.sliding_windows[layer_idx] if args.sliding_windows else None
        self.act = _ACTIVATIONS[args.hidden_act]
        h, d = args.hidden_size, args.head_dim
        qkv_out = (args.num_heads + 2 * args.num_kv_heads) * d
        self.input_norm = _param((h,))
        self.post_norm = _param((h,))
        self.qkv_weight = _param((qkv_out, h))
        self.qkv_bias = _param((qkv_out,)) if args.qkv_bias else None
        self.o_weight = _param((h, args.num_heads * d))
        self.o_bias = _param((h,)) if args.o_bias else None
        # q_norm / k_norm weights laid out per head so one norm covers q and k together.
        self.qk_norm_weight = (
            _param((args.num_heads + args.num_kv_heads, d)) if args.qk_norm else None
        )
        self.gate_up_weight = _param((2 * args.intermediate_size, h))
        self.gate_up_bias = _param((2 * args.intermediate_size,)) if args.mlp_bias else None
        self.down_weight = _param((h, args.intermediate_size))
        self.down_bias = _param((h,)) if args.mlp_bias else None
        # oneDNN-packed weights (CPU float32 only; see pack_linear), set after loading.
        self.packed: dict[str, torch.Tensor | None] = {}

    def pack(self) -> None:
        self.packed = {
            n: pack_linear(getattr(self, n))
            for n in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        }

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = rms_norm(x, self.input_norm, self.eps)
        pk = self.packed
        qkv = linear(h, self.qkv_weight, self.qkv_bias, pk.get("qkv_weight"))
        qkv = qkv.view(t, hq + 2 * hkv, d)
        qk = qkv[:, : hq + hkv]
        if self.qk_norm_weight is not None:
            qk = rms_norm(qk, self.qk_norm_weight, self.eps)
        qk = apply_rope(qk, cos, sin)
        attn = paged_attention(
            qk[:, :hq],
            qk[:, hq:],
            qkv[:, hq + hkv :],
            kv_cache,
            meta,
            self.scale,
            self.layer_idx,
            plan=plan,
            sliding_window=self.sliding_window,
        )
        x = x + linear(attn.reshape(t, hq * d), self.o_weight, self.o_bias, pk.get("o_weight"))
        h = rms_norm(x, self.post_norm, self.eps)
        gu = linear(h, self.gate_up_weight, self.gate_up_bias, pk.get("gate_up_weight"))
        i = self.intermediate_size
        act = self.act(gu[:, :i]) * gu[:, i:]
        return x + linear(act, self.down_weight, self.down_bias, pk.get("down_weight"))


class CausalLM(nn.Module):
    """Decoder-only LM over a paged KV cache. Build with gpu_worker.models.load_model."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.config = args
        self.embed_tokens = _param((args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = _param((args.hidden_size,))
        if args.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _param((args.vocab_size, args.hidden_size))
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self._packed_lm_head: torch.Tensor | None = None
        # False: SDPA even where flash_attn could serve the cache (--no-flash-attn).
        self.allow_flash = True
        # Distinct windows across layers: masks are built once per forward for each.
        self._windows: tuple[int | None, ...] = tuple(
            dict.fromkeys(args.sliding_windows or (None,))
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, head_dim] in the model dtype, once per forward for all layers."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> final-normed hidden states [T, hidden]."""
        plan = prepare_attention(meta, kv_caches[0], self._windows, self.allow_flash)
        cos, sin = self.rope_cos_sin(positions)
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            # .forward directly: nn.Module.__call__ hook handling is pure overhead per layer.
            x = layer.forward(x, cos, sin, kv_cache, meta, plan)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (matmul in the model dtype, like HF)."""
        return linear(hidden, self.lm_head, None, self._packed_lm_head).float()

    # ---- weights -------------------------------------------------------------------------

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """HF checkpoint tensor names this model needs, with their shapes."""
        a = self.config
        h, d, i = a.hidden_size, a.head_dim, a.intermediate_size
        out: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (a.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not a.tie_word_embeddings:
            out["lm_head.weight"] = (a.vocab_size, h)
        for n in range(a.num_layers):
            p = f"model.layers.{n}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
            for name, rows in (("q", a.num_heads), ("k", a.num_kv_heads), ("v", a.num_kv_heads)):
                out[p + f"self_attn.{name}_proj.weight"] = (rows * d, h)
                if a.qkv_bias:
                    out[p + f"self_attn.{name}_proj.bias"] = (rows * d,)
            out[p + "self_attn.o_proj.weight"] = (h, a.num_heads * d)
            if a.o_bias:
                out[p + "self_attn.o_proj.bias"] = (h,)
            if a.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (d,)
                out[p + "self_attn.k_norm.weight"] = (d,)
            for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
                out[p + f"mlp.{name}_proj.weight"] = shape
                if a.mlp_bias:
                    out[p + f"mlp.{name}_proj.bias"] = (shape[0],)
        return out

    def load_weights(self, get: Callable[[str], torch.Tensor]) -> None:
        """Fill every parameter from ``get(hf_name)`` (already in the target dtype/device).

        Fused tensors are concatenated on the target device; the parts are dropped right away.
        """
        a = self.config
        self.embed_tokens = nn.Parameter(get("model.embed_tokens.weight"), requires_grad=False)
        self.norm = nn.Parameter(get("model.norm.weight"), requires_grad=False)
        if a.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(get("lm_head.weight"), requires_grad=False)
        for n, layer in enumerate(self.layers):
            p = f"model.layers.{n}."

            def cat(names: list[str], prefix: str = p) -> nn.Parameter:
                parts = [get(prefix + x) for x in names]
                t = parts[0] if len(parts) == 1 else torch.cat(parts)
                return nn.Parameter(t, requires_grad=False)

            layer.input_norm = cat(["input_layernorm.weight"])
            layer.post_norm = cat(["post_attention_layernorm.weight"])
            qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
            layer.qkv_weight = cat([x + ".weight" for x in qkv])
            if a.qkv_bias:
                layer.qkv_bias = cat([x + ".bias" for x in qkv])
            layer.o_weight = cat(["self_attn.o_proj.weight"])
            if a.o_bias:
                layer.o_bias = cat(["self_attn.o_proj.bias"])
            if a.qk_norm:
                qn = get(p + "self_attn.q_norm.weight")
                kn = get(p + "self_attn.k_norm.weight")
                layer.qk_norm_weight = nn.Parameter(
                    torch.cat([qn.expand(a.num_heads, -1), kn.expand(a.num_kv_heads, -1)]),
                    requires_grad=False,
                )
            layer.gate_up_weight = cat(["mlp.gate_proj.weight", "mlp.up_proj.weight"])
            layer.down_weight = cat(["mlp.down_proj.weight"])
            if a.mlp_bias:
                layer.gate_up_bias = cat(["mlp.gate_proj.bias", "mlp.up_proj.bias"])
                layer.down_bias = cat(["mlp.down_proj.bias"])
        self.inv_freq = rope_inv_freq(a).to(self.embed_tokens.device)
        left = [n for n, t in self.named_parameters() if t.is_meta]
        if left:
            raise ValueError(f"weights not loaded: {', '.join(left)}")

    def pack_weights(self) -> None:
        """oneDNN-packed copies of the linear weights (CPU float32; else a no-op).

        Packed copies double these weights' CPU memory; CPU serving is for small models.
        """
        self._packed_lm_head = pack_linear(self.lm_head)
        for layer in self.layers:
            cast(DecoderLayer, layer).pack()
