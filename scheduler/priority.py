"""The waiting queue's policy (`--scheduling-policy`): first come first served, or by priority.

fcfs: arrivals join the back of the queue and preempted requests its front, as before.
priority (vLLM's): the queue is kept ordered by (priority, arrival, request id) — a lower
priority value runs first, ties by arrival — and a preempted request goes back to its place
by that order. The running list is ordered the same way at the start of every plan, so the
requests KV pressure preempts (the scheduler takes victims from the running list's end) are
the lowest-priority ones, and a waiting request of strictly higher priority than the
lowest-priority running one preempts it when seats or blocks are short (`victims`). Equal
priorities never preempt each other, so two requests cannot take turns evicting each other.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tandem_serve.proto.config import SCHEDULING_POLICIES
from tandem_serve.scheduler.requests import Request


def priority_key(req: Request) -> tuple[int, float, int]:
    return req.sampling.priority, req.arrival_time, req.request_id


class WaitingPolicy:
    """Where a request goes in the waiting queue, and which running ones yield to it."""

    def __init__(self, policy: str) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy {policy!r} is not one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        self.by_priority = policy == "priority"

    def enqueue(self, waiting: deque[Request], req: Request) -> None:
        """A new arrival."""
        if not self.by_priority:
            waiting.append(req)
            return
        _insert(waiting, req)

    def requeue(self, waiting: deque[Request], req: Request) -> None:
        """A preempted request: first in line under fcfs, in its place by priority."""
        if not self.by_priority:
            waiting.appendleft(req)
            return
        _insert(waiting, req)

    def order_running(self, running: list[Request]) -> None:
        """Highest priority first, so the end of the list is what yields first."""
        if self.by_priority:
            running.sort(key=priority_key)

    def victims(self, waiting: deque[Request], running: list[Request], max_num_seqs: int,
                fits: Callable[[Request, list[Request]], bool]) -> list[Request]:
        """Running requests (lowest priority first) to preempt so that the head of the queue,
        of strictly higher priority than each, can start: the fewest that free a seat and
        leave it blocks enough (`fits(head, victims)`); none when no such set exists.
        `running` must be in `order_running`'s order."""
        if not self.by_priority or not waiting:
            return []
        head = waiting[0]
        out: list[Request] = []
        for req in reversed(running):
            if len(running) - len(out) < max_num_seqs and fits(head, out):
                return out
            if req.sampling.priority <= head.sampling.priority:
                return []  # only strictly higher priority preempts
            out.append(req)
        return out if len(running) - len(out) < max_num_seqs and fits(head, out) else []


def _insert(waiting: deque[Request], req: Request) -> None:
    """Before the first queued request that sorts after it (from the back: arrivals are
    mostly the latest)."""
    key = priority_key(req)
    index = len(waiting)
    while index > 0 and priority_key(waiting[index - 1]) > key:
        index -= 1
    waiting.insert(index, req)
