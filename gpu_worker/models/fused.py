"""Fused row-wise kernels for a layer on CUDA: RMSNorm (with the residual add before it),
RoPE in place, and the MLP's activation times up.

Inside a decode CUDA graph the small-batch floor is set by how many kernels a layer launches,
not by what they compute: eager, a layer is about 35 small kernels, most of them the eight
ops of each RMSNorm, the residual adds, RoPE's slices, negation and products, and SiLU's
multiply. Here each of those groups is one Triton kernel. The launchers keep the eager
functions' contracts (`layers.rms_norm`, `layers.gemma_rms_norm`, `layers.apply_rope`, the
MLP's `act(gate) * up`) and their rounding (`fused_kernels`), and take the Triton path only
for CUDA tensors when Triton imports (`use_triton`); anything else, the CPU path above all,
runs the eager torch code itself, bit for bit. `TANDEM_FUSED_KERNELS=0` turns the Triton
path off (A/B runs). Tests force it onto CPU tensors under Triton's interpreter (`forced`).
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from tandem_serve.gpu_worker.models import layers

_FORCED = False
# Activations with a Triton kernel (layers.ACTIVATIONS names); others run eagerly.
_GELU_TANH = {"silu": False, "swish": False, "gelu_pytorch_tanh": True}


@functools.cache
def triton_available() -> bool:
    if os.environ.get("TANDEM_FUSED_KERNELS", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels serve tensors like x: CUDA, with Triton installed."""
    return (_FORCED or x.is_cuda) and triton_available()


@contextlib.contextmanager
def forced() -> Iterator[None]:
    """Take the Triton path for CPU tensors too (tests, under TRITON_INTERPRET=1)."""
    global _FORCED
    before, _FORCED = _FORCED, True
    try:
        yield
    finally:
        _FORCED = before


def _kernels() -> ModuleType:
    from tandem_serve.gpu_worker.models import fused_kernels

    return fused_kernels


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# ------------------------------------------------------------------ RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.rms_norm` (one kernel on CUDA)."""
    return _norm(x, weight, eps, False)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.gemma_rms_norm` (one kernel on CUDA)."""
    return _norm(x, weight, eps, True)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    eager = layers.gemma_rms_norm if gemma else layers.rms_norm
    if not use_triton(x) or x.dim() not in (2, 3) or x.shape[0] == 0:
        return eager(x, weight, eps)
    n = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    # Rows of n contiguous elements, heads n apart (q|k of a fused qkv row are).
    if x.stride(-1) != 1 or (heads > 1 and x.stride(1) != n):
        x = x.contiguous()
    if weight.shape != (heads, n) and weight.shape != (n,):
        return eager(x, weight, eps)
    w = weight.expand(heads, n).contiguous()
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block = _block(n)
    _kernels().rms_norm_kernel[(x.shape[0], heads)](
        x, w, out, x.stride(0), n, eps, GEMMA=gemma, BLOCK=block, num_warps=_warps(block))
    return out


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float,
                 gemma: bool = False, a_weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it, as the decoder layer computes them:
    x' = x + a (Gemma, `a_weight` given: x + gemma_rms_norm(a, a_weight)), returns
    (norm(x', weight), x'). One kernel on CUDA; x and a are not modified."""
    if (not use_triton(x) or x.dim() != 2 or x.shape[0] == 0 or a.shape != x.shape
            or a.dtype != x.dtype or weight.shape != (x.shape[1],)
            or (a_weight is not None and (not gemma or a_weight.shape != weight.shape))):
        norm = layers.gemma_rms_norm if gemma else layers.rms_norm
        x = x + (a if a_weight is None else norm(a, a_weight, eps))
        return norm(x, weight, eps), x
    n = x.shape[1]
    x, a = x.contiguous(), a.contiguous()
    res = torch.empty_like(x)
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    mode = 0 if not gemma else 1 if a_weight is None else 2
    block = _block(n)
    _kernels().add_rms_norm_kernel[(x.shape[0],)](
        x, a, weight, weight if a_weight is None else a_weight, out, res, n, eps,
        MODE=mode, BLOCK=block, num_warps=_warps(block))
    return out, res


# ------------------------------------------------------------------ RoPE


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`layers.apply_rope(qk, cos, sin)`: qk [T, H, D], cos/sin [T, 1, R] (R <= D, partial
    rotary leaves the last D - R dims). On the Triton path qk is rotated in place and
    returned; use the result either way."""
    t, heads = qk.shape[0], qk.shape[1] if qk.dim() == 3 else 0
    rot = cos.shape[-1]
    if (not use_triton(qk) or qk.dim() != 3 or t == 0 or qk.stride(-1) != 1
            or cos.shape != (t, 1, rot) or sin.shape != cos.shape or rot % 2
            or rot > qk.shape[-1] or cos.dtype != qk.dtype or sin.dtype != qk.dtype):
        return layers.apply_rope(qk, cos, sin)
    half = rot // 2
    block_h, block_half = _block(heads), _block(half)
    _kernels().rope_kernel[(t,)](
        qk, cos.contiguous(), sin.contiguous(), qk.stride(0), qk.stride(1), heads, half,
        BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=_warps(block_h * block_half))
    return qk


# ------------------------------------------------------------------ MLP activation


def act_mul(gu: torch.Tensor, act: str, inter: int) -> torch.Tensor:
    """The MLP's act(gate) * up from the fused gate|up projection gu [T, 2 * inter] ->
    [T, inter]; `act` a `layers.ACTIVATIONS` name (SiLU and tanh-GELU have a kernel)."""
    if (not use_triton(gu) or gu.dim() != 2 or gu.shape[0] == 0 or gu.stride(1) != 1
            or gu.shape[1] != 2 * inter or act not in _GELU_TANH):
        return layers.ACTIVATIONS[act](gu[:, :inter]) * gu[:, inter:]
    out = torch.empty(gu.shape[0], inter, dtype=gu.dtype, device=gu.device)
    block = min(_block(inter), 1024)
    _kernels().act_mul_kernel[(gu.shape[0], _cdiv(inter, block))](
        gu, out, gu.stride(0), inter, GELU_TANH=_GELU_TANH[act], BLOCK=block,
        num_warps=_warps(block))
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
