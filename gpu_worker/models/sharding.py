"""Tensor-parallel sharding, Megatron style: which part of each checkpoint tensor a rank holds.

Torch-free (shape arithmetic only), so the launcher can refuse a shape that does not split
before any process starts (`tandem.preflight`), and the loader reads only its rank's part of
each tensor from the checkpoint.

| module | style | rank r of N holds | communication |
|---|---|---|---|
| embed_tokens | vocab-parallel | rows [r V/N, (r+1) V/N) | all-reduce (zeros elsewhere) |
| q_proj (+ bias) | column | its query heads [r Hq/N, (r+1) Hq/N) | none |
| k_proj, v_proj (+ bias) | column | its kv heads [r Hkv/N, ...) (1) | none |
| q_norm, k_norm (Qwen3) | per head_dim | all of it | none |
| o_proj | row | its query heads' columns; bias on rank 0 | one all-reduce |
| gate_proj, up_proj (+ bias) | column | rows [r I/N, (r+1) I/N) | none |
| down_proj | row | the matching columns; bias on rank 0 | one all-reduce |
| each expert's gate/up (w1/w3) | column | rows [r I_e/N, (r+1) I_e/N) of every expert | none |
| each expert's down (w2) | row | the matching columns | one all-reduce (per MoE block) |
| router (mlp.gate) | replicated | all of it | none |
| norms | replicated | all of it | none |
| lm_head (or tied embedding) | vocab-parallel | rows [r V/N, (r+1) V/N) | all-gather logits |

(1) With fewer kv heads than ranks, kv head r // (N / Hkv): each head replicated to N / Hkv
ranks, the ones whose query heads use it.

A rank's `ModelArgs` (`local_args`) has its own head, kv-head and MLP widths, so the decoder
and the KV cache code run unchanged on a shard; `vocab_size` stays the full vocabulary (the
sampler sees gathered logits).

LoRA adapters split the same way (`lora_part`): on a column-parallel module A is replicated
and B split along its output rows like the weight; on a row-parallel module A is split along
its input columns like the weight and B replicated.  Each rank's delta is then its slice of
the output (column) or a partial sum that the module's existing all-reduce adds up (row),
so adapters cost no extra communication.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from tandem_serve.gpu_worker.models.config import ModelArgs

FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class Shard:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")


@dataclass(frozen=True)
class Part:
    """What a rank reads of one checkpoint tensor: [start, stop) along `dim`, all of it
    (`dim` None), or zeros of the tensor's shape (`zeros`: a row-parallel bias off rank 0)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    zeros: bool = False


WHOLE = Part()
ZEROS = Part(zeros=True)


def split_problems(args: ModelArgs, size: int) -> list[str]:
    """Why `args` cannot be split over `size` ranks, each naming the shape and the flag."""
    if size <= 1:
        return []
    out = []
    sizes = [("num_attention_heads", args.num_heads),
             ("intermediate_size", args.intermediate_size), ("vocab_size", args.vocab_size)]
    if args.num_experts:
        sizes.append(("moe_intermediate_size", args.moe_intermediate_size))
    if args.shared_expert_intermediate_size:
        sizes.append(("shared_expert_intermediate_size", args.shared_expert_intermediate_size))
    if args.linear_attn is not None:  # Gated DeltaNet: whole key heads (and their value heads)
        sizes.append(("linear_num_key_heads", args.linear_attn.num_k_heads))
    for name, value in sizes:
        if value % size:
            out.append(f"{name} {value} is not divisible by {FLAG} {size}")
    kv = args.num_kv_heads
    if kv >= size and kv % size:
        out.append(f"num_key_value_heads {kv} is not divisible by {FLAG} {size}")
    elif kv < size and size % kv:
        out.append(f"{FLAG} {size} is not a multiple of num_key_value_heads {kv} (fewer kv "
                   f"heads than ranks are replicated, each to the same number of ranks)")
    return out


def check_split(args: ModelArgs, size: int) -> None:
    problems = split_problems(args, size)
    if problems:
        raise ValueError("; ".join(problems))


