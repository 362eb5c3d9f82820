"""One verify step of the K-step loop (speculative decoding, `gpu_worker.spec_batch`):
propose, one forward over every row's 1 + k tokens, sample the first token as a plain step
would, accept the greedy rows' drafts, cut runs at finishing tokens, advance on the device.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tandem_serve.gpu_worker.batch import DecodeBatch, StepTensors
from tandem_serve.gpu_worker.sampler import SamplerOutput
from tandem_serve.gpu_worker.spec_batch import (
    VerifyRows,
    accept_greedy,
    finish_run,
    mask_min_new,
)
from tandem_serve.gpu_worker.steps import PrefillInputs

# (verify rows, step, the step's prefill pieces) -> logits [B * (1 + k), V] and prompt detail.
Forward = Callable[[VerifyRows, int, PrefillInputs | None], tuple[Tensor, Any]]
Sample = Callable[[DecodeBatch, Tensor], SamplerOutput]
# After sampling: per-row state that only rows without drafts use (guided, penalties).
Record = Callable[[DecodeBatch, Tensor], None]


def verify_step(b: DecodeBatch, step: int, pre: PrefillInputs | None, forward: Forward,
                sample: Sample, record: Record, max_model_len: int) -> StepTensors:
    """The step's tokens come back as [B, 1 + k] (-1 past each row's emitted run)."""
    spec = b.spec
    assert spec is not None, "a verify step needs the plan's speculative state"
    drafts, length = spec.propose(b.positions, b.active, b.output_count, b.max_new,
                                  max_model_len)
    rows = spec.expand(b.input_ids, drafts, length, b.positions, b.active, b.block_tables,
                       b.max_seq_len(step), b.row_lens(step))
    logits, details = forward(rows, step, pre)
    logits = logits.view(b.size, spec.stride, -1)
    if b.hints.any_min_new_tokens:
        mask_min_new(logits, b.output_count, b.sampling.min_new_tokens, b.stop_ids)
    target = logits.argmax(dim=2)  # before the sampler edits the first column in place
    # Rows without drafts take exactly this token, as in a plain step; greedy rows with
    # drafts get the argmax here too (they have nothing that changes their logits).
    out = sample(b, logits[:, 0].contiguous())
    tokens = torch.cat((out.token_ids.unsqueeze(1), target[:, 1:]), dim=1)
    accepted = accept_greedy(drafts, length, target)
    emitted, finish, count = finish_run(tokens, accepted, b.active, b.output_count,
                                        b.max_new, b.stop_ids, b.positions, max_model_len)
    record(b, emitted[:, 0])
    b.output_count += count.to(torch.int32)
    last = emitted.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    b.input_ids = torch.where(count > 0, last, b.input_ids)
    b.positions = b.positions + count
    b.active = b.active & (finish.amax(dim=1) == 0)
    spec.record(emitted, length, count)
    return StepTensors(step, emitted, finish, out.logprobs, out.ranks, out.top_ids,
                       out.top_logprobs, details)
