"""Per-request response assembly: ids → text delta, stop strings, token detail, finish.

Input-token detail (prompt logprobs from the gpu worker's prefill, in `PromptDetail` chunks)
is collected per request and goes out once, on the request's first delta.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem_serve.postproc_worker.detokenizer import IncrementalDetokenizer
from tandem_serve.postproc_worker.stops import StopChecker
from tandem_serve.proto.request_messages import RegisterRequest
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta, PromptDetail, TokenBatch
from tandem_serve.tokenization.tokenizer import Tokenizer


@dataclass
class RowDetail:
    logprob: float | None = None
    rank: int | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


# A generated token as the postproc worker receives it: id, finish known on the device, detail.
Row = tuple[int, FinishReason, "RowDetail"]


class PromptScores:
    """A prompt's logprobs, ranks and alternatives as `PromptDetail` chunks fill them in.

    Chunks cover [start, start + n); a re-sent range (a prefill redone) overwrites.  Position
    0 has no prefix, so it keeps NaN / rank 0 / no alternatives.
    """

    def __init__(self, num_tokens: int) -> None:
        self.logprobs = np.full(num_tokens, np.nan, dtype=np.float32)
        self.ranks = np.zeros(num_tokens, dtype=np.int32)
        self.top_ids: np.ndarray | None = None  # [num_tokens, k], -1 where unscored
        self.top_logprobs: np.ndarray | None = None
        self.started = False  # a chunk has come: the first token waits for the last one
        self.complete = False

    def add(self, msg: PromptDetail) -> None:
        n = len(self.logprobs)
        start = max(msg.start, 0)
        end = min(msg.start + len(msg.logprobs), n)
        src = slice(start - msg.start, end - msg.start)
        self.started = True
        if end > start:
            self.logprobs[start:end] = msg.logprobs[src]
            self.ranks[start:end] = msg.ranks[src]
            if msg.top_ids is not None and msg.top_logprobs is not None:
                if self.top_ids is None or self.top_ids.shape[1] != msg.top_ids.shape[1]:
                    k = msg.top_ids.shape[1]
                    self.top_ids = np.full((n, k), -1, dtype=np.int32)
                    self.top_logprobs = np.zeros((n, k), dtype=np.float32)
                assert self.top_logprobs is not None
                self.top_ids[start:end] = msg.top_ids[src]
                self.top_logprobs[start:end] = msg.top_logprobs[src]
        self.complete = self.complete or msg.last

    def fill(self, delta: OutputDelta, tok: Tokenizer) -> None:
        delta.prompt_logprobs = [float(x) for x in self.logprobs]
        delta.prompt_ranks = [int(x) for x in self.ranks]
        if self.top_ids is None or self.top_logprobs is None:
            return
        texts: list[list[str]] = []
        lps: list[list[float]] = []
        for ids, row in zip(self.top_ids.tolist(), self.top_logprobs.tolist(), strict=True):
            keep = [j for j, i in enumerate(ids) if i >= 0]
            texts.append([tok.id_to_token(ids[j]) for j in keep])
            lps.append([row[j] for j in keep])
        delta.prompt_top_texts = texts
        delta.prompt_top_logprobs = lps


class RequestOutput:
    def __init__(self, reg: RegisterRequest, tok: Tokenizer) -> None:
        self.request_id = reg.request_id
        self.options = reg.options
        self._tok = tok
        self._detok = IncrementalDetokenizer(tok, reg.prompt_ids.tolist(),
                                             reg.options.skip_special_tokens)
        self._stops = StopChecker(reg.options.stop_sequences, reg.options.include_stop_sequence)
        self._prompt = PromptScores(len(reg.prompt_ids))
        self.held: list[Row] = []  # tokens that came while the prompt detail was incomplete
        self.generated = 0
        self.done = False

    @property
    def awaiting_prompt(self) -> bool:
        """Some prompt detail came but not its last chunk: the first delta must wait for it."""
        return self.generated == 0 and self._prompt.started and not self._prompt.complete

    def add_prompt_detail(self, msg: PromptDetail) -> None:
        # After the first delta the client has the input detail already; a later chunk is a
        # prefill redone after preemption and changes nothing the client sees.
        if self.generated == 0:
            self._prompt.add(msg)

    def add(self, token_id: int, finish: FinishReason, detail: RowDetail) -> OutputDelta:
        """One generated token (the last one when `finish` is set)."""
        self.generated += 1
        delta = OutputDelta(self.request_id, "", self.generated, [token_id])
        if self.generated == 1 and self._prompt.started:
            self._prompt.fill(delta, self._tok)
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