def local_kv_heads(args: ModelArgs, size: int) -> int:
    return max(1, args.num_kv_heads // size)


def kv_heads(args: ModelArgs, shard: Shard) -> tuple[int, int]:
    """[first, last) kv heads of `shard`; one replicated head when there are fewer than ranks."""
    kv = args.num_kv_heads
    if kv >= shard.size:
        n = kv // shard.size
        return shard.rank * n, (shard.rank + 1) * n
    head = shard.rank // (shard.size // kv)
    return head, head + 1


def local_args(args: ModelArgs, shard: Shard) -> ModelArgs:
    """The decoder's shape on one rank (vocab_size stays the whole vocabulary)."""
    if shard.size == 1:
        return args
    check_split(args, shard.size)
    s, n = args.linear_attn, shard.size
    return dataclasses.replace(args, num_heads=args.num_heads // n,
                               num_kv_heads=local_kv_heads(args, n),
                               intermediate_size=args.intermediate_size // n,
                               moe_intermediate_size=args.moe_intermediate_size // n,
                               shared_expert_intermediate_size=(
                                   args.shared_expert_intermediate_size // n),
                               linear_attn=None if s is None else dataclasses.replace(
                                   s, num_k_heads=s.num_k_heads // n,
                                   num_v_heads=s.num_v_heads // n))


def vocab_range(args: ModelArgs, shard: Shard) -> tuple[int, int]:
    n = args.vocab_size // shard.size
    return shard.rank * n, (shard.rank + 1) * n


Style = Literal["column", "row", "vocab", "replicated"]


def style(name: str) -> Style:
    """How a checkpoint tensor (or the module it belongs to) is split."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "vocab"
    if any(m in name for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", ".w1.",
                               ".w3.")):
        return "column"
    if any(m in name for m in ("o_proj", "down_proj", ".w2.")):
        return "row"
    return "replicated"


def checkpoint_part(name: str, args: ModelArgs, shard: Shard) -> Part:
    """The part of checkpoint tensor `name` (HF naming, global shapes) that `shard` holds."""
    if shard.size == 1:
        return WHOLE
    if ".linear_attn." in name:
        return _linear_attention_part(name, args, shard)
    kind = style(name)
    if kind == "vocab":
        return Part(0, *vocab_range(args, shard))
    if kind == "replicated":
        return WHOLE
    d = args.head_dim
    if "q_proj" in name and args.attn_output_gate:  # per head: d query rows, then d gate rows
        n = args.num_heads // shard.size
        rows = (shard.rank * n * 2 * d, (shard.rank + 1) * n * 2 * d)
    elif "q_proj" in name or "o_proj" in name:
        n = args.num_heads // shard.size
        rows = (shard.rank * n * d, (shard.rank + 1) * n * d)
    elif "k_proj" in name or "v_proj" in name:
        first, last = kv_heads(args, shard)
        rows = (first * d, last * d)
    else:  # gate_proj, up_proj, down_proj; an expert's are its own width
        width = (args.moe_intermediate_size if ".experts." in name
                 else args.shared_expert_intermediate_size if ".shared_expert." in name
                 else args.intermediate_size)
        n = width // shard.size
        rows = (shard.rank * n, (shard.rank + 1) * n)
    if kind == "column":  # weight [out, in] and bias [out]: split the output rows
        return Part(0, *rows)
    if name.endswith(".bias"):
        # Row-parallel: the bias must be added once to the all-reduced sum.
        return WHOLE if shard.rank == 0 else ZEROS
    return Part(1, *rows)  # weight [out, in]: split the input columns


def _linear_attention_part(name: str, args: ModelArgs, shard: Shard) -> Part:
    """A Gated DeltaNet tensor's part: each rank holds whole key heads and their value heads.
    Qwen3-Next's in_proj_qkvz / in_proj_ba group their rows by key head (contiguous per rank);
    the q | k | v parts of Qwen3.5's in_proj_qkv and of the convolution are asked for
    separately (`layout.views`), each split by heads; norm.weight (per head dim) is whole."""
    s = args.linear_attn
    assert s is not None
    kh, vh = s.num_k_heads // shard.size, s.num_v_heads // shard.size

    def rows(per_head: int, heads: int) -> Part:
        return Part(0, shard.rank * heads * per_head, (shard.rank + 1) * heads * per_head)

    r = s.num_v_heads // s.num_k_heads
    if "in_proj_qkvz" in name:
        return rows(2 * s.head_k_dim + 2 * r * s.head_v_dim, kh)
    if "in_proj_ba" in name:
        return rows(2 * r, kh)
    if name.endswith(("in_proj_q.weight", "in_proj_k.weight", "conv1d_q.weight",
                      "conv1d_k.weight")):
        return rows(s.head_k_dim, kh)
    if name.endswith(("in_proj_v.weight", "in_proj_z.weight", "conv1d_v.weight")):
        return rows(s.head_v_dim, vh)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log")):
        return rows(1, vh)
    if name.endswith("out_proj.weight"):
        return Part(1, shard.rank * vh * s.head_v_dim, (shard.rank + 1) * vh * s.head_v_dim)
    return WHOLE


def lora_part(module_weight: str, matrix: Literal["A", "B"], args: ModelArgs,
              shard: Shard) -> Part:
    """The part of a LoRA matrix (A [r, in], B [out, r]) for the module whose checkpoint
    weight is `module_weight`: column-parallel modules replicate A and split B like the
    weight's rows; row-parallel ones split A like the weight's columns and replicate B."""
    part = checkpoint_part(module_weight, args, shard)
    kind = style(module_weight)
    if kind == "column":
        return part if matrix == "B" else WHOLE
    if kind == "row":
        return part if matrix == "A" else WHOLE
    return WHOLE
