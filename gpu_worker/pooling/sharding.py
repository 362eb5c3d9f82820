"""Tensor parallelism for the pooling models, Megatron style, on transformers' own modules.

Each rank loads the checkpoint whole, then keeps its part of every layer's linears and
drops the rest (pooling models are small: reading them whole once costs less than a
per-tensor loader for each family):

| linear (BERT and XLM-R; Qwen3) | style | rank r of N keeps | communication |
|---|---|---|---|
| query, key, value; q/k/v_proj | column | its heads | none |
| intermediate.dense; gate/up_proj | column | rows [r I/N, (r+1) I/N) | none |
| attention.output.dense, output.dense; o_proj, down_proj | row | its columns (1) | all-reduce |

(1) The bias is added once, after the sum.

Embeddings, norms, BERT's pooler and a cross-encoder's classifier stay whole on every rank.
transformers' attention reshapes to (-1 heads, head size), so a rank's modules run its heads
without any other change; every rank ends each layer with the same hidden states, and rank
0's pooled output is the group's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# (suffix of the module's name, style) per family; the first suffix that matches decides.
_ENCODER = (("attention.self.query", "column"), ("attention.self.key", "column"),
            ("attention.self.value", "column"), ("attention.output.dense", "row"),
            ("intermediate.dense", "column"), ("output.dense", "row"))
_DECODER = (("self_attn.q_proj", "column"), ("self_attn.k_proj", "column"),
            ("self_attn.v_proj", "column"), ("self_attn.o_proj", "row"),
            ("mlp.gate_proj", "column"), ("mlp.up_proj", "column"), ("mlp.down_proj", "row"))


class RowParallelLinear(nn.Module):
    """A row-parallel linear: this rank's input columns, the partial outputs summed over the
    ranks, then the bias once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


def split_problems(config: object, size: int) -> list[str]:
    """What keeps the model from splitting over `size` ranks (empty: nothing)."""
    out = []
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % size:
            out.append(f"{name} ({value}) is not a multiple of --tensor-parallel-size {size}")
    return out


def shard(model: nn.Module, rank: int, size: int, causal: bool,
          all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Replace the model's layer linears by this rank's parts; how many were split."""
    rules = _DECODER if causal else _ENCODER
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        style = next((s for suffix, s in rules if name.endswith(suffix)), None)
        if style is not None:
            targets.append((name, module, style))
    for name, module, style in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, _part(module, style, rank, size, all_reduce))
    return len(targets)


def _part(linear: nn.Linear, style: str, rank: int, size: int,
          all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    w, b = linear.weight.data, linear.bias.data if linear.bias is not None else None
    if style == "column":
        rows = w.shape[0] // size
        keep = slice(rank * rows, (rank + 1) * rows)
        out = nn.Linear(w.shape[1], rows, bias=b is not None, device=w.device, dtype=w.dtype)
        out.weight.data.copy_(w[keep])
        if b is not None:
            out.bias.data.copy_(b[keep])
        return out.requires_grad_(False)
    cols = w.shape[1] // size
    part = w[:, rank * cols:(rank + 1) * cols].contiguous()
    return RowParallelLinear(part, b.clone() if b is not None else None, all_reduce)
