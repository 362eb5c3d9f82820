"""Which rows of a plan speculate: a measured rule, decided on the host when the plan starts.

A speculating request costs its plan k more rows in every step's forward (its drafts), and
pays back only the drafts the target accepts.  Whether that wins depends on the device: on
a GPU a decode forward is memory-bound, so a few more rows are nearly free at small batch
sizes and cost their full share at large ones; on a CPU every row costs its matmuls.  So
the rule weighs the two with figures measured on this device, per plan:

* `StepCost`: the seconds of one decode forward over n rows, measured when the worker starts
  at powers of two up to a device's cap (a few forwards each), interpolated between and
  extended linearly past the cap;
* each request's acceptance estimate: drafts accepted per verify step, averaged over its
  plans that speculated (steps whose lookup found nothing count as 0: their rows cost the
  same).  A new request starts from `prior` (half of k); a request that does not speculate
  drifts back toward it plan by plan, so one whose text turns repetitive is tried again.

Rows are added best estimate first while they raise the plan's expected tokens per second,
(T + a) / C(n + k) > T / C(n) with T tokens and n rows so far: speculation helps a batch as
a whole or not at all.  Rows with penalties, guided decoding or typical-p never speculate
(`gpu_worker.spec.batch.eligible`).  The choice is fixed for the plan (no host read inside
it), and a plan where no row speculates runs plain steps, CUDA graphs included.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from functools import partial

import torch

from tandem_serve.gpu_worker.spec.batch import SpecBatch, build_spec_batch, eligible
from tandem_serve.gpu_worker.spec.proposer import Proposer
from tandem_serve.gpu_worker.spec.step_cost import DecodeForward, decode_timer
from tandem_serve.gpu_worker.state import RequestState
from tandem_serve.proto.speculative import SpeculativeConfig

# How far a non-speculating request's estimate moves back toward the prior per plan.
DRIFT = 0.2
# Timed forwards per measured size (the fastest counts: a busy host only slows some).
REPEATS = 3
# The most rows measured, by device: a CPU forward is compute-bound from a few rows on; a
# GPU's stays memory-bound up to a few hundred rows for a 7-8B model.
MEASURED_ROWS = {"cpu": 64, "cuda": 512}


class StepCost:
    """Seconds of one decode forward over n rows, measured at powers of two up to `cap`
    (`prime`: all of them at start, so serving never waits for a measurement) and
    extended past it along the last two sizes' slope (rows cost linearly once a forward is
    compute-bound; `cap` lies past a device's memory-bound knee)."""

    def __init__(self, measure: Callable[[int], float], cap: int = 1 << 20) -> None:
        self._measure = measure
        self.cap = cap
        self._sizes: list[int] = []
        self._seconds: list[float] = []

    def prime(self) -> None:
        size = 1
        while size <= self.cap:
            self._at(size)
            size *= 2

    def _at(self, size: int) -> float:
        i = bisect_left(self._sizes, size)
        if i == len(self._sizes) or self._sizes[i] != size:
            self._measure(size)  # warm-up: first-use allocations are not the step's cost
            best = min(self._measure(size) for _ in range(REPEATS))
            self._sizes.insert(i, size)
            self._seconds.insert(i, best)
        return self._seconds[i]

    def __call__(self, rows: int) -> float:
        top = 1 << (self.cap.bit_length() - 1)
        if rows > top and top > 1:
            a, b = self._at(top // 2), self._at(top)
            return b + (b - a) * (rows - top) / (top // 2)
        low = 1 << (max(rows, 1).bit_length() - 1)  # the largest power of two <= rows
        high = low if low == rows else low * 2
        if high == low:
            return self._at(low)
        a, b = self._at(low), self._at(high)
        return a + (b - a) * (rows - low) / (high - low)


class SpecPolicy:
    """Picks a plan's speculating rows (the module doc)."""

    def __init__(self, k: int, cost: Callable[[int], float],
                 draft_cost: Callable[[int], float] | None = None, always: bool = False
                 ) -> None:
        self.k = k
        self.cost = cost
        # What proposing adds to a step for S speculating rows (None: nothing to count, as
        # for n-gram; `Proposer.step_cost`).
        self.draft_cost = draft_cost
        self.prior = k / 2
        self.always = always  # tests: every eligible row speculates, whatever it costs

    def estimate(self, req: RequestState) -> float:
        return self.prior if req.spec_rate < 0 else req.spec_rate

    def step_time(self, rows: int, speculating: int) -> float:
        time = self.cost(rows + speculating * self.k)
        if speculating and self.draft_cost is not None:
            time += self.draft_cost(speculating)
        return time

    def choose(self, reqs: list[RequestState], eligible: list[bool]) -> list[int]:
        """Indices of the rows that speculate in this plan, in batch order: the best
        estimates first, as many as give the most expected tokens per second (every prefix
        is weighed: a draft model's forwards cost the first row most)."""
        candidates = [i for i, ok in enumerate(eligible) if ok]
        if self.always or not candidates:
            return candidates
        ranked = sorted(candidates, key=lambda i: -self.estimate(reqs[i]))
        rows = len(reqs)
        tokens, best, best_rate = float(rows), 0, rows / self.step_time(rows, 0)
        for n, i in enumerate(ranked, 1):
            gain = self.estimate(reqs[i])
            if gain <= 0:
                break
            tokens += gain
            rate = tokens / self.step_time(rows, n)
            if rate > best_rate:
                best, best_rate = n, rate
        return sorted(ranked[:best])

    def learn(self, reqs: list[RequestState], chosen: list[int], steps: list[int],
              accepted: list[int]) -> None:
        """After the plan: fold each speculating row's accepted drafts per verify step into
        its estimate; the others drift back toward the prior."""
        spoke = dict(zip(chosen, zip(steps, accepted, strict=True), strict=True))
        for i, req in enumerate(reqs):
            if i in spoke:
                n, a = spoke[i]
                if n:
                    rate = a / n
                    req.spec_rate = rate if req.spec_rate < 0 else 0.5 * (req.spec_rate + rate)
            elif req.spec_rate >= 0:
                req.spec_rate += DRIFT * (self.prior - req.spec_rate)


class Speculation:
    """The runner's speculative decoding: its settings, the rule, the method's proposer, a
    plan's start and end."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 measure: Callable[[int], float], cap: int = MEASURED_ROWS["cpu"],
                 agree: Callable[[float], float] | None = None) -> None:
        self.config = config
        self.proposer = proposer

        def timed(forward: Callable[[int], float]) -> Callable[[int], float]:
            cost = StepCost(_agreed(forward, agree), cap)
            if config.adaptive:  # measured now: serving never waits for it
                cost.prime()
            return cost
        target = timed(measure)
        self.policy = SpecPolicy(config.num_speculative_tokens, target,
                                 proposer.step_cost(config.num_speculative_tokens, timed),
                                 always=not config.adaptive)

    @property
    def stride(self) -> int:
        return self.config.num_speculative_tokens + 1

    def plan(self, reqs: list[RequestState], num_steps: int, block_size: int,
             device: torch.device) -> SpecBatch | None:
        """The plan's speculative state (None: no row speculates, plain steps)."""
        chosen = self.policy.choose(reqs, [eligible(r) for r in reqs])
        if not chosen:
            return None
        spec = build_spec_batch(self.config, self.proposer, reqs, chosen, num_steps, block_size,
                                device)
        self.proposer.start_plan([reqs[i] for i in chosen])
        return spec

    def finish(self, spec: SpecBatch, reqs: list[RequestState]
               ) -> tuple[int, int, int, list[int]]:
        """After the plan's host read: learn from it; the counters' increments (drafts,
        draft tokens, accepted tokens, accepted tokens per draft position)."""
        steps, drafted, tokens, accepted, at_position = spec.counts()
        self.policy.learn(reqs, spec.chosen, steps, accepted)
        self.proposer.end_plan([reqs[i] for i in spec.chosen])
        return sum(drafted), sum(tokens), sum(accepted), at_position


def make_speculation(config: SpeculativeConfig | None, proposer: Proposer | None,
                     forward_decode: DecodeForward, device: torch.device, max_model_len: int,
                     block_size: int, agree: Callable[[float], float] | None = None
                     ) -> Speculation | None:
    """The runner's speculation (None: off) over the method's proposer
    (`gpu_worker.spec.registry.make_proposer`, built before the KV cache is sized: its blocks
    may count).  `agree`: under tensor parallelism, the largest of the ranks' timings, so
    every rank picks the same rows (the picks decide the forward's shape, and its
    collectives need every rank's)."""
    if config is None:
        return None
    assert proposer is not None, "a speculative config has its method's proposer"
    timed = decode_timer(partial(forward_decode, lora=None), device, max_model_len, block_size)
    return Speculation(config, proposer, timed,
                       MEASURED_ROWS.get(device.type, MEASURED_ROWS["cpu"]), agree)


def _agreed(measure: Callable[[int], float], agree: Callable[[float], float] | None
            ) -> Callable[[int], float]:
    if agree is None:
        return measure
    reduce = agree

    def agreed(rows: int) -> float:
        return reduce(measure(rows))
    return agreed
