"""The plan's decode batch: the decoding requests' host state (`gpu_worker.state`) moved
to the device once per plan; the K steps then advance it on the device without reading
anything back.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem_serve.gpu_worker.attention.base import StateRows
from tandem_serve.gpu_worker.sampling.sampler import SamplerHints, SamplingBatch, SamplingTensors
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.proto.token_messages import PromptDetail

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.constrain.tables import GuidedBatch, GuidedRegistry
    from tandem_serve.gpu_worker.lora import LoraContext
    from tandem_serve.gpu_worker.spec.batch import SpecBatch


@dataclass
class DecodeBatch:
    """Device tensors for the decoding rows of one plan, advanced in place step by step."""

    request_ids: np.ndarray  # int64 [B], host
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, nb] int32
    active: torch.Tensor  # [B] bool
    output_count: torch.Tensor  # [B] int32
    max_new: torch.Tensor  # [B] int32
    stop_ids: torch.Tensor  # [B, S] int64, -1 padded
    # The rows' sampling parameters, penalty tables (advanced in place) and host facts.
    sampling: SamplingBatch
    max_position: int  # host: largest starting position
    guided: GuidedBatch | None = None  # the plan's constrained rows (None: there are none)
    lora: LoraContext | None = None  # the rows' adapters, once per plan (None: none)
    # Rows that start decoding at a later step of the plan (their last prefill piece runs
    # then): step -> [B] bool, the rows that join then.  Masked until that step.
    joins: dict[int, torch.Tensor] = field(default_factory=dict)
    # Host bound of the joined rows' context length at each step: rows not yet decoding
    # must not widen every row's gathered context (their own output is discarded).
    step_lens: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)  # host, at the plan's start
    join_steps: list[int] = field(default_factory=list)
    # Speculative decoding (`gpu_worker.spec`): the plan's drafts and histories, and
    # the most positions a row advances per step (1 + k; 1 without speculation).
    spec: SpecBatch | None = None
    stride: int = 1
    plan_id: int = -1  # for the profiler's spans inside a step
    # An M-RoPE model's (Qwen VL) per-row offset of the rotary position past the prompt
    # (`gpu_worker.vision.inputs`); None: rotary positions are the positions.
    rope_delta: torch.Tensor | None = None
    # Hybrid models: the rows' recurrent-state slots (None: no such model).
    states: StateRows | None = None

    def max_seq_len(self, step: int) -> int:
        if step < len(self.step_lens):
            return self.step_lens[step]
        return self.max_position + (step + 1) * self.stride

    def row_lens(self, step: int) -> list[int]:
        """Host bound of each row's context length at `step` (a row not decoding yet: 1,
        its output is discarded)."""
        joins = self.join_steps or [0] * len(self.start_positions)
        return [p + (step - j + 1) * self.stride if j <= step else 1
                for p, j in zip(self.start_positions, joins, strict=True)]

    @property
    def size(self) -> int:
        return int(self.request_ids.shape[0])

    def join(self, step: int) -> None:
        """Unmask the rows whose last prefill piece runs in `step`."""
        joining = self.joins.get(step)
        if joining is not None:
            self.active = self.active | joining


def _pad(rows: list[list[int]], fill: int) -> np.ndarray:
    width = max(1, max((len(r) for r in rows), default=1))
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _pad_float(rows: list[list[float]]) -> np.ndarray:
    width = max(1, max((len(r) for r in rows), default=1))
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def build_decode_batch(reqs: list[RequestState], vocab_size: int, device: torch.device,
                       guided: GuidedRegistry | None = None,
                       join_steps: list[int] | None = None, stride: int = 1) -> DecodeBatch:
    """`join_steps[i]`: the step row i starts decoding in (None: every row from step 0);
    `stride`: the most positions a row advances per step (speculative decoding)."""
    params = [r.sampling for r in reqs]
    joins = join_steps or [0] * len(reqs)

    def col(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    st = SamplingTensors(
        temperature=col([p.temperature for p in params], torch.float32),
        top_k=col([p.top_k for p in params], torch.int32),
        top_p=col([p.top_p for p in params], torch.float32),
        typical_p=col([p.typical_p for p in params], torch.float32),
        min_p=col([p.min_p for p in params], torch.float32),
        repetition_penalty=col([p.repetition_penalty for p in params], torch.float32),
        seed=col([p.seed & 0x7FFF_FFFF_FFFF_FFFF for p in params], torch.int64),
        min_new_tokens=col([p.min_new_tokens for p in params], torch.int32),
        stop_token_ids=torch.from_numpy(_pad([p.stop_token_ids for p in params], -1)).to(device),
        lp_start=col([p.length_penalty_start for p in params], torch.int32),
        lp_decay=col([p.length_penalty_decay for p in params], torch.float32),
        prompt_len=col([r.num_prompt for r in reqs], torch.int32),
    )
    any_penalty = any(p.repetition_penalty != 1.0 for p in params)
    seen = None
    if any_penalty:
        seen = torch.zeros(len(reqs), vocab_size, dtype=torch.bool)
        for i, r in enumerate(reqs):
            seen[i, torch.tensor(r.history, dtype=torch.int64)] = True
        seen = seen.to(device)
    counts = None
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        st.frequency_penalty = col([p.frequency_penalty for p in params], torch.float32)
        st.presence_penalty = col([p.presence_penalty for p in params], torch.float32)
        counts = torch.zeros(len(reqs), vocab_size, dtype=torch.float32)
        for i, r in enumerate(reqs):
            out = torch.tensor(r.history[r.num_prompt:], dtype=torch.int64)
            counts[i].index_add_(0, out, torch.ones(len(out)))
        counts = counts.to(device)
    if any(p.logit_bias_ids for p in params):
        st.bias_ids = torch.from_numpy(_pad([p.logit_bias_ids for p in params], 0)).to(device)
        st.bias_values = torch.from_numpy(
            _pad_float([p.logit_bias_values for p in params])).to(device)
    positions = [len(r.history) - 1 for r in reqs]
    return DecodeBatch(
        request_ids=np.array([r.request_id for r in reqs], dtype=np.int64),
        input_ids=col([r.history[-1] for r in reqs], torch.int64),
        positions=col(positions, torch.int64),
        block_tables=torch.from_numpy(_pad([r.block_ids for r in reqs], 0).astype(np.int32))
        .to(device),
        active=col([s == 0 for s in joins], torch.bool),
        output_count=col([r.num_generated for r in reqs], torch.int32),
        max_new=col([p.max_new_tokens for p in params], torch.int32),
        stop_ids=st.stop_token_ids,
        sampling=SamplingBatch(
            st, SamplerHints.from_params(params), seen, counts,
            all_greedy=all(p.temperature == 0.0 for p in params), any_penalty=any_penalty,
            need_logprobs=any(p.logprobs or p.top_n > 0 for p in params),
            max_top_n=max(p.top_n for p in params)),
        max_position=max(positions),
        guided=guided.batch(reqs) if guided is not None else None,
        joins={step: col([s == step for s in joins], torch.bool)
               for step in sorted(set(joins)) if step > 0},
        step_lens=_step_lens(positions, joins, stride) if any(joins) else [],
        start_positions=positions, join_steps=joins, stride=stride,
        states=StateRows(col([r.state_slot for r in reqs], torch.int64), [], [])
        if any(r.state_slot >= 0 for r in reqs) else None,
    )


def _step_lens(positions: list[int], joins: list[int], stride: int) -> list[int]:
    """Per step up to the last join, the longest joined row's context length then."""
    return [max([p + (step - j + 1) * stride for p, j in zip(positions, joins, strict=True)
                 if j <= step], default=1) for step in range(max(joins) + 1)]


@dataclass
class StepTensors:
    """One decode step's outputs, still on the device."""

    step: int
    token_ids: torch.Tensor  # [B] int64, -1 for masked rows
    finish: torch.Tensor  # [B] uint8
    logprobs: torch.Tensor | None
    ranks: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    # Prompt logprobs of the step's prefill pieces, still on the device, and what makes the
    # PromptDetail messages of them once read back (the publisher's `send_scores`).
    details: tuple[list[torch.Tensor], Callable[[list[np.ndarray]], list[PromptDetail]]] \
        | None = None
