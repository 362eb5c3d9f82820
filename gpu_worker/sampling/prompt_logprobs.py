"""Input-token detail: each prompt token's logprob, rank and top-n given its prefix.

A prefill forward over positions [start, end) of a request yields hidden states whose logits
predict the tokens at positions start + 1 .. end.  The worker prefills history[:len - 1], so
across a request's chunks every prompt token 1 .. L-1 is predicted by exactly one position
(0 .. L-2); token 0 has no prefix.  `RequestState.num_prompt_scored` remembers how far a
request got, so re-prefilling after preemption (or a later chunk overlapping nothing new)
never sends a token twice.

Only the rows of requests that asked are sent through the LM head, in slices, so a long
flattened prefill never materialises [T, vocab] logits.  Scores are taken from the raw model
logits (no penalties, no temperature), as HF's forward gives them.  Which rows score what is
decided on the host when a forward's inputs are built (`select_rows`); the scores stay on the
device (`score_tensors`) until the token publisher reads them off the K-step loop's thread
and builds the messages (`messages`), so a step with prefill pieces reads nothing back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem_serve.proto.token_messages import PromptDetail

if TYPE_CHECKING:
    from tandem_serve.gpu_worker.models.decoder import CausalLM
    from tandem_serve.gpu_worker.state import RequestState

log = logging.getLogger(__name__)

# LM-head rows per slice: bounds the float32 logits to ROWS_PER_SLICE * vocab at a time.
ROWS_PER_SLICE = 256


@dataclass
class _Span:
    req: RequestState
    first: int  # first prompt position scored by this span (the token at first + 1)
    count: int


@dataclass
class ScoreRows:
    """Which rows of a flattened prefill score which prompt tokens."""

    rows: list[int] = field(default_factory=list)  # indices into the forward's tokens
    targets: list[int] = field(default_factory=list)  # the token each row scores
    spans: list[_Span] = field(default_factory=list)  # consecutive runs of rows, per request
    # rows and targets on the device, copied when the forward's inputs are (`to`)
    device_rows: torch.Tensor | None = None
    device_targets: torch.Tensor | None = None

    def to(self, device: torch.device) -> ScoreRows:
        if self.rows:
            self.device_rows = torch.tensor(self.rows, dtype=torch.int64).to(
                device, non_blocking=True)
            self.device_targets = torch.tensor(self.targets, dtype=torch.int64).to(
                device, non_blocking=True).unsqueeze(1)
        return self


def select_rows(reqs: list[RequestState], chunk_starts: list[int],
                row_offsets: list[int], chunk_lens: list[int]) -> ScoreRows:
    """The rows to score in a prefill of `reqs`, whose chunk i starts at history position
    chunk_starts[i] and at row row_offsets[i] of the flattened forward."""
    sel = ScoreRows()
    for r, start, offset, n in zip(reqs, chunk_starts, row_offsets, chunk_lens, strict=True):
        if not r.sampling.prompt_logprobs:
            continue
        if r.num_prompt_scored < start < r.num_prompt:
            log.warning("request %d: prompt positions %d..%d were never computed (prefix "
                        "cache?); their prompt logprobs are missing", r.request_id,
                        r.num_prompt_scored, start - 1)
            r.num_prompt_scored = min(start, r.num_prompt - 1)
        lo = max(start, r.num_prompt_scored)
        hi = min(start + n, r.num_prompt - 1)
        if hi <= lo:
            continue
        sel.rows.extend(range(offset + lo - start, offset + hi - start))
        sel.targets.extend(r.history[lo + 1: hi + 1])
        sel.spans.append(_Span(r, lo, hi - lo))
        # Selected is as good as sent: the forward that computes these rows runs before any
        # later selection reads this (a plan's steps run in order).
        r.num_prompt_scored = hi
    return sel


@torch.inference_mode()
def score_tensors(model: CausalLM, hidden: torch.Tensor, sel: ScoreRows) -> list[torch.Tensor]:
    """The selected rows' scores on the device (chosen logprob, rank[, top ids, top
    logprobs]) from a prefill's hidden states [T, H]; nothing is read back."""
    if sel.device_rows is None:
        sel.to(hidden.device)
    rows, targets = sel.device_rows, sel.device_targets
    assert rows is not None and targets is not None
    top_n = max(s.req.sampling.top_n for s in sel.spans)
    parts: list[tuple[torch.Tensor, ...]] = []
    for a in range(0, len(sel.rows), ROWS_PER_SLICE):
        b = a + ROWS_PER_SLICE
        lp = torch.log_softmax(model.compute_logits(hidden.index_select(0, rows[a:b])), dim=1)
        chosen = lp.gather(1, targets[a:b])
        ranks = (lp > chosen).sum(dim=1, dtype=torch.int32).add_(1)
        part: tuple[torch.Tensor, ...] = (chosen.squeeze(1), ranks)
        if top_n > 0:
            top_lp, top_ids = torch.topk(lp, min(top_n, lp.shape[1]), dim=1)
            part += (top_ids.to(torch.int32), top_lp)
        parts.append(part)
    return [torch.cat(cols) for cols in zip(*parts, strict=True)]


def messages(sel: ScoreRows, host: list[np.ndarray]) -> list[PromptDetail]:
    """The PromptDetail messages of `sel`, from its `score_tensors` read back to the host."""
    out = []
    targets = np.asarray(sel.targets, dtype=np.int32)
    at = 0
    for s in sel.spans:
        r, end = s.req, at + s.count
        n = r.sampling.top_n
        out.append(PromptDetail(
            request_id=r.request_id, start=s.first + 1, token_ids=targets[at:end],
            logprobs=host[0][at:end].astype(np.float32, copy=False), ranks=host[1][at:end],
            top_ids=host[2][at:end, :n] if n > 0 else None,
            top_logprobs=host[3][at:end, :n] if n > 0 else None,
            last=s.first + s.count == r.num_prompt - 1))
        at = end
    return out


def empty_detail(req: RequestState) -> PromptDetail:
    """The whole detail of a one-token prompt: nothing to score, but the reader learns so."""
    n = req.sampling.top_n
    return PromptDetail(
        request_id=req.request_id, start=1, token_ids=np.zeros(0, dtype=np.int32),
        logprobs=np.zeros(0, dtype=np.float32), ranks=np.zeros(0, dtype=np.int32),
        top_ids=np.zeros((0, n), dtype=np.int32) if n > 0 else None,
        top_logprobs=np.zeros((0, n), dtype=np.float32) if n > 0 else None, last=True)
