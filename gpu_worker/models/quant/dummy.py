"""`--load-format dummy` with a quantization_config: random weights of the real shapes,
quantized on the device into the format's in-memory form, so a benchmark of a quantized
model's shape runs the kernels (and holds the bytes) the real checkpoint would.

The scales are each row's (and block's or group's) absolute maximum over the format's
largest value: the tokens are meaningless, the cost is the real one.
"""
from __future__ import annotations

import torch

from tandem_serve.gpu_worker.models.quant.formats import FP8, Fp8Weight, Int4Weight, QuantWeight
from tandem_serve.gpu_worker.models.quant.load import QuantLinears

FP8_MAX = float(torch.finfo(FP8).max)


def quantize_fp8(w: torch.Tensor, block: int) -> Fp8Weight:
    """w [out, in] -> e4m3 with one scale per row and `block` input columns."""
    out, inp = w.shape
    nb = -(-inp // block)
    padded = torch.nn.functional.pad(w.float(), (0, nb * block - inp)).view(out, nb, block)
    scale = (padded.abs().amax(dim=2) / FP8_MAX).clamp(min=1e-12)
    q = (padded / scale.unsqueeze(2)).view(out, -1)[:, :inp].to(FP8)
    return Fp8Weight(q.contiguous(), scale, block)


def quantize_int4(w: torch.Tensor, group: int) -> Int4Weight:
    """w [out, in] -> symmetric int4 (zero 8) with one scale per row and group."""
    out, inp = w.shape
    grouped = w.float().view(out, inp // group, group)
    scale = (grouped.abs().amax(dim=2) / 7).clamp(min=1e-12)
    q = (torch.round(grouped / scale.unsqueeze(2)) + 8).clamp(0, 15).to(torch.uint8)
    return Int4Weight(q.view(out, inp), torch.full_like(scale, 8.0), scale, group)


class DummyQuantLinears(QuantLinears):
    """`QuantLinears` over random weights: each part is the dummy dense weight, quantized."""

    def part(self, module: str) -> QuantWeight:
        w = self.dense(module + ".weight")
        if self.q.is_int4:
            return quantize_int4(w, self.q.group_size or w.shape[1])
        return quantize_fp8(w, self.q.block[1] if self.q.block[1] else w.shape[1])
