"""A hybrid model's two kinds of layer, each the shared `DecoderLayer` with its token mixer
replaced (the MLP or experts after it are the decoder's own):

* `LinearAttentionLayer`, Gated DeltaNet: one fused input projection (q | k | v | z | b | a,
  Qwen3-Next's per-key-head interleaving undone at load), a causal depthwise convolution with
  SiLU over q | k | v, the gated delta rule (`delta_rule`) from the request's state slot, an
  RMSNorm gated by SiLU(z), and the output projection (the layer's `o_weight`);
* `GatedAttentionLayer`: attention over the paged cache whose output is multiplied by
  sigmoid(gate) before o_proj, the gate being q_proj's second half per head (kept after
  q | k | v in the fused projection).

Numerics follow transformers: the delta rule and the gated norm in float32, the
convolution's output cast back to the model dtype.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.attention.base import AttentionBackend
from tandem_serve.gpu_worker.attention.kv_cache import KVCache
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.decoder import DecoderLayer
from tandem_serve.gpu_worker.models.fused import rope
from tandem_serve.gpu_worker.models.hybrid import delta_rule
from tandem_serve.gpu_worker.models.hybrid.state_cache import (
    Segments,
    StateCache,
    StateRowsPlan,
)
from tandem_serve.gpu_worker.models.rope import CosSin

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.lora import LoraContext


def _param(shape: tuple[int, ...]) -> torch.nn.Parameter:
    # A placeholder on the meta device until the weights are loaded (`models.fill`).
    return torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class GatedAttentionLayer(DecoderLayer):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        h, d = args.hidden_size, args.head_dim
        self.qkv_width = (args.num_heads + 2 * args.num_kv_heads) * d
        self.qkv_weight = _param((self.qkv_width + args.num_heads * d, h))

    def forward(self, x: torch.Tensor, cos_sin: CosSin, kv_cache: KVCache,
                attention: AttentionBackend, plan: Any,
                lora: LoraContext | None = None) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = self.norm(x, self.input_norm, self.eps)
        qkvg = self._linear("qkv_weight", h, None)
        if lora is not None:  # q | k | v | gate, as `LoraWeights.hybrid` lays the deltas out
            qkvg = lora.add(self.layer_idx, "qkv", h, qkvg)
        gate = qkvg[:, self.qkv_width:]
        qkv = qkvg[:, : self.qkv_width].reshape(t, hq + 2 * hkv, d)
        assert self.qk_norm_weight is not None
        qk = rope(self.norm(qkv[:, : hq + hkv], self.qk_norm_weight, self.eps), *cos_sin)
        attn = self.attend(qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:], kv_cache, attention, plan)
        return self.after_attention(x, attn.reshape(t, -1) * torch.sigmoid(gate), lora)


class LinearAttentionLayer(DecoderLayer):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        s = args.linear_attn
        assert s is not None
        self.shape = s
        h = args.hidden_size
        # q | k | v (the convolution's channels), z, b, a.
        self.qkv_weight = _param((s.conv_dim + s.value_dim + 2 * s.num_v_heads, h))
        self.o_weight = _param((h, s.value_dim))  # out_proj
        self.qk_norm_weight = None
        self.adapts_o = False
        self.conv_weight = _param((s.conv_dim, s.conv_kernel))
        self.dt_bias = _param((s.num_v_heads,))
        self.a_log = _param((s.num_v_heads,))
        self.gated_norm = _param((s.head_v_dim,))

    def forward_linear(self, x: torch.Tensor, rows: StateRowsPlan, states: StateCache,
                       index: int, lora: LoraContext | None = None) -> torch.Tensor:
        """x [T, hidden] (decode rows, then prefill pieces) -> the layer's output; reads and
        advances the rows' state slots (this layer's are `index`-th in `states`)."""
        s, t = self.shape, x.shape[0]
        conv, recurrent = states.conv[index], states.recurrent[index]
        proj = self._linear("qkv_weight", self.norm(x, self.input_norm, self.eps), None)
        c, vd, hv = s.conv_dim, s.value_dim, s.num_v_heads
        mixed, z = proj[:, :c], proj[:, c:c + vd]
        b, a = proj[:, c + vd:c + vd + hv], proj[:, c + vd + hv:]
        beta = b.sigmoid()
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(t, hv, s.head_v_dim, dtype=torch.float32, device=x.device)
        # Pieces first: a row joining the decode rows in this forward reads the state its
        # last piece leaves.
        for piece in rows.pieces:
            c_state, r_state = self._initial(piece, states, index)
            for first, end, block in piece.parts():
                part = slice(first, end)
                mixed_conv, c_state = delta_rule.conv_sequence(mixed[part], c_state,
                                                               self.conv_weight)
                q, k, v = self._split(mixed_conv)
                core[part], r_state = delta_rule.chunked(q, k, v, g[part], beta[part], r_state)
                if block >= 0:
                    states.ckpt_conv[index][block] = c_state
                    states.ckpt_recurrent[index][block] = r_state
            assert c_state is not None and r_state is not None
            conv[piece.slot], recurrent[piece.slot] = c_state, r_state
        n = rows.num_decode
        if n and rows.verify is not None:
            assert rows.decode_slots is not None
            states.pending[index] = self._verify(mixed, g, beta, core, rows.decode_slots,
                                                 rows.verify, conv, recurrent)
        elif n:
            slots = rows.decode_slots
            assert slots is not None
            mixed_conv, conv_new = delta_rule.conv_step(mixed[:n], conv.index_select(0, slots),
                                                        self.conv_weight)
            conv.index_copy_(0, slots, conv_new)
            q, k, v = self._split(mixed_conv)
            core[:n] = delta_rule.recurrent_update(q, k, v, g[:n], beta[:n], recurrent, slots)
            if rows.decode_checkpoints is not None:
                states.ckpt_conv[index].index_copy_(0, rows.decode_checkpoints, conv_new)
                states.ckpt_recurrent[index].index_copy_(0, rows.decode_checkpoints,
                                                         recurrent.index_select(0, slots))
        out = self._gated_norm(core.to(x.dtype), z.reshape(t, hv, s.head_v_dim))
        return self.after_attention(x, out.reshape(t, vd), lora)

    @staticmethod
    def _initial(piece: Segments, states: StateCache, index: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A piece's starting states: none (zeros) or its slot's (the previous piece's, or a
        cached prefix's checkpoint restored there)."""
        if piece.fresh:
            return None, None
        return states.conv[index][piece.slot], states.recurrent[index][piece.slot]

    def _verify(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                core: torch.Tensor, slots: torch.Tensor, verify: tuple[torch.Tensor, int],
                conv: torch.Tensor, recurrent: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A verify step: each of the B rows' first token, then the speculating rows' k
        drafts, one position at a time from the rows' slots. Nothing is written to the slots:
        the states after every position are returned ([B, 2 + k, ...], position 0 the state
        before the step) for the step to keep each row's accepted run (`StateCache.commit`).
        A row that does not speculate repeats its first token past position 0; those
        outputs and states are never used."""
        index, k = verify
        b = slots.shape[0]
        token = torch.arange(b, device=mixed.device).unsqueeze(1).repeat(1, 1 + k)
        drafts = b + torch.arange(index.shape[0] * k, device=mixed.device).view(-1, k)
        token[index, 1:] = drafts
        conv_s, state = conv.index_select(0, slots), recurrent.index_select(0, slots)
        convs, states = [conv_s], [state]
        for j in range(1 + k):
            at = token[:, j]
            mixed_conv, conv_s = delta_rule.conv_step(mixed[at], conv_s, self.conv_weight)
            q, k_, v = self._split(mixed_conv)
            out, state = delta_rule.recurrent_step(q, k_, v, g[at], beta[at], state)
            if j == 0:
                core[:b] = out
            else:
                core.index_copy_(0, drafts[:, j - 1], out.index_select(0, index))
            convs.append(conv_s)
            states.append(state)
        return slots, torch.stack(convs, dim=1), torch.stack(states, dim=1)

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, t = self.shape, mixed.shape[0]
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        return (q.reshape(t, s.num_k_heads, s.head_k_dim), k.reshape(t, s.num_k_heads,
                s.head_k_dim), v.reshape(t, s.num_v_heads, s.head_v_dim))

    def _gated_norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm (plain weight) times SiLU(z), in float32, as transformers' RMSNormGated."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.gated_norm * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)
