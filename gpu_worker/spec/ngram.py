"""Speculative decoding's `ngram` method (prompt lookup): a row's drafts continue the most
recent earlier occurrence of its longest suffix n-gram, for n from `prompt_lookup_max` down
to `prompt_lookup_min`, found by batched tensor ops over each speculating row's history (the
plan's `SpecBatch.history`, on the device).  No model, no KV cache, no cost worth timing:
every hook but `propose` is the interface's default.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem_serve.gpu_worker.spec.proposer import DraftInputs, Proposer, ProposerContext
from tandem_serve.proto.speculative import SpeculativeConfig


class NgramProposer(Proposer):
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, rows: DraftInputs) -> tuple[Tensor, Tensor]:
        return propose_ngram(rows.history, rows.hist_len, rows.k, self.n_min, self.n_max)


def build_ngram(config: SpeculativeConfig, ctx: ProposerContext) -> NgramProposer:
    """The registry's factory for method `ngram`."""
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def propose_ngram(history: Tensor, hist_len: Tensor, k: int, n_min: int, n_max: int
                  ) -> tuple[Tensor, Tensor]:
    """Prompt-lookup drafts for every row: the longest suffix n-gram (n_max down to n_min)
    of `history[:hist_len]` that also occurs earlier; its most recent earlier occurrence's
    continuation, up to k tokens, is the draft.  Returns drafts [B, k] (garbage past each
    row's length) and their lengths [B] (0: no match)."""
    rows, width = history.shape
    device = history.device
    start = torch.full((rows,), -1, dtype=torch.int64, device=device)
    found = torch.zeros(rows, dtype=torch.bool, device=device)
    for n in range(n_max, n_min - 1, -1):
        if width < n + 1:
            continue
        windows = history.unfold(1, n, 1)  # [B, W, n]: every n-gram, by start
        suffix_at = (hist_len - n).clamp(min=0).unsqueeze(1) + torch.arange(n, device=device)
        suffix = history.gather(1, suffix_at.clamp(max=width - 1))
        same = (windows == suffix.unsqueeze(1)).all(dim=2)  # [B, W]
        at = torch.arange(windows.shape[1], device=device)
        # An earlier occurrence with at least one token after it (not the suffix itself).
        ok = same & (at.unsqueeze(0) + n < hist_len.unsqueeze(1)) & (hist_len >= n).unsqueeze(1)
        last = torch.where(ok, at.unsqueeze(0), -1).amax(dim=1)
        take = ~found & (last >= 0)
        start = torch.where(take, last + n, start)
        found = found | take
    length = torch.where(found, (hist_len - start).clamp(max=k), 0)
    index = (start.clamp(min=0).unsqueeze(1) + torch.arange(k, device=device))
    return history.gather(1, index.clamp(max=width - 1)), length
