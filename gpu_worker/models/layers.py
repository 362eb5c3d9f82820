"""Stateless layer math shared by the decoders: RoPE, RMSNorm and the (oneDNN-packed) linear.

Numerics follow HF: RMSNorm in float32 then cast (Gemma: scaled in float32, then cast), RoPE
inverse frequencies in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.models.config import ModelArgs

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32, computed exactly as transformers does."""
    dim = args.rotary_dim or args.head_dim
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


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: ``weight`` is (1 + w) in float32 (folded at load), applied before the
    cast back, as HF's Gemma3RMSNorm does."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, R] (both halves), R <= D: partial rotary leaves the last
    D - R dims as they are. HF's rotate_half formulation."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
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


# Above this many rows a packed linear runs through F.linear (MKL's sgemm) instead; see
# `onednn_rows`.
ONEDNN_MAX_ROWS = 256


def onednn_rows(m: int) -> int:
    """How many rows a packed linear runs with when it is given ``m`` (at most
    ONEDNN_MAX_ROWS): ``m`` rounded up to one of 8 sizes per octave (exact up to 16, then steps
    of 2 to 32, 4 to 64, ...).

    oneDNN builds (JIT-compiles) a primitive per input shape and keeps it in two caches (its
    own and ideep's, 1024 entries each), about half a MB per shape and weight, more for large
    row counts (2,048 rows: ~7 MB over the tiny model's weights). Prefill token counts and
    batch sizes take hundreds of values, so unpadded the gpu worker's RSS grew for as long as
    new row counts kept turning up, by hundreds of MB; rounding bounds them to 48 sizes up to
    256 rows, for at most 12.5% padded rows.  Above 256 rows MKL's sgemm on the plain weight is
    as fast as the packed primitive (measured on the tiny model's and a 1024-wide model's
    shapes, 256 to 2,048 rows: 0.88-1.12x) and keeps no per-shape state, so large prefill
    forwards, rare and each a new shape, no longer add primitives late in a server's life.
    """
    if m <= 16:
        return m
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """x [M, in] -> [M, out], through oneDNN with ``packed`` (see pack_linear) up to
    ONEDNN_MAX_ROWS rows, else F.linear."""
    m = x.shape[0]
    if packed is not None and m <= ONEDNN_MAX_ROWS:
        rows = onednn_rows(m)
        if rows != m:  # zero rows, dropped again below (a view: no copy)
            x = F.pad(x, (0, 0, 0, rows - m))
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed, bias, "none", [], ""
        )
        return out[:m] if rows != m else out
    return F.linear(x, weight, bias)
