"""The token budget of the plan being built, step by step (SARATHI-style chunked prefill).

Each of a plan's K steps is one forward over every decoding row (one token each) and the
prefill chunk pieces placed in it, under `max_num_batched_tokens` per step: decoding rows
come first, then the oldest prompts fill what is left, earliest step first, so no decoding
row waits for more than one step's share of a prompt.  A chunk that completes its prompt
starts decoding in the step of its last piece (its decode row reads that piece's KV from
the same forward) and from then on takes one token of every step it decodes in.

A prefill token's cost grows with the context it attends over, which a plain token count
misses: a prompt's last pieces would make the slowest steps.  So a piece of n tokens after c
computed ones counts n x (1 + (c + n/2) / L), L being the context at which a token's
attention costs what the rest of its forward does (the gpu worker works it out from the
model's shape and device, `WorkerReady.attention_tokens`; 0: plain tokens).  Steps then take
about the same time whichever part of a prompt they carry.

Two plans are shaped differently:

* nothing decodes at the plan's start: nobody can stall, so the first step takes whole
  chunks, up to the plan's K x budget tokens (no prompt is cut into K forwards for nothing);
* the baseline (`--prefill-phase`): one budget for the whole plan, chunks plus one token per
  decoding request, every chunk run in a forward of its own before the K steps.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Decode steps a request runs when it starts decoding at a given step (its limits apply).
DecodeSteps = Callable[[int], int]

# The default budget, by the gpu worker's device: per step with mixed steps, per plan for the
# baseline (what it was before mixed steps).  Why these numbers: see `default_tokens`.
STEP_TOKENS = {"cpu": 160, "cuda": 512}
PLAN_TOKENS = 2048


def default_tokens(device_type: str, prefill_phase: bool) -> int:
    """`--max-num-batched-tokens 0`.  A decoding stream's worst inter-token gap is a step
    carrying a full share of prefill, and a prompt's time to first token grows with the
    steps its prefill is cut into, each paying the decode rows' own work again: the budget
    trades the one against the other.  CPU, measured with `tandem bench stall --in-process`
    (tiny default model, K=8, 4 streams, 1,000-token prompts 1.2 s apart): a decode step
    there costs about what 80 prefill tokens do, so 160 units put a step near 3x a decode
    step (`--budgets 96,128,160,224 --rounds 3`, worst gap over the median and TTFT over
    --prefill-phase's, medians: 96: 3.3x and 2.0x; 128: 3.8x and 1.7x; 160: 3.7x and 1.7x;
    224: 4.8x and 1.6x; a worst gap swings by a round's one slow step).  No budget meets 3x
    and 1.5x together there (docs/DESIGN.md, section 14).  CUDA, measured on an H200 with
    the Llama-3-8B shape (bfloat16, piecewise graphs, the same scenario, 3 rounds): 512 gave
    a worst gap of 4.1x with TTFT 1.08x; a budget taking a whole prompt per step, 6.4x and
    1.00x; --prefill-phase 7.0x.  A mixed step there costs ~8 ms + ~0.027 ms per prefill
    token, so 256 should be near 3x: not yet measured."""
    if prefill_phase:
        return PLAN_TOKENS
    return STEP_TOKENS.get(device_type, STEP_TOKENS["cpu"])


def piece_cost(n: int, context: int, attention_tokens: int) -> int:
    """Budget a piece of n prefill tokens after `context` computed ones takes."""
    if not attention_tokens or n <= 0:
        return n
    return n + -(-n * (2 * context + n) // (2 * attention_tokens))


def largest_piece(room: int, context: int, attention_tokens: int) -> int:
    """The most tokens a piece after `context` computed ones may have within `room`."""
    if room <= 0:
        return 0
    if not attention_tokens:
        return room
    b = attention_tokens + context  # n^2 + 2bn <= 2L room: the positive root, then exact
    n = max(0, int((b * b + 2 * attention_tokens * room) ** 0.5 - b))
    while n > 0 and piece_cost(n, context, attention_tokens) > room:
        n -= 1
    while piece_cost(n + 1, context, attention_tokens) <= room:
        n += 1
    return n


def whole_piece(context: int, n: int, most: int, whole: Sequence[tuple[int, int]]) -> int:
    """A piece of about `n` tokens after `context` that ends outside every span of `whole`:
    cut back to the start of the span it would end inside, or, when the piece starts right
    at that span, stretched over all of it (at most `most` tokens; else 0).  An image longer
    than a step's budget is scheduled whole rather than refused: the step runs over its
    budget once, and a prompt with such an image still runs under any
    --max-num-batched-tokens."""
    if n <= 0:
        return 0
    end = context + n
    for start, stop in whole:
        if start < end < stop:
            end = start if start > context else stop
            break
    return end - context if end - context <= most else 0


@dataclass
class Split:
    """Where one request's chunk of this plan goes."""

    pieces: list[int] = field(default_factory=list)  # tokens per step, from step 0
    join: int | None = None  # the step it starts decoding in (None: still prefilling after)
    decode_steps: int = 0  # steps it decodes in this plan
    costs: list[int] = field(default_factory=list, compare=False)  # budget of each piece

    @property
    def total(self) -> int:
        return sum(self.pieces)

    def complete(self, n: int, cost: int, join: int, steps: int) -> Split:
        """The last piece, `n` tokens costing `cost`, completes the prompt in step `join`,
        which its first decode row joins for `steps` steps."""
        self.pieces.append(n)
        self.costs.append(cost)
        self.join, self.decode_steps = join, steps
        return self

    def message_steps(self) -> list[int]:
        """`prefill_steps` for the plan message: empty when all of it is in step 0."""
        return [] if len(self.pieces) <= 1 else list(self.pieces)


class StepBudget:
    def __init__(self, num_steps: int, tokens: int, prefill_phase: bool = False,
                 attention_tokens: int = 0) -> None:
        self.num_steps = num_steps
        self.tokens = tokens
        self.attention_tokens = attention_tokens
        # The baseline has one budget for the plan; mixed steps one per step.
        self.left = [tokens] if prefill_phase else [tokens] * num_steps
        self.prefill_steps = len(self.left)  # how many leading steps may take prefill

    def prefill_only(self) -> None:
        """Nothing decodes at the plan's start: whole chunks in its first step."""
        if len(self.left) > 1:
            self.left[0] = self.tokens * self.num_steps
            self.prefill_steps = 1

    def has_room(self) -> bool:
        return any(n > 0 for n in self.left[: self.prefill_steps])

    def split(self, prefill_left: int, decode_steps: DecodeSteps, limit: int | None = None,
              context: int = 0, whole: Sequence[tuple[int, int]] = ()) -> Split | None:
        """Place `prefill_left` tokens that follow `context` computed ones (at most `limit`,
        which then never completes the prompt), earliest step first; None when no step has
        room for any of it.  `whole`: [start, end) position spans no piece may end inside
        (Gemma 3's images, `whole_piece`)."""
        todo = prefill_left if limit is None else min(prefill_left, limit)
        may_complete = todo == prefill_left
        split = Split()
        for s in range(self.prefill_steps):
            room = self.left[s]
            steps = decode_steps(s)
            cost = piece_cost(todo, context, self.attention_tokens)
            # The whole rest plus its first decode token, and a token in each later step.
            if may_complete and cost + 1 <= room and self._decode_fits(s, steps):
                return split.complete(todo, cost, s, steps)
            # Else hold the last token back: a prompt completes only with its decode row.
            n = max(0, min(todo - int(may_complete),
                           largest_piece(room, context, self.attention_tokens)))
            if whole:
                n = whole_piece(context, n, todo, whole)
                if may_complete and n == todo:  # the image runs up to the last token
                    return split.complete(n, piece_cost(n, context, self.attention_tokens),
                                          s, steps)
            split.pieces.append(n)
            split.costs.append(piece_cost(n, context, self.attention_tokens))
            todo -= n
            context += n
            if todo == 0:
                break
        while split.pieces and split.pieces[-1] == 0:
            split.pieces.pop()
            split.costs.pop()
        return split if split.pieces else None

    def _decode_fits(self, join: int, steps: int) -> bool:
        return all(self.left[t] >= 1 for t in range(join + 1, min(join + steps,
                                                                   len(self.left))))

    def take(self, split: Split) -> None:
        for s, n in enumerate(split.costs or split.pieces):
            self.left[s] -= n
        if split.join is not None:
            self.decode(split.join, split.decode_steps)

    def decode(self, first: int, steps: int) -> None:
        """A row decoding from step `first` for `steps` steps (the baseline: once)."""
        for s in range(first, min(first + steps, len(self.left))):
            self.left[s] -= 1
