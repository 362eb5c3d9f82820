"""LoRA on the device: adapter slots as stacked weights, applied to mixed batches.

Every fused linear of the decoder (q|k|v, o, gate|up, down) gets, per layer, two stacked
matrices over the `max_loras` slots, each slot `n_sub * max_lora_rank` rows wide (one block
per sub-module: q, k, v for the fused qkv; ranks below the maximum padded with zeros):

    A  [slots * R_m, in]    the slots' lora_A blocks
    Bt [slots * R_m, out]   their lora_B blocks, transposed, scaled by alpha/r, each in the
                            output columns of its sub-module (the rest zero)

A forward gets a `LoraContext`: every row's slot (0 = no adapter) as a one-hot [T, n] over
slots 1..n, built once per plan for decode rows.  Per module it runs

    u = x @ A[:n R_m]^T ;  u *= one-hot (per slot block) ;  out += u @ Bt[:n R_m]

so rows of different adapters (or none: an all-zero one-hot adds exactly 0) share one pair
of matmuls with static shapes: the K-step loop and CUDA graphs need no host read, and a plan
with no adapter rows skips all of it.  Eager forwards use only the first n slots (the
highest slot in the plan) and the modules its adapters target; graphs take every slot.  The
cost per token is ∝ n * max_lora_rank * (in + out) per adapted module.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open

from adapters.peft import AdapterError, LoraAdapter, ModelShapes, read_adapter

log = logging.getLogger(__name__)

# Fused module of the decoder -> the PEFT modules stacked in it, in output order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_PLACE = {sub: (fused, i) for fused, subs in FUSED.items() for i, sub in enumerate(subs)}


class LoraWeights:
    """The stacked slot weights of every layer, and what each slot holds."""

    def __init__(self, shapes: ModelShapes, cache_dir: str, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shapes = shapes
        self.cache_dir = cache_dir
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.rows = {f: len(subs) * max_rank for f, subs in FUSED.items()}  # R_m per slot
        self.offsets: dict[str, int] = {}  # sub-module -> first output column in its fused
        for subs in FUSED.values():
            col = 0
            for sub in subs:
                self.offsets[sub] = col
                col += shapes.linears[sub][0]
        zeros = lambda r, c: torch.zeros(max_loras * r, c, dtype=dtype, device=device)  # noqa: E731
        self.a: list[dict[str, torch.Tensor]] = []
        self.bt: list[dict[str, torch.Tensor]] = []
        for _ in range(shapes.num_layers):
            self.a.append({f: zeros(self.rows[f], shapes.linears[subs[0]][1])
                           for f, subs in FUSED.items()})
            self.bt.append({f: zeros(self.rows[f], sum(shapes.linears[s][0] for s in subs))
                            for f, subs in FUSED.items()})
        self.adapter_of: dict[int, str] = {}  # slot -> adapter id loaded there
        self.targets: dict[int, frozenset[str]] = {}  # slot -> fused modules it adapts
        self.failed: dict[int, AdapterError] = {}  # slot -> why its last load failed
        self.all_modules = frozenset(FUSED)
        self._slot_ids = torch.arange(1, max_loras + 1, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (*self.a, *self.bt) for t in d.values())

    # ------------------------------------------------------------------ loading

    def load(self, slot: int, adapter_id: str) -> None:
        """Read the adapter off the cache into `slot`; on any failure the slot holds zeros
        and is marked failed (AdapterError: the reason, naming the adapter)."""
        if not 1 <= slot <= self.max_loras:
            raise AdapterError(adapter_id, f"slot {slot} is outside 1..{self.max_loras}")
        self.clear(slot)
        try:
            adapter = read_adapter(self.cache_dir, adapter_id, self.shapes, self.max_rank)
            self._copy_in(slot, adapter)
        except Exception as exc:
            self.clear(slot)
            error = exc if isinstance(exc, AdapterError) else AdapterError(
                adapter_id, f"loading failed: {type(exc).__name__}: {exc}")
            self.failed[slot] = error
            raise error from exc
        self.adapter_of[slot] = adapter_id
        self.targets[slot] = frozenset(_PLACE[m][0] for m in adapter.targets)
        self.failed.pop(slot, None)
        log.info("adapter %r loaded into slot %d (rank %d, %s)", adapter_id, slot,
                 adapter.rank, ", ".join(adapter.targets))

    def clear(self, slot: int) -> None:
        for layer in range(self.shapes.num_layers):
            for f, r in self.rows.items():
                self.a[layer][f][(slot - 1) * r: slot * r].zero_()
                self.bt[layer][f][(slot - 1) * r: slot * r].zero_()
        self.adapter_of.pop(slot, None)
        self.targets.pop(slot, None)

    def _copy_in(self, slot: int, adapter: LoraAdapter) -> None:
        with safe_open(adapter.weights_path, framework="pt", device="cpu") as f:
            for m in adapter.modules:
                fused, index = _PLACE[m.module]
                first = (slot - 1) * self.rows[fused] + index * self.max_rank
                rows = slice(first, first + m.rank)
                a = f.get_tensor(m.a_key).float()
                b = f.get_tensor(m.b_key).float() * m.scaling  # folded in at full precision
                col = self.offsets[m.module]
                self.a[m.layer][fused][rows].copy_(a.to(self.dtype))
                self.bt[m.layer][fused][rows, col: col + b.shape[0]].copy_(
                    b.t().to(self.dtype))

    # ------------------------------------------------------------------ forwards

    def context(self, slots: list[int]) -> LoraContext | None:
        """The eager context for rows with these slots; None when no row uses an adapter."""
        n = max(slots, default=0)
        if n == 0:
            return None
        modules = frozenset().union(*(self.targets.get(s, frozenset()) for s in set(slots)))
        index = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        return LoraContext(self, index, n, modules)

    def full_context(self, slots: torch.Tensor) -> LoraContext:
        """Every slot and module, whatever is loaded: the shape a CUDA graph captures."""
        return LoraContext(self, slots, self.max_loras, self.all_modules)


@dataclass
class LoraContext:
    """One forward's adapter rows: `add` puts each row's own adapter delta on a module."""

    weights: LoraWeights
    slots: torch.Tensor  # [T] int64 on the device, 0 = no adapter
    n: int  # slots 1..n take part
    modules: frozenset[str]  # fused modules some taking-part adapter adapts

    def __post_init__(self) -> None:
        ids = self.weights._slot_ids[: self.n]
        self.onehot = (self.slots.unsqueeze(1) == ids).to(self.weights.dtype).unsqueeze(2)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out_features] += each row's adapter delta for `fused` at `layer`."""
        if fused not in self.modules:
            return out
        w = self.weights
        r = w.rows[fused]
        rows = self.n * r
        u = F.linear(x, w.a[layer][fused][:rows])
        u = (u.view(-1, self.n, r) * self.onehot).view(-1, rows)
        return out.addmm_(u, w.bt[layer][fused][:rows])
