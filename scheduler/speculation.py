"""The scheduler's view of speculative decoding: a plan's token counts become bounds.

Without speculation a K-step plan adds exactly K tokens to a decoding request, so the
scheduler predicts every count (`scheduler.requests`).  With k draft tokens per step a row
advances by 1 to k + 1 tokens a step, known only when the plan's StepDone arrives.  So
planning keeps the *lower* bound (K tokens: a verify step always emits at least the target's
own token) and, while a plan is unconfirmed, the *slack* it may add on top (K * k per
request).  Lower bounds keep every count-based finish true (a request the scheduler
finishes by counts has finished at the worker too; the worker reports the finishes it
reaches earlier in StepDone), KV lookahead covers the upper bound (the slack of plans still
running plus K * (k + 1) for the plan being built), and StepDone replaces the bound by the
worker's count.  A preempted request resumes only once its counts are confirmed: resuming
re-prefills the history, whose length must be exact.
"""
from __future__ import annotations

from tandem_serve.scheduler.requests import Request, RequestStatus


class SpecCounts:
    """Per plan and request: the tokens predicted (the lower bound) and the slack added."""

    def __init__(self, num_speculative_tokens: int, cache_positions: int) -> None:
        self.k = num_speculative_tokens
        # The lookahead never asks for more than the whole cache: a request that fits
        # without speculation must not fail for it (the worker drafts only into the blocks a
        # row holds, so a smaller reservation costs speculation, never correctness).
        self.cache_positions = cache_positions
        self._plans: dict[int, dict[int, tuple[int, int]]] = {}
        self._slack: dict[int, int] = {}  # request id -> slack of its unconfirmed plans

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def positions(self, req: Request, num_computed: int, steps: int) -> int:
        """KV positions `req` may fill after `steps` decode steps from `num_computed` (a
        lower bound), within its history limit."""
        if not self.enabled or not steps:
            return num_computed + steps
        bound = num_computed + self._slack.get(req.request_id, 0) + steps * (self.k + 1)
        bound = min(bound, req.max_tokens, self.cache_positions)
        return max(bound, num_computed + steps)

    def predict(self, plan_id: int, req: Request, steps: int) -> None:
        """`req` decodes `steps` steps in plan `plan_id`: K tokens at least, K * k more at most."""
        if not self.enabled or not steps:
            return
        slack = steps * self.k
        self._plans.setdefault(plan_id, {})[req.request_id] = (steps, slack)
        self._slack[req.request_id] = self._slack.get(req.request_id, 0) + slack

    def confirmed(self, req: Request) -> bool:
        return not self._slack.get(req.request_id)

    def correct(self, plan_id: int, produced: dict[int, int],
                requests: dict[int, Request]) -> list[Request]:
        """StepDone(plan_id): the worker's counts replace the plan's lower bounds.  Returns
        the running requests that the corrected counts show finishing by their limits in a
        plan already built (finished by counts, as without speculation)."""
        reached = []
        for rid, (predicted, slack) in self._plans.pop(plan_id, {}).items():
            left = self._slack.get(rid, 0) - slack
            if left > 0:
                self._slack[rid] = left
            else:
                self._slack.pop(rid, None)
            req = requests.get(rid)
            if req is None or rid not in produced or req.status is RequestStatus.FINISHED:
                continue
            later = [plans for _, plans in sorted(self._plans.items()) if rid in plans]
            exact = (req.num_tokens - predicted - sum(p[rid][0] for p in later)
                     + produced[rid])
            # Later plans were predicted from the bound: cap each by what is really left.
            room = req.max_tokens - exact
            for plan in later:
                steps, plan_slack = plan[rid]
                plan[rid] = (min(steps, max(room, 0)), plan_slack)
                room -= plan[rid][0]
            bound = exact + sum(p[rid][0] for p in later)
            if req.status is RequestStatus.RUNNING:  # a preempted one recomputes from 0
                req.num_computed += bound - req.num_tokens
            req.num_tokens = bound
            if req.status is RequestStatus.RUNNING and req.count_finish() is not None:
                reached.append(req)
        return reached
