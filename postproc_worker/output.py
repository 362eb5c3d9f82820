"""Per-request response assembly: ids → text delta, stop strings, token detail, finish."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from postproc_worker.detokenizer import IncrementalDetokenizer
from postproc_worker.stops import StopChecker
from proto.messages import FinishReason, OutputDelta, RegisterRequest, TokenBatch
from rpc.tokenizer import Tokenizer


@dataclass
class RowDetail:
    logprob: float | None = None
    rank: int | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


class RequestOutput:
    def __init__(self, reg: RegisterRequest, tok: Tokenizer) -> None:
        self.request_id = reg.request_id
        self.options = reg.options
        self._tok = tok
        self._detok = IncrementalDetokenizer(tok, reg.prompt_ids.tolist(),
                                             reg.options.skip_special_tokens)
        self._stops = StopChecker(reg.options.stop_sequences, reg.options.include_stop_sequence)
        self.generated = 0
        self.done = False

    def add(self, token_id: int, finish: FinishReason, detail: RowDetail) -> OutputDelta:
        """One generated token (the last one when `finish` is set)."""
        self.generated += 1
        delta = OutputDelta(self.request_id, "", self.generated, [token_id])
        self._add_detail(delta, token_id, detail)
        text, matched = self._stops.feed(self._detok.add([token_id]))
        if matched is None and finish != FinishReason.NOT_FINISHED:
            tail, matched = self._stops.feed(self._detok.flush())
            text += tail
            if matched is None:  # a held-back overlap of stops may still resolve to one
                text += self._stops.flush()
                matched = self._stops.matched
        delta.text = text
        if matched is not None:
            delta.finish_reason = FinishReason.STOP_SEQUENCE
            delta.stop_sequence = matched
        elif finish != FinishReason.NOT_FINISHED:
            delta.finish_reason = finish
            if finish == FinishReason.EOS_TOKEN:
                delta.stop_sequence = self._tok.id_to_token(token_id)
        self.done = delta.finish_reason != FinishReason.NOT_FINISHED
        return delta

    def _add_detail(self, delta: OutputDelta, token_id: int, d: RowDetail) -> None:
        opts = self.options
        if not opts.token_details:
            return
        delta.token_texts = [self._tok.id_to_token(token_id)]
        if opts.logprobs and d.logprob is not None:
            delta.logprobs = [float(d.logprob)]
        if opts.ranks and d.rank is not None:
            delta.ranks = [int(d.rank)]
        if opts.top_n and d.top_ids is not None and d.top_logprobs is not None:
            ids = [int(i) for i in d.top_ids[: opts.top_n]]
            delta.top_ids = [ids]
            delta.top_texts = [[self._tok.id_to_token(i) for i in ids]]
            delta.top_logprobs = [[float(x) for x in d.top_logprobs[: opts.top_n]]]


def row_detail(batch: TokenBatch, i: int) -> RowDetail:
    return RowDetail(
        logprob=None if batch.logprobs is None else float(batch.logprobs[i]),
        rank=None if batch.ranks is None else int(batch.ranks[i]),
        top_ids=None if batch.top_ids is None else batch.top_ids[i],
        top_logprobs=None if batch.top_logprobs is None else batch.top_logprobs[i])
