"""Whether a quantized checkpoint's linear layers fit the format's packing and, under tensor
parallelism, split without cutting a scale group, a scale block or a packed word.

Torch-free, so the launcher (`split_problems`: the dense model's and these) refuses a shape or
a `--tensor-parallel-size` before any process starts. What must hold, per rank part:

* int4: input columns are a multiple of 8 (packed words) and of the group size; a
  row-parallel rank's columns start at a group boundary. GPTQ and AWQ pack zeros (and AWQ
  the weight) along the outputs: a column-parallel rank's rows start and end on a word.
* fp8-block: a row-parallel rank's columns start at a block boundary. Output rows may cut a
  block: each rank reads the scale rows its rows use (`formats`).
"""
from __future__ import annotations

from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.quant.config import AWQ, FP8_BLOCK, GPTQ, QuantConfig
from tandem_serve.gpu_worker.models.quant.tensors import PACK
from tandem_serve.gpu_worker.models.sharding import FLAG, Shard, checkpoint_part
from tandem_serve.gpu_worker.models.sharding import split_problems as dense_problems

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def linear_shapes(args: ModelArgs, layer: int) -> dict[str, tuple[int, int]]:
    """Each dense linear of `layer`: its module name -> the whole model's [out, in]."""
    h, d, i = args.hidden_size, args.head_dim, args.intermediate_size
    shapes = ((args.num_heads * d, h), (args.num_kv_heads * d, h), (args.num_kv_heads * d, h),
              (h, args.num_heads * d), (i, h), (i, h), (h, i))
    p = f"model.layers.{layer}."
    return {p + m: s for m, s in zip(_LINEARS, shapes, strict=True)}


def split_problems(args: ModelArgs, size: int) -> list[str]:
    """Why `args` cannot be served at `size` ranks: the dense shapes' and the quantized
    layout's reasons."""
    return dense_problems(args, size) + problems(args, size)


def problems(args: ModelArgs, size: int) -> list[str]:
    """Why the quantized linears cannot be read at `size` ranks (size 1: at all)."""
    q = args.quant
    if q is None:
        return []
    out: list[str] = []
    for module, (rows, cols) in linear_shapes(args, 0).items():
        if not q.quantized(module):
            continue
        name = module.split(".", 2)[-1]
        out += _shape_problems(q, name, rows, cols)
        if size > 1 and not out:
            for rank in range(size):
                part = checkpoint_part(module + ".weight", args, Shard(rank, size))
                why = _part_problem(q, part.dim, part.start, part.stop)
                if why:
                    out.append(f"{FLAG} {size} would split {why}: {name}'s "
                               f"{'rows' if part.dim == 0 else 'input columns'} "
                               f"[{part.start}, {part.stop}) on rank {rank}")
                    break
    return out


def _shape_problems(q: QuantConfig, name: str, rows: int, cols: int) -> list[str]:
    out = []
    if q.is_int4 and cols % PACK:
        out.append(f"{name}'s {cols} input columns are not a multiple of {PACK} "
                   f"(int4 packs {PACK} to a word)")
    if q.group_size and cols % q.group_size:
        out.append(f"{name}'s {cols} input columns are not a multiple of "
                   f"quantization_config group_size {q.group_size}")
    if q.kind in (GPTQ, AWQ) and rows % PACK:
        out.append(f"{name}'s {rows} output rows are not a multiple of {PACK} ({q.kind} "
                   "packs zeros along the outputs)")
    return out


def _part_problem(q: QuantConfig, dim: int | None, a: int, b: int) -> str | None:
    if dim == 1:  # row-parallel: input columns
        if q.kind == FP8_BLOCK and a % q.block[1]:
            return f"a weight_block_size block of {q.block[1]} input columns"
        unit = q.group_size or PACK
        if q.is_int4 and a % unit:
            what = f"group_size {q.group_size}" if q.group_size else f"{PACK}-value words"
            return f"a group ({what})"
    if dim == 0 and q.kind in (GPTQ, AWQ) and (a % PACK or b % PACK):
        return f"a packed word of {PACK} outputs"
    return None
