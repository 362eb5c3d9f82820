"""The gated delta rule of Gated DeltaNet layers, in torch: a chunked form for prefill pieces
and the one-token recurrence for decode rows, both from a given state; and the causal
depthwise convolution in front of it with its rolling state.

The state S [Hv, dk, dv] (float32) evolves per token t as
    S = exp(g_t) * S;  S = S + k_t (beta_t * (v_t - k_t^T S))^T;  o_t = S^T q_t
with q and k L2-normalised per head and q scaled by dk^-1/2 (queries and keys of a key head
serve Hv / Hk value heads). The chunked form (flash-linear-attention's algorithm, as
transformers' `torch_chunk_gated_delta_rule` writes it) computes 64 tokens at a time with a
triangular solve (the UT transform) and carries S between chunks: the same numbers as the
recurrence up to float rounding, at matmul speed. Everything computes in float32, as
transformers does, whatever the model dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.models.fused import use_triton

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """flash-linear-attention's l2norm (transformers' too): x / sqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, dk] -> [..., Hv, dk] float32, normalised, q scaled."""
    groups = num_v_heads // q.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, Hk, dk], v [B, Hv, dv], g and beta [B, Hv], state
    [B, Hv, dk, dv] float32 -> (out [B, Hv, dv] float32, the new state)."""
    q, k = _heads(q, k, v.shape[-2])
    state = state * g.float().exp()[..., None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v.float() - kv_mem) * beta.float().unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def recurrent_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor
                     ) -> torch.Tensor:
    """`recurrent_step` for rows whose states live in `states` [S, Hv, dk, dv] (float32) at
    `slots` [B], advanced in place -> out [B, Hv, dv] float32. One Triton kernel on CUDA
    (`delta_kernels`), else the torch step between a gather and a scatter."""
    if not use_triton(q):
        out, new = recurrent_step(q, k, v, g, beta, states.index_select(0, slots))
        states.index_copy_(0, slots, new)
        return out
    import triton

    from tandem_serve.gpu_worker.models.hybrid.delta_kernels import recurrent_step_kernel

    rows, hv, dv = v.shape
    dk = q.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(rows, hv, dv, dtype=torch.float32, device=v.device)
    block_v = min(64, triton.next_power_of_2(dv))
    recurrent_step_kernel[(rows, hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, states, slots, out, q.stride(0), k.stride(0), v.stride(0),
        g.stride(0), states.stride(0), states.stride(1), hv // q.shape[1], dk, dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v)
    return out


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor | None, chunk: int = CHUNK
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of L tokens: q, k [L, Hk, dk], v [L, Hv, dv], g and beta [L, Hv], state
    [Hv, dk, dv] float32 (None: zeros) -> (out [L, Hv, dv] float32, the state after it)."""
    length, hv, dv = v.shape
    q, k = _heads(q, k, hv)
    # Heads first, the sequence padded to whole chunks: [Hv, n, chunk, ...].
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v.float()))
    beta, decay = (F.pad(x.float().transpose(0, 1), (0, pad)) for x in (beta, g))
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(hv, -1, chunk, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    cum = decay.reshape(hv, -1, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    s = (torch.zeros(hv, k.shape[-1], dv, dtype=torch.float32, device=q.device)
         if state is None else state.float())
    out = torch.zeros_like(new_v)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[1]):
        v_i = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_i
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
    return out.reshape(hv, -1, dv)[:, :length].transpose(0, 1), s


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows: x [B, C] after the rows' last K - 1 inputs `state` [B, C, K - 1] ->
    (SiLU(conv) [B, C], the new state). weight [C, K]."""
    window = torch.cat((state, x.unsqueeze(-1)), dim=-1)
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    return F.silu(out[..., -1]).to(x.dtype), window[..., 1:]


def conv_sequence(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [L, C] after `state` [C, K - 1] (None: zeros, a fresh sequence) ->
    (SiLU(conv) [L, C], the last K - 1 inputs)."""
    c, width = weight.shape
    if state is None:
        state = x.new_zeros(c, width - 1)
    window = torch.cat((state, x.transpose(0, 1)), dim=-1)
    out = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=c)[0]
    return F.silu(out).to(x.dtype).transpose(0, 1), window[:, -(width - 1):]
