"""The gpu worker → postproc token channel.

Over the shared-memory ring (one writer, N readers, every reader sees every batch and
keeps its own rows) when `Addresses.ring_name` is set, else over ZeroMQ: the writer then
splits each batch by owner and pushes each part into that postproc worker's inbox.  A
`PromptDetail` (one request's prompt logprobs) goes to its owner only.
"""
from __future__ import annotations

import time

import numpy as np

from tandem_serve.ipc.channels import Receiver, Sender
from tandem_serve.proto import codec
from tandem_serve.proto.config import Addresses
from tandem_serve.proto.token_messages import PromptDetail, TokenBatch


def owner(request_id: int, num_workers: int) -> int:
    return request_id % num_workers


def detail_for(msg: PromptDetail, index: int, num_workers: int) -> PromptDetail | None:
    """The detail when postproc worker `index` owns its request, else None."""
    return msg if owner(msg.request_id, num_workers) == index else None


def rows_for(batch: TokenBatch, index: int, num_workers: int) -> TokenBatch:
    """The part of a batch that postproc worker `index` owns."""
    if num_workers == 1 or len(batch.request_ids) == 0:
        return batch
    keep = (batch.request_ids % num_workers) == index

    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[keep]

    return TokenBatch(batch.plan_id, batch.step, batch.request_ids[keep],
                      batch.token_ids[keep], batch.finish[keep], cut(batch.logprobs),
                      cut(batch.ranks), cut(batch.top_ids), cut(batch.top_logprobs),
                      batch.last)


# Start-up waits between the gpu worker and the postproc workers have no deadline of their
# own: how long the worker takes to create the ring (importing torch) or a reader to attach
# depends on the host's load and page cache, not on whether anything is wrong.  Whoever
# started the processes (the launcher) sees a death and stops the rest.
class TokenWriter:
    def __init__(self, addr: Addresses, ready_timeout: float | None = None) -> None:
        self._n = len(addr.postproc_inboxes)
        self._ring = None
        self._senders: list[Sender] = []
        if addr.ring_name:
            from tandem_serve.ipc.shm_ring import RingWriter

            self._ring = RingWriter(addr.ring_name, self._n, addr.ring_doorbell, addr.ring_side)
            self._ready_timeout = ready_timeout
        else:
            self._senders = [Sender(a) for a in addr.postproc_inboxes]

    def wait_ready(self) -> None:
        if self._ring is not None:
            self._ring.wait_ready(self._ready_timeout)

    def put(self, batch: TokenBatch | PromptDetail) -> None:
        if self._ring is not None:
            self._ring.put_frames(codec.encode(batch))
            return
        if isinstance(batch, PromptDetail):
            self._senders[owner(batch.request_id, self._n)].put(batch)
            return
        for i, s in enumerate(self._senders):
            s.put(rows_for(batch, i, self._n))

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
        for s in self._senders:
            s.close()


class TokenReader:
    """Postproc side of the ring; None when batches arrive in the inbox instead."""

    def __init__(self, addr: Addresses, index: int) -> None:
        from tandem_serve.ipc.shm_ring import RingReader

        self.index = index
        self._n = len(addr.postproc_inboxes)
        self._ring = RingReader(addr.ring_name, index, addr.ring_doorbell, addr.ring_side,
                                attach_timeout=None)

    def get(self, timeout: float | None) -> TokenBatch | PromptDetail | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frames = self._ring.get_frames(timeout)
            if frames is None:
                return None
            msg = codec.decode(frames)
            if not isinstance(msg, PromptDetail):
                return rows_for(msg, self.index, self._n)
            if detail_for(msg, self.index, self._n) is not None:
                return msg
            # Another worker's detail: keep waiting for ours within the same timeout.
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())

    def backlog(self) -> int:
        """Messages the gpu worker published that this reader has not taken yet."""
        return self._ring.backlog()

    def close(self) -> None:
        self._ring.close()


def open_reader(addr: Addresses, index: int) -> TokenReader | None:
    return TokenReader(addr, index) if addr.ring_name else None


__all__ = ["TokenWriter", "TokenReader", "open_reader", "owner", "rows_for", "detail_for",
           "Receiver"]
