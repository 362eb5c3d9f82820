"""One verify step of the K-step loop (speculative decoding, `gpu_worker.spec_batch`):
propose, one forward over every row's 1 + k tokens, sample every position as a plain step
would sample that token, accept each row's matching prefix of drafts, cut runs at finishing
tokens, advance on the device.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tandem_serve.gpu_worker.batch import DecodeBatch, StepTensors
from tandem_serve.gpu_worker.sampler import Sampler, SamplerOutput, SamplingTensors
from tandem_serve.gpu_worker.spec_batch import VerifyRows, accept_prefix, finish_run
from tandem_serve.gpu_worker.steps import PrefillInputs

# (verify rows, step, the step's prefill pieces) -> logits [B * (1 + k), V] and prompt detail.
Forward = Callable[[VerifyRows, int, PrefillInputs | None], tuple[Tensor, Any]]
Sample = Callable[[DecodeBatch, Tensor], SamplerOutput]
# After sampling: per-row state that only rows without drafts use (guided, penalties).
Record = Callable[[DecodeBatch, Tensor], None]


def verify_step(b: DecodeBatch, step: int, pre: PrefillInputs | None, forward: Forward,
                sample: Sample, sampler: Sampler, record: Record, max_model_len: int
                ) -> StepTensors:
    """The step's tokens come back as [B, 1 + k] (-1 past each row's emitted run)."""
    spec = b.spec
    assert spec is not None, "a verify step needs the plan's speculative state"
    proposed = spec.drafter(b, step, pre) if spec.drafter is not None else None
    drafts, length = spec.propose(b.positions, b.active, b.output_count, b.max_new,
                                  max_model_len, proposed)
    rows = spec.expand(b.input_ids, drafts, length, b.positions, b.active, b.block_tables,
                       b.max_seq_len(step), b.row_lens(step))
    logits, details = forward(rows, step, pre)
    logits = logits.view(b.size, spec.stride, -1)
    # The first position exactly as a plain step samples it (every row: penalties, guided
    # masks, logprobs); the draft positions only matter for rows that speculate.
    out = sample(b, logits[:, 0].contiguous())
    later = _sample_later(b, logits[:, 1:], sampler)
    tokens = torch.cat((out.token_ids.unsqueeze(1), later.token_ids.view(b.size, -1)), dim=1)
    accepted = accept_prefix(drafts, length, tokens)
    emitted, finish, count = finish_run(tokens, accepted, b.active, b.output_count,
                                        b.max_new, b.stop_ids, b.positions, max_model_len)
    record(b, emitted[:, 0])
    b.output_count += count.to(torch.int32)
    last = emitted.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    b.input_ids = torch.where(count > 0, last, b.input_ids)
    b.positions = b.positions + count
    b.active = b.active & (finish.amax(dim=1) == 0)
    spec.record(emitted, length, count)
    return StepTensors(step, emitted, finish, _columns(out.logprobs, later.logprobs),
                       _columns(out.ranks, later.ranks), _columns(out.top_ids, later.top_ids),
                       _columns(out.top_logprobs, later.top_logprobs), details)


def _columns(first: Tensor | None, rest: Tensor | None) -> Tensor | None:
    """A token detail of position 0 [B, ...] and of positions 1..k [B * k, ...] as
    [B, 1 + k, ...] (the publisher sends column j with the step's j-th batch)."""
    if first is None or rest is None:
        return first
    rest = rest.view(first.shape[0], -1, *first.shape[1:])
    return torch.cat((first.unsqueeze(1), rest), dim=1)


def _sample_later(b: DecodeBatch, logits: Tensor, sampler: Sampler) -> SamplerOutput:
    """Positions 1..k of every row, each with the output count it would have there (its
    seeded uniform, min_new_tokens and length penalty follow), with the logprobs the batch
    asks for; no penalties or guided masks: rows that need them have no drafts, and their
    tokens here are never used."""
    rows, k, vocab = logits.shape
    counts = (b.output_count.unsqueeze(1)
              + torch.arange(1, k + 1, dtype=b.output_count.dtype, device=logits.device))
    return sampler(logits.reshape(rows * k, vocab), _repeat(b.sampling, k), None,
                   counts.reshape(-1), all_greedy=b.all_greedy, any_penalty=False,
                   need_logprobs=b.need_logprobs, max_top_n=b.max_top_n, hints=b.hints,
                   inplace=True)


def _repeat(st: SamplingTensors, k: int) -> SamplingTensors:
    """Each row's parameters k times over, without the output-count penalties."""
    fields = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    repeated = {name: t.repeat_interleave(k, dim=0) for name, t in fields.items()
                if t is not None}
    repeated.update(frequency_penalty=None, presence_penalty=None)
    return SamplingTensors(**repeated)
