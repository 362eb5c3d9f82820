"""Each format's checkpoint tensors for one linear layer, and the part of each a
tensor-parallel rank reads.

A linear `m` with a [out, in] weight is stored as (g: group size, 0 = one per channel):

| kind | tensors |
|---|---|
| fp8-block | m.weight e4m3 [out, in]; m.weight_scale_inv [⌈out/bo⌉, ⌈in/bi⌉] |
| ct-fp8 | m.weight e4m3 [out, in]; m.weight_scale [out, 1] |
| ct-w4a16 | m.weight_packed int32 [out, in/8]; m.weight_scale [out, in/g]; m.weight_shape [2] |
| gptq | m.qweight int32 [in/8, out]; m.qzeros int32 [in/g, out/8]; m.scales [in/g, out]; |
|      | m.g_idx [in] |
| awq | m.qweight int32 [in, out/8]; m.qzeros int32 [in/g, out/8]; m.scales [in/g, out] |

Sharding cuts the weight's output rows (column-parallel) or input columns (row-parallel);
`parts` maps that cut onto each tensor's own axes (GPTQ and AWQ store [in, out]; packed
axes hold 8 values a word; scales hold one value per group or block). Whether a cut keeps
groups, blocks and words whole is `split`'s business. Torch-free.
"""
from __future__ import annotations

from tandem_serve.gpu_worker.models.quant.config import (
    AWQ,
    CT_FP8,
    CT_W4A16,
    FP8_BLOCK,
    GPTQ,
    QuantConfig,
)
from tandem_serve.gpu_worker.models.sharding import WHOLE, Part

Shape = tuple[int, ...]
PACK = 8  # int4 values per int32 word


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def groups(q: QuantConfig, inp: int) -> int:
    """Scale rows (GPTQ/AWQ) or columns (compressed-tensors) for `inp` input columns."""
    return inp // q.group_size if q.group_size else 1


def checkpoint_tensors(q: QuantConfig, m: str, out: int, inp: int) -> dict[str, Shape]:
    """The tensors of linear `m` ("model.layers.0.mlp.down_proj") and their shapes."""
    if q.kind == FP8_BLOCK:
        bo, bi = q.block
        return {f"{m}.weight": (out, inp), f"{m}.weight_scale_inv": (cdiv(out, bo),
                                                                     cdiv(inp, bi))}
    if q.kind == CT_FP8:
        return {f"{m}.weight": (out, inp), f"{m}.weight_scale": (out, 1)}
    g = groups(q, inp)
    if q.kind == CT_W4A16:
        return {f"{m}.weight_packed": (out, inp // PACK), f"{m}.weight_scale": (out, g),
                f"{m}.weight_shape": (2,)}
    zeros = {f"{m}.qzeros": (g, out // PACK), f"{m}.scales": (g, out)}
    if q.kind == GPTQ:
        return {f"{m}.qweight": (inp // PACK, out), **zeros, f"{m}.g_idx": (inp,)}
    assert q.kind == AWQ, q.kind
    return {f"{m}.qweight": (inp, out // PACK), **zeros}


def parts(q: QuantConfig, m: str, weight: Part) -> dict[str, Part]:
    """Tensor name -> the part of it that holds `weight` (the part of m's [out, in] weight
    sharding gives this rank)."""
    names = checkpoint_tensors(q, m, 1, 1)
    if weight.dim is None:
        return dict.fromkeys(names, WHOLE)
    a, b = weight.start, weight.stop
    rows = weight.dim == 0  # a cut of the output rows (else of the input columns)
    per_group = _per_group(q, a, b)
    if q.kind == FP8_BLOCK:
        bo, bi = q.block
        scale = Part(0, a // bo, cdiv(b, bo)) if rows else Part(1, a // bi, cdiv(b, bi))
        return {f"{m}.weight": weight, f"{m}.weight_scale_inv": scale}
    if q.kind == CT_FP8:
        return {f"{m}.weight": weight, f"{m}.weight_scale": weight if rows else WHOLE}
    if q.kind == CT_W4A16:
        return {f"{m}.weight_packed": weight if rows else Part(1, a // PACK, b // PACK),
                f"{m}.weight_scale": weight if rows else Part(1, *per_group)
                if q.group_size else WHOLE, f"{m}.weight_shape": WHOLE}
    # GPTQ and AWQ: [in, out] layouts; zeros packed along out, one row per group.
    zeros = Part(1, a // PACK, b // PACK) if rows else _group_rows(q, per_group)
    scales = Part(1, a, b) if rows else _group_rows(q, per_group)
    out = {f"{m}.qzeros": zeros, f"{m}.scales": scales}
    if q.kind == GPTQ:
        out[f"{m}.qweight"] = Part(1, a, b) if rows else Part(0, a // PACK, b // PACK)
        out[f"{m}.g_idx"] = WHOLE if rows else Part(0, a, b)
    else:
        out[f"{m}.qweight"] = Part(1, a // PACK, b // PACK) if rows else Part(0, a, b)
    return out


def _per_group(q: QuantConfig, a: int, b: int) -> tuple[int, int]:
    g = q.group_size or 1
    return a // g, b // g


def _group_rows(q: QuantConfig, per_group: tuple[int, int]) -> Part:
    # Per channel: one scale row serves every input column, so each rank reads all of it.
    return Part(0, *per_group) if q.group_size else WHOLE
