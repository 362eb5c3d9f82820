"""The Triton kernel behind `delta_rule.recurrent_update` on CUDA (imported only when the
launcher takes the Triton path, so `TRITON_INTERPRET` set by a test before that applies).

One program per (decode row, value head, tile of value dims): it reads the row's slot, loads
its query and key (the value head's key head; L2-normalised in float32, the query scaled by
dk^-1/2), and the state tile [dk, BLOCK_V] from the slot in the cache, then decays it, adds
the delta rule's correction, writes it back to the slot in place and writes the output
tile: the gather, the dozen elementwise ops and the scatter of the torch code in one kernel.
Rows share a slot only when masked (the scratch slot), whose contents are never read for an
output that is kept.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def recurrent_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, out_ptr,
                          q_row, k_row, v_row, gb_row, s_slot, s_head, groups, dk, dv,
                          BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kh = head // groups
    ks = tl.arange(0, BLOCK_K)
    vs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = ks < dk
    vmask = vs < dv
    q = tl.load(q_ptr + row * q_row + kh * dk + ks, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * k_row + kh * dk + ks, mask=kmask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(dk.to(tl.float32)))
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + row * v_row + head * dv + vs, mask=vmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * gb_row + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * gb_row + head).to(tl.float32)
    slot = tl.load(slot_ptr + row)
    at = state_ptr + slot * s_slot + head * s_head + ks[:, None] * dv + vs[None, :]
    both = kmask[:, None] & vmask[None, :]
    s = tl.load(at, mask=both, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(at, s, mask=both)
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + row * (dv * tl.num_programs(1)) + head * dv + vs, out, mask=vmask)
