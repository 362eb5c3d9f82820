"""LoRA on the device: adapter slots as stacked weights, applied to mixed batches.

Every fused linear of the decoder (q|k|v, o, gate|up, down) gets, per layer, two stacked
matrices over the `max_loras` slots, each slot R_m = n_sub * max_lora_rank rows wide (one
block per sub-module: q, k, v for the fused qkv), an adapter's blocks packed at the front of
its slot at its own rank (lower-rank modules padded with zeros):

    A  [slots * R_m, in]    the slots' lora_A blocks
    Bt [slots * R_m, out]   their lora_B blocks, transposed, scaled by alpha/r, each in the
                            output columns of its sub-module (the rest zero)

A forward gets a `LoraContext`, built once per plan (decode) or per prefill, in one of two
forms; a plan with no adapter rows gets none and skips all of it.

* masked (CUDA graphs): every row's slot as a one-hot [T, slots]; per module

      u = x @ A^T ;  u *= one-hot (per slot block) ;  out += u @ Bt

  rows of different adapters (or none: an all-zero one-hot adds exactly 0) share one pair
  of matmuls with static shapes, so a captured graph serves any mix, and loading an
  adapter only rewrites weights in place.  Cost per token ∝ slots * R_m * (in + out).
  On CUDA with Triton the same contract is met by BGMV kernels (`gpu_worker.lora_bgmv`):
  each row gathers only its own slot's rows, ∝ R_m * (in + out), still graph-safe.
* segments (eager forwards: CPU, prefill, anything not replayed from a graph): the runner
  orders a plan's rows by slot, so each adapter's rows are one contiguous range, known on
  the host when the plan starts; per module and adapter, `out[a:b] += x[a:b] @ A_s^T @ Bt_s`.
  Each token pays only its own adapter, at its own rank (∝ n_sub * r * (in + out)), for two
  small matmuls per adapter in the plan; modules an adapter does not target are skipped.

Neither reads anything back from the device inside the K-step loop.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open

from tandem_serve.adapters.peft import (
    AdapterError,
    LoraAdapter,
    LoraModule,
    ModelShapes,
    read_adapter,
)
from tandem_serve.gpu_worker.models.config import ModelArgs
from tandem_serve.gpu_worker.models.fused import use_triton
from tandem_serve.gpu_worker.models.sharding import Shard, lora_part

log = logging.getLogger(__name__)

# Fused module of the decoder -> the PEFT modules stacked in it, in output order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_PLACE = {sub: (fused, i) for fused, subs in FUSED.items() for i, sub in enumerate(subs)}
FUSED_OF = {sub: fused for sub, (fused, _) in _PLACE.items()}


class LoraWeights:
    """The stacked slot weights of every layer, and what each slot holds."""

    def __init__(self, shapes: ModelShapes, cache_dir: str, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device,
                 split: Callable[[LoraModule, str, torch.Tensor], torch.Tensor] | None = None,
                 full_shapes: ModelShapes | None = None,
                 expert_layers: tuple[bool, ...] = ()) -> None:
        # Under tensor parallelism `shapes` are this rank's modules and `full_shapes` the
        # model's (what an adapter's files hold); `split` cuts a file's A or B to the rank's
        # part (`tensor_parallel_split`).
        self.shapes = shapes
        self.full_shapes = full_shapes or shapes
        self.split = split
        # Per layer: whether its MLP is a mixture of experts (no gate/up/down to adapt).
        self.expert_layers = expert_layers
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
        self.used: dict[int, dict[str, int]] = {}  # slot -> fused module -> rows it fills
        self.failed: dict[int, AdapterError] = {}  # slot -> why its last load failed
        self._slot_ids = torch.arange(1, max_loras + 1, device=device)
        # Hybrid models (`hybrid`): the gated attention's (query heads, head_dim) and which
        # layers are linear attention (no attention projections to adapt).
        self.gated: tuple[int, int] | None = None
        self.linear_layers: tuple[bool, ...] = ()

    def hybrid(self, heads: int, head_dim: int, linear_layers: tuple[bool, ...]) -> None:
        """A hybrid model: q_proj's B rows interleave query and gate rows per head, and the
        fused projection is q | k | v | gate, so the query rows go first and the gate rows
        after v."""
        self.gated, self.linear_layers = (heads, head_dim), linear_layers
        q, kv = heads * head_dim, self.shapes.linears["k_proj"][0]
        self.offsets.update(q_proj=0, k_proj=q, v_proj=q + kv)

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
            adapter = read_adapter(self.cache_dir, adapter_id, self.full_shapes, self.max_rank)
            self._check_experts(adapter)
            self._copy_in(slot, adapter)
        except Exception as exc:
            self.clear(slot)
            error = exc if isinstance(exc, AdapterError) else AdapterError(
                adapter_id, f"loading failed: {type(exc).__name__}: {exc}")
            self.failed[slot] = error
            raise error from exc
        self.adapter_of[slot] = adapter_id
        self.failed.pop(slot, None)
        log.info("adapter %r loaded into slot %d (rank %d, %s)", adapter_id, slot,
                 adapter.rank, ", ".join(adapter.targets))

    def _check_experts(self, adapter: LoraAdapter) -> None:
        """Experts are stacked per projection, not linear layers: an adapter on the MLP of a
        mixture-of-experts layer is refused rather than silently left out."""
        for m in adapter.modules:
            if FUSED_OF[m.module] in ("qkv", "o") and self.linear_layers \
                    and self.linear_layers[m.layer]:
                raise AdapterError(adapter.adapter_id, f"adapts {m.module} of layer {m.layer}, "
                                   "a linear-attention layer, which has no such projection")
            if FUSED_OF[m.module] in ("gate_up", "down") and self.expert_layers \
                    and self.expert_layers[m.layer]:
                raise AdapterError(adapter.adapter_id, f"adapts {m.module} of layer {m.layer}, "
                                   "whose MLP is a mixture of experts; adapters on experts "
                                   "are not supported")

    def clear(self, slot: int) -> None:
        for layer in range(self.shapes.num_layers):
            for f, r in self.rows.items():
                self.a[layer][f][(slot - 1) * r: slot * r].zero_()
                self.bt[layer][f][(slot - 1) * r: slot * r].zero_()
        self.adapter_of.pop(slot, None)
        self.used.pop(slot, None)

    def _copy_in(self, slot: int, adapter: LoraAdapter) -> None:
        # Per fused module, sub-module blocks `width` rows apart: the adapter's highest rank.
        width: dict[str, int] = {}
        for m in adapter.modules:
            fused = _PLACE[m.module][0]
            width[fused] = max(width.get(fused, 0), m.rank)
        with safe_open(adapter.weights_path, framework="pt", device="cpu") as f:
            for m in adapter.modules:
                fused, index = _PLACE[m.module]
                first = (slot - 1) * self.rows[fused] + index * width[fused]
                rows = slice(first, first + m.rank)
                a = f.get_tensor(m.a_key).float()
                b = f.get_tensor(m.b_key).float() * m.scaling  # folded in at full precision
                if self.split is not None:
                    a, b = self.split(m, "A", a), self.split(m, "B", b)
                col = self.offsets[m.module]
                self.a[m.layer][fused][rows].copy_(a.to(self.dtype))
                bt = self.bt[m.layer][fused]
                if m.module == "q_proj" and self.gated is not None:
                    heads, d = self.gated
                    per_head = b.reshape(heads, 2 * d, -1)
                    gate_col = bt.shape[1] - heads * d  # after q | k | v
                    bt[rows, :heads * d].copy_(per_head[:, :d].reshape(heads * d, -1).t())
                    bt[rows, gate_col:].copy_(per_head[:, d:].reshape(heads * d, -1).t())
                    continue
                bt[rows, col: col + b.shape[0]].copy_(b.t().to(self.dtype))
        self.used[slot] = {f: len(FUSED[f]) * w for f, w in width.items()}

    # ------------------------------------------------------------------ forwards

    def context(self, slots: list[int]) -> LoraContext | None:
        """The eager context for rows with these slots (segments when each adapter's rows
        are one or two ranges, else masked); None when no row uses an adapter."""
        if not any(slots):
            return None
        index = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        runs = [(s, a) for a, s in enumerate(slots) if a == 0 or slots[a - 1] != s]
        adapted = [s for s, _ in runs if s]
        # An adapter's rows may be a few ranges (guided rows come grouped by constraint
        # first); many ranges per adapter would cost more small matmuls than the mask.
        if max(adapted.count(s) for s in set(adapted)) > 2:
            return LoraContext(self, index)
        bounds = [a for _, a in runs] + [len(slots)]
        segments = [(s, a, b, self.used.get(s, {}))
                    for (s, a), b in zip(runs, bounds[1:], strict=True) if s]
        return LoraContext(self, index, segments)

    def full_context(self, slots: torch.Tensor) -> LoraContext:
        """Every slot and module, whatever is loaded: the shape a CUDA graph captures."""
        return LoraContext(self, slots)


# An adapter's rows in a forward: (slot, first row, end row, rows of its slot each fused
# module uses; a module it does not adapt is absent).
Segment = tuple[int, int, int, dict[str, int]]


@dataclass
class LoraContext:
    """One forward's adapter rows: `add` puts each row's own adapter delta on a module."""

    weights: LoraWeights
    slots: torch.Tensor  # [T] int64 on the device, 0 = no adapter
    segments: list[Segment] | None = None  # None: masked over every slot

    def __post_init__(self) -> None:
        # The masked form on CUDA with Triton: per-row gathers of the row's own slot
        # (`gpu_worker.lora_bgmv`) instead of every slot times a one-hot.
        self.bgmv = self.segments is None and use_triton(self.slots)
        if self.segments is None and not self.bgmv:
            ids = self.weights._slot_ids
            self.onehot = (self.slots.unsqueeze(1) == ids).to(self.weights.dtype).unsqueeze(2)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out_features] += each row's adapter delta for `fused` at `layer`."""
        w = self.weights
        r = w.rows[fused]
        a, bt = w.a[layer][fused], w.bt[layer][fused]
        if self.segments is not None:
            for slot, first, end, used in self.segments:
                if fused in used:
                    rows = slice((slot - 1) * r, (slot - 1) * r + used[fused])
                    out[first:end].addmm_(F.linear(x[first:end], a[rows]), bt[rows])
            return out
        if self.bgmv:
            from tandem_serve.gpu_worker.lora_bgmv import add_lora  # imports triton

            return add_lora(x, a, bt, self.slots, out, r)
        u = F.linear(x, a)
        u = (u.view(-1, w.max_loras, r) * self.onehot).view(-1, w.max_loras * r)
        return out.addmm_(u, bt)


_PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def tensor_parallel_split(args: ModelArgs, shard: Shard
                          ) -> Callable[[LoraModule, str, torch.Tensor], torch.Tensor]:
    """Cut an adapter's A [r, in] or B [out, r] to this rank's part, the way its module's
    weight is cut (`sharding.lora_part`): each rank's delta is then its slice of the output
    (column-parallel) or a partial sum the module's all-reduce adds up (row-parallel)."""

    def split(m: LoraModule, matrix: str, t: torch.Tensor) -> torch.Tensor:
        name = f"model.layers.{m.layer}.{_PREFIX[m.module]}.{m.module}.weight"
        part = lora_part(name, "A" if matrix == "A" else "B", args, shard)
        if part.dim is None:
            return t
        return t.narrow(part.dim, part.start, part.stop - part.start)

    return split
