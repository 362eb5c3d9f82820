"""The loader's side of quantized checkpoints: what the files must hold, which tensors are
quantization state, and each fused linear (q|k|v, o, gate|up, down) built from its parts.

A fused linear whose parts are all quantized becomes a `QuantLinear` (the weights stay
quantized on the device) or, where `keep_quantized` is off (the CPU by default), the
exactly dequantized weight in the compute dtype; one with an unquantized part (a module
`ignore`d or not converted) is dequantized whole, so mixed parts never need a mixed kernel.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.quant.formats import (
    Fp8Weight,
    Int4Weight,
    QuantWeight,
    read_linear,
)
from tandem_serve.gpu_worker.models.quant.linear import QuantLinear
from tandem_serve.gpu_worker.models.quant.split import linear_shapes
from tandem_serve.gpu_worker.models.quant.tensors import checkpoint_tensors
from tandem_serve.gpu_worker.models.sharding import Part, Shard, checkpoint_part

Shape = tuple[int, ...]
# Last name components that hold quantization state in the formats people publish.
_STATE = ("qweight", "qzeros", "g_idx", "weight_packed", "weight_shape", "weight_zero_point",
          "scales")
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def is_quant_state(name: str) -> bool:
    """Whether a checkpoint tensor carries quantization state (`*scale*`, `qweight`, ...):
    one the model does not expect is an error, not a tensor to skip."""
    last = name.rsplit(".", 1)[-1]
    return "scale" in last or last in _STATE


def quantized_modules(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """Every quantized linear module -> its whole-model [out, in]."""
    q = args.quant
    if q is None:
        return {}
    out: dict[str, tuple[int, int]] = {}
    for layer in range(args.num_layers):
        out.update({m: s for m, s in linear_shapes(args, layer).items() if q.quantized(m)})
    return out


def checkpoint_shapes(args: ModelArgs, stored: dict[str, Shape]) -> dict[str, Shape]:
    """`stored` (the unquantized layout) with each quantized linear's weight replaced by its
    format's tensors."""
    q = args.quant
    if q is None:
        return stored
    out = dict(stored)
    for module, (rows, cols) in quantized_modules(args).items():
        del out[module + ".weight"]
        out.update(checkpoint_tensors(q, module, rows, cols))
    return out


def unexpected(names: set[str], stored: dict[str, Shape], harmless: tuple[str, ...]
               ) -> tuple[list[str], list[str]]:
    """Checkpoint tensors the model does not read: (quantization state: an error, the rest)."""
    extra = sorted(n for n in names - stored.keys()
                   if not n.endswith(harmless) and n != "lm_head.weight")
    return [n for n in extra if is_quant_state(n)], [n for n in extra if not is_quant_state(n)]


def quant_state_error(names: list[str], args: ModelArgs) -> ValueError:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    why = ("config.json has no quantization_config" if args.quant is None else
           f"quantization_config ({args.quant.kind}) does not use it")
    return ValueError(f"unexpected quantization tensor {names[0]!r}{more}: {why}")


class QuantLinears:
    """Builds each fused linear of a rank from the checkpoint (see the module doc)."""

    def __init__(self, args: ModelArgs, shard: Shard, dtype: torch.dtype,
                 read: Callable[[str, Part], torch.Tensor], dense: Callable[[str], torch.Tensor],
                 keep_quantized: bool) -> None:
        assert args.quant is not None
        self.args, self.q, self.shard, self.dtype = args, args.quant, shard, dtype
        self.read, self.dense = read, dense
        self.keep_quantized = keep_quantized
        self.modules = quantized_modules(args)
        self.modes: dict[str, int] = {}  # kernel mode -> fused linears using it

    def part(self, module: str) -> QuantWeight:
        """Linear `module`'s part on this rank, unpacked."""
        weight = checkpoint_part(module + ".weight", self.args, self.shard)
        return read_linear(self.q, self.read, module, weight, self.modules[module][0])

    def __call__(self, names: list[str]) -> torch.Tensor | QuantLinear:
        """The fused linear of these ".weight" names: a QuantLinear, or a dense weight."""
        modules = [n.removesuffix(".weight") for n in names]
        if not all(m in self.modules for m in modules):
            return torch.cat([self.dense(n) if m not in self.modules
                              else self.part(m).dequantize(self.dtype)
                              for n, m in zip(names, modules, strict=True)])
        parts = [self.part(m) for m in modules]
        fused: QuantWeight = (
            Fp8Weight.cat([p for p in parts if isinstance(p, Fp8Weight)])
            if isinstance(parts[0], Fp8Weight)
            else Int4Weight.cat([p for p in parts if isinstance(p, Int4Weight)]))
        if not self.keep_quantized:
            return fused.dequantize(self.dtype)
        linear = QuantLinear(fused, self.dtype)
        self.modes[linear.mode] = self.modes.get(linear.mode, 0) + 1
        return linear
