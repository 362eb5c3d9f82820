"""Each format's tensors -> one of two in-memory forms, unchanged in value.

* `Fp8Weight`: e4m3 values [out, in] and float32 scales [out, ⌈in/block⌉]: one scale per
  row and block of input columns. HF's [⌈out/bo⌉, ⌈in/bi⌉] block scales are repeated over
  their rows (a fused q|k|v or a rank's rows need not start on a block), compressed-
  tensors' per-channel scales are the case block = in.
* `Int4Weight`: values 0..15 [out, in] (uint8, one a byte while loading), float32 zero
  points and scales [out, in/group]: W = (q − z) · s. compressed-tensors stores q + 8 (its
  zero is 8), GPTQ v1 zero − 1, AWQ the zero itself.

`read(name, part)` returns a checkpoint tensor's part as stored (see `tensors.parts`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem_serve.gpu_worker.models.quant.config import (
    AWQ,
    CT_FP8,
    CT_W4A16,
    FP8_BLOCK,
    GPTQ,
    QuantConfig,
)
from tandem_serve.gpu_worker.models.quant.tensors import PACK, parts
from tandem_serve.gpu_worker.models.sharding import Part

Read = Callable[[str, Part], torch.Tensor]
FP8 = torch.float8_e4m3fn
# AWQ's GEMM packing: nibble i of a word holds output column 8c + _AWQ_ORDER[i].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(sorted(range(PACK), key=lambda i: _AWQ_ORDER[i]))


@dataclass
class Fp8Weight:
    q: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out, ceil(in / block)] float32
    block: int  # input columns per scale

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        s = self.scale.repeat_interleave(self.block, dim=1)[:, : self.q.shape[1]]
        return (self.q.float() * s).to(dtype)

    @staticmethod
    def cat(weights: list[Fp8Weight]) -> Fp8Weight:
        return Fp8Weight(torch.cat([w.q for w in weights]),
                         torch.cat([w.scale for w in weights]), weights[0].block)


@dataclass
class Int4Weight:
    q: torch.Tensor  # [out, in] uint8, 0..15
    zero: torch.Tensor  # [out, in / group] float32
    scale: torch.Tensor  # [out, in / group] float32
    group: int  # input columns per scale

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        z = self.zero.repeat_interleave(self.group, dim=1)
        s = self.scale.repeat_interleave(self.group, dim=1)
        return ((self.q.float() - z) * s).to(dtype)

    @staticmethod
    def cat(weights: list[Int4Weight]) -> Int4Weight:
        return Int4Weight(torch.cat([w.q for w in weights]),
                          torch.cat([w.zero for w in weights]),
                          torch.cat([w.scale for w in weights]), weights[0].group)


QuantWeight = Fp8Weight | Int4Weight


def read_linear(q: QuantConfig, read: Read, m: str, weight: Part, out: int
                ) -> QuantWeight:
    """Linear `m`'s part `weight` of its [out, in] weight (`out`: the whole model's rows)."""
    p = parts(q, m, weight)
    get = lambda name: read(name, p[name])  # noqa: E731
    if q.kind == FP8_BLOCK:
        rows = (weight.start, weight.stop) if weight.dim == 0 else (0, out)
        return _fp8_block(q, _typed(get(f"{m}.weight"), FP8, m),
                          _scales(get(f"{m}.weight_scale_inv"), m), rows)
    if q.kind == CT_FP8:
        w = _typed(get(f"{m}.weight"), FP8, m)
        return Fp8Weight(w, _scales(get(f"{m}.weight_scale"), m), w.shape[1])
    if q.kind == CT_W4A16:
        return _ct_int4(q, get, m)
    if q.kind == GPTQ:
        return _gptq(q, get, m, weight)
    assert q.kind == AWQ, q.kind
    return _awq(q, get, m)


def _typed(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    if t.dtype != dtype:
        raise ValueError(f"{name}: stored as {t.dtype}, expected {dtype} for this "
                         "quantization_config")
    return t


def _scales(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: scales stored as {t.dtype}; expected float32, bfloat16 "
                         "or float16")
    return t.float()


def _fp8_block(q: QuantConfig, w: torch.Tensor, s: torch.Tensor, rows: tuple[int, int]
               ) -> Fp8Weight:
    bo, bi = q.block
    first = rows[0] - rows[0] // bo * bo  # the scale rows read start at a block
    per_row = s.repeat_interleave(bo, dim=0)[first: first + rows[1] - rows[0]]
    return Fp8Weight(w, per_row.contiguous(), bi)


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (bits 4j.. of a word is value j), along `dim`:
    [.., n, ..] -> [.., 8n, ..] uint8."""
    words = _typed(words, torch.int32, "packed int4 tensor")
    vals = torch.stack([(words >> (4 * j)) & 0xF for j in range(PACK)], dim=dim + 1)
    shape = list(words.shape)
    shape[dim] *= PACK
    return vals.reshape(shape).to(torch.uint8)


def _group(q: QuantConfig, cols: int) -> int:
    return q.group_size or cols


def _ct_int4(q: QuantConfig, get: Callable[[str], torch.Tensor], m: str) -> Int4Weight:
    u = _nibbles(get(f"{m}.weight_packed"), 1)  # stored q + 8
    s = _scales(get(f"{m}.weight_scale"), m)
    return Int4Weight(u, torch.full_like(s, 8.0), s, _group(q, u.shape[1]))


def _gptq(q: QuantConfig, get: Callable[[str], torch.Tensor], m: str, weight: Part
          ) -> Int4Weight:
    u = _nibbles(get(f"{m}.qweight"), 0).t()  # [in, out] -> [out, in]
    z = _nibbles(get(f"{m}.qzeros"), 1).t().float() + 1  # v1 stores zero - 1
    s = _scales(get(f"{m}.scales"), m).t()
    group = _group(q, u.shape[1])
    first = weight.start if weight.dim == 1 else 0
    want = torch.arange(first, first + u.shape[1], device=u.device) // group
    g_idx = get(f"{m}.g_idx").to(want.device)
    if q.group_size and not torch.equal(g_idx.long(), want):
        raise ValueError(f"{m}.g_idx is not i // group_size: act-order (desc_act) "
                         "checkpoints are not supported")
    return Int4Weight(u.contiguous(), z.contiguous(), s.contiguous(), group)


def _awq(q: QuantConfig, get: Callable[[str], torch.Tensor], m: str) -> Int4Weight:
    def unpack(words: torch.Tensor) -> torch.Tensor:
        n = _nibbles(words, 1)
        return n.view(n.shape[0], -1, PACK)[..., list(_AWQ_UNDO)].reshape(n.shape)

    u = unpack(get(f"{m}.qweight")).t()
    z = unpack(get(f"{m}.qzeros")).t().float()
    s = _scales(get(f"{m}.scales"), m).t()
    return Int4Weight(u.contiguous(), z.contiguous(), s.contiguous(), _group(q, u.shape[1]))
