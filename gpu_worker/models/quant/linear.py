"""A quantized linear layer that stays quantized in memory, and the kernels that run it.

Per weight form and device, the first of these that applies:

* FP8, one scale per output row (compressed-tensors' per-channel FP8), CUDA with compute
  capability ≥ 8.9, bfloat16: `torch._scaled_mm` on e4m3 × e4m3 with row-wise scales. Each
  forward quantizes its activations per token (amax / 448, as `activation_scheme: dynamic`
  means), so results differ from the dequantized weights' by FP8 rounding of the inputs.
* int4 (GPTQ, AWQ, compressed-tensors W4A16), CUDA sm80+ in bfloat16: torch's tinygemm
  kernel `aten._weight_int4pack_mm`, weights repacked once here by
  `_convert_weight_to_int4pack`; on the CPU (when kept quantized) its CPU twin. Both compute
  (q − 8) · s + zero per group, so a zero point z becomes zero = (8 − z) · s.
* anything else (block-scaled FP8, float16/float32, older GPUs, a shape the kernel does not
  take): dequantize-then-matmul, the weights still stored quantized.

A kernel is used only after it reproduced the dequantized matmul on a small random weight
once per process (`_kernel_ok`), so a packing convention torch changes costs speed, never
correctness.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.models.quant.formats import FP8, Fp8Weight, Int4Weight, QuantWeight

log = logging.getLogger(__name__)

FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT4_GROUPS = (32, 64, 128, 256)  # tinygemm's group sizes
_checked: dict[tuple[str, str, torch.dtype], bool] = {}


class QuantLinear:
    """`forward(x [M, in], bias) -> [M, out]` in x's dtype over a quantized weight."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype, kernels: bool = True) -> None:
        self.out_features, self.in_features = weight.q.shape
        self.dtype = dtype
        self.mode = "dequantize"
        self.tensors: dict[str, torch.Tensor] = {}
        self.group = 0
        device = weight.q.device
        if isinstance(weight, Fp8Weight):
            if kernels and _fp8_rowwise_usable(weight, dtype) and _kernel_ok("fp8", device,
                                                                              dtype):
                self.mode = "fp8-scaled-mm"
                self.tensors = {"qt": weight.q.t(), "scale": weight.scale.view(1, -1)}
            else:
                self.tensors = {"q": weight.q, "scale": weight.scale}
                self.group = weight.block
        else:
            group = int4_kernel_group(weight, dtype)
            if kernels and group and _kernel_ok("int4", device, dtype):
                self.mode = "int4-tinygemm" if device.type == "cuda" else "int4-cpu"
                self.group = group
                self.tensors = int4_pack(weight, dtype, group)
            else:
                self.group = weight.group
                self.tensors = {"packed": _pack_nibbles(weight.q), "zero": weight.zero,
                                "scale": weight.scale}
        self._forward = self._pick(isinstance(weight, Fp8Weight))

    @property
    def tensors_device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _pick(self, fp8: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        t = self.tensors
        if self.mode == "fp8-scaled-mm":
            return lambda x: fp8_rowwise_mm(x, t["qt"], t["scale"])
        if self.mode == "int4-tinygemm":
            return lambda x: torch.ops.aten._weight_int4pack_mm(x, t["w"], self.group, t["sz"])
        if self.mode == "int4-cpu":
            return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t["w"], self.group,
                                                                        t["sz"])
        return lambda x: F.linear(x, self.dequantize())

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype (exact: the stored values times their
        scales in float32, then one rounding)."""
        t = self.tensors
        if "q" in t:
            return Fp8Weight(t["q"], t["scale"], self.group).dequantize(self.dtype)
        if "packed" in t:
            q = _unpack_nibbles(t["packed"])
            return Int4Weight(q, t["zero"], t["scale"], self.group).dequantize(self.dtype)
        raise AssertionError(f"{self.mode} keeps no dequantizable form")

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._forward(x)
        return out if bias is None else out + bias


def fp8_rowwise_mm(x: torch.Tensor, qt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ (qt [in, out] e4m3, column-major) · scale [1, out], with x quantized to
    e4m3 per row (dynamic per-token scales), on the device, no host sync."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    sa = amax / FP8_MAX
    xq = (x.float() / sa).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out: torch.Tensor = torch._scaled_mm(xq, qt, scale_a=sa, scale_b=scale, out_dtype=x.dtype)
    return out


def _fp8_rowwise_usable(w: Fp8Weight, dtype: torch.dtype) -> bool:
    dev = w.q.device
    if dev.type != "cuda" or dtype != torch.bfloat16 or w.scale.shape[1] != 1:
        return False
    if w.q.shape[0] % 16 or w.q.shape[1] % 16:
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 9)


def int4_kernel_group(w: Int4Weight, dtype: torch.dtype) -> int:
    """The group size torch's int4 kernel runs `w` with (per-channel scales repeated over
    groups of 128 or fewer columns), 0 where it cannot: CUDA sm80+ in bfloat16, or the CPU
    in float32 / bfloat16; out a multiple of 8, in of 32 and of the group."""
    dev = w.q.device
    if dev.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(dev) < (8, 0):
            return 0
    elif dev.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return 0
    n, k = w.q.shape
    if n % 8 or k % 32:
        return 0
    if w.group in INT4_GROUPS:
        return w.group
    if w.group == k:  # per channel
        return next((g for g in (128, 64, 32) if k % g == 0), 0)
    return 0


def int4_pack(w: Int4Weight, dtype: torch.dtype, group: int) -> dict[str, torch.Tensor]:
    """Repack for torch's int4 kernel: "w" (its tiled layout) and "sz" [in/group, out, 2]
    (scale, and zero = (8 − z) · s, so that (q − 8) · s + zero = (q − z) · s)."""
    k = w.q.shape[1]
    reps = group and w.group // group
    scale = w.scale.repeat_interleave(reps, dim=1)
    zero = (8 - w.zero.repeat_interleave(reps, dim=1)) * scale
    sz = torch.stack([scale.t(), zero.t()], dim=2).to(dtype).contiguous()
    inner = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    if w.q.device.type == "cuda":
        # Two values a byte, the even column in the high nibble (torch >= 2.5's input).
        packed = (w.q[:, ::2] << 4 | w.q[:, 1::2]).to(torch.uint8).contiguous()
        tiled = torch.ops.aten._convert_weight_to_int4pack(packed, inner)
    else:
        tiled = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), inner)
    return {"w": tiled, "sz": sz}


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 -> [out, in/2] bytes (the even column in the low nibble)."""
    return (q[:, ::2] | q[:, 1::2] << 4).to(torch.uint8).contiguous()


