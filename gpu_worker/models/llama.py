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

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem_serve.gpu_worker.attention import (
    AttentionMetadata,
    AttentionPlan,
    KVCache,
    paged_attention,
    prepare_attention,
)
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.layers import (
    ACTIVATIONS,
    apply_rope,
    linear,
    pack_linear,
    rms_norm,
    rope_inv_freq,
)

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.lora import LoraContext


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


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
        self.act = ACTIVATIONS[args.hidden_act]
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
        # Tensor parallelism (gpu_worker.parallel): sums the row-parallel o/down partial
        # outputs over the ranks; the identity on one rank.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _same

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
        lora: LoraContext | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = rms_norm(x, self.input_norm, self.eps)
        pk = self.packed
        n = self.layer_idx
        qkv = linear(h, self.qkv_weight, self.qkv_bias, pk.get("qkv_weight"))
        if lora is not None:  # each row's own adapter delta (see gpu_worker.lora)
            qkv = lora.add(n, "qkv", h, qkv)
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
        a = attn.reshape(t, hq * d)
        o = linear(a, self.o_weight, self.o_bias, pk.get("o_weight"))
        # Row-parallel under TP: each rank's delta is a partial sum, like its o itself.
        x = x + self.reduce(o if lora is None else lora.add(n, "o", a, o))
        h = rms_norm(x, self.post_norm, self.eps)
        gu = linear(h, self.gate_up_weight, self.gate_up_bias, pk.get("gate_up_weight"))
        if lora is not None:
            gu = lora.add(n, "gate_up", h, gu)
        i = self.intermediate_size
        act = self.act(gu[:, :i]) * gu[:, i:]
        down = linear(act, self.down_weight, self.down_bias, pk.get("down_weight"))
        return x + self.reduce(down if lora is None else lora.add(n, "down", act, down))


class CausalLM(nn.Module):
    """Decoder-only LM over a paged KV cache. Build with gpu_worker.models.loader.load_model."""

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
        # Tensor parallelism (gpu_worker.parallel) replaces these: the vocab-parallel
        # embedding lookup (ids -> hidden) and the gather of vocab-sharded logits.
        self.embed: Callable[[torch.Tensor], torch.Tensor] = self._embed_whole
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] = _same

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
        lora: LoraContext | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> final-normed hidden states [T, hidden].

        `lora`: the rows' adapters (None: the base model for every row)."""
        plan = prepare_attention(meta, kv_caches[0], self._windows, self.allow_flash)
        cos, sin = self.rope_cos_sin(positions)
        x = self.embed(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            # .forward directly: nn.Module.__call__ hook handling is pure overhead per layer.
            x = layer.forward(x, cos, sin, kv_cache, meta, plan, lora)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def _embed_whole(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (matmul in the model dtype, like HF)."""
        return self.gather_logits(linear(hidden, self.lm_head, None, self._packed_lm_head)).float()

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
