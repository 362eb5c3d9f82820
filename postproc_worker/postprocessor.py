"""A postproc worker's state, driven by messages: each request's detokenizer, stops and
token detail, and the tokens that came before their request's registration.  No sockets:
`postproc_worker/main.py` feeds it, and unit tests drive it directly."""
from __future__ import annotations

import logging
import time

from tandem_serve.postproc_worker.output import RequestOutput, Row, RowDetail, row_detail
from tandem_serve.proto.request_messages import RegisterRequest
from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta, PromptDetail, TokenBatch
from tandem_serve.tokenization.tokenizer import Tokenizer

log = logging.getLogger("tandem.postproc")

# Tokens for a request whose registration has not arrived yet are kept this long.
PENDING_TTL = 30.0


class Postprocessor:
    """The worker's state, driven by messages; no sockets (unit tests drive it directly)."""

    def __init__(self, tok: Tokenizer, index: int) -> None:
        self.tok = tok
        self.index = index
        self.requests: dict[int, RequestOutput] = {}
        self.finished: dict[int, float] = {}  # late tokens of these are discarded
        # Tokens and prompt detail that came before their registration, in arrival order.
        self.pending: dict[int, tuple[float, list[Row | PromptDetail]]] = {}

    def register(self, msg: RegisterRequest) -> list[OutputDelta]:
        req = RequestOutput(msg, self.tok)
        self.requests[msg.request_id] = req
        _, early = self.pending.pop(msg.request_id, (0.0, []))
        deltas: list[OutputDelta] = []
        for item in early:
            if isinstance(item, PromptDetail):
                deltas += self.on_prompt_detail(item)
            elif not req.done:
                deltas += self._route(req, item)
        return deltas

    def on_prompt_detail(self, msg: PromptDetail) -> list[OutputDelta]:
        """A chunk of prompt logprobs; its last one releases the tokens that waited for it."""
        rid = msg.request_id
        if rid in self.finished:
            return []
        req = self.requests.get(rid)
        if req is None:  # registration still in flight: keep it, in order with the tokens
            self.pending.setdefault(rid, (time.monotonic(), []))[1].append(msg)
            return []
        req.add_prompt_detail(msg)
        if req.awaiting_prompt or not req.held:
            return []
        rows, req.held = req.held, []
        return [self._add(req, *row) for row in rows if not req.done]

    def _route(self, req: RequestOutput, row: Row) -> list[OutputDelta]:
        # The first delta carries the whole input detail, so it waits for the last chunk.
        if req.awaiting_prompt:
            req.held.append(row)
            return []
        return [self._add(req, *row)]

    def forget(self, request_id: int) -> None:
        self.requests.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.finished[request_id] = time.monotonic()

    def on_batch(self, batch: TokenBatch) -> list[OutputDelta]:
        deltas: list[OutputDelta] = []
        for i, rid in enumerate(batch.request_ids.tolist()):
            tok = int(batch.token_ids[i])
            if tok < 0 or rid in self.finished:
                continue
            row = (tok, FinishReason(int(batch.finish[i])), row_detail(batch, i))
            req = self.requests.get(rid)
            if req is None:  # registration still in flight: keep the token for it
                self.pending.setdefault(rid, (time.monotonic(), []))[1].append(row)
                continue
            deltas += self._route(req, row)
        return deltas

    def _add(self, req: RequestOutput, tok: int, finish: FinishReason,
             detail: RowDetail) -> OutputDelta:
        delta = req.add(tok, finish, detail)
        if req.done:
            del self.requests[req.request_id]
            self.finished[req.request_id] = time.monotonic()
        return delta

    def expire(self, now: float) -> None:
        for rid in [r for r, (t, _) in self.pending.items() if now - t > PENDING_TTL]:
            log.warning("dropping tokens of request %d: never registered", rid)
            del self.pending[rid]
        for rid in [r for r, t in self.finished.items() if now - t > PENDING_TTL]:
            del self.finished[rid]
