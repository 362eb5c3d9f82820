"""One request's output queue in the frontend, bounded for clients that stop reading.

Deltas arrive one per decode step; the request's RPC takes them as fast as its client reads.
A client that stops reading makes gRPC's `yield` wait once the HTTP/2 flow-control windows
are full, and deltas pile up here.  Past FOLD_AFTER queued deltas, each new one folds into
the last one still waiting (fewer, longer deltas, nothing lost), and the payload folded so
far counts against `limit` bytes (text, token texts and token detail: what the client would
be sent).  Beyond it the stream *overflows*: what it holds is dropped, the request is to be
cancelled (its KV blocks freed) and the RPC ends with RESOURCE_EXHAUSTED naming the limit
whenever the client reads again.  A client that keeps up never gets near the limit: the
queue holds at most FOLD_AFTER deltas of one step each, and folding costs nothing then.
"""
from __future__ import annotations

import asyncio

from tandem_serve.proto.request_params import FinishReason
from tandem_serve.proto.token_messages import OutputDelta

FOLD_AFTER = 16  # queued deltas before new ones fold into the last
_LISTS = ("token_ids", "token_texts", "logprobs", "ranks", "top_ids", "top_texts",
          "top_logprobs")


def payload_bytes(d: OutputDelta) -> int:
    """About what `d` costs to send: UTF-8-ish text plus 8 bytes per number.

    Additive over folding (a folded delta costs the sum of its parts), so the buffer can add
    each part as it folds and subtract the whole when the RPC takes it.
    """
    n = len(d.text) + 8 * len(d.token_ids)
    if d.token_texts is not None:
        n += sum(len(t) for t in d.token_texts)
    for numbers in (d.logprobs, d.ranks):
        if numbers is not None:
            n += 8 * len(numbers)
    if d.top_texts is not None:
        n += sum(len(t) + 16 for row in d.top_texts for t in row)
    return n


def _foldable(last: object, item: OutputDelta) -> bool:
    """Can `item` be appended to `last`: both plain deltas of a running request, with the
    same token-detail lists present (prompt detail comes once, first, and is never folded)."""
    if not isinstance(last, OutputDelta) or last.finish_reason != FinishReason.NOT_FINISHED:
        return False
    if any(p is not None for p in (item.prompt_logprobs, item.prompt_ranks,
                                   item.prompt_top_texts, item.prompt_top_logprobs)):
        return False
    for f in _LISTS:
        a, b = getattr(last, f), getattr(item, f)
        if not ((a is None and b is None) or (isinstance(a, list) and isinstance(b, list))):
            return False
    return True


def _fold(last: OutputDelta, item: OutputDelta) -> None:
    last.text += item.text
    for f in _LISTS:
        if getattr(item, f) is not None:
            getattr(last, f).extend(getattr(item, f))
    if item.num_generated >= 0:
        last.num_generated = item.num_generated
    last.finish_reason, last.stop_sequence = item.finish_reason, item.stop_sequence


class StreamBuffer:
    def __init__(self, limit: int) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.limit = limit  # bytes folded and not yet taken; 0: no limit
        self.buffered = 0
        self._folded: dict[int, int] = {}  # id(queued delta) -> bytes folded into it
        self.overflowed = False

    def put(self, item: object) -> bool:
        """Queue `item` (an OutputDelta, or an error or rejection for the RPC to raise);
        False when this made the stream overflow (the caller cancels the request)."""
        if self.overflowed:
            return True  # the request is being cancelled: late deltas go nowhere
        queue = self.queue
        if isinstance(item, OutputDelta) and queue.qsize() >= FOLD_AFTER:
            last = queue._queue[-1]  # type: ignore[attr-defined]  # asyncio.Queue's deque
            if _foldable(last, item):
                _fold(last, item)
                size = payload_bytes(item)
                self._folded[id(last)] = self._folded.get(id(last), 0) + size
                self.buffered += size
                if self.limit and self.buffered > self.limit:
                    self._overflow()
                    return False
                return True
        queue.put_nowait(item)
        return True

    def took(self, item: object) -> None:
        """The RPC took `item` off the queue: what was folded into it is no longer held."""
        if self._folded:
            self.buffered -= self._folded.pop(id(item), 0)

    def _overflow(self) -> None:
        """Drop what the stream holds: the client reads none of it, and the request ends."""
        self.overflowed = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self._folded.clear()
