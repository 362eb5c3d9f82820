"""One verify step of the K-step loop (speculative decoding, `gpu_worker.spec.batch`):
propose, one forward over the batch's rows and the speculating rows' drafts, sample every
position as a plain step would sample that token, accept each row's matching prefix of
drafts, cut runs at finishing tokens, advance on the device.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tandem_serve.gpu_worker.batch import DecodeBatch, StepTensors
from tandem_serve.gpu_worker.sampling.sampler import Sampler, SamplerOutput, SamplingTensors
from tandem_serve.gpu_worker.spec.batch import accept_prefix, finish_run
from tandem_serve.gpu_worker.spec.rows import DraftContext, advance_, draft_context
from tandem_serve.gpu_worker.steps import PrefillInputs
from tandem_serve.ipc.tracing import TRACER

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.executor import StepExecutor


def verify_step(b: DecodeBatch, step: int, pre: PrefillInputs | None, ex: StepExecutor,
                last: bool) -> StepTensors:
    """The step's tokens come back as [B, 1 + k] (-1 past each row's emitted run); the
    forward, the first position's sampling and the recording are the plain step's (`ex`)."""
    spec = b.spec
    assert spec is not None, "a verify step needs the plan's speculative state"
    rows, i = b.size, spec.index
    # Spans inside the step's "forward" (on CUDA, launch time: kernels run async).
    with TRACER.span("draft", b.plan_id, step):
        drafts, length = spec.proposer.propose(spec.inputs(
            b.input_ids, b.positions, b.active, b.block_tables, b.max_seq_len(step),
            b.row_lens(step)))
        length = spec.cap(length, b.positions, b.active, b.output_count, b.max_new,
                          ex.max_model_len)
    with TRACER.span("verify", b.plan_id, step):
        verify = spec.expand(b.input_ids, drafts, length, b.positions, b.active,
                             b.block_tables, b.max_seq_len(step), b.row_lens(step), b.states)
        if b.rope_delta is not None:  # M-RoPE: drafts rotate at index + their row's delta
            verify.rope_delta = spec.per_verify_row(b.rope_delta)
        logits, details = ex.logits(verify, step, pre, b.lora)
    # The first position exactly as a plain step samples it (every row: penalties, guided
    # masks, logprobs); the draft positions only for the rows that speculate.
    ctx = draft_context(b, spec, drafts, length)
    out = ex.sample(b, logits[:rows])
    later = _sample_later(b, i, logits[rows:].view(len(spec.chosen), spec.k, -1), ex.sampler,
                          ctx)
    tokens = torch.cat((out.token_ids.unsqueeze(1),
                        spec.spread(rows, later.token_ids.view(-1, spec.k), -1)), dim=1)
    all_length = spec.spread(rows, length, 0)
    accepted = accept_prefix(spec.spread(rows, drafts, -1), all_length, tokens)
    emitted, finish, count = finish_run(tokens, accepted, b.active, b.output_count,
                                        b.max_new, b.stop_ids, b.positions, ex.max_model_len)
    if ex.states is not None:  # each row's state after its emitted run, no more
        ex.states.commit(count)
    ex.record(b, emitted[:, 0], last)
    advance_(b, spec, ctx, emitted, count)
    spec.record(emitted[i], length, count[i], b.active[i])
    b.output_count += count.to(torch.int32)
    newest = emitted.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    b.input_ids = torch.where(count > 0, newest, b.input_ids)
    b.positions = b.positions + count
    b.active = b.active & (finish.amax(dim=1) == 0)

    def columns(first: Tensor | None, rest: Tensor | None) -> Tensor | None:
        """A token detail of position 0 [B, ...] and of the draft positions [S * k, ...]
        as [B, 1 + k, ...] (the publisher sends column j with the step's j-th batch)."""
        if first is None or rest is None:
            return first
        rest = spec.spread(rows, rest.view(len(spec.chosen), spec.k, *first.shape[1:]), 0)
        return torch.cat((first.unsqueeze(1), rest), dim=1)

    return StepTensors(step, emitted, finish, columns(out.logprobs, later.logprobs),
                       columns(out.ranks, later.ranks), columns(out.top_ids, later.top_ids),
                       columns(out.top_logprobs, later.top_logprobs), details)


def _sample_later(b: DecodeBatch, index: Tensor, logits: Tensor, sampler: Sampler,
                  ctx: DraftContext) -> SamplerOutput:
    """Positions 1..k of the speculating rows `index`, each as a plain step would sample it
    after the drafts before it: the output count it would have there (its seeded uniform,
    min_new_tokens and length penalty follow), the penalty tables and guided state along the
    draft path (`gpu_worker.spec.rows`), and the logprobs the batch asks for."""
    rows, k, vocab = logits.shape
    counts = (b.output_count[index].unsqueeze(1)
              + torch.arange(1, k + 1, dtype=b.output_count.dtype, device=logits.device))
    at = dataclasses.replace(b.sampling, params=_repeat(b.sampling.params, index, k),
                             seen=ctx.seen, counts=ctx.counts)
    return sampler(logits.reshape(rows * k, vocab), at, counts.reshape(-1), inplace=True,
                   mask=partial(ctx.mask_, k=k) if ctx.paths else None)


def _repeat(st: SamplingTensors, index: Tensor, k: int) -> SamplingTensors:
    """The parameters of rows `index`, each k times over."""
    fields = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    return SamplingTensors(**{name: t[index].repeat_interleave(k, dim=0)
                              for name, t in fields.items() if t is not None})
