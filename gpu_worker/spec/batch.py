"""Speculative decoding inside the K-step loop, its device state and tensor ops: drafts
proposed on the device by the method's `Proposer` (`gpu_worker.spec.proposer`), verified by
the step's one target forward (`gpu_worker.spec.verify`), accepted on the device.

A verify step gives each row that speculates in the plan (`gpu_worker.spec.policy` picks
them) 1 + k query tokens: its input token and up to k draft tokens at the following
positions.  The plan's rows come first, as a plain step has them, then k draft rows per
speculating row (same block table, its own position and context length), so the forward,
the attention paths and the mixed steps' prefill pieces need no new kernel: every token's
KV is written before any row attends, so the row of draft j sees drafts 1..j-1 of the same
forward, which is causal verification.  The draft positions a row does not use write
nothing (slot -1).

Every verify position is sampled as a plain step would sample that token (same processing,
same seeded uniform: the row's seed and its output count at that position), and a row
accepts the longest prefix of drafts equal to those tokens, then emits the sampled token at
the first mismatch: a + 1 tokens, identical to what a + 1 plain steps would have produced.
For greedy rows that is the longest prefix matching the argmax plus the target's next token.
For sampled rows it is exactly the standard rejection rule with a one-hot draft: the draft t
is accepted with probability p(t) (the sampled token is t), and on rejection the emitted
token is distributed as p with t removed and renormalised (a draw from p given it is not
t); the target distribution is kept exactly, and a seeded row gets the very tokens it gets
without speculation.  The KV of rejected drafts stays in the cache past the row's position
and is overwritten when real tokens reach those positions.  Stop ids, max_new_tokens and
max_model_len cut a run exactly at the finishing token.  Logprobs and top-n come from each
position's own distribution, as a plain step gives them.

Penalties and guided tables at a draft position count the drafts before it
(`gpu_worker.spec.rows`).  Rows that cannot be sampled that way do not speculate: grammar
rows (a host matcher, one step at a time), guided rows held by min_new_tokens, and, not
composed yet, typical-p (its entropy is a float sum that may round differently over the
verify rows).  They advance by their one sampled token, exactly as without speculation
(`eligible`).

Everything here is batched tensor ops with no host read, so the K-step loop stays free of
host syncs; the per-row history proposers read (n-gram searches it, the draft model takes
the token before the input from it) lives on the device for the plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem_serve.gpu_worker.attention.base import StateRows
from tandem_serve.gpu_worker.spec.proposer import DraftInputs, Proposer
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.proto.request_params import FinishReason, GuidedKind
from tandem_serve.proto.speculative import SpeculativeConfig


def eligible(req: RequestState) -> bool:
    """Whether the row's draft positions can be sampled as plain steps would sample them
    (the module doc)."""
    p = req.sampling
    if p.guided_kind == GuidedKind.GRAMMAR:
        return False  # its mask comes from a host matcher, one step at a time
    if p.guided_kind == GuidedKind.TABLE and p.min_new_tokens > 0:
        return False  # which stop ids it may hold back depends on each position's state
    return not 0 < p.typical_p < 1


def accept_prefix(drafts: Tensor, length: Tensor, target: Tensor) -> Tensor:
    """Drafts accepted per row: the longest prefix (within `length`) equal to the tokens
    sampled from the target at the same positions.  drafts [B, k], target [B, 1 + k]."""
    k = drafts.shape[1]
    within = torch.arange(k, device=drafts.device).unsqueeze(0) < length.unsqueeze(1)
    match = (drafts == target[:, :k]) & within
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)


def finish_run(tokens: Tensor, accepted: Tensor, active: Tensor, output_count: Tensor,
               max_new: Tensor, stop_ids: Tensor, positions: Tensor, max_model_len: int
               ) -> tuple[Tensor, Tensor, Tensor]:
    """Cut each row's run of `accepted + 1` tokens at its first finishing token.  Returns the
    emitted tokens [B, 1 + k] (-1 past the run), their finish reasons (uint8, at the
    finishing token only) and the emitted count per row."""
    j = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    in_run = (j <= accepted.unsqueeze(1)) & active.unsqueeze(1)
    is_stop = (tokens.unsqueeze(2) == stop_ids.unsqueeze(1)).any(dim=2)
    hit_max = output_count.unsqueeze(1) + j + 1 >= max_new.unsqueeze(1)
    # Token j makes the history positions + j + 2 long.
    hit_len = positions.unsqueeze(1) + j + 2 >= max_model_len
    reason = torch.where(
        is_stop, int(FinishReason.EOS_TOKEN),
        torch.where(hit_max, int(FinishReason.MAX_TOKENS),
                    torch.where(hit_len, int(FinishReason.TOKEN_LIMIT), 0)))
    reason = torch.where(in_run, reason, 0)
    ends = (reason > 0).to(torch.int32)
    after_end = (ends.cumsum(dim=1) - ends) > 0
    emit = in_run & ~after_end
    return (torch.where(emit, tokens, -1), torch.where(emit, reason, 0).to(torch.uint8),
            emit.sum(dim=1))


@dataclass
class VerifyRows:
    """A verify step's decode rows, shaped for the runner's forwards like a `DecodeBatch`:
    the plan's B rows as a plain step has them, then k draft rows for each of the S rows that
    speculate (a row's unused draft positions are inactive: they write no KV)."""

    input_ids: Tensor  # [B + S * k]
    positions: Tensor
    active: Tensor
    block_tables: Tensor
    bound: int  # host bound of every row's context length in this step
    lens: list[int]  # host bound per verify row
    # Hybrid models: the B rows' state slots and the speculating rows (None: no such model).
    states: StateRows | None = None
    # M-RoPE models: each row's rotary offset, a draft row's its request's (None: none).
    rope_delta: Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def max_seq_len(self, step: int) -> int:
        return self.bound

    def row_lens(self, step: int) -> list[int]:
        return self.lens


@dataclass
class SpecBatch:
    """A plan's speculative state on the device, next to its `DecodeBatch`: for the S rows
    that speculate in this plan (`index`, chosen by `gpu_worker.spec.policy`)."""

    config: SpeculativeConfig
    proposer: Proposer  # the method's (`gpu_worker.spec.registry`)
    index: Tensor  # [S] int64: the batch rows that speculate
    chosen: list[int]  # the same, on the host
    history: Tensor  # [S, L] int64: prompt + output so far, -1 past hist_len
    hist_len: Tensor  # [S] int64
    capacity: Tensor  # [S] int64: positions the row's KV blocks hold
    # Device counters per speculating row over the plan: verify steps it was active in,
    # steps it had a draft, draft tokens, accepted drafts.
    steps: Tensor
    drafted: Tensor
    draft_tokens: Tensor
    accepted: Tensor
    at_position: Tensor  # [k]: drafts accepted at each draft position, over the rows

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def stride(self) -> int:
        return self.k + 1

    def inputs(self, input_ids: Tensor, positions: Tensor, active: Tensor,
               block_tables: Tensor, bound: int, lens: list[int]) -> DraftInputs:
        """What the proposer sees of a step (the batch's [B] tensors and host bounds given):
        the speculating rows' part."""
        i = self.index
        return DraftInputs(self.k, self.history, self.hist_len, self.capacity, input_ids[i],
                           positions[i], active[i], block_tables[i], bound,
                           [lens[r] for r in self.chosen])

    def cap(self, length: Tensor, positions: Tensor, active: Tensor, output_count: Tensor,
            max_new: Tensor, max_model_len: int) -> Tensor:
        """The proposer's draft lengths [S] capped where tokens could never be kept: past
        the row's KV blocks, max_model_len or max_new_tokens (the batch's [B] tensors
        given); 0 for rows not decoding in this step."""
        i = self.index
        pos = positions[i]
        room = torch.minimum(self.capacity - 1 - pos,
                             torch.minimum(max_model_len - 2 - pos,
                                           (max_new[i] - output_count[i] - 1).to(torch.int64)))
        length = torch.minimum(length, room.clamp(min=0))
        return torch.where(active[i], length, 0)

    def expand(self, input_ids: Tensor, drafts: Tensor, length: Tensor, positions: Tensor,
               active: Tensor, block_tables: Tensor, bound: int, lens: list[int],
               states: StateRows | None = None) -> VerifyRows:
        """The verify forward's rows: the batch's B rows, then k draft rows per speculating
        row (`lens`: each batch row's host bound)."""
        i, k = self.index, self.k
        j = torch.arange(1, k + 1, device=positions.device).unsqueeze(0)
        used = active[i].unsqueeze(1) & (j <= length.unsqueeze(1))
        # Unused positions repeat the input token (a draft past a row's length may be -1).
        ids = torch.where(used, drafts, input_ids[i].unsqueeze(1))
        pos = torch.where(used, positions[i].unsqueeze(1) + j, positions[i].unsqueeze(1))
        return VerifyRows(torch.cat((input_ids, ids.reshape(-1))),
                          torch.cat((positions, pos.reshape(-1))),
                          torch.cat((active, used.reshape(-1))),
                          torch.cat((block_tables, block_tables[i].repeat_interleave(k, dim=0))),
                          bound, lens + [lens[r] for r in self.chosen for _ in range(k)],
                          None if states is None else StateRows(states.decode, [], [], (i, k)))

    def per_verify_row(self, values: Tensor) -> Tensor:
        """Per batch row values [B, ...] for the verify forward's rows (`expand`'s order):
        the batch's, then each speculating row's k times."""
        return torch.cat((values, values[self.index].repeat_interleave(self.k, dim=0)))

    def spread(self, rows: int, values: Tensor, fill: int) -> Tensor:
        """Per speculating row values [S, ...] as [rows, ...], `fill` elsewhere."""
        out = torch.full((rows, *values.shape[1:]), fill, dtype=values.dtype,
                         device=values.device)
        return out.index_copy_(0, self.index, values)

    def record(self, tokens: Tensor, length: Tensor, count: Tensor, active: Tensor) -> None:
        """Append each speculating row's emitted tokens [S, 1 + k] to its history; count its
        verify steps (`active`: the row decoded in this one), drafts and acceptances."""
        j = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        at = (self.hist_len.unsqueeze(1) + j).clamp(max=self.history.shape[1] - 1)
        keep = self.history.gather(1, at)
        self.history.scatter_(1, at, torch.where(tokens >= 0, tokens, keep))
        self.hist_len = self.hist_len + count
        drafted = length > 0
        self.steps += active.to(torch.int64)
        self.drafted += drafted.to(torch.int64)
        self.draft_tokens += length
        taken = torch.where(drafted, (count - 1).clamp(min=0), 0)
        self.accepted += taken
        j = torch.arange(self.k, device=taken.device).unsqueeze(0)
        self.at_position += (j < taken.unsqueeze(1)).sum(dim=0)

    def counts(self) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """Read back once the plan has ended: per speculating row its verify steps, steps
        with a draft, draft tokens and accepted drafts; and the drafts accepted at each draft
        position."""
        rows = torch.stack((self.steps, self.drafted, self.draft_tokens, self.accepted))
        flat = torch.cat((rows.reshape(-1), self.at_position)).tolist()
        n = len(self.chosen)
        steps, drafted, tokens, accepted = (flat[i * n:(i + 1) * n] for i in range(4))
        return steps, drafted, tokens, accepted, flat[4 * n:]


def verify_slots(spec: SpecBatch | None, slots: list[int]) -> list[int]:
    """Per-row values (adapter slots) for a step's rows: the batch's, then each speculating
    row's k times (`SpecBatch.expand`'s order)."""
    if spec is None:
        return slots
    return slots + [slots[i] for i in spec.chosen for _ in range(spec.k)]


def build_spec_batch(config: SpeculativeConfig, proposer: Proposer, reqs: list[RequestState],
                     chosen: list[int], num_steps: int, block_size: int, device: torch.device
                     ) -> SpecBatch:
    """The chosen rows' host histories onto the device once per plan, with room for the
    plan's tokens."""
    stride = config.num_speculative_tokens + 1
    rows = [reqs[i] for i in chosen]
    width = max(len(r.history) for r in rows) + num_steps * stride
    history = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        history[i, : len(r.history)] = torch.tensor(r.history, dtype=torch.int64)

    def col(values: list, dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    zeros = torch.zeros(len(rows), dtype=torch.int64, device=device)
    return SpecBatch(config, proposer, col(chosen), list(chosen),
                     history.to(device, non_blocking=True), col([len(r.history) for r in rows]),
                     col([len(r.block_ids) * block_size for r in rows]),
                     zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone(),
                     torch.zeros(config.num_speculative_tokens, dtype=torch.int64,
                                 device=device))
