"""One decoder for Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 3 and Phi-3 checkpoints,
driven by ModelArgs flags.

Differences between the families handled here:
  * Qwen2: bias on q/k/v (not o);
  * Qwen3, Qwen3-MoE, Gemma 3: per-head RMSNorm on q and k before RoPE;
  * Llama: optional bias on q/k/v/o (``attention_bias``) and on the MLP (``mlp_bias``);
  * Mistral / Mixtral / Phi-3 / Qwen / Gemma 3 sliding-window layers: a window on the mask;
  * Qwen3-MoE / Mixtral: a sparse mixture of experts instead of the MLP (`moe`);
  * Gemma 3: (1 + w) norms, also after attention and around the MLP, embeddings scaled by
    sqrt(hidden), its own attention scale, a second RoPE for the sliding layers, capped logits;
  * Phi-3: partial rotary and LongRoPE (`rope`); its fused checkpoint tensors (`layout`).

Weights are fused at load (q|k|v into one matrix, gate|up into one; `fill`) so a layer runs
three matmuls for attention+MLP input projections instead of five. Numerics follow HF:
RMSNorm in float32 then cast, RoPE cos/sin computed in float32 then cast to the model dtype.
On CUDA the row-wise work between the matmuls (norms with their residual add, RoPE, the
MLP's activation) runs as fused Triton kernels with the same rounding (`fused`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem_serve.gpu_worker.attention.base import AttentionBackend, AttentionMetadata, WarmUp
from tandem_serve.gpu_worker.attention.kv_cache import KVCache
from tandem_serve.gpu_worker.attention.sdpa import SdpaBackend
from tandem_serve.gpu_worker.models import layout
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.fused import (
    act_mul,
    add_rms_norm,
    gemma_rms_norm,
    rms_norm,
    rope,
)
from tandem_serve.gpu_worker.models.layers import ACTIVATIONS, linear, pack_linear
from tandem_serve.gpu_worker.models.moe import experts_forward, route
from tandem_serve.gpu_worker.models.quant.linear import QuantLinear
from tandem_serve.gpu_worker.models.rope import CosSin, model_ropes

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.lora import LoraContext


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _param(shape: tuple[int, ...]) -> nn.Parameter:
    # Placeholders on the meta device: no memory until load_weights puts the real tensors in.
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.args = args
        self.layer_idx = layer_idx
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.intermediate_size = args.intermediate_size
        self.eps = args.rms_norm_eps
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self.sliding_window = args.sliding_windows[layer_idx] if args.sliding_windows else None
        self.act = ACTIVATIONS[args.hidden_act]
        self.norm: Norm = gemma_rms_norm if args.one_plus_norms else rms_norm
        self.rope_index = 0  # which of the model's ropes (Gemma 3: 1 = the sliding layers')
        h, d = args.hidden_size, args.head_dim
        qkv_out = (args.num_heads + 2 * args.num_kv_heads) * d
        self.input_norm = _param((h,))
        self.post_norm = _param((h,))  # post_attention_layernorm
        # Gemma: the MLP's own norms (post_norm then norms the attention output).
        self.pre_ff_norm = _param((h,)) if args.gemma_norms else None
        self.post_ff_norm = _param((h,)) if args.gemma_norms else None
        self.qkv_weight = _param((qkv_out, h))
        self.qkv_bias = _param((qkv_out,)) if args.qkv_bias else None
        self.o_weight = _param((h, args.num_heads * d))
        self.o_bias = _param((h,)) if args.o_bias else None
        # q_norm / k_norm weights laid out per head so one norm covers q and k together.
        self.qk_norm_weight = (
            _param((args.num_heads + args.num_kv_heads, d)) if args.qk_norm else None
        )
        self.moe = args.is_moe(layer_idx)
        if self.moe:
            e, i = args.num_experts, args.moe_intermediate_size
            self.router = _param((e, h))
            self.experts_gate_up = _param((e, 2 * i, h))
            self.experts_down = _param((e, h, i))
            self.grouped = True  # set at load: whether torch's grouped matmul serves them
            # Qwen3-Next / Qwen3.5-MoE: a shared expert beside the routed ones, its output
            # weighed by sigmoid(shared_gate . h).
            si = args.shared_expert_intermediate_size
            self.shared_gate_up = _param((2 * si, h)) if si else None
            self.shared_down = _param((h, si)) if si else None
            self.shared_gate = _param((1, h)) if si else None
        else:
            self.gate_up_weight = _param((2 * args.intermediate_size, h))
            self.gate_up_bias = _param((2 * args.intermediate_size,)) if args.mlp_bias else None
            self.down_weight = _param((h, args.intermediate_size))
            self.down_bias = _param((h,)) if args.mlp_bias else None
        # oneDNN-packed weights (CPU float32 only; see pack_linear), set after loading.
        self.packed: dict[str, torch.Tensor | None] = {}
        # Quantized checkpoints: the linears kept quantized, by weight name (`models.quant`).
        self.quant: dict[str, QuantLinear] = {}
        # Whether LoRA's o_proj applies to `o_weight` (a linear-attention layer's is its
        # output projection, which no adapter targets).
        self.adapts_o = True
        # Tensor parallelism (gpu_worker.parallel): sums the row-parallel o/down partial
        # outputs over the ranks; the identity on one rank.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _same

    def pack(self) -> None:
        names = ["qkv_weight", "o_weight"] + ([] if self.moe else ["gate_up_weight",
                                                                  "down_weight"])
        self.packed = {n: pack_linear(getattr(self, n)) for n in names if n not in self.quant}

    def _linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q = self.quant.get(name)
        if q is not None:
            return q.forward(x, bias)
        return linear(x, getattr(self, name), bias, self.packed.get(name))

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: CosSin,
        kv_cache: KVCache,
        attention: AttentionBackend,
        plan: Any,
        lora: LoraContext | None = None,
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(self.norm(x, self.input_norm, self.eps), cos_sin, lora)
        attn = self.attend(q, k, v, kv_cache, attention, plan)
        return self.after_attention(x, attn.reshape(x.shape[0], -1), lora)

    # A layer in three parts: what runs before attention, attention itself, and the rest.
    # Piecewise CUDA graphs (`gpu_worker.graphs.piecewise`) capture the first and last, and run
    # attention between them eagerly.

    def project_qkv(self, h: torch.Tensor, cos_sin: CosSin, lora: LoraContext | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed input h [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D], RoPE'd."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._linear("qkv_weight", h, self.qkv_bias)
        if lora is not None:  # each row's own adapter delta (see gpu_worker.lora)
            qkv = lora.add(self.layer_idx, "qkv", h, qkv)
        qkv = qkv.view(t, hq + 2 * hkv, d)
        qk = qkv[:, : hq + hkv]
        if self.qk_norm_weight is not None:
            qk = self.norm(qk, self.qk_norm_weight, self.eps)
        qk = rope(qk, *cos_sin)  # on CUDA in place, in qkv
        return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               attention: AttentionBackend, plan: Any) -> torch.Tensor:
        """k/v into the layer's cache, then attention (`plan`: the backend's, per forward)."""
        return attention.forward(q, k, v, kv_cache, plan, self.scale, self.sliding_window)

    def after_attention(self, x: torch.Tensor, a: torch.Tensor,
                        lora: LoraContext | None) -> torch.Tensor:
        """The residual x and attention's output a [T, Hq * D] -> the layer's output."""
        o = self._linear("o_weight", a, self.o_bias)
        # Row-parallel under TP: each rank's delta is a partial sum, like its o itself.
        a = self.reduce(o if lora is None or not self.adapts_o
                        else lora.add(self.layer_idx, "o", a, o))
        if self.pre_ff_norm is not None:  # Gemma: norm the attention output, then the input
            h, x = add_rms_norm(x, a, self.pre_ff_norm, self.eps, True, self.post_norm)
        else:
            h, x = add_rms_norm(x, a, self.post_norm, self.eps, self.args.one_plus_norms)
        m = self._experts(h) if self.moe else self._mlp(h, lora)
        if self.post_ff_norm is not None:
            m = self.norm(m, self.post_ff_norm, self.eps)
        return x + m

    def _mlp(self, h: torch.Tensor, lora: LoraContext | None) -> torch.Tensor:
        n = self.layer_idx
        gu = self._linear("gate_up_weight", h, self.gate_up_bias)
        if lora is not None:
            gu = lora.add(n, "gate_up", h, gu)
        act = act_mul(gu, self.args.hidden_act, self.intermediate_size)
        down = self._linear("down_weight", act, self.down_bias)
        return self.reduce(down if lora is None else lora.add(n, "down", act, down))

    def _experts(self, h: torch.Tensor) -> torch.Tensor:
        experts, weights = route(h, self.router, self.args)
        out = experts_forward(h, experts, weights, self.experts_gate_up, self.experts_down,
                              self.act, self.grouped)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_gate is not None
            gu = linear(h, self.shared_gate_up, None, None)
            act = act_mul(gu, self.args.hidden_act, self.args.shared_expert_intermediate_size)
            shared = linear(act, self.shared_down, None, None)
            out = out + torch.sigmoid(linear(h, self.shared_gate, None, None)) * shared
        return self.reduce(out)


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
        self.ropes, rope_of_layer = model_ropes(args)
        for layer, index in zip(self.layers, rope_of_layer, strict=True):
            cast(DecoderLayer, layer).rope_index = index
        self.norm_fn: Norm = gemma_rms_norm if args.one_plus_norms else rms_norm
        # Gemma: embeddings times sqrt(hidden), in the model dtype (set at load).
        self.embed_scale: torch.Tensor | None = None
        self._packed_lm_head: torch.Tensor | None = None
        # How every layer attends (`gpu_worker.attention`): the SDPA backend until the
        # runner sets the one it chose at start-up (`registry.select_backend`).
        self.attention: AttentionBackend = SdpaBackend()
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

    @property
    def uses_history_lens(self) -> bool:
        """Whether a prefill forward needs each token's request's history length (LongRoPE
        picks its frequencies by it; see `gpu_worker.models.rope`)."""
        return self.ropes[0].long_inv_freq is not None

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, rotary_dim] of the first RoPE, in the model dtype."""
        return self.ropes[0].cos_sin(positions, self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        lora: LoraContext | None = None,
        history_lens: torch.Tensor | None = None,
        mm: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> final-normed hidden states [T, hidden].

        `lora`: the rows' adapters (None: the base model for every row). `history_lens`
        [T]: a prefill token's request's history length (see `uses_history_lens`). `mm`:
        (rows, values [1 + D, rows, hidden]): values[0] replaces those rows' token
        embeddings (a VL model's images, unscaled, as transformers scatters them) and
        values[1 + i] is added to their residual stream after layer i (Qwen3-VL's
        DeepStack); positions may then be M-RoPE's [3, T]."""
        attention = self.attention
        plan = attention.prepare(meta, kv_caches[0], self._windows)
        cos_sin = [r.cos_sin(positions, self.dtype, history_lens) for r in self.ropes]
        x = self.embed_inputs(input_ids, mm)
        deepstack = mm[1].shape[0] - 1 if mm is not None else 0
        for i, (module, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            layer = cast(DecoderLayer, module)
            # .forward directly: nn.Module.__call__ hook handling is pure overhead per layer.
            x = layer.forward(x, cos_sin[layer.rope_index], kv_cache, attention, plan, lora)
            if i < deepstack:
                assert mm is not None
                x = x.index_add(0, mm[0], mm[1][1 + i].to(x.dtype))
        return self.norm_fn(x, self.norm, self.config.rms_norm_eps)

    def embed_inputs(self, input_ids: torch.Tensor,
                     mm: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The rows' token embeddings (Gemma's scaled), a VL model's image embeddings in
        place of its placeholders' (`forward`'s `mm`)."""
        x = self.embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if mm is not None:
            x = x.index_copy(0, mm[0], mm[1][0].to(x.dtype))
        return x

    def attention_warm_up(self, kv_cache: KVCache) -> WarmUp:
        """What an attention backend's start-up check runs over: a layer's cache (read,
        never written) and this model's query heads, windows, scale and dtype."""
        layer = cast(DecoderLayer, self.layers[0])
        return WarmUp(kv_cache, layer.num_heads, self._windows, layer.scale, self.dtype)

    def _embed_whole(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (matmul in the model dtype, like HF;
        Gemma's cap, tanh(logits / cap) * cap, too)."""
        logits = self.gather_logits(linear(hidden, self.lm_head, None, self._packed_lm_head))
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """HF checkpoint tensor names this model needs, with their shapes (`layout`)."""
        return layout.expected_weights(self.config)

    def pack_weights(self) -> None:
        """oneDNN-packed copies of the linear weights (CPU float32; else a no-op).

        Packed copies double these weights' CPU memory; CPU serving is for small models.
        """
        self._packed_lm_head = pack_linear(self.lm_head)
        for layer in self.layers:
            cast(DecoderLayer, layer).pack()

    def unpack_weights(self) -> None:
        """Drop the packed copies (`pack_weights` makes them again from the weights)."""
        self._packed_lm_head = None
        for layer in self.layers:
            cast(DecoderLayer, layer).packed = {}
