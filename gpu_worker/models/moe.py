"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral) as one grouped computation.

Routing: softmax over the router's logits in float32, the top k experts per token, their
weights renormalised to sum to 1 when the family does (`norm_topk_prob`; Mixtral always).

Experts: every expert's gate|up and down weights are stacked at load into one tensor per
projection ([E, 2I, H] and [E, H, I]). A forward sorts the T*k (token, expert) pairs by
expert, gathers their rows, runs one grouped matmul per projection over the experts'
contiguous row ranges (`torch.nn.functional.grouped_mm`: a CUTLASS kernel for bfloat16 on
CUDA, a loop in C++ on CPU), weighs each row by its routing weight, puts the rows back in
token order and sums each token's k rows. The group offsets are computed on the device
(`searchsorted` over the sorted expert ids), so nothing is read back to the host and every
shape is fixed by T and k: the K-step loop stays sync-free and CUDA graphs can capture it.
This is transformers' own `grouped_mm` experts path, operation for operation, so float32
results match it.

Where the grouped kernel cannot run (strides not 16-byte multiples; on CUDA float16,
float32 or a pre-sm80 GPU), each pair gathers its expert's weights and one batched matmul
runs them: the same numbers, at the cost of copying T*k experts' weights per forward.

Tensor parallelism splits each expert's intermediate dimension like a dense MLP's (gate|up
by rows, down by columns); the block's output is then a partial sum the layer's all-reduce
completes, and the router is replicated.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem_serve.gpu_worker.models.config import ModelArgs

Activation = Callable[[torch.Tensor], torch.Tensor]
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_usable(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...]) -> bool:
    """Whether torch's grouped matmul serves these weights: every row stride a multiple of
    16 bytes; on CUDA, bfloat16 on an sm80+ device (what its kernel takes)."""
    if _grouped_mm is None:
        return False
    width = torch.empty((), dtype=dtype).element_size()
    if any(d * width % 16 for d in dims):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return True


def route(x: torch.Tensor, router: torch.Tensor, args: ModelArgs
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (expert ids [T, k], weights [T, k]) as transformers' routers compute them."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, args.num_experts_per_tok, dim=-1)
    if args.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not args.router_weights_fp32:
        weights = weights.to(logits.dtype)
    return experts, weights


def experts_forward(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, act: Activation,
                    grouped: bool) -> torch.Tensor:
    """Each token's weighted sum over its k experts of down(act(gate) * up); [T, H]."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    sorted_ids, perm = torch.sort(flat)
    rows = x[perm // k]
    # Where each expert's rows end: the group offsets, computed on the device.
    ids = torch.arange(gate_up.shape[0], device=x.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, ids, right=True).to(torch.int32)
    gu = _project(rows, gate_up, sorted_ids, ends, grouped)
    i = gu.shape[1] // 2
    out = _project(act(gu[:, :i]) * gu[:, i:], down, sorted_ids, ends, grouped)
    out = out * weights.reshape(-1)[perm].unsqueeze(-1)
    back = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], device=x.device))
    return out[back].view(t, k, -1).sum(dim=1).to(x.dtype)


def _project(rows: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, ends: torch.Tensor,
             grouped: bool) -> torch.Tensor:
    """rows [S, in] sorted by expert -> [S, out] through each row's expert's [out, in]."""
    if not grouped:
        return torch.bmm(weight[ids], rows.unsqueeze(2)).squeeze(2)
    assert _grouped_mm is not None
    out: torch.Tensor = _grouped_mm(rows, weight.transpose(-2, -1), offs=ends)
    return out
