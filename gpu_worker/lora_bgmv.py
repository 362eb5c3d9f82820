"""BGMV LoRA for CUDA: each row reads only its own adapter slot's weights.

The masked form (`gpu_worker.lora`, what a CUDA graph captures) multiplies every row by every
slot's A and Bt and zeroes the other slots' share with a one-hot: per step it reads all
slots' weights whatever the rows use (about 1 GB at 8 slots of rank 16 on a Llama-8B shape)
and does `slots` times the work. Here two Triton kernels (punica's "batched gather
matrix-vector", shrink then expand) index the stacked slot weights by each row's slot, read
from a device tensor, so the grid depends on shapes only and a captured graph serves any mix
of adapters:

    shrink  u[t]  = x[t] @ A[slot_t]^T          A  [slots * R, in]   -> u [T, R]
    expand  out[t] += u[t] @ Bt[slot_t]          Bt [slots * R, out]  (alpha / r folded in)

with R = `LoraWeights.rows[fused]` (sub-modules x max rank; an adapter's unused rows are
zero). A row with slot 0 (no adapter, padding) or -1 reads nothing and leaves out as it is,
as the masked form adds exactly 0 to it. Rounding follows the masked form: u is rounded to
the model dtype, the expand accumulates in float32 and rounds once with out added. Under
tensor parallelism A/Bt are already the rank's parts, so nothing here changes.

Imported only on that path (CUDA with Triton, or a test under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_R = 16
_BLOCK_IN = 128
_BLOCK_OUT = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, u_ptr, stride_x, n_in, rank,
                   BLOCK_R: tl.constexpr, BLOCK_IN: tl.constexpr):
    """Grid (T, cdiv(R, BLOCK_R)): u[t, r] = sum_i x[t, i] * A[(slot - 1) * R + r, i]."""
    t = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + t)
    # A row without an adapter masks every element (0 rows of its slot are in range).
    r_ok = r < tl.where(slot > 0, rank, 0)
    rows = (tl.maximum(slot - 1, 0) * rank + r).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, n_in, BLOCK_IN):
        i = start + tl.arange(0, BLOCK_IN)
        i_ok = i < n_in
        x = tl.load(x_ptr + t * stride_x + i, mask=i_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + rows[:, None] * n_in + i[None, :],
                    mask=r_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(u_ptr + t * rank + r, acc.to(u_ptr.dtype.element_ty), mask=r_ok)


@triton.jit
def _expand_kernel(u_ptr, bt_ptr, slot_ptr, out_ptr, stride_out, rank, n_out,
                   BLOCK_R: tl.constexpr, BLOCK_OUT: tl.constexpr):
    """Grid (T, cdiv(out, BLOCK_OUT)): out[t, o] += sum_r u[t, r] * Bt[(slot - 1) * R + r, o]."""
    t = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    slot = tl.load(slot_ptr + t)
    o_ok = o < tl.where(slot > 0, n_out, 0)  # no adapter: nothing read or written
    in_slot = tl.where(slot > 0, rank, 0)
    first = tl.maximum(slot - 1, 0) * rank
    acc = tl.zeros((BLOCK_OUT,), dtype=tl.float32)
    for start in range(0, rank, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        r_ok = r < in_slot
        u = tl.load(u_ptr + t * rank + r, mask=r_ok, other=0.0).to(tl.float32)
        rows = (first + r).to(tl.int64)
        b = tl.load(bt_ptr + rows[:, None] * n_out + o[None, :],
                    mask=r_ok[:, None] & o_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(u[:, None] * b, axis=0)
    dst = out_ptr + t * stride_out + o
    y = tl.load(dst, mask=o_ok, other=0.0).to(tl.float32) + acc
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=o_ok)


def add_lora(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor,
             out: torch.Tensor, rank: int) -> torch.Tensor:
    """out [T, O] += x [T, in] @ A_s^T @ Bt_s for each row's slot s = slots[t] (int, on the
    device; <= 0: nothing), A [slots * rank, in], Bt [slots * rank, O]; in place, returned.

    The same contract as `LoraContext.add`'s masked form, graph-safe: no host reads, the
    grid from shapes only."""
    t = x.shape[0]
    if t == 0:
        return out
    assert out.shape[0] == t and slots.shape == (t,), "one slot per row"
    assert a.shape[0] % rank == 0 and bt.shape[0] == a.shape[0], "stacked slot weights"
    if x.stride(-1) != 1:
        x = x.contiguous()
    a, bt = a.contiguous(), bt.contiguous()
    u = torch.empty(t, rank, dtype=x.dtype, device=x.device)
    _shrink_kernel[(t, triton.cdiv(rank, _BLOCK_R))](
        x, a, slots, u, x.stride(0), a.shape[1], rank, BLOCK_R=_BLOCK_R, BLOCK_IN=_BLOCK_IN)
    target = out if out.stride(-1) == 1 else out.contiguous()
    _expand_kernel[(t, triton.cdiv(bt.shape[1], _BLOCK_OUT))](
        u, bt, slots, target, target.stride(0), rank, bt.shape[1], BLOCK_R=_BLOCK_R,
        BLOCK_OUT=_BLOCK_OUT)
    if target is not out:
        out.copy_(target)
    return out
