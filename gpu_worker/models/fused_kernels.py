"""The Triton kernels behind `gpu_worker.models.fused` (imported only when a launcher takes the
Triton path, so `TRITON_INTERPRET` set by a test before that still applies).

Every kernel computes in float32 and rounds to the model dtype wherever the eager torch code
it replaces rounds (`_rnd`): a bfloat16 result then differs from eager only by summation
order inside the RMS reduction. Only `triton.language` features that Triton 3.6 and 3.9 both
have are used: no autotuning (it would synchronise inside a CUDA graph capture), no tuples
as arguments, no early returns.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rnd(x, dt: tl.constexpr):
    """x (float32) rounded to the storage dtype `dt` and widened back."""
    return x.to(dt).to(tl.float32)


@triton.jit
def _scaled(x, w, n, eps, dt: tl.constexpr, GEMMA: tl.constexpr):
    """RMSNorm of the float32 row x, scaled by w (float32), as `layers.rms_norm` computes it
    (normalise, round to dt, then scale) or `layers.gemma_rms_norm` (scale, then round)."""
    var = tl.sum(x * x, axis=0) / n
    h = x * tl.rsqrt(var + eps)
    if GEMMA:
        y = h * w
    else:
        y = w * _rnd(h, dt)
    return y


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_t, n, eps,
                    GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (T, H): x [T, H, n] (head stride n, row stride `stride_t`), w [H, n]; out
    contiguous [T, H, n]."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + t * stride_t + h * n + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + h * n + cols, mask=m, other=0.0).to(tl.float32)
    y = _scaled(x, w, n, eps, x_ptr.dtype.element_ty, GEMMA)
    row = t * tl.num_programs(1) + h
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def add_rms_norm_kernel(x_ptr, a_ptr, w_ptr, pre_w_ptr, out_ptr, res_ptr, n, eps,
                        MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (T,), every tensor contiguous [T, n]: res = x + a, out = norm(res) * w.
    MODE 0: `rms_norm`; 1: `gemma_rms_norm`; 2: Gemma's sandwich, res = x + norm(a) * pre_w
    (both norms Gemma's)."""
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * n + cols, mask=m, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t * n + cols, mask=m, other=0.0).to(tl.float32)
    if MODE == 2:
        pw = tl.load(pre_w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        a = _rnd(_scaled(a, pw, n, eps, dt, True), dt)
    r = _rnd(x + a, dt)
    tl.store(res_ptr + t * n + cols, r.to(dt), mask=m)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = _scaled(r, w, n, eps, dt, MODE != 0)
    tl.store(out_ptr + t * n + cols, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def rope_kernel(qk_ptr, cos_ptr, sin_ptr, stride_t, stride_h, heads, half,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Grid (T,): rotate-half RoPE in place on qk [T, heads, D] (last stride 1), dims
    [0, 2 * half) of each head; cos/sin contiguous [T, 2 * half] (both halves equal, so only
    the first is read). Rounds like `layers.apply_rope`: x * cos, rotated * sin, their sum."""
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_HALF)[None, :]
    m = (h < heads) & (c < half)
    dt = qk_ptr.dtype.element_ty
    first = qk_ptr + t * stride_t + h * stride_h + c
    x1 = tl.load(first, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=m, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * 2 * half + c, mask=c < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * 2 * half + c, mask=c < half, other=0.0).to(tl.float32)
    o1 = _rnd(x1 * cos, dt) + _rnd(-x2 * sin, dt)
    o2 = _rnd(x2 * cos, dt) + _rnd(x1 * sin, dt)
    tl.store(first, o1.to(dt), mask=m)
    tl.store(first + half, o2.to(dt), mask=m)


@triton.jit
def act_mul_kernel(gu_ptr, out_ptr, stride_t, inter, GELU_TANH: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Grid (T, cdiv(inter, BLOCK)): out [T, inter] = act(gu[:, :inter]) * gu[:, inter:],
    act SiLU (x / (1 + exp(-x)), as torch computes it) or tanh-approximated GELU
    (0.5 x (1 + tanh(y)) = x * sigmoid(2y)); rounded after the activation, as eager is."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * stride_t + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_t + inter + cols, mask=m, other=0.0).to(tl.float32)
    if GELU_TANH:
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 * sqrt(2 / pi) * (...)
        act = g / (1.0 + tl.exp(-z))
    else:
        act = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + t * inter + cols, (_rnd(act, dt) * u).to(dt), mask=m)