def _unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 0xF, p >> 4], dim=2).reshape(p.shape[0], -1)


def _kernel_ok(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the `kind` kernel reproduces the dequantized matmul here (checked once)."""
    key = (kind, str(device), dtype)
    if key not in _checked:
        try:
            _checked[key] = _self_check(kind, device, dtype)
        except (RuntimeError, NotImplementedError) as exc:
            log.info("%s kernel unavailable on %s (%s): dequantize-then-matmul", kind,
                     device, exc)
            _checked[key] = False
        if not _checked[key]:
            log.warning("%s kernel does not reproduce the dequantized matmul on %s %s: "
                        "dequantize-then-matmul instead", kind, device, dtype)
    return _checked[key]


def _self_check(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    n, k = 64, 256
    x = torch.randn(5, k, generator=gen).to(device, dtype)
    weight: QuantWeight
    if kind == "fp8":
        q = (torch.randn(n, k, generator=gen) * 64).to(FP8).to(device)
        weight = Fp8Weight(q, torch.rand(n, 1, generator=gen).to(device) / 256, k)
        tolerance = 0.1  # the activations' FP8 rounding
    else:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8).to(device)
        zero = torch.randint(0, 16, (n, k // 32), generator=gen).float().to(device)
        weight = Int4Weight(q, zero, torch.rand(n, k // 32, generator=gen).to(device) / 8, 32)
        tolerance = 0.02
    want = F.linear(x.float(), weight.dequantize(torch.float32))
    if isinstance(weight, Fp8Weight):
        out = fp8_rowwise_mm(x, q.t(), weight.scale.view(1, -1))
    else:
        t = int4_pack(weight, dtype, 32)
        op = (torch.ops.aten._weight_int4pack_mm if device.type == "cuda"
              else torch.ops.aten._weight_int4pack_mm_for_cpu)
        out = op(x, t["w"], 32, t["sz"])
    err = (out.float() - want).norm() / want.norm()
    return bool(err < tolerance)
