"""`HybridLM`: the decoder with Gated DeltaNet layers between gated full-attention layers.

Only the attention layers have a KV cache (`kv_caches` lists theirs, in layer order); the
linear layers keep a recurrent state per request in the `StateCache` the runner sets on the
model (`states`), whose slots each forward's metadata names (`AttentionMetadata.states`).
A forward's rows are laid out as for any model (decode rows, then prefill pieces), so decode
steps, mixed steps and a separate prefill forward all take the same path; the linear layers
advance the state of every row in place, masked decode rows writing only the scratch slot.
Qwen3.5's images come in as embeddings at their placeholders, rotated by M-RoPE's [3, T]
positions, as in any VL model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem_serve.gpu_worker.attention.base import AttentionMetadata
from tandem_serve.gpu_worker.attention.kv_cache import KVCache
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.decoder import CausalLM, DecoderLayer
from tandem_serve.gpu_worker.models.hybrid.layers import GatedAttentionLayer, LinearAttentionLayer
from tandem_serve.gpu_worker.models.hybrid.state_cache import StateCache

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.lora import LoraContext


class HybridLM(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleList(
            LinearAttentionLayer(args, n) if args.is_linear(n) else GatedAttentionLayer(args, n)
            for n in range(args.num_layers))
        self.states: StateCache | None = None  # the runner's, once allocated

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
        """As `CausalLM.forward`; `mm`'s values hold the image embeddings alone (Qwen3.5's
        tower has no DeepStack)."""
        states = self.states
        if states is None:
            raise ValueError("a hybrid model runs with its state cache (HybridLM.states)")
        attention = self.attention
        plan = attention.prepare(meta, kv_caches[0], self._windows)
        rows = states.rows(meta)
        cos_sin = self.ropes[0].cos_sin(positions, self.dtype, history_lens)
        if mm is not None and mm[1].shape[0] != 1:
            raise ValueError("a hybrid model takes image embeddings, no DeepStack levels")
        x = self.embed_inputs(input_ids, mm)
        caches = iter(kv_caches)
        linear = 0
        for module in self.layers:
            if isinstance(module, LinearAttentionLayer):
                x = module.forward_linear(x, rows, states, linear, lora)
                linear += 1
            else:
                layer: DecoderLayer = module  # type: ignore[assignment]
                x = layer.forward(x, cos_sin, next(caches), attention, plan, lora)
        return self.norm_fn(x, self.norm, self.config.rms_norm_eps)
